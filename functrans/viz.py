"""Pictures: the Pareto front of activation memory against recompute (needs matplotlib, the
``viz`` extra: ``pip install functrans[viz]``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._errors import FunctransError
from ._pareto import ParetoPoint
from ._partition import partition

__all__ = ["plot_pareto"]


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise FunctransError("functrans.viz needs matplotlib: pip install 'functrans[viz]'") from e
    return plt


def plot_pareto(
    points: Sequence[ParetoPoint],
    path: str | Path,
    *,
    title: str = "",
    others: dict[str, Sequence[tuple[float, float]]] | None = None,
) -> Path:
    """Plot activation bytes against recompute FLOPs for ``points`` and write ``path`` (.png or
    .svg). ``default``, ``min_cut`` and ``full_remat`` are marked; ``others`` adds labelled
    series of ``(activation bytes, recompute FLOPs)`` pairs (e.g. torch's knob).

    >>> import torch, tempfile, os, functrans as ft
    >>> jg = ft.joint(lambda x, w: torch.tanh(x @ w).sum())(torch.ones(8, 8), torch.ones(8, 8))
    >>> out = plot_pareto(ft.pareto(jg, points=3), os.path.join(tempfile.mkdtemp(), "p.svg"))
    >>> out.stat().st_size > 0
    True
    """
    plt = _pyplot()
    path = Path(path)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(
        [p.activation_bytes for p in points],
        [p.recompute_flops for p in points],
        "o-",
        label="functrans memory_budget",
    )
    for label, series in (others or {}).items():
        ax.plot([a for a, _ in series], [r for _, r in series], "s--", label=label)
    if points:
        joint = points[0].partition.joint
        for name, marker in (("default", "^"), ("min_cut", "*"), ("full_remat", "v")):
            p = partition(joint, name)
            ax.plot([p.activation_bytes], [p.recompute_flops], marker, markersize=11, label=name)
    ax.set_xlabel("activation bytes saved for backward")
    ax.set_ylabel("recompute FLOPs")
    ax.set_title(title or "memory / recompute trade-off")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
