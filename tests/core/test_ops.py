"""functrans._core.ops: the op vocabulary every layer asks, defined once."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from functrans._core.ops import OpClass, is_view_op, op_class

aten = torch.ops.aten


def test_is_view_op_answers_for_a_node_or_its_target() -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    t = g.call_function(aten.t.default, (x,))
    sin = g.call_function(aten.sin.default, (t,))
    pair = g.call_function(aten.var_mean.correction, (sin,))
    first = g.call_function(operator.getitem, (pair, 0))
    assert is_view_op(t) and is_view_op(aten.t.default) and is_view_op(aten.expand.default)
    assert not any(map(is_view_op, (x, sin, pair, aten.sin.default, "t", None)))
    assert not is_view_op(first) and op_class(first) is OpClass.VIEW  # getitem: a class only
