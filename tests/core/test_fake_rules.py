"""The fast metadata rules of symbolic traces give what torch's fake kernels give: the same
sizes, strides, offset, dtype and device (as expressions) and no guard, op by op and for a
whole GPT's symbolic joint graph; cases outside a rule fall through to torch's kernel."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import functrans as ft
from functrans._core.fake_rules import RULES, SymbolicFakeMode
from functrans._core.shapes import shape_env_of, symbolic_fakes

aten = torch.ops.aten


def _meta(v: Any) -> Any:
    if v is None:
        return None
    if isinstance(v, (list, tuple)):
        return [_meta(x) for x in v]
    if not isinstance(v, torch.Tensor):
        return str(v)
    return (
        [str(s) for s in v.shape],
        [str(s) for s in v.stride()],
        str(v.storage_offset()),
        v.dtype,
        v.device,
    )


@pytest.fixture
def rule_calls() -> Iterator[list[Any]]:
    """The ops a rule answered (not None) while the test ran."""
    calls: list[Any] = []
    saved = dict(RULES)

    def spy(op: Any, rule: Any) -> Any:
        def run(mode: Any, args: Sequence[Any], kwargs: Any) -> Any:
            out = rule(mode, args, kwargs)
            if out is not None:
                calls.append(op)
            return out

        return run

    for op, rule in saved.items():
        RULES[op] = spy(op, rule)
    yield calls
    RULES.clear()
    RULES.update(saved)


def _both(make: Callable[[], list[torch.Tensor]], call: Callable[..., Any]) -> tuple[Any, Any]:
    """``call`` on fresh symbolic fakes from ``make``, with the rules and then (on fakes of
    another shape environment) with torch's kernels: the outputs' metadata and the guards
    each added."""
    results = []
    for on in (True, False):
        fakes = make()
        mode = fakes[0].fake_mode
        assert isinstance(mode, SymbolicFakeMode)
        env = mode.shape_env
        assert env is not None
        before = len(env.guards)
        mode.rules_enabled = on
        try:
            out = _meta(call(*fakes))
        finally:
            del mode.rules_enabled
        results.append((out, [str(g.expr) for g in env.guards[before:]]))
    return results[0], results[1]


def _fakes(
    shapes: Sequence[tuple[int, ...]], dims: Sequence[dict[int, Any]], dtype: torch.dtype
) -> list[torch.Tensor]:
    return symbolic_fakes([torch.ones(s, dtype=dtype) for s in shapes], tuple(dims))


VIEWS: list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = [
    ("split last", lambda x: x.view(x.shape[0], x.shape[1], 4, 16)),
    ("merge leading", lambda x: x.view(x.shape[0] * x.shape[1], 64)),
    ("flatten", lambda x: x.view(x.numel())),
    ("unsqueeze-like", lambda x: x.view(x.shape[0], 1, x.shape[1], 64)),
    ("trailing one", lambda x: x.view(x.shape[0], x.shape[1], 64, 1)),
    ("same", lambda x: x.view(x.shape[0], x.shape[1], 64)),
    ("split leading", lambda x: x.view(x.shape[0], x.shape[1] * 8, 8)),
    ("minus one", lambda x: x.view(-1, 64)),
    ("transposed", lambda x: x.transpose(0, 1).view(x.shape[1], x.shape[0], 4, 16)),
    ("sliced", lambda x: x[:, 1:].reshape(-1)),
    ("narrow rows", lambda x: x[:, :, :32].reshape(x.shape[0], -1)),
]


@pytest.mark.parametrize("case", VIEWS, ids=[c[0] for c in VIEWS])
def test_view_rule_gives_torchs_layout(
    case: tuple[str, Callable[[torch.Tensor], torch.Tensor]],
) -> None:
    with_rules, torchs = _both(
        lambda: _fakes([(4, 6, 64)], [{0: None, 1: None}], torch.float32), case[1]
    )
    assert with_rules == torchs


def test_view_rule_answers_contiguous_inputs_only(rule_calls: list[Any]) -> None:
    (x,) = _fakes([(4, 6, 64)], [{0: None, 1: None}], torch.float32)
    x.view(x.shape[0] * x.shape[1], 64)
    assert rule_calls == [aten.view.default]
    x.transpose(0, 1).view(x.shape[1], x.shape[0], 4, 16)  # not contiguous: torch's kernel
    x.view(-1, 64)  # -1: torch's kernel infers it
    assert rule_calls.count(aten.view.default) == 1


NORMS: list[tuple[str, tuple[int, ...], dict[int, Any], bool, bool, torch.dtype]] = [
    ("3d", (4, 6, 64), {0: "b", 1: "t"}, True, True, torch.float32),
    ("2d", (6, 32), {0: "b"}, True, True, torch.float32),
    ("no bias", (4, 6, 64), {0: "b", 1: "t"}, True, False, torch.float32),
    ("no affine", (4, 6, 64), {0: "b", 1: "t"}, False, False, torch.float32),
    ("float64", (4, 6, 16), {0: "b"}, True, True, torch.float64),
    ("bfloat16", (4, 6, 16), {0: "b"}, True, True, torch.bfloat16),  # torch's kernel
    ("two dims", (4, 6, 8, 16), {0: "b", 1: "t"}, True, True, torch.float32),
]


@pytest.mark.parametrize("case", NORMS, ids=[c[0] for c in NORMS])
def test_layer_norm_rules_give_torchs_outputs(case: Any) -> None:
    _, shape, dims, affine, has_bias, dtype = case
    k = 2 if case[0] == "two dims" else 1
    normalized = list(shape[-k:])

    def make() -> list[torch.Tensor]:
        return _fakes(
            [shape, tuple(normalized), tuple(normalized), shape], [dims, {}, {}, dims], dtype
        )

    def params(w: torch.Tensor, b: torch.Tensor) -> tuple[Any, Any]:
        return (w if affine else None), (b if has_bias else None)

    def forward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, g: torch.Tensor) -> Any:
        return aten.native_layer_norm.default(x, normalized, *params(w, b), 1e-5)

    fwd, torch_fwd = _both(make, forward)
    assert fwd == torch_fwd
    for mask in ([True, True, True], [True, False, False], [False, True, True]):

        def backward(
            x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, g: torch.Tensor, mask: Any = mask
        ) -> Any:
            _, mean, rstd = forward(x, w, b, g)
            return aten.native_layer_norm_backward.default(
                g, x, normalized, mean, rstd, *params(w, b), mask
            )

        bwd, torch_bwd = _both(make, backward)
        assert bwd == torch_bwd


def test_layer_norm_rules_fall_through_for_half_precision(rule_calls: list[Any]) -> None:
    x, w, b = _fakes([(4, 6, 16), (16,), (16,)], [{0: None}, {}, {}], torch.bfloat16)
    aten.native_layer_norm.default(x, [16], w, b, 1e-5)
    assert aten.native_layer_norm.default not in rule_calls  # (its float32 insides may be)
    y, w32, b32 = _fakes([(4, 6, 16), (16,), (16,)], [{0: None}, {}, {}], torch.float32)
    aten.native_layer_norm.default(y, [16], w32, b32, 1e-5)
    assert aten.native_layer_norm.default in rule_calls


POINTWISE: list[tuple[str, Callable[..., Any]]] = [
    ("add", lambda x, y: aten.add.Tensor(x, y)),
    ("add alpha", lambda x, y: aten.add.Tensor(x, y, alpha=2)),
    ("sub", lambda x, y: aten.sub.Tensor(x, y)),
    ("mul", lambda x, y: aten.mul.Tensor(x, y)),
    ("div", lambda x, y: aten.div.Tensor(x, y)),
    ("gelu", lambda x, y: aten.gelu.default(x)),
    ("gelu tanh", lambda x, y: aten.gelu.default(x, approximate="tanh")),
    ("gelu_backward", lambda x, y: aten.gelu_backward.default(x, y)),
    ("gelu_backward tanh", lambda x, y: aten.gelu_backward.default(x, y, approximate="tanh")),
    # torch's kernels: broadcasting, a transposed operand, a 0-dim one
    ("broadcast", lambda x, y: aten.add.Tensor(x, y[:1])),
    ("transposed", lambda x, y: aten.mul.Tensor(x.transpose(0, 1), y.transpose(0, 1))),
    ("mixed layouts", lambda x, y: aten.mul.Tensor(x, y.transpose(0, 1).contiguous().t())),
    ("scalar tensor", lambda x, y: aten.mul.Tensor(x, y.sum())),
]


@pytest.mark.parametrize("case", POINTWISE, ids=[c[0] for c in POINTWISE])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pointwise_rule_gives_torchs_layout(
    case: tuple[str, Callable[..., Any]], dtype: torch.dtype
) -> None:
    def make() -> list[torch.Tensor]:
        return _fakes([(4, 6), (4, 6)], [{0: "b", 1: "t"}, {0: "b", 1: "t"}], dtype)

    with_rules, torchs = _both(make, case[1])
    assert with_rules == torchs


def test_pointwise_rule_leaves_broadcasting_to_torch(rule_calls: list[Any]) -> None:
    x, y = _fakes([(4, 6), (4, 6)], [{0: "b", 1: "t"}, {0: "b", 1: "t"}], torch.float32)
    aten.add.Tensor(x, y[:1])
    aten.mul.Tensor(x.transpose(0, 1), y.transpose(0, 1))
    assert aten.add.Tensor not in rule_calls and aten.mul.Tensor not in rule_calls
    aten.add.Tensor(x, y)
    assert rule_calls.count(aten.add.Tensor) == 1


MATMULS: list[tuple[str, Callable[..., Any]]] = [
    ("mm", lambda a, b, c: aten.mm.default(a, b)),
    ("mm of a transposed", lambda a, b, c: aten.mm.default(a, c.t())),
    ("addmm", lambda a, b, c: aten.addmm.default(b[0], a, b)),
    ("addmm alpha beta", lambda a, b, c: aten.addmm.default(b[0], a, b, beta=2, alpha=3)),
    ("t", lambda a, b, c: aten.t.default(a)),
    ("transpose", lambda a, b, c: aten.transpose.int(a.view(2, -1, 8), 0, -1)),
    ("transpose back", lambda a, b, c: aten.transpose.int(aten.t.default(a), 1, 0)),
    # torch's kernels: a bias that broadcasts from one element, inner sizes that differ
    ("addmm scalar bias", lambda a, b, c: aten.addmm.default(b[0, :1], a, b)),
    ("mm mismatched", lambda a, b, c: aten.mm.default(a, c)),
]


@pytest.mark.parametrize("case", MATMULS, ids=[c[0] for c in MATMULS])
def test_matmul_and_transpose_rules_give_torchs_layout(
    case: tuple[str, Callable[..., Any]],
) -> None:
    def make() -> list[torch.Tensor]:
        return symbolic_fakes(
            [torch.ones(6, 16), torch.ones(16, 8), torch.ones(8, 16)], ({0: "n"}, {}, {0: "k"})
        )

    def run(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> Any:
        try:
            return case[1](a, b, c)
        except RuntimeError as e:  # both sides must refuse alike
            return type(e).__name__

    with_rules, torchs = _both(make, run)
    assert with_rules == torchs


def test_rules_leave_tensors_on_two_devices_to_torch(rule_calls: list[Any]) -> None:
    # a fake CUDA tensor needs no GPU: torch's kernel raises for the mix, so no rule answers
    (x,) = _fakes([(4, 6)], [{0: "b"}], torch.float32)
    with x.fake_mode:
        y = torch.empty(x.shape[0], 6, device="cuda")
        w = torch.empty(6, 6, device="cuda")
    for call in (
        lambda: aten.add.Tensor(x, y),
        lambda: aten.mm.default(x, w),
        lambda: aten.native_layer_norm.default(x, [6], w[0], None, 1e-5),
    ):
        with pytest.raises(RuntimeError, match="device"):
            call()
    assert rule_calls == []


@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_cross_entropy_rules_give_torchs_outputs(reduction: int) -> None:
    def make() -> list[torch.Tensor]:
        return symbolic_fakes(
            [torch.ones(12, 10), torch.ones(12, 10), torch.zeros(12, dtype=torch.int64)],
            ({0: "n"}, {0: "n"}, {0: "n"}),
        )

    def run(logits: torch.Tensor, grad: torch.Tensor, target: torch.Tensor) -> Any:
        logp = aten._log_softmax.default(logits, 1, False)
        back = aten._log_softmax_backward_data.default(grad, logp, 1, torch.float32)
        loss, total = aten.nll_loss_forward.default(logp, target, None, reduction, -100)
        g = aten.ones_like.default(loss)
        dlogp = aten.nll_loss_backward.default(g, logp, target, None, reduction, -100, total)
        return [logp, back, loss, total, dlogp]

    with_rules, torchs = _both(make, run)
    assert with_rules == torchs


class _Block(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class _GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(64, 32), nn.Embedding(16, 32)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.ln = nn.LayerNorm(32)
        self.head = nn.Linear(32, 64, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.head(self.ln(x)).flatten(0, 1), targets.flatten())


def test_a_symbolic_gpt_traces_alike_with_and_without_the_rules(
    monkeypatch: pytest.MonkeyPatch, rule_calls: list[Any]
) -> None:
    torch.manual_seed(0)
    model = _GPT()
    params = {k: v.detach().requires_grad_() for k, v in model.named_parameters()}
    idx, tgt = torch.randint(0, 64, (3, 7)), torch.randint(0, 64, (3, 7))

    def loss(ps: dict[str, torch.Tensor], i: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, ps, (i, t))

    seen = []
    for on in (True, False):
        monkeypatch.setattr(SymbolicFakeMode, "rules_enabled", on)
        jg = ft.joint(  # jit's table: layer norm's backward kept whole
            loss,
            decompositions="minimal",
            dynamic={"i": {0: "b", 1: "t"}, "t": {0: "b", 1: "t"}},
        )(params, idx, tgt)
        env = shape_env_of([n.meta["val"] for n in jg.primals()])
        assert env is not None
        guards = sorted(str(g.expr) for g in env.guards)
        # the same tensor ops with the same metadata and the same guards (a rule's view takes
        # the sizes it is given as its own, so later ops read them from where they were made,
        # not from a sym_size of the view: the size arithmetic nodes may differ)
        tensor_ops = [
            (str(n.target), _meta(n.meta["val"]))
            for n in jg.ops()
            if isinstance(n.meta.get("val"), (torch.Tensor, tuple, list))
        ]
        seen.append((tensor_ops, guards))
        if on:
            # the rules a GPT's ops reach all answered (its pointwise ops are adds of equal
            # shapes; its other multiplications broadcast, as in dropout's scale, or are gelu's)
            assert set(rule_calls) == set(RULES) - {
                aten.sub.Tensor,
                aten.div.Tensor,
                aten.mul.Tensor,
            }
    assert seen[0] == seen[1]


def _outcome(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call``, with an error it raises as its type's name (both sides must refuse alike)."""

    def run(*fakes: torch.Tensor) -> Any:
        try:
            return call(*fakes)
        except Exception as e:
            return type(e).__name__

    return run


# Cases a review found the first rules got wrong (each was a mismatch with torch's kernel):
# a complex Python scalar promotes a float tensor; an out-of-range dim or an unknown gelu
# approximation raises; an odd stride on a size-one dimension is kept in a result laid out
# like its input; a permuted gradient gives layer norm's backward a permuted result; an empty
# input's layer norm backward returns weight and bias gradients; a sparse tensor's transpose
REVIEWED: list[tuple[str, Callable[..., Any]]] = [
    ("complex scalar", lambda x, g: aten.mul.Tensor(x, 1j)),
    ("complex alpha", lambda x, g: aten.add.Tensor(x, g, alpha=1j)),
    ("log_softmax dim", lambda x, g: aten._log_softmax.default(x, 5, False)),
    (
        "log_softmax backward dim",
        lambda x, g: aten._log_softmax_backward_data.default(g, x, 5, torch.float32),
    ),
    ("gelu approximation", lambda x, g: aten.gelu.default(x, approximate="bogus")),
    # the rule's own reread found it: torch keeps the odd stride of a size-one dimension in a
    # view of the same shape (the first rule gave stride 1 where torch gives 16)
    ("view keeps a size-one stride", lambda x, g: aten.view.default(x[:1, 0], [1])),
    (
        "odd size-one stride",
        lambda x, g: aten._log_softmax.default(
            x.view(x.shape[0], 1, 2, 8).as_strided((x.shape[0], 1, 2, 8), (16, 7, 8, 1)),
            -1,
            False,
        ),
    ),
    (
        "layer norm of an odd size-one stride",
        lambda x, g: aten.native_layer_norm.default(
            x.view(x.shape[0], 1, 2, 8).as_strided((x.shape[0], 1, 2, 8), (16, 7, 8, 1)),
            [8],
            None,
            None,
            1e-5,
        ),
    ),
    (
        "layer norm backward of a permuted gradient",
        lambda x, g: aten.native_layer_norm_backward.default(
            g.view(-1, 4, 4).transpose(1, 2),
            x.view(-1, 4, 4),
            [4, 4],
            *aten.native_layer_norm.default(x.view(-1, 4, 4), [4, 4], None, None, 1e-5)[1:],
            None,
            None,
            [True, False, False],
        ),
    ),
]


@pytest.mark.parametrize("case", REVIEWED, ids=[c[0] for c in REVIEWED])
def test_reviewed_cases_give_torchs_outcome(case: tuple[str, Callable[..., Any]]) -> None:
    def make() -> list[torch.Tensor]:
        return _fakes([(4, 16), (4, 16)], [{0: "b"}, {0: "b"}], torch.float32)

    with_rules, torchs = _both(make, _outcome(case[1]))
    assert with_rules == torchs


def test_a_complex_product_of_a_real_input_stays_real_end_to_end() -> None:
    # found by review: the pointwise rule kept float32 for x * 1j, so the trace dropped .real
    f = ft.jit(lambda x: ((x * 1j) * (x * 1j)).real.sum(), dynamic=True)
    for n in (3, 5):
        x = torch.randn(n, 4)
        got, want = f(x), ((x * 1j) * (x * 1j)).real.sum()
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want)


def test_a_sparse_tensor_goes_to_torchs_kernels(rule_calls: list[Any]) -> None:
    (x,) = _fakes([(4, 6)], [{0: "b"}], torch.float32)
    with x.fake_mode:
        sparse = torch.empty(3, 6).to_sparse()
    assert sparse.t().layout == torch.sparse_coo
    assert rule_calls == []
