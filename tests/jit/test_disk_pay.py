"""The on-disk trace cache's cheap paths: the store-time round-trip check compares decoded
nodes (and still catches every change a stored document could carry), and the recorder's
walk stops at frames it walked before without missing a caller."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from hypothesis import given, settings

import functrans as ft
from functrans._jit.disk import graph_json
from functrans._jit.disk.code_deps import Recorder
from functrans.extend import REMAT
from functrans.testing import programs


def _f(x, w):
    h = (x @ w * 2.5).reshape(2, 8)
    out = ft.remat(lambda t: t.tanh().sum((0,)), policy=ft.policies.dots_saveable)(h).sum()
    return out.to(torch.float64)  # a call with keyword arguments


def _doc(g):
    return json.loads(json.dumps(graph_json.dump(g)))


def _joint():
    x, w = torch.randn(4, 4), torch.randn(4, 4, requires_grad=True)
    return ft.joint(_f, argnums=1)(x, w)


def test_a_dumped_graph_passes_the_round_trip_check():
    jg = _joint()
    graph_json.check_round_trip(_doc(jg), jg)
    g = ft.trace(_f)(torch.randn(4, 4), torch.randn(4, 4))
    graph_json.check_round_trip(_doc(g), g)


def _node(doc, op):
    return next(nd for nd in doc["nodes"] if nd.get("target", [None, None])[1:2] == [op])


def _changes():
    """Changes to a stored document that decode to another graph, each by name."""

    def float_arg(doc):
        _node(doc, "mul")["args"]["tuple"][1] = {"float": "2.0"}

    def list_to_tuple(doc):
        nd = _node(doc, "view")
        nd["args"]["tuple"][1] = {"tuple": nd["args"]["tuple"][1]}

    def int_to_bool(doc):
        nd = _node(doc, "view")
        nd["args"]["tuple"][1][0] = True

    def swapped_reference(doc):
        nd = _node(doc, "mul")
        first = nd["args"]["tuple"][0]
        other = next(n["name"] for n in doc["nodes"] if n["op"] == "placeholder")
        assert first != {"node": other}
        nd["args"]["tuple"][0] = {"node": other}

    def target(doc):
        _node(doc, "tanh")["target"] = ["aten", "sigmoid", "default"]

    def kwarg_name(doc):
        nd = next(n for n in doc["nodes"] if n.get("kwargs"))
        key = next(iter(nd["kwargs"]))
        nd["kwargs"][key + "_x"] = nd["kwargs"].pop(key)

    def kwarg_value(doc):
        nd = next(n for n in doc["nodes"] if n.get("kwargs", {}).get("dtype"))
        nd["kwargs"]["dtype"] = {"dtype": "float16"}

    def meta(doc):
        nd = next(n for n in doc["nodes"] if REMAT in n["meta"])
        nd["meta"][REMAT] = "MUST_SAVE" if nd["meta"][REMAT] != "MUST_SAVE" else "PREFER_RECOMPUTE"

    def name(doc):
        doc["nodes"][-2]["name"] += "_renamed"

    def dropped_node(doc):
        del doc["nodes"][-2]

    def joint_field(doc):
        doc["joint"]["num_outputs"] += 1

    def calling_convention(doc):
        doc["in_flat"]["is_tensor"][0] = not doc["in_flat"]["is_tensor"][0]

    return [
        float_arg,
        list_to_tuple,
        int_to_bool,
        swapped_reference,
        target,
        kwarg_name,
        kwarg_value,
        meta,
        name,
        dropped_node,
        joint_field,
        calling_convention,
    ]


@pytest.mark.parametrize("change", _changes(), ids=lambda c: c.__name__)
def test_the_round_trip_check_catches_a_changed_document(change):
    jg = _joint()
    doc = _doc(jg)
    bad = copy.deepcopy(doc)
    change(bad)
    assert bad != doc
    with pytest.raises(graph_json.NotStorable):
        graph_json.check_round_trip(bad, jg)


def test_the_round_trip_check_catches_a_changed_constant():
    def f(x):
        return x * torch.tensor([1.0, -0.0, 3.0])

    g = ft.trace(f)(torch.ones(3))
    doc = _doc(g)
    graph_json.check_round_trip(doc, g)
    nd = next(n for n in doc["nodes"] if n["op"] == "get_attr")
    nd["constant"]["value"][2][1] = 0.0  # -0.0 and 0.0 compare equal, print differently
    with pytest.raises(graph_json.NotStorable):
        graph_json.check_round_trip(doc, g)


@settings(max_examples=25, deadline=None)
@given(programs(max_steps=6))
def test_random_programs_pass_the_round_trip_check(prog):
    xs = [t.requires_grad_(True) for t in prog.example_inputs()]
    jg = ft.joint(prog)(*xs)
    graph_json.check_round_trip(_doc(jg), jg)


# -- the recorder ------------------------------------------------------------------------------


def _gen():
    x = yield
    while True:
        x = yield x.sin()  # a torch call in a generator resumed by two callers


def _first(g, x):
    return g.send(x)


def _second(g, x):  # calls no torch function itself: seen on the generator's stack only
    return g.send(x)


def _deep(n, x):
    return x.cos() if n == 0 else _deep(n - 1, x) + _leaf(x)


def _leaf(x):
    return x * 2


def test_the_recorder_sees_the_callers_of_a_resumed_generator():
    def f(x):
        g = _gen()
        next(g)
        a = _first(g, x)
        b = _second(g, x)  # no torch call in between: the generator's frame was walked last
        return a + b

    with Recorder() as r:
        ft.trace(f)(torch.ones(2))
    observed = {c for c in r.codes if c not in r.static}
    assert {_gen.__code__, _first.__code__, _second.__code__, f.__code__} <= observed


def test_the_recorder_sees_code_entered_after_a_stop():
    """The walk stops at a frame a call walked before: code entered below it later (a
    recursion, a helper) is still seen, and so is code entered after the stack unwound."""

    def f(x):
        return _deep(3, x) + _leaf(x)

    with Recorder() as r:
        ft.trace(f)(torch.ones(2))
    observed = {c for c in r.codes if c not in r.static}
    assert {f.__code__, _deep.__code__, _leaf.__code__} <= observed
    assert r._stack == [] and r._index == {}  # no frame is kept past the trace
