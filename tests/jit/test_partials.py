"""Functions that hold tensors and modules outside a closure: ``functools.partial`` bound
arguments and default arguments (found by a user's try: ``ft.grad(partial(loss, w))`` raised
``TypeError: 'functools.partial' object is not subscriptable`` from the capture walk, which
read a bound argument as an item of the partial; ``def loss(x, m=bn)`` over a training
BatchNorm was refused, the walk not looking into defaults). The tensors a partial binds are
the call's inputs like a closure's, and so are a default module's: results and buffer
writes equal eager's, and an in-place update of a bound tensor is seen by the next call."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import functrans as ft


def _loss(w: torch.Tensor, m: nn.Module, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
    return (m(x) * w * scale).square().mean()


@pytest.mark.parametrize("transform", ["grad", "value_and_grad", "jit"])
def test_a_partial_binding_tensors_and_a_module_is_eagers(transform: str) -> None:
    torch.manual_seed(0)
    w, m, scale = torch.randn(4), nn.Linear(4, 4), torch.tensor(2.0)
    f = functools.partial(_loss, w, m, scale=scale)
    run = {"grad": ft.grad, "value_and_grad": ft.value_and_grad, "jit": ft.jit}[transform](f)
    for step in range(2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        xr = x.clone().requires_grad_()
        want_loss = f(xr)
        (want,) = torch.autograd.grad(want_loss, xr)
        got = run(x)
        if transform == "jit":
            torch.testing.assert_close(got, want_loss.detach())
        elif transform == "value_and_grad":
            torch.testing.assert_close(got[0], want_loss.detach())
            torch.testing.assert_close(got[1], want)
        else:
            torch.testing.assert_close(got, want)
        with torch.no_grad():  # the bound tensors change in place: the next call sees it
            w.mul_(1.5)
            scale.add_(1.0)
    assert all(p.grad is None for p in m.parameters())  # no transform here runs a backward


@pytest.mark.parametrize("transform", ["grad", "value_and_grad", "jit"])
def test_a_training_norm_as_a_default_argument_is_eagers(transform: str) -> None:
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(4).train()
    twin = copy.deepcopy(bn)

    def loss(x: torch.Tensor, m: nn.Module = bn) -> torch.Tensor:
        return m(x).square().mean()

    run = {"grad": ft.grad, "value_and_grad": ft.value_and_grad, "jit": ft.jit}[transform](loss)
    for step in range(2):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        xr = x.clone().requires_grad_()
        want_loss = loss(xr, twin)
        (want,) = torch.autograd.grad(want_loss, xr)
        got = run(x)
        if transform == "grad":
            torch.testing.assert_close(got, want)
        elif transform == "value_and_grad":
            torch.testing.assert_close(got[1], want)
        else:
            torch.testing.assert_close(got, want_loss.detach())
        for (name, a), (_, b) in zip(bn.named_buffers(), twin.named_buffers(), strict=True):
            torch.testing.assert_close(a, b, msg=f"{name} after {step}")
