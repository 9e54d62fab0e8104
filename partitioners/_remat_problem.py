"""The save-or-recompute problem shared by the budgeted solvers (ILP and greedy).

For every FORWARD-phase node ``v``: may it be saved (and at what activation bytes), may it be
recomputed in backward (and at what cost), and which values backward reads directly. Hard rules:
random and effectful ops are never recomputed (no exact RNG replay yet), MUST_SAVE bans
recomputation, MUST_RECOMPUTE bans saving, inputs are never recomputed (they are given).
Compute-intensive ops MAY be recomputed here (that is what a tight budget buys), at their cost.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from functrans.extend import (
    PHASE,
    ROLE,
    JointGraph,
    OpClass,
    Phase,
    Policy,
    Role,
    activation_bytes,
    flops,
    op_class,
    policy_of,
)

from .default import forward_core

__all__ = ["RematProblem", "build_problem"]

CostFn = Callable[[fx.Node], float]


@dataclass(frozen=True)
class RematProblem:
    """Arrays over ``nodes`` (the forward-phase nodes, in graph order)."""

    nodes: list[fx.Node]
    inputs: list[list[int]]  # indices of each node's forward-phase inputs
    bytes: list[int]  # activation bytes if saved
    cost: list[float]  # cost of recomputing it (0 outside the forward core: no extra work)
    can_save: list[bool]
    can_recompute: list[bool]
    drains: list[int]  # nodes backward reads directly


def _must_keep(node: fx.Node) -> bool:
    cls = op_class(node)
    return (
        cls in (OpClass.RANDOM, OpClass.EFFECTFUL, OpClass.INPUT)
        or policy_of(node) is Policy.MUST_SAVE
    )


def build_problem(joint: JointGraph, cost: CostFn | None = None) -> RematProblem:
    """Collect the per-node facts the solvers need (``cost`` defaults to FLOPs)."""
    cost_fn: CostFn = cost or (lambda n: float(flops(n)))
    core = forward_core(joint)
    nodes = [
        n for n in joint.fx_graph.nodes if n.meta.get(PHASE) is Phase.FORWARD and n.op != "output"
    ]
    index = {n: i for i, n in enumerate(nodes)}
    drains = {index[n] for n in joint.grad_outputs() if isinstance(n, fx.Node) and n in index}
    for n, i in index.items():
        if any(u.meta.get(PHASE) is Phase.BACKWARD for u in n.users):
            drains.add(i)
    return RematProblem(
        nodes=nodes,
        inputs=[[index[a] for a in n.all_input_nodes if a in index] for n in nodes],
        bytes=[activation_bytes(n) for n in nodes],
        cost=[cost_fn(n) if n in core else 0.0 for n in nodes],
        can_save=[  # a random op tagged MUST_RECOMPUTE is saved: it is never recomputed
            isinstance(n.meta.get("val"), torch.Tensor)
            and (policy_of(n) is not Policy.MUST_RECOMPUTE or op_class(n) is OpClass.RANDOM)
            for n in nodes
        ],
        can_recompute=[
            not (_must_keep(n) and (n in core or n.meta.get(ROLE) is Role.PRIMAL)) for n in nodes
        ],
        drains=sorted(drains),
    )
