"""Properties of the rule "a compiled entry depends on what its trace read" (``functrans/_trace/
reads.py``), over generated functions that read state of many kinds (``_state_kinds.py``:
closures, dicts nested in them, globals and dicts of another module, patched helpers and torch
functions, namespaces, nested dataclass configs, class attributes, module attributes, lists
and configs held by modules, patched forwards).

1. Change one piece of state the function reads after its first jitted call: the next call
   equals eager (values and gradients).
2. Change state beside it that it does not read: the next call compiles nothing.
"""

from __future__ import annotations

import _state_kinds as kinds
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import functrans as ft

_NAMES = sorted(kinds.KINDS)
_pieces = st.lists(st.sampled_from(_NAMES), min_size=1, max_size=3, unique=True)


def _function(pieces: list[kinds.Piece]):
    readers = [p.read for p in pieces]

    def f(x: torch.Tensor) -> torch.Tensor:
        for read in readers:
            x = read(x)
        return x

    return f


def _step(f, x: torch.Tensor, grad: bool):
    """The output and, with ``grad``, the input's gradient."""
    x = x.detach().requires_grad_(grad)
    out = f(x)
    if not grad:
        return out.detach(), None
    (g,) = torch.autograd.grad(out.sum(), x)
    return out.detach(), g


def _check(jitted, f, x: torch.Tensor, grad: bool) -> None:
    got, got_grad = _step(jitted, x, grad)
    want, want_grad = _step(f, x, grad)
    torch.testing.assert_close(got, want)
    if grad:
        torch.testing.assert_close(got_grad, want_grad)


@settings(max_examples=max(60, settings().max_examples // 2))  # ~0.15 s an example
@given(names=_pieces, which=st.integers(0, 2), grad=st.booleans(), seed=st.integers(0, 99))
def test_property_a_change_to_state_the_function_reads_is_seen(names, which, grad, seed):
    pieces = [kinds.KINDS[n]() for n in names]
    f = _function(pieces)
    jitted = ft.jit(f)
    x = torch.randn(4, generator=torch.Generator().manual_seed(seed))
    _check(jitted, f, x, grad)
    undo = pieces[which % len(pieces)].change()
    try:
        _check(jitted, f, x, grad)
    finally:
        undo()


@settings(max_examples=max(60, settings().max_examples // 2))  # ~0.15 s an example
@given(names=_pieces, which=st.integers(0, 2), grad=st.booleans())
def test_property_a_change_to_state_the_function_does_not_read_compiles_nothing(names, which, grad):
    pieces = [kinds.KINDS[n]() for n in names]
    beside = pieces[which % len(pieces)].change_unread
    assume(beside is not None)
    f = _function(pieces)
    jitted = ft.jit(f)
    x = torch.randn(4)
    _check(jitted, f, x, grad)
    undo = beside()
    try:
        _check(jitted, f, x, grad)
        assert jitted.cache_info().misses == 1
    finally:
        undo()


@pytest.mark.parametrize("name", _NAMES)
def test_every_kind_is_seen(name):
    """Each kind alone (the shrunk form of the first property), with a gradient."""
    piece = kinds.KINDS[name]()
    f = _function([piece])
    jitted = ft.jit(f)
    x = torch.randn(4)
    _check(jitted, f, x, True)
    undo = piece.change()
    try:
        _check(jitted, f, x, True)
        assert jitted.cache_info().misses == 2
    finally:
        undo()


def _summed(f):
    return lambda x: f(x).sum()


def _grad_of(g):
    return lambda x: g(x)[1]


#: each transform, built once over ``f``: the input's gradient of ``f(x).sum()`` (``vjp``: the
#: pull-back of ones), what eager's autograd gives for the same call
_TRANSFORMS = {
    "grad": lambda f: ft.grad(_summed(f)),
    "value_and_grad": lambda f: _grad_of(ft.value_and_grad(_summed(f))),
    "jit(grad)": lambda f: ft.jit(ft.grad(_summed(f))),
    "vjp": lambda f: lambda x: ft.vjp(f, x)[1](torch.ones_like(x))[0],
}


def _eager_grad(f, x: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_()
    (g,) = torch.autograd.grad(f(x).sum(), x)
    return g


@settings(max_examples=max(40, settings().max_examples // 3))
@given(
    names=_pieces,
    which=st.integers(0, 2),
    transform=st.sampled_from(sorted(_TRANSFORMS)),
    seed=st.integers(0, 99),
)
def test_property_a_change_the_function_reads_is_seen_through_every_transform(
    names, which, transform, seed
):
    """The rule holds for every transform that keeps compiled entries, not only ``ft.jit``:
    ``ft.grad`` once kept the first call's Python values (its function is reached through
    functrans' own closures, which the reads were not followed through)."""
    pieces = [kinds.KINDS[n]() for n in names]
    f = _function(pieces)
    run = _TRANSFORMS[transform](f)
    x = torch.randn(4, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(run(x), _eager_grad(f, x))
    undo = pieces[which % len(pieces)].change()
    try:
        torch.testing.assert_close(run(x), _eager_grad(f, x))
    finally:
        undo()
