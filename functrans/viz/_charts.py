"""The report's two charts as inline SVG (:mod:`functrans.viz._report` puts them on the page).

The memory timeline (:func:`timeline_svg`): every partition's timeline on one x axis, the
forward pass filling the left part and the backward pass the right, each partition's ops spread
evenly over its phase's part (the parts are as wide as the longest forward and the longest
backward), so the passes' boundary is one line for all partitions.

The trade-off panel (:func:`pareto_svg`): device activation bytes against recompute FLOPs. A
partition that offloads pays in host memory and copies instead, so points are compared on all
four costs (:class:`Point`): offloading never dominates a partition merely by moving bytes off
the device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from functrans._cut.partition import Partition, format_bytes

from ._svg import esc

__all__ = ["PALETTE", "Point", "Series", "pareto_svg", "peak_index", "points", "series"]

#: line colours, one per partition (matplotlib's tab10)
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2")


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
        f'viewBox="0 0 {w} {h}" style="max-width:100%;height:auto" font-family="sans-serif" '
        f'font-size="12">{body}</svg>'
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
    body.append(_x_ticks(lines[0].boundary - 0.5, x_end, pt, h - pad[3]))
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


def _x_ticks(forward: float, end: float, pt: Callable[[float, float], str], base: float) -> str:
    """Ticks under the x axis counting ops in each pass: 0, half and all of the forward's,
    then half and all of the backward's (counted from the passes' boundary)."""
    out = []
    backward = end - forward
    for start, n, fracs in ((0.0, forward, (0.0, 0.5, 1.0)), (forward, backward, (0.5, 1.0))):
        for frac in fracs:
            x, _ = pt(start + frac * n, 0).split(",")
            out.append(
                f'<line class="xtick" x1="{x}" y1="{base}" x2="{x}" y2="{base + 4}" '
                f'stroke="#333"/><text class="xtick" x="{x}" y="{base + 15}" '
                f'text-anchor="middle">{round(frac * n)}</text>'
            )
    return "".join(out)


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


@dataclass(frozen=True)
class Point:
    """A partition's costs on the trade-off panel, each lower-is-better: activation bytes kept
    on the device, recompute FLOPs, peak host bytes of offloaded values, bytes copied."""

    label: str
    device: int
    flops: int
    host: int
    copied: int

    @property
    def offloads(self) -> bool:
        """Whether the partition keeps values in host memory (a diamond on the panel)."""
        return self.host > 0 or self.copied > 0

    def dominates(self, other: Point) -> bool:
        """No worse than ``other`` on every cost and better on one.

        >>> on_host = Point("offload", device=0, flops=0, host=64, copied=128)
        >>> remat, saver = Point("remat", 0, 500, 0, 0), Point("saver", 0, 9, 0, 0)
        >>> on_host.dominates(remat), saver.dominates(on_host), saver.dominates(remat)
        (False, False, True)
        """
        mine = (self.device, self.flops, self.host, self.copied)
        theirs = (other.device, other.flops, other.host, other.copied)
        return mine != theirs and all(a <= b for a, b in zip(mine, theirs, strict=True))


def points(items: Sequence[tuple[str, Partition]]) -> list[Point]:
    """The :class:`Point` of each labelled partition.

    >>> import torch, functrans as ft
    >>> p = ft.partition(ft.joint(lambda x: x.exp().sin().sum())(torch.ones(4)), "default")
    >>> points([("default", p)])
    [Point(label='default', device=16, flops=0, host=0, copied=0)]
    """
    return [
        Point(label, p.activation_bytes, p.recompute_flops, p.host_peak_bytes, p.transfer_bytes)
        for label, p in items
    ]


def _describe(q: Point, beaten_by: Sequence[str]) -> str:
    costs = f"{format_bytes(q.device)} on the device, {q.flops:,} FLOPs recomputed"
    if q.offloads:
        costs += f", {format_bytes(q.host)} host peak, {format_bytes(q.copied)} copied"
    verdict = f"dominated by {', '.join(beaten_by)}" if beaten_by else "not dominated"
    return f"{q.label}: {costs}; {verdict}"


#: label layout: an estimated character width (12 px sans-serif) and the line step
CHAR_W, LINE = 7.2, 15


def place_labels(
    spots: Sequence[tuple[float, float, str]], w: float, h: float
) -> list[tuple[float, float, str]]:
    """Where to write each ``(x, y, text)`` label beside its point: ``(x, baseline,
    text-anchor)``, right of the point (left where it would leave the ``w`` x ``h`` panel),
    moved down or up a line at a time until it clears every point and every label before it.

    >>> place_labels([(50, 50, "a"), (50, 50, "b")], 200, 100)
    [(59, 54, 'start'), (59, 69, 'start')]
    """
    taken = [(x - 6, y - 6, x + 6, y + 6) for x, y, _ in spots]  # the markers
    out = []
    for x, y, text in spots:
        width = CHAR_W * len(text)
        right = x + 9 + width <= w
        left = x + 9 if right else x - 9 - width
        for k in range(4 * len(spots) + 2):
            dy = (k + 1) // 2 * LINE * (1 if k % 2 else -1)
            base = y + 4 + dy
            box = (left, base - 11, left + width, base + 3)
            inside = box[1] >= 0 and box[3] <= h
            if inside and not any(_meet(box, t) for t in taken):
                break
        taken.append(box)
        out.append((x + 9 if right else x - 9, base, "start" if right else "end"))
    return out


def _meet(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _marker(q: Point, x: float, y: float, filled: bool) -> str:
    colour = "#9467bd" if q.offloads else "#1f77b4"
    paint = f'fill="{colour if filled else "#fff"}" stroke="{colour}" stroke-width="2"'
    if q.offloads:
        return f'<polygon points="{x},{y - 7} {x + 7},{y} {x},{y + 7} {x - 7},{y}" {paint}/>'
    return f'<circle cx="{x}" cy="{y}" r="5" {paint}/>'


def pareto_svg(items: Sequence[tuple[str, Partition]], w: int = 720, h: int = 380) -> str:
    """Device activation bytes against recompute FLOPs, a point per partition (a diamond where
    it offloads), filled unless another partition dominates it on all four costs of
    :class:`Point`; the line joins the undominated partitions that offload nothing. A caption
    under the panel says so."""
    pts = points(items)
    beaten = {q.label: [o.label for o in pts if o.dominates(q)] for q in pts}
    pad, inset = (80, 16, 16, 40), 12
    x_end, y_end = max(q.device for q in pts) or 1, max(q.flops for q in pts) or 1
    sx = (w - pad[0] - pad[2] - 2 * inset) / x_end
    sy = (h - pad[1] - pad[3] - 2 * inset) / y_end

    def pt(q: Point) -> tuple[float, float]:
        return pad[0] + inset + q.device * sx, h - pad[3] - inset - q.flops * sy

    body = [_axes(w, h, pad, "activation bytes kept on the device", "recompute FLOPs")]
    for frac in (0.0, 1.0):
        x, y = pt(Point("", int(x_end * frac), int(y_end * frac), 0, 0))
        body.append(
            f'<text x="{x:.1f}" y="{h - pad[3] + 14}" text-anchor="middle">'
            f'{esc(format_bytes(int(x_end * frac)))}</text><text x="{pad[0] - 4}" y="{y:.1f}" '
            f'text-anchor="end">{int(y_end * frac):,}</text>'
        )
    front = sorted((q.device, q.flops) for q in pts if not beaten[q.label] and not q.offloads)
    line = " ".join("{:.1f},{:.1f}".format(*pt(Point("", d, f, 0, 0))) for d, f in front)
    body.append(f'<polyline class="front" points="{line}" fill="none" stroke="#888"/>')
    texts = [
        f"{q.label}: {format_bytes(q.host)} host, {format_bytes(q.copied)} copied"
        if q.offloads
        else q.label
        for q in pts
    ]
    spots = [(*pt(q), t) for q, t in zip(pts, texts, strict=True)]
    for q, (x, y, text), (tx, ty, anchor) in zip(
        pts, spots, place_labels(spots, w, h), strict=True
    ):
        kind = "offload" if q.offloads else "device"
        body.append(
            f'<g class="point {kind}" data-partition="{esc(q.label)}" '
            f'data-dominated="{"yes" if beaten[q.label] else "no"}">'
            f"<title>{esc(_describe(q, beaten[q.label]))}</title>"
            f"{_marker(q, round(x, 1), round(y, 1), not beaten[q.label])}"
            f'<text x="{tx:.1f}" y="{ty:.1f}" text-anchor="{anchor}">{esc(text)}</text></g>'
        )
    return _svg("pareto", w, h, "".join(body)) + _CAPTION


_CAPTION = (
    '<p class="caption">x: activation bytes kept on the device; y: FLOPs recomputed in '
    "backward. Circles keep every saved value on the device; diamonds keep some in host memory "
    "(their labels give the host peak and the bytes copied out and back). A point is filled "
    "unless another partition is no worse on device bytes, recompute FLOPs, host bytes and "
    "bytes copied, and better on one: moving bytes to the host is not counted as saving "
    "memory, so a partition that offloads never hides one that does not. The grey line joins "
    "the filled circles.</p>"
)
