"""What the trace recorded about a node (``node.meta["val"]``), as every stage reads it.

>>> import torch, functrans as ft
>>> g = ft.trace(lambda x: torch.var_mean(x, 0))(torch.ones(2, 3))
>>> vm = next(n for n in g.ops() if n.target is torch.ops.aten.var_mean.correction)
>>> type(traced_value(vm)).__name__, tuple(first_output(vm).shape)
('tuple', (3,))
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

__all__ = ["first_output", "traced_value"]


def traced_value(node: object) -> Any:
    """The value the trace recorded for ``node``: a (fake) tensor, a tuple of them for an op
    with several outputs, a SymInt; None for anything that is not a node or has no value."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def first_output(node: fx.Node) -> Any:
    """The recorded value of ``node`` 's (first) output: the value itself, or the first of an
    op's several outputs (``var_mean`` 's variance)."""
    v = node.meta["val"]
    return v[0] if isinstance(v, (tuple, list)) else v
