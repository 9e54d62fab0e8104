"""Write a partition strategy in a few lines, register it, and fuzz it against eager autograd
with functrans' own hypothesis strategies."""

import torch.fx as fx
from hypothesis import given, settings

from functrans import partitioners
from functrans.extend import JointGraph, OpClass, op_class
from functrans.testing import check_partition, programs


def save_matmuls_only(joint: JointGraph) -> list[fx.Node]:
    """Save what matmuls produce (and random-op outputs, which must never be recomputed);
    backward recomputes everything else from those and the inputs."""
    keep = (OpClass.COMPUTE, OpClass.RANDOM)
    return [n for n in joint.forward_nodes() if op_class(n) in keep]


partitioners.register("save_matmuls_only", save_matmuls_only, replace=True)


@settings(max_examples=25, deadline=None)
@given(programs())
def fuzz(program):
    check_partition(program, program.example_inputs(), "save_matmuls_only")


if __name__ == "__main__":
    fuzz()
    print("save_matmuls_only preserved outputs and gradients on 25 random programs")
