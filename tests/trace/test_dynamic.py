"""Dynamic shapes: ``trace``/``joint``/``jit`` with ``dynamic=``, symbolic graphs through the
partitioners, the report, the backends and the cache."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from expecttest import assert_expected_inline
from hypothesis import example, given
from hypothesis import strategies as st

import functrans as ft
from functrans import FunctransError
from functrans._core.shapes import shape_env_of
from functrans.codegen.aten import AtenBackend
from functrans.testing import check_dynamic_partition, programs
from functrans.testing._program import InputSpec, Program, Step

STRATEGIES = ("default", "min_cut", "full_remat")


def mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ w1)
    return (F.gelu(h) @ w2).softmax(-1).pow(2).sum()


def weights(d: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(d, 16, generator=g), torch.randn(16, d, generator=g)


def guards_of(jg: ft.JointGraph) -> list[str]:
    env = shape_env_of([n.meta["val"] for n in jg.primals()])
    assert env is not None
    return [str(g.expr) for g in env.guards]


def renumbered(text: str) -> str:
    """``text`` with torch's size symbols (numbered by a hash) renamed s0, s1, ... in order of
    first appearance."""
    names: dict[str, str] = {}
    return re.sub(r"\bs\d+\b", lambda m: names.setdefault(m[0], f"s{len(names)}"), text)


# ---------------------------------------------------------------------------------------------
# trace and joint


def test_trace_dynamic_golden_and_runs_at_other_sizes() -> None:
    g = ft.trace(lambda x: (x * 2).sum(0), dynamic=True)(torch.ones(4, 3))
    assert_expected_inline(
        renumbered(str(g)),
        """\
def forward(x: "f32[s0, s1]"):
    mul: "f32[s0, s1]" = aten.mul.Tensor(x, 2)
    sum_1: "f32[s1]" = aten.sum.dim_IntList(mul, [0])
    return (sum_1,)""",
    )
    for shape in [(4, 3), (7, 5), (2, 9)]:
        x = torch.randn(shape)
        torch.testing.assert_close(g(x), (x * 2).sum(0))


def test_a_graph_refuses_inputs_that_break_its_guards() -> None:
    g = ft.trace(lambda x: x.view(-1, 4).sum(1), dynamic=True)(torch.ones(8))
    torch.testing.assert_close(g(torch.ones(12)), torch.full((3,), 4.0))
    with pytest.raises(FunctransError, match=r"break the conditions the graph was traced under"):
        g(torch.ones(1))  # size 1 is specialised away by torch (the trace assumed s0 >= 2)


def test_named_dimensions_share_one_symbol() -> None:
    def f(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return (x * mask.unsqueeze(-1)).sum()

    x, mask = torch.randn(4, 6, 3), torch.ones(4, 6)
    dyn = {"x": {0: "batch", 1: "seq"}, "mask": {0: "batch", 1: "seq"}}
    g = ft.trace(f, dynamic=dyn)(x, mask)
    (xs, ms) = [n.meta["val"] for n in g.placeholders()]
    assert isinstance(xs.shape[0], torch.SymInt) and str(xs.shape[0]) == str(ms.shape[0])
    assert str(xs.shape[1]) == str(ms.shape[1])
    x2, m2 = torch.randn(3, 9, 3), torch.rand(3, 9)
    torch.testing.assert_close(g(x2, m2), f(x2, m2))
    with pytest.raises(TraceError_ := FunctransError, match="both named 'batch'"):
        ft.trace(f, dynamic=dyn)(torch.randn(4, 6, 3), torch.ones(5, 6))
    del TraceError_


@pytest.mark.parametrize(
    ("dynamic", "message"),
    [
        ({"y": (0,)}, "no tensor argument is named 'y'; the tensor inputs are x"),
        ({"x": (2,)}, "x has 2 dimensions, so it has no dimension 2"),
        ({"x": "batch"}, "expected the dimensions as a mapping"),
        ({"x": {0.5: "b"}}, "is not a dimension"),
        ("yes", "expected False, True, 'auto'"),
    ],
)
def test_bad_dynamic_specs_are_named(dynamic: object, message: str) -> None:
    with pytest.raises(FunctransError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ft.trace(lambda x: x + 1, dynamic=dynamic)(torch.ones(2, 3))  # type: ignore[arg-type]


def test_jit_rejects_a_bad_dynamic_value() -> None:
    with pytest.raises(FunctransError, match="dynamic=3"):
        ft.jit(lambda x: x, dynamic=3)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# partitioning: no guards, the same decisions at the hint, bytes as formulas


@pytest.mark.parametrize("strategy", [*STRATEGIES, "memory_budget"])
def test_partitioning_adds_no_guards(strategy: str) -> None:
    w1, w2 = weights()
    jg = ft.joint(mlp, dynamic={"x": {0: "batch"}})(torch.randn(6, 8), w1, w2)
    before = guards_of(jg)
    opts = {"budget": 0.5} if strategy == "memory_budget" else {}
    p = ft.partition(jg, strategy, **opts)
    p.report()
    _ = p.peak_bytes, p.activation_bytes_expr
    assert guards_of(jg) == before


def _saved_tensors(p: ft.Partition) -> list[tuple[str, tuple[int, ...], torch.dtype | None, int]]:
    return sorted(
        (s.op, s.shape, s.dtype, s.storage_bytes)
        for s in p.saved
        if isinstance(s.node.meta.get("val"), torch.Tensor)
    )


@pytest.mark.parametrize("model", ["mlp_stack", "gpt_block", "llama_block"])
@pytest.mark.parametrize(
    ("strategy", "options"),
    [("default", {}), ("full_remat", {}), ("min_cut", {}), ("memory_budget", {"budget": 0.4})],
)
def test_saved_sets_at_the_hint_equal_the_static_ones(
    model: str, strategy: str, options: dict[str, float]
) -> None:
    from benchmarks import zoo

    m = getattr(zoo, model)()
    args = m.make("small", torch.float32, 0)
    static = ft.partition(ft.joint(m.fn)(*args), strategy, **options)
    sym = ft.partition(ft.joint(m.fn, dynamic=True)(*args), strategy, **options)
    assert sym.activation_bytes == static.activation_bytes
    assert sym.recompute_flops == static.recompute_flops
    if strategy != "memory_budget":  # the ILP may break a tie between equal-cost sets either way
        assert _saved_tensors(sym) == _saved_tensors(static)


def test_report_shows_bytes_as_formulas_with_their_value() -> None:
    w1, w2 = weights()
    jg = ft.joint(mlp, dynamic={"x": {0: "batch"}})(torch.randn(6, 8), w1, w2)
    p = ft.partition(jg, "default")
    text = p.report()
    assert "64*s" in text and "= 384" in text  # tanh: batch x 16 float32 at batch 6
    formula = p.activation_bytes_expr
    assert formula is not None and f"activation bytes: {formula} = {p.activation_bytes}" in text
    residuals = ft.saved_residuals(mlp, torch.randn(6, 8), w1, w2, dynamic={"x": {0: "batch"}})
    grows = [r for r in residuals if r.bytes_expr is not None]
    assert grows and all("s0" in str(r) and f"= {r.nbytes} B" in str(r) for r in grows)
    assert sum(r.nbytes for r in residuals) == p.activation_bytes


def test_memory_budget_plans_at_the_declared_sizes() -> None:
    w1, w2 = weights()
    jg = ft.joint(mlp, dynamic={"x": {0: "batch"}})(torch.randn(6, 8), w1, w2)
    at_hint = ft.partition(jg, "memory_budget", max_bytes=2000)
    at_large = ft.partition(jg, "memory_budget", max_bytes=2000, at={"batch": 4096})
    assert at_hint.activation_bytes > 0  # fits at batch 6: something is saved
    big = [s for s in at_large.saved if s.bytes_expr is not None and not s.is_input]
    assert not big  # at batch 4096 nothing that grows with the batch fits 2000 bytes
    with pytest.raises(FunctransError, match="no symbolic dimension is named 'seq'"):
        ft.partition(jg, "memory_budget", max_bytes=2000, at={"seq": 3})
    static = ft.joint(mlp)(torch.randn(6, 8), w1, w2)
    with pytest.raises(FunctransError, match="static shapes"):
        ft.partition(static, "memory_budget", max_bytes=2000, at={"batch": 3})


# Shrunk by CI: a saved view with a size-one dimension whose stride differs at run time
# (meaningless for a size-one dimension) was refused by backward's shape guard.
SIZE_ONE_STRIDE = Program(
    inputs=(InputSpec((), torch.float32), InputSpec((2, 1), torch.float32)),
    steps=(Step("mm", (1, 1), (1,), (2, 2)),),
    outputs=(2,),
    batch=2,
)
# F.pad reads its input's sizes, so the trace pins the batch with a guard (Eq(s0, 2)) while
# the inputs keep their symbols: only the traced batch can run the graph
PAD_PINS_THE_BATCH = Program(
    inputs=(InputSpec((1, 2), torch.float32),),
    steps=(Step("pad", (0,), (0, 0), (1, 2)),),
    outputs=(1,),
    batch=2,
)
# Shrunk by make fuzz: layer_norm over 2 elements under vmap, float32. Its gradients are
# rounding noise (the output is +-1 whatever the input), so the symbolic graph's op order and
# eager's differ by 1.5e-4 at batch 3, past float32's tolerance; the float64 oracle shows both
# as accurate (the check now asks it when float32 disagrees)
LAYER_NORM_OF_TWO = Program(
    inputs=(InputSpec((), torch.float32), InputSpec((2, 3, 2), torch.float32)),
    steps=(Step("layer_norm", (1,), (), (2, 3, 2)),),
    outputs=(2,),
    batch=2,
)


@given(programs(batch=True, max_steps=5), st.sampled_from(STRATEGIES))
@example(SIZE_ONE_STRIDE, "default")
@example(PAD_PINS_THE_BATCH, "default")
@example(LAYER_NORM_OF_TWO, "default")
def test_property_dynamic_batch_partitions(prog: ft.testing.Program, strategy: str) -> None:
    check_dynamic_partition(prog, strategy)


# ---------------------------------------------------------------------------------------------
# jit


def _eager_and_jit(f, jf, shapes: list[tuple[int, ...]], w: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
    for shape in shapes:
        x = torch.randn(shape, requires_grad=True)
        out = jf(x, w)
        out.backward()
        gx, gw = x.grad, w.grad
        x.grad = w.grad = None
        f(x, w).backward()
        torch.testing.assert_close(out, f(x, w))
        torch.testing.assert_close(gx, x.grad)
        torch.testing.assert_close(gw, w.grad)
        x.grad = w.grad = None


def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    B, T, C = x.shape
    h = (x @ w).view(B, T, 2, C // 2).softmax(-1).reshape(B, T, C)
    return (torch.tanh(h) * x).sum()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_jit_dynamic_true_three_shapes_one_compile(strategy: str) -> None:
    w = torch.randn(8, 8, requires_grad=True)
    jf = ft.jit(block, dynamic=True, partition=strategy)
    _eager_and_jit(block, jf, [(2, 5, 8), (3, 7, 8), (4, 9, 8)], w)
    assert jf.cache_info().misses == 1
    assert jf.cache_info().hits == 2


def test_jit_auto_goes_symbolic_on_the_second_shape() -> None:
    w = torch.randn(8, 8, requires_grad=True)
    jf = ft.jit(block, dynamic="auto")
    _eager_and_jit(block, jf, [(2, 5, 8), (3, 7, 8), (4, 9, 8), (6, 3, 8), (2, 5, 8)], w)
    info = jf.cache_info()
    assert (info.misses, info.hits) == (2, 3)


def test_size_one_adds_at_most_one_entry() -> None:
    w = torch.randn(8, 8, requires_grad=True)
    jf = ft.jit(block, dynamic={"x": {0: "batch", 1: "seq"}})
    shapes = [(3, 5, 8), (1, 5, 8), (4, 6, 8), (1, 9, 8), (1, 2, 8), (5, 5, 8)]
    _eager_and_jit(block, jf, shapes, w)
    assert jf.cache_info().misses == 2


def test_fixed_sizes_keep_their_guard() -> None:
    w = torch.randn(8, 8, requires_grad=True)
    jf = ft.jit(block, dynamic={"x": {0: "batch"}})
    _eager_and_jit(block, jf, [(2, 5, 8), (3, 5, 8), (3, 6, 8)], w)
    assert jf.cache_info().misses == 2  # seq was not declared dynamic: 6 is a new entry


def test_divisibility_is_guarded_like_eager() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x.view(-1, 4).softmax(-1).sum()

    jf = ft.jit(f, dynamic=True)
    for n in (8, 12, 20):
        torch.testing.assert_close(jf(torch.ones(n)), f(torch.ones(n)))
    with pytest.raises(RuntimeError, match="invalid for input of size 10"):
        f(torch.ones(10))
    with pytest.raises(RuntimeError, match="invalid for input of size 10"):
        jf(torch.ones(10))


def test_non_contiguous_input_is_not_given_a_contiguous_entry() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x.view(-1).cumsum(0)

    jf = ft.jit(f, dynamic=True)
    jf(torch.randn(3, 4))
    x = torch.randn(5, 3).t()
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        f(x)
    with pytest.raises((RuntimeError, ValueError), match="view"):
        jf(x)  # the trace of the new layout fails as eager does (torch's refs raise ValueError)
    y = torch.randn(5, 6)
    torch.testing.assert_close(jf(y), f(y))


def test_an_unused_output_gets_zeros_of_this_calls_size() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.sin(), x.cos().sum()

    jf = ft.jit(f, dynamic=True)
    for n in (3, 5, 9):
        x = torch.randn(n, requires_grad=True)
        _, s = jf(x)
        s.backward()
        torch.testing.assert_close(x.grad, -x.detach().sin())


def test_inference_entries_are_dynamic_too() -> None:
    jf = ft.jit(block, dynamic=True)
    w = torch.randn(8, 8)
    with torch.no_grad():
        for shape in [(2, 5, 8), (3, 6, 8)]:
            x = torch.randn(shape)
            torch.testing.assert_close(jf(x, w), block(x, w))
    assert jf.cache_info().misses == 1


def test_a_new_shape_is_found_on_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    jf = ft.jit(block, dynamic=True)
    w = torch.randn(8, 8)
    jf(torch.randn(2, 5, 8), w)
    calls = []
    original = jf._lookup
    monkeypatch.setattr(jf, "_lookup", lambda *a: calls.append(1) or original(*a))
    jf(torch.randn(3, 7, 8), w)  # new sizes: the guards (sizes skipped, expression) pass
    jf(torch.randn(4, 4, 8), w)
    assert not calls and jf.cache_info().hits == 2


@pytest.mark.parametrize("executor", ["native", "python", "fx"])
def test_aten_executors_run_symbolic_graphs(executor: str) -> None:
    w = torch.randn(8, 8)
    g = ft.trace(block, dynamic={"x": {0: "b", 1: "t"}})(torch.randn(2, 5, 8), w)
    run = AtenBackend(executor=executor).compile(g, [])
    if executor == "native":
        assert "Program" in repr(run)  # not the Python fallback
    for shape in [(3, 4, 8), (5, 9, 8)]:
        x = torch.randn(shape)
        torch.testing.assert_close(run(x, w)[0], block(x, w))


def test_native_executor_size_arithmetic_follows_python() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        return x.reshape(n // 3, -1).sum(0) + (n % 5) - (-n // 4)

    g = ft.trace(f, dynamic=True)(torch.ones(9))
    run = AtenBackend(executor="native").compile(g, [])
    for n in (6, 9, 12, 21):
        x = torch.arange(float(n))
        torch.testing.assert_close(run(x)[0], f(x))


def test_triton_backend_falls_back_to_one_entry_per_shape(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("triton")
    jf = ft.jit(lambda x: torch.tanh(x) * 2, backend="triton", dynamic=True)
    ft.set_logs("dynamic")
    try:
        for n in (4, 6):
            x = torch.randn(n)
            torch.testing.assert_close(jf(x), torch.tanh(x) * 2)
    finally:
        ft.set_logs()
    assert jf.cache_info().misses == 2
    assert "backend 'triton' compiles static shapes only" in capsys.readouterr().err


def test_dynamic_training_loop_matches_eager() -> None:
    """A user's loop: an MLP classifier trained with AdamW on batches of varying size and
    sequence length, dropout on, compared with eager step by step under one seed."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(32, 16)
            self.fc = torch.nn.Linear(16, 16)
            self.drop = torch.nn.Dropout(0.1)
            self.out = torch.nn.Linear(16, 32)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            h = self.drop(F.gelu(self.fc(self.emb(idx))))
            return F.cross_entropy(self.out(h).flatten(0, 1), idx.flatten())

    def run(compiled: bool) -> list[float]:
        torch.manual_seed(0)
        net = Net()
        model = ft.jit(net, dynamic="auto") if compiled else net
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        losses = []
        for b, t in [(4, 6), (3, 9), (5, 2), (1, 7), (2, 3), (4, 6), (6, 11)]:
            idx = torch.randint(0, 32, (b, t), generator=g)
            loss = model(idx)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        if compiled:
            assert model.cache_info().misses <= 4  # type: ignore[operator]
        return losses

    assert run(True) == pytest.approx(run(False), rel=1e-5, abs=1e-6)


def test_dynamo_backend_compiles_a_dynamic_graph_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import functrans._jit.dynamo as dynamo

    made = []
    original = dynamo._dynamic_graph
    monkeypatch.setattr(
        dynamo, "_dynamic_graph", lambda *a, **k: made.append(original(*a, **k)) or made[-1]
    )
    w = torch.randn(6, 6, requires_grad=True)

    def f(x: torch.Tensor) -> torch.Tensor:
        return (x @ w).view(x.shape[0], -1, 2).softmax(-1).sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, backend=ft.dynamo_backend(), dynamic=True)
    for n in (4, 5, 8):
        x = torch.randn(n, 6, requires_grad=True)
        out = compiled(x)
        out.backward()
        gx, gw = x.grad, w.grad
        x.grad = w.grad = None
        f(x).backward()
        torch.testing.assert_close(out, f(x))
        torch.testing.assert_close((gx, gw), (x.grad, w.grad))
        x.grad = w.grad = None
    assert len(made) == 1
    info = made[0].cache_info()
    assert (info.misses, info.hits) == (1, 2)


def test_auto_a_batch_of_one_after_symbolic_shapes_adds_one_entry() -> None:
    """Under "auto", once larger batches went symbolic, the first batch of one compiles an
    entry symbolic in the other dimensions that vary (the 1 stays fixed, as torch keeps it):
    later batches of one with other lengths reuse it."""
    w = torch.randn(8, 8, requires_grad=True)
    jf = ft.jit(block)  # dynamic="auto", the default
    _eager_and_jit(block, jf, [(3, 5, 8), (4, 6, 8), (1, 7, 8), (1, 9, 8), (1, 4, 8)], w)
    assert jf.cache_info().misses == 3


def test_dynamo_backend_dynamic_graph_with_module_floats() -> None:
    """Under dynamic=True dynamo hands a module's float attributes (LayerNorm's eps, a
    dropout's p) over as 0-d tensors read with .item(): they are static numbers of our trace.
    (Found by a user-style review: it raised a data-dependent TraceError.)"""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Dropout(0.2))
    torch._dynamo.reset()
    compiled = torch.compile(m, backend=ft.dynamo_backend(), dynamic=True)
    for n in (4, 6, 9):
        x = torch.randn(n, 8)
        torch.manual_seed(n)
        out = compiled(x)
        torch.manual_seed(n)
        torch.testing.assert_close(out, m(x))


def test_regression_empty_values_cross_the_cut_with_any_strides() -> None:
    """Shrunk by the dynamic-batch property: a batched ``mm`` of 0-sized matrices hands
    backward empty tensors whose strides differ from the trace's ((0, 1, 0) vs (1, 1, 1));
    an empty tensor's strides mean nothing, so the graph takes it."""
    from functrans.testing._program import InputSpec, Program, Step

    prog = Program(
        inputs=(InputSpec((), torch.float32), InputSpec((0, 1), torch.float32)),
        steps=(Step("mm", (1, 1), (1,), (0, 0)),),
        outputs=(2,),
        batch=2,
    )
    check_dynamic_partition(prog, "default")


# ---------------------------------------------------------------------------------------------
# found by a user-style review (each was silently wrong or refused before)


def test_review_a_size_the_trace_fixed_is_guarded() -> None:
    """x.split(2) of 7 elements ends in a chunk of one, so torch fixes the size at 7 (a
    replacement, not a guard text): that size must still be checked, or 10 elements would
    reuse the 7-element graph and lose a chunk."""

    def f(x: torch.Tensor) -> list[torch.Tensor]:
        return [c * 2 for c in x.split(2)]

    jf = ft.jit(f, dynamic=True)
    for n in (4, 6, 8, 7, 10):
        x = torch.arange(float(n))
        got, want = jf(x), f(x)
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b)


def test_review_a_tensor_made_from_a_size_follows_the_size() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x.sum() * torch.tensor(x.shape[0]) + x.new_tensor([x.shape[1]]).sum()

    jf = ft.jit(f, dynamic=True)
    for n in (4, 6, 9):
        x = torch.ones(n, n + 1)
        torch.testing.assert_close(jf(x), f(x))
    assert jf.cache_info().misses == 1


def test_review_returning_a_size_compiles_per_shape_not_a_stale_size() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Size, float]:
        return x.shape, x.numel() / 2

    jf = ft.jit(f, dynamic=True)
    for n in (4, 6, 9):
        assert jf(torch.ones(n, 3)) == f(torch.ones(n, 3))
    with pytest.raises(FunctransError, match="a size computed from symbolic dimensions"):
        ft.trace(f, dynamic=True)(torch.ones(4, 3))


def test_review_module_dynamic_names_are_forwards_parameters() -> None:
    lin = torch.nn.Linear(3, 3)
    jm = ft.jit(lin, dynamic={"input": {0: "batch"}})  # Linear.forward(self, input)
    for n in (2, 5, 7):
        x = torch.randn(n, 3)
        torch.testing.assert_close(jm(x), lin(x))
    assert jm.cache_info().misses == 1


class _Table(torch.nn.Module):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.e = torch.nn.Embedding(rows, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return (self.e(idx) * self.scale).tanh().sum()


def _table_calls(m: _Table, jm: torch.nn.Module) -> None:
    g = torch.Generator().manual_seed(0)
    for b, t in [(2, 5), (3, 7)]:
        idx = torch.randint(0, 10, (b, t), generator=g)
        torch.testing.assert_close(jm(idx), m(idx))
    m.e.weight = torch.nn.Parameter(torch.randn(16, 4))  # a table of another size
    idx = torch.randint(0, 16, (4, 6), generator=g)
    torch.testing.assert_close(jm(idx), m(idx))
    jm(idx).backward()
    grad = m.e.weight.grad
    m.e.weight.grad = None
    m(idx).backward()
    torch.testing.assert_close(grad, m.e.weight.grad)


def test_dynamic_true_keeps_a_modules_parameter_sizes_static() -> None:
    m = _Table(10)
    jm = ft.jit(m, dynamic=True)
    _table_calls(m, jm)
    # the inputs' sizes are symbolic (one entry for both); the table's rows are not, so a
    # table of 16 rows is a new entry
    assert jm.cache_info().misses == 2


def test_a_named_parameter_dimension_is_symbolic() -> None:
    m = _Table(10)
    jm = ft.jit(m, dynamic={"idx": (0, 1), "params['e.weight']": (0,)})
    _table_calls(m, jm)
    assert jm.cache_info().misses == 1


def test_auto_sizes_that_coincide_at_two_shapes_stay_apart() -> None:
    # Shrunk from a property test of dynamic="auto" that generalised two static traces: at
    # (2, 3) and (3, 4) the slice end `t - 1` equals the batch, so a graph fitted to those two
    # shapes read the batch there, and at (2, 2) it sliced 2 tokens of 2 instead of 1.
    w = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))

    def f(x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        flat = (x.reshape(b * t, c) @ w).view(b, t, -1).sum(1)
        return (flat * t).reshape(b, 3)[:, 1:] - x[:, : t - 1, 0].sum(1, True)

    jf = ft.jit(f)
    for b, t in [(2, 3), (3, 4), (2, 2)]:
        x = torch.randn(b, t, 4)
        torch.testing.assert_close(jf(x), f(x), rtol=0, atol=0)


def test_auto_a_size_threshold_both_shapes_pass_is_guarded() -> None:
    # A Python condition on a size that the first two shapes satisfy alike leaves the same ops
    # in both static traces; the dynamic entry must still take the other branch below it.
    def f(x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        return x.sin().sum(1) if t > 16 else x.cos().sum(1)

    jf = ft.jit(f)
    for t in (20, 24, 8, 30):
        x = torch.randn(3, t)
        torch.testing.assert_close(jf(x), f(x), rtol=0, atol=0)
