"""Pictures: partitions as graphs (``draw``: .dot always, .svg/.html with graphviz), the
Pareto front of activation memory against recompute (``plot_pareto``) and memory over forward
then backward (``plot_memory``; both need matplotlib, the ``viz`` extra: ``pip install
functrans[viz]``), and a self-contained HTML report (``report``: the cut, the saved values,
the memory timeline and the front, drawn as inline SVG; needs nothing).
"""

from __future__ import annotations

import html
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from functrans._core.errors import FunctransError
from functrans._core.graph import Graph
from functrans._cut.pareto import ParetoPoint
from functrans._cut.partition import Partition, format_bytes, partition

from ._charts import peak_index
from ._charts import series as memory_series
from ._dot import to_dot
from ._report import check_path, labelled, page

__all__ = ["draw", "plot_memory", "plot_pareto", "report"]


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
    host = max((p.partition.offloaded_bytes for p in points), default=0)
    ax.plot(
        [p.activation_bytes for p in points],
        [p.recompute_flops for p in points],
        "o-",
        label="functrans memory_budget"
        + (f" + offload (up to {format_bytes(host)} on host)" if host else ""),
    )
    for label, series in (others or {}).items():
        ax.plot([a for a, _ in series], [r for _, r in series], "s--", label=label)
    if points:
        joint = points[0].partition.joint
        for name, marker in (("default", "^"), ("min_cut", "*"), ("full_remat", "v")):
            p = partition(joint, name)
            ax.plot([p.activation_bytes], [p.recompute_flops], marker, markersize=11, label=name)
    ax.set_xlabel("activation bytes kept on the device for backward")
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


def plot_memory(
    partitions: Partition | Sequence[Partition] | Mapping[str, Partition],
    path: str | Path,
    *,
    title: str = "",
) -> Path:
    """Plot live device memory after each op of forward then backward, one line per partition
    (a partition, a sequence of them, or a mapping label -> partition), and write ``path``
    (.png, .svg or .pdf). Host memory is dashed where a partition offloads; the passes'
    boundary is a vertical line (each partition's ops are spread over its pass's part of the
    x axis, so the boundary is shared); a dot marks each peak, which the legend gives.

    >>> import torch, tempfile, os, functrans as ft
    >>> jg = ft.joint(lambda x: x.exp().sin().sum())(torch.ones(64))
    >>> ps = {"saved": ft.partition(jg, "default"), "remat": ft.partition(jg, "full_remat")}
    >>> out = plot_memory(ps, os.path.join(tempfile.mkdtemp(), "m.png"))
    >>> out.suffix, out.stat().st_size > 0
    ('.png', True)
    """
    items = labelled(partitions, "plot_memory")
    path = check_path(path, (".png", ".svg", ".pdf"), "plot_memory")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 4.5))
    lines = memory_series(items)
    for s in lines:
        if not s.device:
            continue
        k = peak_index(s)
        (drawn,) = ax.plot(
            s.x,
            s.device,
            "-",
            lw=1.8,
            label=f"{s.label}: device (peak {format_bytes(s.device[k])})",
        )
        ax.plot([s.x[k]], [s.device[k]], "o", color=drawn.get_color())
        if any(s.host):
            ax.plot(s.x, s.host, "--", color=drawn.get_color(), label=f"{s.label}: host")
    ax.axvline(lines[0].boundary, color="#555", ls=":", lw=1)
    ax.text(
        lines[0].boundary,
        1.0,
        "forward | backward ",
        transform=ax.get_xaxis_transform(),
        ha="center",
        va="bottom",
        fontsize=8,
    )
    ax.yaxis.set_major_formatter(lambda v, _pos: format_bytes(int(v)))
    ax.set_xlabel("ops (forward, then backward)")
    ax.set_ylabel("live bytes")
    ax.set_ylim(bottom=0)
    ax.set_title(title or "memory over forward then backward (dots: peaks)", pad=16)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def report(
    partitions: Partition | Sequence[Partition] | Mapping[str, Partition],
    path: str | Path,
    *,
    title: str = "functrans memory report",
) -> Path:
    """Write a self-contained HTML page (no network, no scripts, no graphviz) about one or more
    partitions (a partition, a sequence, or a mapping label -> partition): a summary row each,
    the memory timeline, with several partitions the trade-off panel (device activation bytes
    against recompute FLOPs; partitions that offload are marked apart and compared on host
    bytes and copies too), and per partition its inputs, its cut drawn as SVG (every forward
    node a ``<g data-node=NAME class=KIND>``, its source line on hover) and its saved-values
    table, whose bytes add up to the summary's.

    >>> import torch, tempfile, os, functrans as ft
    >>> p = ft.partition(ft.joint(lambda x: x.exp().sin().sum())(torch.ones(8)), "min_cut")
    >>> out = report(p, os.path.join(tempfile.mkdtemp(), "report.html"))
    >>> 'data-node="exp"' in out.read_text()
    True
    """
    items = labelled(partitions, "report")
    path = check_path(path, (".html", ".htm"), "report")
    path.write_text(page(items, title), encoding="utf-8")
    return path
