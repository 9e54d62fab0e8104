"""A symbolic graph from two static traces (functrans._trace.unify) and its use by jit."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functrans as ft
from functrans._core.graph import verify
from functrans._trace import unify
from functrans._trace.unify import Mismatch, SizeExpr, SymbolClass, explain, generalise

BOTH = ({0: None, 1: None},)


def _flatten_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    b, t, c = x.shape
    return (x.reshape(b * t, c) @ w).view(b, t, -1).sum(1)


def test_flattened_view_is_batch_times_tokens() -> None:
    w = torch.randn(4, 3)
    a = ft.trace(_flatten_matmul)(torch.randn(3, 5, 4), w)
    b = ft.trace(_flatten_matmul)(torch.randn(6, 7, 4), w)
    g = generalise(a, b, ({0: None, 1: None}, {}))
    assert not isinstance(g, Mismatch), g
    text = str(g)
    assert "f32[s0*s1, 4]" in text and "sym_size" in text
    verify(g)
    x = torch.randn(2, 9, 4)
    torch.testing.assert_close(g(x, w), _flatten_matmul(x, w), rtol=0, atol=0)
    # neither input graph was modified
    assert "sym_size" not in str(a) + str(b)


def test_size_used_as_a_scalar_argument() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x * x.shape[1] + x.shape[0] - 1

    g = generalise(ft.trace(f)(torch.ones(3, 5)), ft.trace(f)(torch.ones(4, 7)), BOTH)
    assert not isinstance(g, Mismatch), g
    x = torch.randn(6, 11)
    torch.testing.assert_close(g(x), f(x), rtol=0, atol=0)


def test_shape_dependent_branch_falls_back() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x.sin() if x.shape[0] > 4 else x.cos() * 2

    out = generalise(ft.trace(f)(torch.ones(3, 2)), ft.trace(f)(torch.ones(6, 2)), ({0: None},))
    assert isinstance(out, Mismatch)


def test_different_constants_fall_back() -> None:
    a = ft.trace(lambda x: x * 2.0)(torch.ones(3))
    b = ft.trace(lambda x: x * 3.0)(torch.ones(5))
    assert isinstance(generalise(a, b, ({0: None},)), Mismatch)


def test_a_dimension_of_the_same_size_in_both_traces_falls_back() -> None:
    a = ft.trace(lambda x: x * 2)(torch.ones(3, 4))
    b = ft.trace(lambda x: x * 2)(torch.ones(5, 4))
    assert isinstance(generalise(a, b, BOTH), Mismatch)


def test_ambiguous_sizes_are_refused() -> None:
    classes = [SymbolClass(((0, 0),), 4, 2), SymbolClass(((0, 1),), 8, 4)]
    assert isinstance(explain(8, 4, classes), Mismatch)  # s1 or 2 * s0
    assert isinstance(explain(32, 8, classes), Mismatch)  # s0 * s1 or 2 * s0 * s0
    apart = [SymbolClass(((0, 0),), 4, 3), SymbolClass(((0, 1),), 7, 5)]
    assert explain(28, 15, apart) == SizeExpr(1, (0, 1))
    assert explain(5, 5, apart) is None


def test_equal_dimensions_share_a_symbol_and_are_guarded() -> None:
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x * y).flatten()

    dims = ({0: None}, {0: None})
    a = ft.trace(f)(torch.ones(3, 2), torch.ones(3, 2))
    b = ft.trace(f)(torch.ones(5, 2), torch.ones(5, 2))
    g = generalise(a, b, dims)
    assert not isinstance(g, Mismatch), g
    assert 'forward(x: "f32[s0, 2]", y: "f32[s0, 2]")' in str(g)  # one symbol for both
    x, y = torch.randn(7, 2), torch.randn(7, 2)
    torch.testing.assert_close(g(x, y), f(x, y), rtol=0, atol=0)


def test_joint_graph_generalises() -> None:
    w = torch.randn(4, 3)

    def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return _flatten_matmul(x, w).square().mean()

    a = ft.joint(loss, argnums=0)(w, torch.randn(3, 5, 4))
    b = ft.joint(loss, argnums=0)(w, torch.randn(6, 7, 4))
    g = generalise(a, b, ({}, {0: None, 1: None}))
    assert not isinstance(g, Mismatch), g
    verify(g)
    x = torch.randn(2, 9, 4)
    out, grad = g((w, x), (torch.tensor(1.0),))
    wr = w.clone().requires_grad_()
    ref = loss(wr, x)
    ref.backward()
    torch.testing.assert_close(out, ref.detach(), rtol=0, atol=0)
    assert wr.grad is not None
    torch.testing.assert_close(grad, wr.grad, rtol=1e-6, atol=1e-6)


def _count_generalised(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    made: list[bool] = []
    original = unify.generalise

    def counting(*args: Any) -> Any:
        out = original(*args)
        made.append(not isinstance(out, Mismatch))
        return out

    monkeypatch.setattr(unify, "generalise", counting)
    return made


def test_jit_auto_generalises_on_the_second_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    made = _count_generalised(monkeypatch)
    lin = torch.nn.Linear(4, 3)

    def f(x: torch.Tensor) -> torch.Tensor:
        return lin(x.flatten(0, 1)).relu().sum() / x.shape[1]

    jf = ft.jit(f)
    for shape in [(3, 5, 4), (6, 7, 4), (2, 9, 4), (5, 3, 4)]:
        x = torch.randn(shape)
        out = jf(x)
        out.backward()
        grad = lin.weight.grad.clone()  # type: ignore[union-attr]
        lin.zero_grad()
        ref = f(x)
        ref.backward()
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        torch.testing.assert_close(grad, lin.weight.grad, rtol=1e-6, atol=1e-6)
        lin.zero_grad()
    assert made == [True]
    assert jf.cache_info().misses == 2  # static, then the generalised one for every shape


def test_jit_guards_of_a_generalised_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    made = _count_generalised(monkeypatch)

    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x + y).flatten() * x.shape[0]

    jf = ft.jit(f)
    for n, m in [(3, 3), (5, 5), (4, 4), (4, 6), (1, 1)]:  # equal batch, then not, then 1
        x, y = torch.randn(n, 2), torch.randn(m, 2) if n == m else torch.randn(1, 2)
        torch.testing.assert_close(jf(x, y), f(x, y), rtol=0, atol=0)
    assert made and made[0]


@settings(max_examples=8, deadline=None)
@given(st.lists(st.tuples(st.integers(2, 9), st.integers(2, 9)), min_size=3, max_size=5))
def test_property_generalised_entry_matches_eager(shapes: list[tuple[int, int]]) -> None:
    w = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))

    def f(x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return (_flatten_matmul(x, w) * t).reshape(b, 3)[:, 1:] - x[:, : t - 1, 0].sum(1, True)

    jf = ft.jit(f)
    for b, t in shapes:
        x = torch.randn(b, t, 4)
        torch.testing.assert_close(jf(x), f(x), rtol=0, atol=0)
