"""The cut as inline SVG, laid out in Python (no graphviz): the forward nodes of a partition's
joint graph in layers, each node coloured by what the partition does with it.

Layout (:func:`layered_layout`), the simplest layered drawing that reads well:

- layering by longest path from the sources, so every edge points down (``y`` grows);
- order within a layer by barycentre: two sweeps down and one up, each node placed at the mean
  position of its neighbours in the layers already ordered (ties keep graph order);
- a layer's boxes sit ``gap`` apart, the layer centred on the widest one: boxes never overlap.

Each node is an SVG ``<g data-node="NAME" class="KIND">`` (``KIND`` one of :data:`KINDS`) with
a ``<title>`` (name, op, type, bytes, the user's source line) that browsers show on hover.
"""

from __future__ import annotations

import html
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch.fx as fx

from ._errors import InvalidArgumentError
from ._format import format_value_type, op_name
from ._graph import PATH, SOURCE, JointGraph
from ._partition import Partition, format_bytes

__all__ = ["COLOURS", "KINDS", "Box", "Layout", "cut_svg", "esc", "layered_layout", "node_kinds"]

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
    "recomputed": "recomputed in backward",
    "input": "input (saved inputs have a thick border)",
    "op": "forward op",
}
BOX_W, BOX_H, GAP_X, GAP_Y, MARGIN = 150, 38, 16, 30, 12


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
    """Longest-path layering (Kahn's order); raises on a cycle."""
    preds: dict[_K, list[_K]] = {n: [] for n in nodes}
    succs: dict[_K, list[_K]] = {n: [] for n in nodes}
    for a, b in edges:
        preds[b].append(a)
        succs[a].append(b)
    missing = {n: len(preds[n]) for n in nodes}
    ready = [n for n in nodes if missing[n] == 0]
    layer = dict.fromkeys(ready, 0)
    while ready:
        n = ready.pop()
        for s in succs[n]:
            layer[s] = max(layer.get(s, 0), layer[n] + 1)
            missing[s] -= 1
            if missing[s] == 0:
                ready.append(s)
    if len(layer) != len(nodes) or any(missing.values()):
        raise InvalidArgumentError(
            f"layered_layout: edges={list(edges)[:5]!r}... form a cycle; expected a DAG"
        )
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
) -> Layout[_K]:
    """Lay out a DAG top to bottom: every node a ``box``-sized rectangle, edges pointing down.

    Edges whose ends are not both in ``nodes`` are dropped.

    >>> lay = layered_layout(["a", "b", "c"], [("a", "c"), ("b", "c")])
    >>> [lay.boxes[n].layer for n in "abc"], lay.boxes["a"].y < lay.boxes["c"].y
    ([0, 0, 1], True)
    """
    keep = set(nodes)
    if len(keep) != len(nodes):
        raise InvalidArgumentError(f"layered_layout: nodes={list(nodes)!r} repeat a node")
    inner = tuple((a, b) for a, b in edges if a in keep and b in keep and a != b)
    layer = _layers(nodes, inner)
    rows: list[list[_K]] = [[] for _ in range(max(layer.values(), default=-1) + 1)]
    for n in nodes:
        rows[layer[n]].append(n)
    _order(rows, inner)
    (w, h), (gx, gy) = box, gap
    widest = max((len(r) for r in rows), default=0)
    width = widest * (w + gx) - gx if widest else 0.0
    boxes = {}
    for i, row in enumerate(rows):
        left = (width - (len(row) * (w + gx) - gx)) / 2
        for j, n in enumerate(row):
            boxes[n] = Box(left + j * (w + gx), i * (h + gy), w, h, i)
    height = len(rows) * (h + gy) - gy if rows else 0.0
    return Layout(boxes, inner, float(width), float(height))


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
        what = op_name(n.target).removeprefix("aten.").removesuffix(".default")
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
    tip = [f"{n.name} ({kind})", first if first != n.name else "", second]
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


def legend_svg() -> str:
    """A one-row SVG legend of the node colours."""
    items, x = [], 4
    for kind in KINDS:
        items.append(
            f'<g class="legend-{kind}"><rect x="{x}" y="4" width="16" height="16" '
            f'fill="{COLOURS[kind]}" stroke="#333"/><text x="{x + 22}" y="17">'
            f"{esc(_LEGEND[kind])}</text></g>"
        )
        x += 22 + 7 * len(_LEGEND[kind]) + 24  # about 7 px a character at 12 px
    return (
        f'<svg class="legend" xmlns="http://www.w3.org/2000/svg" width="{x}" '
        f'height="24" font-family="sans-serif" font-size="12">{"".join(items)}</svg>'
    )


def _edge_svg(a: Box, b: Box) -> str:
    x1, y1, x2, y2 = a.x + a.w / 2, a.y + a.h, b.x + b.w / 2, b.y
    return f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}"/>'


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
        f'viewBox="{-MARGIN} {-MARGIN} {w:.0f} {h:.0f}" font-family="monospace" font-size="11">'
        f'<g class="edges" stroke="#777" stroke-width="1.2">{edges}</g>{nodes}</svg>'
    )
