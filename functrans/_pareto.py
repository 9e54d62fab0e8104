"""The memory / recompute trade-off of one joint graph: partitions across activation budgets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ._graph import JointGraph
from ._partition import Partition, partition
from ._validate import check_names, check_number

__all__ = ["ParetoPoint", "pareto"]


@dataclass(frozen=True)
class ParetoPoint:
    """One budget's partition and its figures."""

    budget: float
    activation_bytes: int
    recompute_flops: int
    peak_bytes: int
    partition: Partition


_HINTS = {
    "budget": "pareto sweeps budget from 0.0 to 1.0 itself; set points= for more budgets",
    "max_bytes": "pareto sweeps budget fractions; call partition(joint, 'memory_budget', "
    "max_bytes=...) for one byte budget",
}


def pareto(joint: JointGraph, points: int = 21, **options: Any) -> list[ParetoPoint]:
    """Partition ``joint`` with ``memory_budget`` at ``points`` budgets from 0 to 1.

    ``options`` go to the strategy (``solver``, ``cost``, ``time_limit``, ``at``, ``offload``:
    with an :class:`~functrans.Offload`, each point's ``activation_bytes`` are what stays on the
    device and its ``partition.offloaded_bytes`` what waits in host memory); ``points`` is an
    int >= 2.

    >>> import torch, functrans as ft
    >>> jg = ft.joint(lambda x, w: torch.tanh(x @ w).sum())(torch.ones(8, 8), torch.ones(8, 8))
    >>> [(p.budget, p.activation_bytes) for p in ft.pareto(jg, points=3)]
    [(0.0, 0), (0.5, 0), (1.0, 256)]
    """
    check_number("pareto", "points", points, at_least=2, integer=True)
    accepted = ("solver", "cost", "time_limit", "at", "offload")
    check_names("pareto", options, accepted, hints=_HINTS)
    out = []
    for b in np.linspace(0.0, 1.0, points):
        p = partition(joint, "memory_budget", budget=float(b), **options)
        out.append(ParetoPoint(float(b), p.activation_bytes, p.recompute_flops, p.peak_bytes, p))
    return out
