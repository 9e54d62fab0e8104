"""Pictures: partitions as graphs (``draw``: .dot always, .svg/.html with graphviz) and the
Pareto front of activation memory against recompute (``plot_pareto``: needs matplotlib, the
``viz`` extra: ``pip install functrans[viz]``).
"""

from __future__ import annotations

import html
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._dot import to_dot
from ._errors import FunctransError
from ._graph import Graph
from ._pareto import ParetoPoint
from ._partition import Partition, partition

__all__ = ["draw", "plot_pareto"]


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


def _svg(dot: str) -> str:
    exe = shutil.which("dot")
    if exe is None:
        raise FunctransError(
            "drawing SVG needs graphviz's `dot` program: install it (apt-get install graphviz, "
            "brew install graphviz, conda install graphviz) or write a .dot file instead"
        )
    done = subprocess.run([exe, "-Tsvg"], input=dot, capture_output=True, text=True, check=True)
    return done.stdout


def draw(obj: Partition | Graph, path: str | Path) -> Path:
    """Draw a partition (its joint graph, the cut's saved edges labelled with bytes, recomputed
    nodes dashed) or a graph, to ``.dot``, ``.svg`` or ``.html`` (by ``path``'s suffix).

    >>> import torch, tempfile, os, functrans as ft
    >>> p = ft.partition(ft.joint(lambda x: x.sin().sum())(torch.ones(2)), "min_cut")
    >>> draw(p, os.path.join(tempfile.mkdtemp(), "p.dot")).read_text().startswith("digraph")
    True
    """
    path = Path(path)
    dot = to_dot(obj)
    suffix = path.suffix.lower()
    if suffix == ".dot":
        path.write_text(dot)
    elif suffix == ".svg":
        path.write_text(_svg(dot))
    elif suffix == ".html":
        body = _svg(dot) if shutil.which("dot") else f"<pre>{html.escape(dot)}</pre>"
        table = f"<pre>{html.escape(obj.report())}</pre>" if isinstance(obj, Partition) else ""
        path.write_text(f"<!doctype html><html><body>{body}{table}</body></html>")
    else:
        raise FunctransError(f"draw writes .dot, .svg or .html files, not {path.name!r}")
    return path
