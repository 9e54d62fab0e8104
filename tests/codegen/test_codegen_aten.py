"""The ``"aten"`` backend: fast Python bindings call the very overloads the graph names, and
``jit`` traces for it with the ``"minimal"`` decompositions."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

import functrans as ft
from benchmarks import zoo
from functrans import codegen
from functrans._core import pytree as ft_pytree
from functrans.codegen import _fastcall
from functrans.codegen.aten import AtenBackend
from functrans.extend import backend_capabilities


class _Calls(TorchDispatchMode):
    """Records every ATen overload dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[object] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["mlp_stack", "gpt_block", "llama_block", "conv_block"])
def test_fast_calls_dispatch_the_same_overloads_with_identical_results(name):
    model = zoo.ZOO[name]()
    args = model.make("small")
    jitted = ft.jit(model.fn, backend="aten", decompositions="core")
    params = torch.utils._pytree.tree_map(lambda t: t.requires_grad_(True), args[0])
    jitted(params, args[1]).backward()
    p = jitted.partitions()[0]
    inputs = [t.detach() for t in ft_pytree.flatten(((params, args[1]), {}))[0]]
    order = jitted._cache.slots()[0].order
    inputs = [inputs[i] for i in order]
    slow, fast = AtenBackend(executor="fx"), AtenBackend(executor="python")
    rewritten = _fastcall.use_fast_calls(p.forward.graph_module)
    before = [n.target for n in p.forward.graph_module.graph.nodes]
    assert [n.target for n in rewritten.graph.nodes] != before  # something was rewritten
    for graph, ins in ((p.forward, inputs), (p.backward, None)):
        if ins is None:  # backward: saved values from the forward, then a unit tangent
            n_out = len(p.forward.output_nodes()) - len(p.saved)
            saved = slow.compile(p.forward, inputs)(*inputs)[n_out:]
            ins = [*saved, torch.ones(())]
        runs = []
        for backend in (slow, fast):
            with _Calls() as calls:
                out = backend.compile(graph, ins)(*ins)
            runs.append((out, calls.ops))
        (slow_out, slow_ops), (fast_out, fast_ops) = runs
        moves = {
            torch.ops.aten.t.default,
            torch.ops.aten.transpose.int,
            torch.ops.aten.permute.default,
        }
        assert [op for op in fast_ops if op not in moves] == [
            op for op in slow_ops if op not in moves
        ]
        assert len(fast_ops) <= len(slow_ops)  # transposes that cancel are dropped
        for a, b in zip(fast_out, slow_out, strict=True):
            assert torch.equal(a, b) and a.stride() == b.stride()


def test_transposes_that_cancel_are_dropped_and_outputs_keep_their_strides():
    def f(x, w):
        return (x @ w.t().t()).t().t(), x.permute(1, 0).permute(1, 0)

    args = [torch.randn(3, 4), torch.randn(4, 5)]
    run = AtenBackend(executor="python").compile(ft.trace(f)(*args), args)
    out = run(*args)
    assert run.source.count(" = f") == 3  # mm, and the permutes of an input
    torch.testing.assert_close(out[0], args[0] @ args[1])
    assert out[1] is not args[0]  # an output never is an input itself
    torch.testing.assert_close(out[1], args[0])


def test_cancel_transposes_copies_only_what_it_rewrites():
    from functrans.codegen._peephole import cancel_transposes

    plain = ft.trace(lambda x: x.exp() * 2)(torch.ones(2, 3)).graph_module
    assert cancel_transposes(plain) is plain  # nothing cancels: no copy

    x = torch.randn(2, 3)
    # made by make_fx: ft.trace already drops the pairs (canonicalize)
    chain = make_fx(lambda x: x.t().t().t().t() * 2)(x)
    before = [(n.op, n.target, n.args) for n in chain.graph.nodes]
    out = cancel_transposes(chain)
    assert out is not chain
    assert [(n.op, n.target, n.args) for n in chain.graph.nodes] == before  # left as it was
    calls = [n.target for n in out.graph.nodes if n.op == "call_function"]
    assert calls == [torch.ops.aten.mul.Tensor]  # four transposes: all gone
    torch.testing.assert_close(out(x), x * 2)


def test_a_traced_graph_has_no_transpose_pair_that_cancels():
    g = ft.trace(lambda x: x.t().t().t() * 2)(torch.ones(2, 3))
    assert [str(n.target) for n in g.ops()] == ["aten.permute.default", "aten.mul.Tensor"]
    ident = ft.trace(lambda x: x.t().t())(torch.ones(2, 3))  # an input is no output
    assert len(list(ident.ops())) == 2


def test_sum_without_dims_keeps_its_overload():
    g = ft.trace(lambda x: torch.ops.aten.sum.dim_IntList(x, None))(torch.ones(2, 3))
    rewritten = _fastcall.use_fast_calls(g.graph_module)
    assert torch.ops.aten.sum.dim_IntList in [n.target for n in rewritten.graph.nodes]


def test_jit_traces_for_the_aten_backend_with_composite_ops_whole():
    model = zoo.ZOO["mlp_stack"]()
    params, x = model.make("small")
    params = torch.utils._pytree.tree_map(lambda t: t.requires_grad_(True), params)
    for decompositions, whole in (("auto", True), ("core", False)):
        f = ft.jit(model.fn, decompositions=decompositions)
        f(params, x).backward()
        ops = {n.target for n in f.partitions()[0].backward.ops()}
        assert (torch.ops.aten.gelu_backward.default in ops) is whole
    assert backend_capabilities(codegen.get_backend("aten")).decompositions == "minimal"
