"""A Python function to a functional ATen graph: trace, joint, captures, passes."""
