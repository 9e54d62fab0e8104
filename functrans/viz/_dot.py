"""Graphviz text for graphs and partitions: the picture the joint-graph article draws.

Forward nodes are blue, backward nodes red, inputs grey; for a partition the saved values are
the edges that cross the cut (labelled with their bytes) and recomputed nodes have a dashed
border.
"""

from __future__ import annotations

import html

import torch.fx as fx

from functrans._core.format import format_value_type, op_name
from functrans._core.graph import PHASE, ROLE, Graph, Phase, Role
from functrans._cut.partition import Partition, format_bytes

__all__ = ["to_dot"]

_FILL: dict[Phase | None, str] = {Phase.FORWARD: "#dbe9f6", Phase.BACKWARD: "#f8d7d0"}


def _label(node: fx.Node) -> str:
    what = op_name(node.target) if node.op == "call_function" else node.op
    return html.escape(f"{node.name}\\n{what}\\n{format_value_type(node.meta.get('val'))}")


def _node_line(node: fx.Node, dashed: bool) -> str:
    role = node.meta.get(ROLE)
    phase = node.meta.get(PHASE)
    fill = "#e8e8e8" if isinstance(role, Role) else _FILL.get(phase, "#ffffff")
    style = "filled,dashed" if dashed else "filled"
    return f'  "{node.name}" [label="{_label(node)}", style="{style}", fillcolor="{fill}"];'


def to_dot(obj: Partition | Graph) -> str:
    """DOT source for a partition (drawn on its joint graph) or any graph.

    >>> import torch, functrans as ft
    >>> p = ft.partition(ft.joint(lambda x: x.sin().sum())(torch.ones(2)), "default")
    >>> print(to_dot(p).splitlines()[0])
    digraph functrans {
    """
    graph = obj.joint if isinstance(obj, Partition) else obj
    saved: dict[fx.Node, int] = {}
    recomputed: set[fx.Node] = set()
    if isinstance(obj, Partition):
        shared = obj.shared_storage()  # a storage's bytes label the edge of its first value
        saved = {s.node: 0 if s.node in shared else s.activation_bytes for s in obj.saved}
        recomputed = set(obj.recomputed)
    lines = ["digraph functrans {", "  rankdir=TB; node [shape=box, fontname=monospace];"]
    for node in graph.fx_graph.nodes:
        if node.op != "output":
            lines.append(_node_line(node, node in recomputed))
    for node in graph.fx_graph.nodes:
        for user in node.users:
            if user.op == "output":
                continue
            lines.append(_edge(node, user, saved, recomputed))
    lines.append("}")
    return "\n".join(lines)


def _edge(node: fx.Node, user: fx.Node, saved: dict[fx.Node, int], recomputed: set[fx.Node]) -> str:
    in_backward = user.meta.get(PHASE) is Phase.BACKWARD or user in recomputed
    crosses = node in saved and in_backward
    if crosses:
        label = f"saved {format_bytes(saved[node])}"
        return f'  "{node.name}" -> "{user.name}" [color="#c0392b", penwidth=2.5, label="{label}"];'
    return f'  "{node.name}" -> "{user.name}";'
