"""What crosses from forward to backward: costs, the cut problem, split, partition."""
