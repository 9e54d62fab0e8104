"""Attention without dropout is not random, and every remat policy works with every
strategy on a GPT block built on ``F.scaled_dot_product_attention``.

The SDPA kernels carry ``torch.Tag.nondeterministic_seeded`` whatever their ``dropout_p``; classed
as random ops, a policy that recomputes them (``nothing_saveable``, ``save_only_these_names``)
made ``min_cut`` fail with "a value tagged MUST_RECOMPUTE that needs a random op" and made
``default``/``full_remat`` save attention outputs the policy said to recompute. With
``dropout_p > 0`` the CPU kernel is decomposed into matmuls, softmax and ``bernoulli``: that mask
is random, saved whatever the policy, and the gradients match eager autograd under one seed.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import functrans as ft
from functrans import policies
from functrans.extend import OpClass, is_random, op_class
from functrans.testing import assert_close, check_policy_tags, eager_vjp, seeded

aten = torch.ops.aten
HEAD_DIM = 8
DTYPE = torch.float64
ONE = torch.ones((), dtype=DTYPE)


def block(params: dict[str, Any], x: torch.Tensor, dropout_p: float, named: bool = True) -> Any:
    """Pre-LayerNorm GPT block on ``(tokens, d)``: causal SDPA over heads (named "attn"), a GELU
    MLP (named "mlp"), both residual. One sequence and a fused q/k/v projection keep the graph
    small: tracing time grows with its ops."""

    def name(t: torch.Tensor, label: str) -> torch.Tensor:
        return ft.checkpoint_name(t, label) if named else t  # torch.func cannot see the name op

    t, d = x.shape
    h = F.layer_norm(x, (d,), params["ln1"]["w"], params["ln1"]["b"])
    q, k, v = (
        u.view(1, t, d // HEAD_DIM, HEAD_DIM).transpose(1, 2)  # the CPU kernel wants 4 dims
        for u in F.linear(h, params["qkv"]).split(d, dim=-1)
    )
    a = name(F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True), "attn")
    x = x + F.linear(a.transpose(1, 2).reshape(t, d), params["proj"]["w"], params["proj"]["b"])
    h = F.layer_norm(x, (d,), params["ln2"]["w"], params["ln2"]["b"])
    m = name(F.gelu(F.linear(h, params["fc1"]["w"], params["fc1"]["b"])), "mlp")
    x = x + F.linear(m, params["fc2"]["w"], params["fc2"]["b"])
    return (x * x).mean()


@functools.cache
def _args() -> tuple[dict[str, Any], torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    d = 2 * HEAD_DIM

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=DTYPE) / 4

    params: dict[str, Any] = {"qkv": r(3 * d, d)}
    params["proj"] = {"w": r(d, d), "b": r(d)}
    params["fc1"] = {"w": r(2 * d, d), "b": r(2 * d)}
    params["fc2"] = {"w": r(d, 2 * d), "b": r(d)}
    params["ln1"] = {"w": 1 + r(d), "b": r(d)}
    params["ln2"] = {"w": 1 + r(d), "b": r(d)}
    return params, r(4, d)


@functools.cache
def _eager(dropout_p: float) -> tuple[Any, Any]:
    """Loss and gradients of the block without remat, by eager autograd under seed 0."""
    with seeded(0):
        return eager_vjp(lambda p, x: block(p, x, dropout_p, named=False), _args(), (ONE,))


POLICIES: dict[str, Any] = {
    "everything_saveable": policies.everything_saveable,
    "nothing_saveable": policies.nothing_saveable,
    "dots_saveable": policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": policies.dots_with_no_batch_dims_saveable,
    "save_only_these_names": policies.save_only_these_names("attn"),
    "save_any_names_but_these": policies.save_any_names_but_these("attn"),
    "save_from_both_policies": policies.save_from_both_policies(
        policies.save_only_these_names("mlp"), policies.dots_with_no_batch_dims_saveable
    ),
    "save_ops": policies.save_ops(aten.gelu.default),
}
STRATEGIES: dict[str, dict[str, Any]] = {
    "default": {},
    "full_remat": {},
    "min_cut": {},
    "memory_budget": {"budget": 0.5},
}
ATTN_BYTES = 2 * 4 * HEAD_DIM * 8  # the attention output: (1, 2 heads, 4, 8) float64


def _check(p: ft.Partition, dropout_p: float) -> None:
    """Remat tags honored; loss and gradients those of eager autograd under the same seed."""
    check_policy_tags(p)
    with seeded(0):
        out, saved = p.forward(*_args())
        grads = p.backward(saved, (ONE,))
    want_out, want_grads = _eager(dropout_p)
    context = f"strategy {p.strategy!r}\n{p.report()}"
    assert_close(out, want_out, "loss", context)
    assert_close(grads, want_grads, "grad", context)


#: What the policies that recompute attention save besides inputs, whatever the strategy: the
#: generator state the dropout mask is drawn again from (replayed, as the policy asks: up to
#: 6e73d63 the mask itself, never recomputed) and the values they name. Before the fix min_cut
#: raised on them, and default/full_remat saved the attention kernel's outputs.
SAVES_ONLY = {"nothing_saveable": (), "save_only_these_names": ("attn",)}
STATE_BYTES = 5056  # the CPU generator's state the mask is replayed from


def _check_saved(p: ft.Partition, policy: str, dropout_p: float) -> None:
    names = SAVES_ONLY[policy]
    kept = {s.op for s in p.saved if not s.is_input}
    want = {"aten.bernoulli.p's generator state"} if dropout_p else set()
    want |= {"functrans.checkpoint_name.default" for _ in names}
    assert kept == want, p.report()
    want_bytes = (STATE_BYTES if dropout_p else 0) + ATTN_BYTES * len(names)
    assert p.activation_bytes == want_bytes, p.report()


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_policy_under_every_strategy_matches_eager(policy: str, dropout_p: float) -> None:
    f = ft.remat(lambda p, x: block(p, x, dropout_p), policy=POLICIES[policy])
    jg = ft.joint(f)(*_args())
    checked: set[tuple[str, ...]] = set()
    for strategy, options in STRATEGIES.items():
        p = ft.partition(jg, strategy, **options)
        assert not any(op_class(r) is OpClass.RANDOM for r in p.recomputed)
        if policy in SAVES_ONLY:
            _check_saved(p, policy, dropout_p)
        key = tuple(s.name for s in p.saved)  # one run per distinct saved set: same graphs
        if key not in checked:
            _check(p, dropout_p)
            checked.add(key)
    random = [n.target for n in jg.ops() if op_class(n) is OpClass.RANDOM]
    assert random == ([aten.bernoulli.p] if dropout_p else []), random  # attention is not


# ---------------------------------------------------------------------------------------------
# The rule itself: randomness read from the arguments through the op's schema


def _call(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> fx.Node:
    graph = fx.Graph()
    q = graph.placeholder("q")
    return graph.call_function(op, tuple(q if a == "q" else a for a in args), kwargs or {})


@pytest.mark.parametrize(
    ("op", "before"),  # the positional arguments before dropout_p
    [
        (aten._scaled_dot_product_flash_attention_for_cpu.default, ("q", "q", "q")),
        (aten._scaled_dot_product_flash_attention.default, ("q", "q", "q")),
        (aten._scaled_dot_product_efficient_attention.default, ("q", "q", "q", None, True)),
        (aten._scaled_dot_product_cudnn_attention.default, ("q", "q", "q", None, True)),
    ],
)
def test_attention_is_random_only_with_dropout(op: Any, before: tuple[Any, ...]) -> None:
    assert torch.Tag.nondeterministic_seeded in op.tags  # the tag alone would say random
    assert not is_random(_call(op, (*before, 0.0)))
    assert op_class(_call(op, (*before, 0.0))) is OpClass.COMPUTE
    assert is_random(_call(op, (*before, 0.1)))
    assert op_class(_call(op, (*before, 0.1))) is OpClass.RANDOM
    assert not is_random(_call(op, before, {"dropout_p": 0.0}))  # passed by keyword
    assert is_random(_call(op, before, {"dropout_p": 0.5}))
    assert not is_random(_call(op, before))  # left out: the schema's default, 0.0
    graph = fx.Graph()
    p = graph.placeholder("p")  # a value only known at run time: random, to be safe
    q = graph.placeholder("q")
    node = graph.call_function(op, (*(q if a == "q" else a for a in before), p))
    assert is_random(node)


def test_other_seeded_ops_stay_random() -> None:
    assert is_random(_call(aten.bernoulli.p, ("q", 0.0)))  # no argument rule: always random
    assert is_random(_call(aten.native_dropout.default, ("q", 0.0, True)))  # still draws
    assert is_random(_call(aten.native_dropout.default, ("q", 0.5, None)))
    assert not is_random(_call(aten.native_dropout.default, ("q", 0.5, False)))  # eval mode


def test_identical_attention_without_dropout_is_computed_once() -> None:
    """Tracing merges common subexpressions but never random ops: two equal attention calls
    without dropout are now one kernel call, with dropout still two."""

    def f(q: torch.Tensor, p: float) -> torch.Tensor:
        a = F.scaled_dot_product_attention(q, q, q, dropout_p=p)
        return a + F.scaled_dot_product_attention(q, q, q, dropout_p=p)

    q = torch.randn(1, 2, 4, 8)
    ops = ft.trace(f, static_argnums=(1,))(q, 0.0).ops()
    assert (
        sum(n.target is aten._scaled_dot_product_flash_attention_for_cpu.default for n in ops) == 1
    )
    ops = ft.trace(f, static_argnums=(1,))(q, 0.5).ops()
    assert sum(n.target is aten.bernoulli.p for n in ops) == 2
