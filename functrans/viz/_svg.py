"""The cut as inline SVG, laid out in Python (no graphviz): the forward nodes of a partition's
joint graph in layers, each node coloured by what the partition does with it.

Layout (:func:`layered_layout`), the simplest layered drawing that reads well and stays compact:

- layering by longest path from the sources, so every edge points down (``y`` grows); then
  each node moves down to just above its nearest user (sinks, such as values only backward
  reads, follow their inputs instead), so an input or a weight's transpose sits next to the op
  that reads it rather than in one wide top row;
- order within a layer by barycentre: two sweeps down and one up, each node placed at the mean
  position of its neighbours in the layers already ordered (ties keep graph order);
- a layer's boxes sit ``gap`` apart, at most :data:`COLS` to a row (a wider layer wraps onto
  the next rows), each row centred: boxes never overlap, the drawing is at most ``COLS`` boxes
  wide, and the page scales it down further where the window is narrower.

Each node is an SVG ``<g data-node="NAME" class="KIND">`` (``KIND`` one of :data:`KINDS`) with
a ``<title>`` (name, op, type, bytes, the user's source line) that browsers show on hover.
"""

from __future__ import annotations

import html
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch.fx as fx

from functrans._core.errors import InvalidArgumentError
from functrans._core.format import format_value_type, op_name
from functrans._core.graph import PATH, SOURCE, JointGraph
from functrans._cut.partition import Partition, format_bytes

__all__ = [
    "COLOURS",
    "KINDS",
    "Box",
    "Layout",
    "cut_svg",
    "esc",
    "layered_layout",
    "legend_html",
    "node_kinds",
]

_K = TypeVar("_K", bound=Hashable)

#: what a partition does with a forward node, most specific first
KINDS = ("offloaded", "saved", "recomputed", "input", "op")
#: fill colour of each kind (the legend shows them)
COLOURS = {
    "offloaded": "#b084d6",
    "saved": "#f0a830",
    "recomputed": "#7fcf95",
    "input": "#d0d3d8",
    "op": "#cfe2f3",
}
_LEGEND = {
    "offloaded": "saved in host memory (offloaded)",
    "saved": "saved on the device",
    "recomputed": "recomputed in backward (dashed)",
    "input": "input (a thick border: saved for backward)",
    "op": "forward op",
}
BOX_W, BOX_H, GAP_X, GAP_Y, MARGIN = 150, 38, 16, 24, 12
#: at most this many boxes a row, a wider layer wraps: six boxes (986 px) fit a 1000 px page
COLS = 6


def esc(text: object) -> str:
    """``text`` escaped for HTML and SVG text and attribute values (quotes included).

    >>> esc('<script>alert("x")</script>')
    '&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;'
    """
    return html.escape(str(text), quote=True)


@dataclass(frozen=True)
class Box:
    """A node's rectangle: top-left corner ``(x, y)``, size ``(w, h)``, its ``layer``."""

    x: float
    y: float
    w: float
    h: float
    layer: int

    def overlaps(self, other: Box) -> bool:
        """Whether the two rectangles share any interior point."""
        return (
            self.x < other.x + other.w
            and other.x < self.x + self.w
            and self.y < other.y + other.h
            and other.y < self.y + self.h
        )


@dataclass(frozen=True)
class Layout(Generic[_K]):
    """Boxes by node, the edges between laid-out nodes, and the drawing's size."""

    boxes: dict[_K, Box]
    edges: tuple[tuple[_K, _K], ...]
    width: float
    height: float


def _layers(nodes: Sequence[_K], edges: Sequence[tuple[_K, _K]]) -> dict[_K, int]:
    """Longest-path layering (Kahn's order; raises on a cycle), then every node that has
    successors moved down to just above its nearest one that is not a sink (in reverse order,
    so each has moved already), and each sink to just below its lowest predecessor: an input
    or a weight's transpose sits next to the op that reads it, not in the top row."""
    preds: dict[_K, list[_K]] = {n: [] for n in nodes}
    succs: dict[_K, list[_K]] = {n: [] for n in nodes}
    for a, b in edges:
        preds[b].append(a)
        succs[a].append(b)
    missing = {n: len(preds[n]) for n in nodes}
    ready = [n for n in nodes if missing[n] == 0]
    layer = dict.fromkeys(ready, 0)
    done: list[_K] = []
    while ready:
        n = ready.pop()
        done.append(n)
        for s in succs[n]:
            layer[s] = max(layer.get(s, 0), layer[n] + 1)
            missing[s] -= 1
            if missing[s] == 0:
                ready.append(s)
    if len(done) != len(nodes):
        raise InvalidArgumentError(
            f"layered_layout: edges={list(edges)[:5]!r}... form a cycle; expected a DAG"
        )
    for n in reversed(done):  # a sink does not hold its predecessors up: it follows them
        ahead = [layer[s] for s in succs[n] if succs[s]]
        if ahead:
            layer[n] = min(ahead) - 1
    for n in done:
        if not succs[n]:
            layer[n] = max((layer[m] + 1 for m in preds[n]), default=0)
    return layer


def _centre(n: _K, side: list[_K], pos: dict[_K, float]) -> float:
    """The mean position of ``side`` (a node's neighbours), or ``n``'s own without any."""
    return sum(pos[m] for m in side) / len(side) if side else pos[n]


def _order(rows: list[list[_K]], edges: Sequence[tuple[_K, _K]]) -> None:
    """Barycentre ordering of ``rows`` in place: sweep down twice (by each node's
    predecessors), then up once (by its successors)."""
    preds: dict[_K, list[_K]] = {n: [] for r in rows for n in r}
    succs: dict[_K, list[_K]] = {n: [] for r in rows for n in r}
    for a, b in edges:
        preds[b].append(a)
        succs[a].append(b)
    pos = {n: i - (len(r) - 1) / 2 for r in rows for i, n in enumerate(r)}
    for near, sweep in ((preds, rows), (preds, rows), (succs, rows[::-1])):
        for row in sweep:
            centre = {n: _centre(n, near[n], pos) for n in row}
            row.sort(key=centre.__getitem__)  # stable: ties keep their order
            pos.update({n: i - (len(row) - 1) / 2 for i, n in enumerate(row)})


def layered_layout(
    nodes: Sequence[_K],
    edges: Sequence[tuple[_K, _K]],
    *,
    box: tuple[float, float] = (BOX_W, BOX_H),
    gap: tuple[float, float] = (GAP_X, GAP_Y),
    cols: int = COLS,
) -> Layout[_K]:
    """Lay out a DAG top to bottom: every node a ``box``-sized rectangle, edges pointing down,
    at most ``cols`` boxes a row (a wider layer wraps onto more rows).

    Edges whose ends are not both in ``nodes`` are dropped.

    >>> lay = layered_layout(["a", "b", "c"], [("a", "c"), ("b", "c")])
    >>> [lay.boxes[n].layer for n in "abc"], lay.boxes["a"].y < lay.boxes["c"].y
    ([0, 0, 1], True)
    >>> wide = layered_layout(range(7), [(i, 6) for i in range(6)], cols=4)
    >>> len({b.y for b in wide.boxes.values()}), wide.width == 4 * BOX_W + 3 * GAP_X
    (3, True)
    """
    keep = set(nodes)
    if len(keep) != len(nodes):
        raise InvalidArgumentError(f"layered_layout: nodes={list(nodes)!r} repeat a node")
    if cols < 1:
        raise InvalidArgumentError(f"layered_layout: cols={cols!r}; expected at least 1")
    inner = tuple((a, b) for a, b in edges if a in keep and b in keep and a != b)
    layer = _layers(nodes, inner)
    rows: list[list[_K]] = [[] for _ in range(max(layer.values(), default=-1) + 1)]
    for n in nodes:
        rows[layer[n]].append(n)
    _order(rows, inner)
    (w, h), (gx, gy) = box, gap
    widest = min(max((len(r) for r in rows), default=0), cols)
    width = widest * (w + gx) - gx if widest else 0.0
    boxes, y = {}, 0.0
    for i, row in enumerate(rows):
        for k in range(0, len(row), cols):
            line = row[k : k + cols]
            left = (width - (len(line) * (w + gx) - gx)) / 2
            for j, n in enumerate(line):
                boxes[n] = Box(left + j * (w + gx), y, w, h, i)
            y += h + gy
    return Layout(boxes, inner, float(width), max(y - gy, 0.0))


def node_kinds(p: Partition) -> dict[fx.Node, str]:
    """The kind (:data:`KINDS`) of every forward node of ``p``'s joint graph.

    >>> import torch, functrans as ft
    >>> p = ft.partition(ft.joint(lambda x: x.exp().sin().sum())(torch.ones(3)), "default")
    >>> {n.name: k for n, k in node_kinds(p).items()}
    {'primals_1': 'input', 'exp': 'saved', 'sin': 'op', 'sum_1': 'op', 'cos': 'op'}
    """
    host = {v.node for v in p.offloaded}
    saved = {v.node for v in p.saved if not v.is_input}
    redone = set(p.recomputed)
    primals = set(p.joint.primals())
    out = {}
    for n in p.joint.forward_nodes():
        flags = {
            "offloaded": n in host,
            "saved": n in saved,
            "recomputed": n in redone,
            "input": n in primals,
        }
        out[n] = next((k for k in KINDS[:-1] if flags[k]), "op")
    return out


def _label(n: fx.Node) -> tuple[str, str]:
    """Two lines: the user's name (argument path for inputs) and the op and type."""
    name = str(n.meta.get(PATH) or n.name)
    if n.op == "call_function":
        full = op_name(n.target)  # aten.mul.Tensor: the overload is in the tooltip, not here
        what = full.split(".")[1] if full.startswith("aten.") else full
    else:
        what = "input" if n.op == "placeholder" else n.op
    return name, f"{what} {format_value_type(n.meta.get('val'))}"


def _clip(text: str, limit: int = 21, keep_end: bool = False) -> str:
    """``text`` cut to ``limit`` characters; an argument path keeps its informative end."""
    if len(text) <= limit:
        return text
    return "…" + text[1 - limit :] if keep_end else text[: limit - 1] + "…"


def _node_svg(n: fx.Node, b: Box, kind: str, saved: dict[fx.Node, str]) -> str:
    first, second = _label(n)
    op = op_name(n.target) if n.op == "call_function" else ""
    tip = [f"{n.name} ({kind})", first if first != n.name else "", op, second]
    if n in saved:
        tip.append(f"saved: {saved[n]}")
    tip.append(str(n.meta.get(SOURCE) or "no source line"))
    border = 3 if n in saved else 1
    dash = ' stroke-dasharray="4 2"' if kind == "recomputed" else ""
    return (
        f'<g data-node="{esc(n.name)}" class="{kind}">'
        f"<title>{esc(chr(10).join(t for t in tip if t))}</title>"
        f'<rect x="{b.x:.1f}" y="{b.y:.1f}" width="{b.w:.0f}" height="{b.h:.0f}" rx="5" '
        f'fill="{COLOURS[kind]}" stroke="#333" stroke-width="{border}"{dash}/>'
        f'<text x="{b.x + b.w / 2:.1f}" y="{b.y + 15:.1f}" text-anchor="middle" '
        f'font-weight="bold">{esc(_clip(first, keep_end=n.op == "placeholder"))}</text>'
        f'<text x="{b.x + b.w / 2:.1f}" y="{b.y + 30:.1f}" text-anchor="middle">'
        f"{esc(_clip(second))}</text></g>"
    )


def legend_html() -> str:
    """The node colours as one HTML line, which wraps with the page (swatch, then meaning).

    >>> '<span class="legend-saved"><span class="swatch" style="background:#f0a830">' in (
    ...     legend_html())
    True
    """
    items = "".join(
        f'<span class="legend-{kind}"><span class="swatch" style="background:{COLOURS[kind]}">'
        f"</span> {esc(_LEGEND[kind])}</span>"
        for kind in KINDS
    )
    return f'<p class="legend">{items}</p>'


def _edge_svg(a: Box, b: Box) -> str:
    """A curve from the bottom of ``a`` to the top of ``b``, leaving and arriving vertically."""
    x1, y1, x2, y2 = a.x + a.w / 2, a.y + a.h, b.x + b.w / 2, b.y
    bend = min((y2 - y1) / 2, 2 * GAP_Y)
    return (
        f'<path d="M{x1:.1f},{y1:.1f} C{x1:.1f},{y1 + bend:.1f} {x2:.1f},{y2 - bend:.1f} '
        f'{x2:.1f},{y2:.1f}"/>'
    )


def forward_layout(joint: JointGraph) -> Layout[fx.Node]:
    """:func:`layered_layout` of ``joint``'s forward nodes and the edges between them."""
    nodes = joint.forward_nodes()
    edges = [(a, b) for b in nodes for a in b.all_input_nodes]
    return layered_layout(nodes, edges)


def cut_svg(p: Partition) -> str:
    """Inline SVG of ``p``'s forward nodes (see the module docstring).

    >>> import torch, functrans as ft
    >>> p = ft.partition(ft.joint(lambda x: x.exp().sin().sum())(torch.ones(3)), "default")
    >>> svg = cut_svg(p)
    >>> svg.startswith("<svg"), 'data-node="exp" class="saved"' in svg
    (True, True)
    """
    lay = forward_layout(p.joint)
    kinds = node_kinds(p)
    shared = p.shared_storage()
    host = {v.node for v in p.offloaded}
    saved = {
        v.node: f"shares {shared[v.node].name}'s storage"
        if v.node in shared
        else f"{format_bytes(v.storage_bytes)} {'in host memory' if v.node in host else ''}"
        for v in p.saved
    }
    edges = "".join(_edge_svg(lay.boxes[a], lay.boxes[b]) for a, b in lay.edges)
    nodes = "".join(_node_svg(n, b, kinds[n], saved) for n, b in lay.boxes.items())
    w, h = lay.width + 2 * MARGIN, lay.height + 2 * MARGIN
    return (
        f'<svg class="cut" xmlns="http://www.w3.org/2000/svg" width="{w:.0f}" height="{h:.0f}" '
        'style="max-width:100%;height:auto" '
        f'viewBox="{-MARGIN} {-MARGIN} {w:.0f} {h:.0f}" font-family="monospace" font-size="11">'
        f'<g class="edges" fill="none" stroke="#777" stroke-width="1.2">{edges}</g>{nodes}</svg>'
    )
