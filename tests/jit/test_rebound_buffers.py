"""A forward that rebinds a buffer (``self.ema = 0.9 * self.ema + ...``, no in-place op).

Eager leaves the new tensor in the module. A trace swaps its own inputs into the module's
slots and puts the real tensors back after, which used to drop the rebinding without a word:
the buffer kept its old value under ``ft.jit``, ``ft.grad`` and ``ft.value_and_grad``
(found by a user's try). The rule, over every entry point and form: after each call, the
buffer holds eager's value, and the results are eager's. A rebinding to another shape cannot
be written back, and is refused by name.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call

import functrans as ft


class EMA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.ema = 0.9 * self.ema + 0.1 * y.detach().mean(0)
        return torch.tanh(y) * self.ema


_FORMS = ("closure", "functional_call", "jit(module)")
_TRANSFORMS = ("jit", "grad", "value_and_grad", "jit(grad)")


def _loss(model: nn.Module, form: str) -> Any:
    if form == "functional_call":
        return lambda p, x: functional_call(model, p, (x,)).square().mean()
    return lambda p, x: model(x).square().mean()


@settings(max_examples=10, deadline=None)
@given(form=st.sampled_from(_FORMS), transform=st.sampled_from(_TRANSFORMS))
def test_a_rebound_buffer_holds_eagers_value_after_every_call(form: str, transform: str) -> None:
    torch.manual_seed(0)
    mine = EMA()
    theirs = copy.deepcopy(mine)
    params = {k: v.detach().clone() for k, v in mine.named_parameters()}
    model = ft.jit(mine) if form == "jit(module)" else mine
    loss = _loss(model, form)
    run = {
        "jit": lambda: ft.jit(loss),
        "grad": lambda: ft.grad(loss),
        "value_and_grad": lambda: ft.value_and_grad(loss),
        "jit(grad)": lambda: ft.jit(ft.grad(loss)),
    }[transform]()
    for step in range(3):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(step))
        leaves = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
        want_loss = _loss(theirs, form)(leaves, x)
        grads = torch.autograd.grad(want_loss, list(leaves.values()), allow_unused=True)
        want = dict(zip(leaves, grads, strict=True))
        got = run(params, x)
        if transform == "jit":
            torch.testing.assert_close(got, want_loss.detach())
        else:
            if transform == "value_and_grad":
                value, got = got
                torch.testing.assert_close(value, want_loss.detach())
            if form == "functional_call":
                torch.testing.assert_close(got, want)
        torch.testing.assert_close(mine.ema, theirs.ema, msg=f"after call {step}")
        assert type(mine.ema) is torch.Tensor


class Growing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = torch.cat([self.seen, x.detach().sum().reshape(1)])
        return x.sin().sum()


def test_a_buffer_rebound_to_another_shape_is_refused_by_name() -> None:
    m = Growing()
    with pytest.raises(ft.FunctransError, match=r"rebinds .*seen.* shape \(2,\).* shape \(3,\)"):
        ft.jit(lambda x: m(x))(torch.ones(1, 3))
    assert m.seen.shape == (2,) and type(m.seen) is torch.Tensor


def test_a_refused_call_leaves_no_fake_tensor_in_the_module() -> None:
    """A module twice in a Sequential, its parameters passed under both names through
    ``functional_call`` (torch's swap then leaves a passed tensor in the module, in eager
    too): the call is refused, and the module holds a real tensor after it, not the trace's
    stand-in (it held a FakeTensor, and every later eager call returned fakes)."""
    ln = nn.LayerNorm(4)
    model = nn.Sequential(nn.Linear(4, 4), ln, nn.Tanh(), ln)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (x,)).square().mean()

    with pytest.raises(ft.FunctransError, match="escaped"):
        ft.grad(loss)(params, torch.randn(2, 4))
    assert all(type(t) is torch.Tensor or type(t) is nn.Parameter for t in model.parameters())
    assert type(model(torch.randn(2, 4))) is torch.Tensor
