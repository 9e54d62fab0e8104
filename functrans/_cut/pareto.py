"""The memory / recompute trade-off of one joint graph: partitions across activation budgets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from functrans._core.graph import JointGraph
from functrans._core.logs import counted
from functrans._core.validate import check_joint, check_names, check_number, check_option

from .partition import Partition, partition

__all__ = ["ParetoPoint", "pareto"]


@dataclass(frozen=True)
class ParetoPoint:
    """One budget's partition and its figures: ``budget`` is the activation-budget fraction
    (``by="bytes"``) or the ``peak_bytes`` limit (``by="peak"``)."""

    budget: float
    activation_bytes: int
    recompute_flops: int
    peak_bytes: int
    partition: Partition


_HINTS = {
    "budget": "pareto sweeps budget from 0.0 to 1.0 itself; set points= for more budgets",
    "max_bytes": "pareto sweeps budget fractions; call partition(joint, 'memory_budget', "
    "max_bytes=...) for one byte budget",
    "peak_bytes": "pareto(by='peak') sweeps peak_bytes itself; call partition(joint, "
    "'memory_budget', peak_bytes=...) for one limit",
}

_BY = ("bytes", "peak")


def pareto(
    joint: JointGraph, points: int = 21, *, by: str = "bytes", **options: Any
) -> list[ParetoPoint]:
    """Partition ``joint`` with ``memory_budget`` at ``points`` limits.

    ``by="bytes"`` sweeps the activation budget (bytes across the cut) from 0 to 1;
    ``by="peak"`` sweeps the step's peak (``peak_bytes``) evenly from the lowest the planner
    reaches (``"min_peak"``) to ``"default"``'s, the trade-off a user measures: peak memory
    against recompute FLOPs. ``options`` go to the strategy (``solver``, ``cost``,
    ``time_limit``, ``at``, ``offload``: with an :class:`~functrans.Offload`, each point's
    ``activation_bytes`` are what stays on the device and its ``partition.offloaded_bytes``
    what waits in host memory); ``points`` is an int >= 2.

    >>> import torch, functrans as ft
    >>> jg = ft.joint(lambda x, w: torch.tanh(x @ w).sum())(torch.ones(8, 8), torch.ones(8, 8))
    >>> [(p.budget, p.activation_bytes) for p in ft.pareto(jg, points=3)]
    [(0.0, 0), (0.5, 0), (1.0, 256)]
    >>> def stack(ws, x):  # activations (32 KiB each) outweigh the weights (1 KiB each)
    ...     for w in ws:
    ...         x = x + torch.tanh(torch.tanh(x @ w).exp())
    ...     return x.sum()
    >>> jg = ft.joint(stack, argnums=0)([torch.ones(16, 16)] * 4, torch.ones(512, 16))
    >>> [(p.peak_bytes, p.recompute_flops) for p in ft.pareto(jg, points=3, by="peak")]
    [(294920, 57344), (393224, 32768), (524296, 0)]
    """
    check_joint("pareto", joint)
    check_number("pareto", "points", points, at_least=2, integer=True)
    check_option("pareto", "by", by, isinstance(by, str) and by in _BY, "'bytes' or 'peak'")
    accepted = ("solver", "cost", "time_limit", "at", "offload")
    check_names("pareto", options, accepted, hints=_HINTS)
    if by == "bytes":
        limits = [{"budget": float(b)} for b in np.linspace(0.0, 1.0, points)]
    else:
        low = partition(joint, "min_peak", **_min_peak_options(options)).peak_bytes
        high = max(low, partition(joint, "default").peak_bytes)
        limits = [{"peak_bytes": round(float(n))} for n in np.linspace(low, high, points)]
    out = []
    with counted("pareto: points", len(limits)) as step:  # an ILP each: say how far it is
        for limit in limits:
            p = partition(joint, "memory_budget", **limit, **options)
            budget = float(next(iter(limit.values())))
            out.append(ParetoPoint(budget, p.activation_bytes, p.recompute_flops, p.peak_bytes, p))
            step()
    return out


def _min_peak_options(options: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in options.items() if k in ("cost", "time_limit")}
