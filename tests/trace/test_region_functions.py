"""Plain functions called as blocks become regions (functrans._trace.regions.functions): the
rule is that a repeated call reused from a region computes what eager computes, whatever the
function is passed, reads or writes, and that the names it is held under are the user's again
after the trace."""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import functrans as ft
from functrans._trace import regions


def block(p: dict[str, torch.Tensor], x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """About 30 ATen ops: a block (regions.functions.MIN_OPS)."""
    h = torch.tanh(F.linear(F.layer_norm(x, x.shape[-1:]), p["w"], p["b"]))
    a = torch.softmax(h @ h.transpose(-1, -2) * scale, dim=-1) @ h
    h = F.gelu(F.linear(a + h, p["w"])) * torch.sigmoid(h) + torch.cos(x)
    return F.layer_norm(h + x, x.shape[-1:]) * p["g"]


CODE = block.__code__


def small(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 2


def params(n: int, d: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        {
            "w": (torch.randn(d, d, generator=gen) / d).requires_grad_(),
            "b": torch.randn(d, generator=gen).requires_grad_(),
            "g": torch.randn(d, generator=gen).requires_grad_(),
        }
        for _ in range(n)
    ]


def stack(ps: list[dict[str, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    for p in ps:
        x = block(p, x)
    return small(small(x)).sum()


def _grads(f, ps, *args):  # type: ignore[no-untyped-def]
    leaves = [t for p in ps for t in p.values()]
    loss = f(ps, *args)
    return loss, torch.autograd.grad(loss, leaves)


def test_a_loop_of_calls_is_one_region_and_equals_eager() -> None:
    ps, x = params(6, 8), torch.randn(3, 8)
    before = regions.stats.reused
    jitted = ft.jit(stack)
    got, want = _grads(jitted, ps, x), _grads(stack, ps, x)
    # call 1 inline (its input needs no grad), call 2 traced as the region, 4 reuse it
    assert regions.stats.reused - before == 4
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert jitted.cache_info().misses == 1
    _grads(jitted, ps, x)
    assert jitted.cache_info().hits == 1  # the wrapper is not what the guards saw
    assert block.__code__ is CODE and block.__kwdefaults__ is None  # the user's again


def test_a_small_helper_called_twice_stays_inline() -> None:
    def f(w: torch.Tensor) -> torch.Tensor:
        return small(small(w)).sum()

    before = regions.stats.traced
    w = torch.randn(4, requires_grad=True)
    ft.jit(f)(w).backward()
    assert regions.stats.traced == before


def test_a_rebound_name_is_a_new_entry() -> None:
    global block
    ps, x = params(3, 4), torch.randn(2, 4)
    jitted = ft.jit(stack)
    first = jitted(ps, x)
    original = block
    try:
        block = lambda p, x, scale=1.0: original(p, x, 3.0)  # noqa: E731
        torch.testing.assert_close(jitted(ps, x), stack(ps, x))
        assert not torch.equal(jitted(ps, x), first)
    finally:
        block = original


def fill(p: dict[str, torch.Tensor], x: torch.Tensor, seen: list[torch.Tensor]) -> torch.Tensor:
    y = block(p, x)
    seen.append(y.sum())
    return y


def test_writes_into_a_passed_list_happen_for_every_call() -> None:
    def f(ps: list[dict[str, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
        seen: list[torch.Tensor] = []
        for p in ps:
            x = fill(p, x, seen)
        return x.sum() + torch.stack(seen).sum()

    ps, x = params(4, 4), torch.randn(2, 4)
    torch.testing.assert_close(_grads(ft.jit(f), ps, x), _grads(f, ps, x))


@settings(max_examples=12, deadline=None)
@given(
    calls=st.lists(
        st.tuples(st.sampled_from([4, 6]), st.sampled_from([1.0, 2.0]), st.booleans()),
        min_size=1,
        max_size=5,
    )
)
def test_property_repeated_calls_with_changing_structure_equal_eager(
    calls: list[tuple[int, float, bool]],
) -> None:
    """Calls of one function with other widths, other plain arguments, and writes into a
    passed list, in any order: the jitted step is eager's."""
    ps = {d: params(1, d, seed=d)[0] for d in (4, 6)}

    def f(ps: dict[int, dict[str, torch.Tensor]], x4: torch.Tensor, x6: torch.Tensor) -> Any:
        xs, seen = {4: x4, 6: x6}, []
        for d, scale, writes in calls:
            xs[d] = fill(ps[d], xs[d], seen) if writes else block(ps[d], xs[d], scale)
        return xs[4].sum() + xs[6].sum() + sum(seen, torch.zeros(()))

    def run(fn):  # type: ignore[no-untyped-def]
        leaves = [t for p in ps.values() for t in p.values()]
        loss = fn(ps, torch.ones(2, 4), torch.ones(2, 6))
        return loss, torch.autograd.grad(loss, leaves, allow_unused=True)

    (got, got_grads), (want, want_grads) = run(ft.jit(f)), run(f)
    torch.testing.assert_close(got, want)
    assert [g is None for g in got_grads] == [g is None for g in want_grads]  # None stays None
    torch.testing.assert_close(
        [g for g in got_grads if g is not None], [g for g in want_grads if g is not None]
    )


W = torch.randn(4, 4, requires_grad=True)


def reads_a_global(x: torch.Tensor) -> torch.Tensor:
    return block({"w": W, "b": W[0], "g": W[1]}, x)


def make(w: torch.Tensor) -> Any:
    def closes_over(x: torch.Tensor) -> torch.Tensor:
        return block({"w": w, "b": w[0], "g": w[1]}, x)

    return closes_over


FIRST, SECOND = make(torch.randn(4, 4, requires_grad=True)), make(torch.randn(4, 4))


def test_tensors_read_from_globals_and_closures_are_each_calls_own() -> None:
    """A function reading a captured tensor (lifted to a graph input by jit) and two closures
    of one code over different tensors: each call computes with its own tensors."""

    def f(x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = SECOND(FIRST(reads_a_global(x)))
        return x.sum()

    x = torch.randn(2, 4, requires_grad=True)
    captured = [W, FIRST.__closure__[0].cell_contents]  # type: ignore[index]
    want = torch.autograd.grad(f(x), [x, *captured])
    got = torch.autograd.grad(ft.jit(f)(x), [x, *captured])
    torch.testing.assert_close(got, want)


def by_signature(fn: Any) -> Any:
    """A user decorator that binds its arguments by the function's signature on every call."""

    def call(*args: Any, **kwargs: Any) -> Any:
        SEEN.append(tuple(inspect.signature(fn).parameters))
        bound = inspect.signature(fn).bind(*args, **kwargs)
        return fn(*bound.args, **bound.kwargs)

    return call


def signed(p: dict[str, torch.Tensor], x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    return block(p, x, scale)


SIGNED = by_signature(signed)
SEEN: list[tuple[str, ...]] = []


def test_a_diverted_function_keeps_its_signature() -> None:
    def f(ps: list[dict[str, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
        for p in ps:
            x = SIGNED(p, x, scale=2.0)
        return x.sum()

    ps, x = params(3, 4), torch.randn(2, 4)
    torch.testing.assert_close(_grads(ft.jit(f), ps, x), _grads(f, ps, x))
    assert set(SEEN) == {("p", "x", "scale")}  # traced and eager calls saw the user's parameters
    assert "__signature__" not in vars(signed)


CFG = {"scale": 1.0, "act": "tanh"}


def configured(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    h = block(p, x, CFG["scale"])
    return torch.tanh(h) if CFG["act"] == "tanh" else torch.sigmoid(h)


@settings(max_examples=8, deadline=None)
@given(
    changes=st.lists(
        st.tuples(st.sampled_from([1.0, 0.5, 2.0]), st.sampled_from(["tanh", "sigmoid"])),
        min_size=1,
        max_size=4,
    )
)
def test_property_state_a_repeated_function_reads_is_guarded(
    changes: list[tuple[float, str]],
) -> None:
    """A config the repeated function reads (not its arguments) changed between calls of one
    jitted step: every call computes what eager computes with the config as it is then."""

    def f(ps: list[dict[str, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
        for p in ps:
            x = configured(p, x)
        return x.sum()

    ps, x = params(4, 4), torch.randn(2, 4)
    jitted = ft.jit(f)
    try:
        for scale, act in changes:
            CFG.update(scale=scale, act=act)
            torch.testing.assert_close(_grads(jitted, ps, x), _grads(f, ps, x))
    finally:
        CFG.update(scale=1.0, act="tanh")


def test_second_derivatives_through_repeated_functions_are_eager_s() -> None:
    """create_graph through a step whose blocks are function regions: a region's backward is
    one op with no derivative, so the step is traced again with every call inline; the
    gradient of the gradient is eager's."""
    ps, x = params(3, 4), torch.randn(2, 4)
    leaves = [t for p in ps for t in p.values()]

    def second(fn: Any) -> list[torch.Tensor]:
        (g,) = torch.autograd.grad(fn(ps, x), [ps[0]["w"]], create_graph=True)
        return list(torch.autograd.grad(g.square().sum(), leaves))

    torch.testing.assert_close(second(ft.jit(stack)), second(stack))
