"""Write a partition strategy in a few lines, register it, and fuzz it against eager autograd
with functrans' own hypothesis strategies."""

import torch.fx as fx
from hypothesis import given, settings

from functrans import partitioners
from functrans.extend import JointGraph, OpClass, cut_problem
from functrans.testing import check_partition, programs


def save_matmuls_only(joint: JointGraph) -> list[fx.Node]:
    """Save what matmuls produce; backward recomputes everything else from those and the
    inputs. The shared rules add what may not be recomputed (random-op outputs, values a remat
    policy must save) and drop what may not be saved: ``legalize``."""
    problem = cut_problem(joint)
    return problem.legalize([v.node for v in problem if v.op_class is OpClass.COMPUTE])


partitioners.register("save_matmuls_only", save_matmuls_only, replace=True)


@settings(max_examples=25, deadline=None)
@given(programs())
def fuzz(program):
    check_partition(program, program.example_inputs(), "save_matmuls_only")


if __name__ == "__main__":
    fuzz()
    print("save_matmuls_only preserved outputs and gradients on 25 random programs")
