"""A self-contained HTML page about one or more partitions (:func:`functrans.viz.report`).

Everything is drawn here, in Python, as inline SVG: no network, no JavaScript, no graphviz. The
page holds a summary row per partition, per partition the cut (:func:`functrans._svg.cut_svg`)
and its saved-values table, the memory timeline of every partition, and with several
partitions their activation bytes against recompute FLOPs (the Pareto front).

Timelines share one x axis: the forward pass fills the left part, the backward pass the right,
each partition's ops spread evenly over its phase's part (the parts are as wide as the longest
forward and the longest backward), so the passes' boundary is one line for all partitions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ._errors import InvalidArgumentError
from ._format import format_value_type
from ._graph import PATH
from ._partition import Partition, format_bytes
from ._svg import cut_svg, esc, legend_svg
from ._validate import describe

__all__ = ["Series", "check_path", "labelled", "page", "peak_index", "saved_table", "series"]

#: line colours, one per partition (matplotlib's tab10)
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2")

Partitions = Partition | Sequence[Partition] | Mapping[str, Partition]


def labelled(partitions: Partitions, where: str) -> list[tuple[str, Partition]]:
    """``(label, partition)`` pairs: a mapping's keys, else each strategy's name (``#2`` added
    to a repeated name); raises :class:`InvalidArgumentError` on anything else or nothing.

    >>> import torch, functrans as ft
    >>> p = ft.partition(ft.joint(lambda x: x.sin().sum())(torch.ones(2)), "min_cut")
    >>> [label for label, _ in labelled([p, p], "report")]
    ['min_cut', 'min_cut #2']
    """
    accepted = "a Partition, a non-empty sequence of them, or a mapping label -> Partition"
    if isinstance(partitions, Partition):
        items: list[tuple[object, object]] = [(partitions.strategy, partitions)]
    elif isinstance(partitions, Mapping):
        items = list(partitions.items())
    elif isinstance(partitions, Sequence) and not isinstance(partitions, str):
        items = [(getattr(p, "strategy", ""), p) for p in partitions]
    else:
        raise InvalidArgumentError(
            f"{where}: partitions={describe(partitions)} is not accepted; expected {accepted}"
        )
    if not items:
        raise InvalidArgumentError(f"{where}: partitions is empty; expected {accepted}")
    out: list[tuple[str, Partition]] = []
    for i, (label, p) in enumerate(items):
        if not isinstance(p, Partition):
            raise InvalidArgumentError(
                f"{where}: partitions[{label if isinstance(partitions, Mapping) else i!r}]="
                f"{describe(p)} is not a Partition; expected {accepted} (ft.partition(...))"
            )
        name, n = str(label), 2
        while name in {lab for lab, _ in out}:
            name, n = f"{label} #{n}", n + 1
        out.append((name, p))
    return out


def check_path(path: str | Path, suffixes: Sequence[str], where: str) -> Path:
    """``path`` as a Path whose folder exists and whose suffix is one of ``suffixes``."""
    path = Path(path)
    if path.suffix.lower() not in suffixes:
        raise InvalidArgumentError(
            f"{where}: path={str(path)!r} has suffix {path.suffix!r}; accepted: "
            f"{', '.join(suffixes)}"
        )
    if not path.parent.is_dir():
        raise InvalidArgumentError(
            f"{where}: path={str(path)!r} is in a folder that does not exist "
            f"({str(path.parent)!r}); create it first or write to an existing folder"
        )
    return path


@dataclass(frozen=True)
class Series:
    """One partition's memory timeline on the shared x axis (see the module docstring)."""

    label: str
    x: tuple[float, ...]
    device: tuple[int, ...]
    host: tuple[int, ...]
    boundary: float  # x between the passes (the same for every series of one call)


def series(items: Sequence[tuple[str, Partition]]) -> list[Series]:
    """The timelines of ``items`` on one x axis.

    >>> import torch, functrans as ft
    >>> p = ft.partition(ft.joint(lambda x: torch.tanh(x).sum())(torch.ones(256)), "default")
    >>> s = series([("default", p)])[0]
    >>> s.x, s.boundary, max(s.device) == p.peak_bytes
    ((1.0, 2.0, 3.0, 4.0, 5.0, 6.0), 2.5, True)
    """
    lines = [(label, p.memory.timeline) for label, p in items]
    width = {
        phase: max((sum(s.phase == phase for s in tl) for _, tl in lines), default=0)
        for phase in ("forward", "backward")
    }
    out = []
    for label, tl in lines:
        xs: list[float] = []
        for phase, start in (("forward", 0.0), ("backward", float(width["forward"]))):
            n = sum(s.phase == phase for s in tl)
            xs += [start + (i + 1) * width[phase] / n for i in range(n)]
        out.append(
            Series(
                label,
                tuple(xs),
                tuple(s.device_bytes for s in tl),
                tuple(s.host_bytes for s in tl),
                width["forward"] + 0.5,
            )
        )
    return out


def saved_table(p: Partition) -> str:
    """The saved values of ``p`` as an HTML table (name, op, shape, dtype, bytes, where,
    source); every cell escaped.

    >>> import torch, functrans as ft
    >>> p = ft.partition(ft.joint(lambda x: x.exp().sin().sum())(torch.ones(3)), "default")
    >>> "<td>exp</td><td>aten.exp.default</td>" in saved_table(p)
    True
    """
    shared = p.shared_storage()
    host = {v.node for v in p.offloaded}
    head = ("name", "op", "shape", "dtype", "bytes", "where", "source")
    rows = []
    for v in p.saved:
        if v.node in shared:
            size = f"shares {shared[v.node].name}"
        else:
            size = str(v.storage_bytes)
            size = size if v.bytes_expr is None else f"{v.bytes_expr} = {size}"
        where = "host" if v.node in host else "device"
        if v.is_input:
            where += " (input)"
        elif v.dtype is None:
            where = "int (a symbolic size)"
        shape = "[" + ", ".join(v.shape_expr or map(str, v.shape)) + "]"
        dtype = "-" if v.dtype is None else str(v.dtype).replace("torch.", "")
        cells = (v.name, v.op, shape, dtype, size, where)
        tds = "".join(f"<td>{esc(c)}</td>" for c in cells)
        rows.append(
            f'<tr class="{where.split()[0]}">{tds}<td><code>{esc(v.source or "")}</code></td></tr>'
        )
    ths = "".join(f"<th>{h}</th>" for h in head)
    return f'<table class="saved"><tr>{ths}</tr>{"".join(rows)}</table>'


def _axes(w: int, h: int, pad: tuple[int, int, int, int], xlabel: str, ylabel: str) -> str:
    left, top, right, bottom = pad
    return (
        f'<line x1="{left}" y1="{h - bottom}" x2="{w - right}" y2="{h - bottom}" stroke="#333"/>'
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h - bottom}" stroke="#333"/>'
        f'<text x="{(left + w - right) / 2}" y="{h - 6}" text-anchor="middle">{esc(xlabel)}</text>'
        f'<text transform="translate(14 {(top + h - bottom) / 2}) rotate(-90)" '
        f'text-anchor="middle">{esc(ylabel)}</text>'
    )


def _svg(cls: str, w: int, h: int, body: str) -> str:
    return (
        f'<svg class="{cls}" xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        f'font-family="sans-serif" font-size="12">{body}</svg>'
    )


def timeline_svg(items: Sequence[tuple[str, Partition]], w: int = 900, h: int = 340) -> str:
    """Live device bytes (solid) and host bytes (dashed, where anything is offloaded) after
    each op, one polyline per partition, the passes' boundary dashed, each peak marked."""
    lines = series(items)
    pad = (80, 16, 16, 40)
    x_end = max((max(s.x, default=1.0) for s in lines), default=1.0) or 1.0
    y_end = max((max(s.device + s.host, default=0) for s in lines), default=0) or 1
    sx, sy = (w - pad[0] - pad[2]) / x_end, (h - pad[1] - pad[3]) / y_end

    def pt(x: float, y: float) -> str:
        return f"{pad[0] + x * sx:.1f},{h - pad[3] - y * sy:.1f}"

    body = [_axes(w, h, pad, "forward ops | backward ops", "live bytes")]
    for frac in (0.0, 0.5, 1.0):
        x, y = pt(0, y_end * frac).split(",")
        body.append(f'<text x="{float(x) - 4}" y="{y}" text-anchor="end">')
        body.append(f"{esc(format_bytes(int(y_end * frac)))}</text>")
    bx, _ = pt(lines[0].boundary, 0).split(",")
    body.append(
        f'<line class="boundary" x1="{bx}" y1="{pad[1]}" x2="{bx}" y2="{h - pad[3]}" '
        f'stroke="#555" stroke-dasharray="6 4"/><text x="{float(bx) - 6}" y="{pad[1] + 12}" '
        f'text-anchor="end">forward</text><text x="{float(bx) + 6}" y="{pad[1] + 12}">'
        "backward</text>"
    )
    for i, s in enumerate(lines):
        colour = PALETTE[i % len(PALETTE)]
        body.append(_polyline(s, s.device, colour, "", pt, "device"))
        if any(s.host):
            body.append(_polyline(s, s.host, colour, ' stroke-dasharray="6 3"', pt, "host"))
        if s.device:
            k = peak_index(s)
            px, py = pt(s.x[k], s.device[k]).split(",")
            body.append(
                f'<circle class="peak" cx="{px}" cy="{py}" r="4" fill="{colour}">'
                f"<title>{esc(s.label)}: peak {esc(format_bytes(s.device[k]))}</title></circle>"
            )
    return _svg("timeline", w, h, "".join(body)) + _key(lines)


def _polyline(
    s: Series,
    ys: Sequence[int],
    colour: str,
    dash: str,
    pt: Callable[[float, float], str],
    kind: str,
) -> str:
    points = " ".join(pt(x, y) for x, y in zip(s.x, ys, strict=True))
    return (
        f'<polyline data-partition="{esc(s.label)}" class="{kind}" points="{points}" '
        f'fill="none" stroke="{colour}" stroke-width="2"{dash}>'
        f"<title>{esc(s.label)}: {kind} memory</title></polyline>"
    )


def peak_index(s: Series) -> int:
    """The index of ``s``'s first device-memory peak."""
    return max(range(len(s.device)), key=s.device.__getitem__)


def _key(lines: Sequence[Series]) -> str:
    spans = [
        f'<span style="color:{PALETTE[i % len(PALETTE)]}">&#9632; {esc(s.label)} '
        f"(peak {esc(format_bytes(max(s.device, default=0)))})</span>"
        for i, s in enumerate(lines)
    ]
    host = any(any(s.host) for s in lines)
    note = "solid: device memory, dashed: host memory (offloaded values); " if host else ""
    return f'<p class="key">{" ".join(spans)}<br>{note}dots mark the peaks</p>'


def _front(points: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The points no other point beats on both axes, by increasing x."""
    return sorted(
        {p for p in points if not any(q[0] <= p[0] and q[1] <= p[1] and q != p for q in points)}
    )


def pareto_svg(items: Sequence[tuple[str, Partition]], w: int = 640, h: int = 360) -> str:
    """Activation bytes against recompute FLOPs: a labelled point per partition (partitions on
    one spot share it), the non-dominated ones joined by the front's line."""
    spots: dict[tuple[int, int], list[str]] = {}
    for label, p in items:
        spots.setdefault((p.activation_bytes, p.recompute_flops), []).append(label)
    pad = (80, 16, 150, 40)
    x_end = max(x for x, _ in spots) or 1
    y_end = max(y for _, y in spots) or 1
    sx, sy = (w - pad[0] - pad[2]) / x_end, (h - pad[1] - pad[3]) / y_end

    def pt(x: float, y: float) -> tuple[float, float]:
        return pad[0] + x * sx, h - pad[3] - y * sy

    body = [_axes(w, h, pad, "activation bytes saved for backward", "recompute FLOPs")]
    for frac in (0.0, 1.0):
        x, y = pt(x_end * frac, y_end * frac)
        body.append(
            f'<text x="{x:.1f}" y="{h - pad[3] + 14}" text-anchor="middle">'
            f'{esc(format_bytes(int(x_end * frac)))}</text><text x="{pad[0] - 4}" y="{y:.1f}" '
            f'text-anchor="end">{int(y_end * frac):,}</text>'
        )
    front = _front(list(spots))
    line = " ".join("{:.1f},{:.1f}".format(*pt(*q)) for q in front)
    body.append(f'<polyline class="front" points="{line}" fill="none" stroke="#888"/>')
    for (ab, fl), labels in spots.items():
        x, y = pt(ab, fl)
        fill = "#1f77b4" if (ab, fl) in front else "#fff"
        text = ", ".join(labels)
        body.append(
            f'<g class="point" data-partition="{esc(text)}"><title>{esc(text)}: '
            f"{esc(format_bytes(ab))} saved, {fl:,} FLOPs recomputed</title>"
            f'<circle cx="{x:.1f}" cy="{y:.1f}" r="5" fill="{fill}" stroke="#1f77b4" '
            f'stroke-width="2"/><text x="{x + 8:.1f}" y="{y - 6:.1f}">{esc(text)}</text></g>'
        )
    return _svg("pareto", w, h, "".join(body))


def _summary(items: Sequence[tuple[str, Partition]]) -> str:
    head = ("partition", "activation", "peak (device)", "host peak", "copied", "recompute")
    rows = []
    for label, p in items:
        cells = (
            label,
            format_bytes(p.activation_bytes),
            format_bytes(p.peak_bytes),
            format_bytes(p.host_peak_bytes),
            format_bytes(p.transfer_bytes),
            f"{len(p.recomputed)} ops, {p.recompute_flops:,} FLOPs",
        )
        rows.append("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in cells) + "</tr>")
    ths = "".join(f"<th>{h}</th>" for h in head)
    return f'<table class="summary"><tr>{ths}</tr>{"".join(rows)}</table>'


def _section(label: str, p: Partition) -> str:
    inputs = ", ".join(
        f"{n.name} = {n.meta.get(PATH) or '?'}: {format_value_type(n.meta.get('val'))}"
        for n in p.joint.primals()
    )
    return (
        f'<section class="partition" data-partition="{esc(label)}"><h2>{esc(label)}</h2>'
        f"<p>inputs: <code>{esc(inputs)}</code></p>"
        f'<div class="scroll">{cut_svg(p)}</div><h3>saved values</h3>{saved_table(p)}</section>'
    )


_STYLE = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1em; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; white-space: nowrap; }
th { background: #eee; } tr.host td { background: #f3eafa; }
code { font-size: 12px; } .scroll { overflow: auto; max-height: 70vh; border: 1px solid #ddd; }
section.partition { margin-bottom: 2em; } .key span { margin-right: 1.5em; }
"""


def page(items: Sequence[tuple[str, Partition]], title: str = "functrans memory report") -> str:
    """The whole HTML page for ``items`` (see the module docstring)."""
    parts = [
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>',
        f"<style>{_STYLE}</style></head><body><h1>{esc(title)}</h1>",
        _summary(items),
        f"<h2>memory over forward then backward</h2>{timeline_svg(items)}",
    ]
    if len(items) > 1:
        parts.append(f"<h2>activation memory against recompute</h2>{pareto_svg(items)}")
    parts.append(f"<h2>the cuts</h2>{legend_svg()}")
    parts += [_section(label, p) for label, p in items]
    parts.append("</body></html>\n")
    return "".join(parts)
