"""The cost model: bytes, op classes from torch tags, FLOPs from torch's formulas."""

import torch

import functrans as ft
from functrans.extend import OpClass, activation_bytes, flops, is_input_alias, nbytes, op_class


def node(graph, name):
    return next(n for n in graph.fx_graph.nodes if n.name == name)


def test_op_classes():
    def f(x, w):
        y = torch.nn.functional.dropout((x @ w).t().relu(), 0.5)
        return y.sum(), y.amax(0)

    g = ft.trace(f)(torch.ones(4, 4), torch.ones(4, 4))
    classes = {n.name: op_class(n) for n in g.fx_graph.nodes if n.op != "output"}
    assert classes["x"] is OpClass.INPUT
    assert classes["mm"] is OpClass.COMPUTE
    assert classes["permute"] is OpClass.VIEW
    assert classes["relu"] is OpClass.POINTWISE
    assert classes["bernoulli"] is OpClass.RANDOM
    assert classes["sum_1"] is OpClass.REDUCTION and classes["amax"] is OpClass.REDUCTION


def test_bytes_and_input_aliases():
    g = ft.trace(lambda x: (x.t() * 2).to(torch.float16))(torch.ones(4, 8))
    assert nbytes(node(g, "x").meta["val"]) == 128
    assert is_input_alias(node(g, "permute")) and activation_bytes(node(g, "permute")) == 0
    assert not is_input_alias(node(g, "mul")) and activation_bytes(node(g, "mul")) == 128
    assert nbytes(node(g, "_to_copy").meta["val"]) == 64


def test_flops():
    g = ft.trace(lambda x, w: (x @ w).sin().sum())(torch.ones(4, 8), torch.ones(8, 16))
    assert flops(node(g, "mm")) == 2 * 4 * 8 * 16
    assert flops(node(g, "sin")) == 4 * 16
    assert flops(node(g, "sum_1")) == 4 * 16
    assert flops(node(g, "x")) == 0
