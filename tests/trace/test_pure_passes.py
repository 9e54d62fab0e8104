"""Passes are pure: no public transform, partition strategy or codegen backend changes the graph
it is given (its code, its nodes, or any node's meta)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import functrans as ft
from functrans import codegen, partitioners, policies
from functrans.extend import cut_problem

Snapshot = tuple[str, list[tuple[str, str, dict[str, Any], dict[str, Any]]]]


def _f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = F.gelu(x @ w)  # decomposed by the triton backend: a retrace
    h = F.layer_norm(h, (h.shape[-1],))
    return torch.softmax(h, -1).pow(2).sum()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(4, 8, generator=gen), torch.randn(8, 8, generator=gen)


def _snapshot(graph: ft.Graph) -> Snapshot:
    """The graph's code, and per node: name, op, meta (the values themselves) and a shallow copy
    of each meta value that is a container (to see in-place changes to it)."""
    gm = graph.graph_module
    nodes = [
        (
            n.name,
            n.op,
            dict(n.meta),
            {k: copy.copy(v) for k, v in n.meta.items() if isinstance(v, dict | list | set)},
        )
        for n in gm.graph.nodes
    ]
    return gm.code, nodes


def _assert_unchanged(before: Snapshot, graph: ft.Graph, what: str) -> None:
    code, nodes = before
    after_code, after = _snapshot(graph)
    assert after_code == code, f"{what} changed its input graph's code"
    assert [n[:2] for n in after] == [n[:2] for n in nodes], f"{what} changed the nodes"
    for (name, _, meta, containers), (_, _, meta_after, _) in zip(nodes, after, strict=True):
        assert meta_after.keys() == meta.keys(), (
            f"{what} changed node {name!r}'s meta keys: "
            f"added {sorted(meta_after.keys() - meta.keys())}, "
            f"removed {sorted(meta.keys() - meta_after.keys())}"
        )
        for key, value in meta.items():
            assert meta_after[key] is value, f"{what} replaced node {name!r}'s meta[{key!r}]"
            if key in containers:
                assert value == containers[key], f"{what} mutated node {name!r}'s meta[{key!r}]"


def _zeros_like_inputs(graph: ft.Graph) -> list[torch.Tensor]:
    vals = [n.meta["val"] for n in graph.graph_module.graph.nodes if n.op == "placeholder"]
    return [torch.zeros(v.shape, dtype=v.dtype) for v in vals]


def _check(graph: ft.Graph, what: str, run: Callable[[ft.Graph], Any]) -> None:
    before = _snapshot(graph)
    run(graph)
    _assert_unchanged(before, graph, what)


@pytest.fixture(scope="module")
def tagged() -> Callable[..., torch.Tensor]:
    """``_f`` under ``remat``: its nodes carry functrans' namespaced meta (remat tags)."""
    return ft.remat(_f, policy=policies.dots_saveable)  # type: ignore[no-any-return]


def test_trace_and_joint_leave_a_graph_unchanged(tagged: Callable[..., torch.Tensor]) -> None:
    args = _inputs()
    graph = ft.trace(tagged)(*args)
    _check(graph, "trace", lambda g: ft.trace(g)(*args))
    _check(graph, "joint", lambda g: ft.joint(g)(*args))


def test_split_leaves_the_joint_graph_unchanged(tagged: Callable[..., torch.Tensor]) -> None:
    jg = ft.joint(tagged)(*_inputs())
    # the primals, plus what the remat tags (MUST_SAVE matmuls) forbid recomputing
    _check(jg, "split", lambda g: ft.split(g, saved=cut_problem(g).legalize(g.primals())))


@pytest.mark.parametrize("name", partitioners.names())
def test_strategies_leave_the_joint_graph_unchanged(
    name: str, tagged: Callable[..., torch.Tensor]
) -> None:
    jg = ft.joint(tagged)(*_inputs())
    for options in partitioners.examples(name):
        what = f"partition(strategy={name!r}, **{options})"
        _check(jg, what, lambda g, o=options: ft.partition(g, name, **o))


@pytest.mark.parametrize("backend", codegen.names())
def test_backends_leave_their_graphs_unchanged(
    backend: str, tagged: Callable[..., torch.Tensor]
) -> None:
    if backend == "triton":
        pytest.importorskip("triton")
    args = _inputs()
    compiler = codegen.get_backend(backend)
    p = ft.partition(ft.joint(tagged)(*args), "min_cut")
    for graph in (ft.trace(tagged)(*args), p.forward, p.backward):
        what = f"{backend!r} backend's compile"
        _check(graph, what, lambda g: compiler.compile(g, _zeros_like_inputs(g)))


def test_a_partitioned_joint_graph_is_freed_with_its_last_reference():
    """The cut problem is derived once per graph and kept on it: a module-level cache keyed
    weakly by the graph, whose value referred to the graph, kept every partitioned graph (and
    its fake tensors) alive for the rest of the process."""
    import gc
    import weakref

    jg = ft.joint(lambda x: torch.tanh(x).exp().sum())(torch.ones(8))
    ft.partition(jg, "min_cut")
    alive = weakref.ref(jg)
    del jg
    gc.collect()
    assert alive() is None
