"""Which node of a compiled step raised, and the user's line it was traced from.

The executors name the node whose op raised: the native one in the error's message
(``... (functrans: while running node index_select)``), the Python one in a note; a block
compiled once (:mod:`functrans._jit.outline`) adds the name of its call in the step's graph
after the name inside the block. :func:`explain` follows those names from the step's graph into
the block's and adds one note with the op and the user's line:

    functrans: raised by aten.index_select.default (node index_select) in the compiled
    forward, traced from model.py:12: return self.l(x).index_select(0, i)

The error itself (its type and message) is torch's, so code that catches it still does.
"""

from __future__ import annotations

import re

import torch.fx as fx

from functrans._core.boxed import RUNNING_NODE
from functrans._core.graph import SOURCE
from functrans._trace.passes import source_of

from .outline import inner_graph

__all__ = ["explain"]

_NAMED = re.compile(re.escape(RUNNING_NODE) + r" (\w+)")


def explain(exc: BaseException, graph: fx.GraphModule | None, phase: str) -> None:
    """Add a note to ``exc`` (raised by running ``graph``, the compiled ``phase``) naming the
    op, its node and the user's line, where the executor named the node."""
    if graph is None or getattr(exc, "_functrans_explained", False):
        return
    texts = [str(exc), *getattr(exc, "__notes__", ())]
    names = [m for t in texts for m in _NAMED.findall(t)]
    found = _innermost(names, graph)
    if found is None:
        return
    source = found.meta.get(SOURCE) or source_of(found.meta.get("stack_trace"))
    where = f", traced from {source}" if source else ""
    exc.add_note(
        f"functrans: raised by {found.target} (node {found.name}) in the compiled {phase}{where}"
    )
    exc._functrans_explained = True  # type: ignore[attr-defined]  # a marker on a raised error


def _innermost(names: list[str], graph: fx.GraphModule) -> fx.Node | None:
    """The node the innermost name denotes: names run from the op that raised out to the
    step's node of the block it ran in (the native executor names only the op inside a
    block: then the blocks the step calls are searched)."""
    graphs = [graph]
    for n in graph.graph.nodes:
        inner = inner_graph(n)
        if inner is not None and all(inner is not g for g in graphs):
            graphs.append(inner)
    for name in names:
        for g in graphs:
            node: fx.Node | None = next((n for n in g.graph.nodes if n.name == name), None)
            if node is not None:
                return node
    return None
