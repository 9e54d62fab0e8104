"""A gradient transform over a function that writes state: eager's gradient and eager's writes.

The rule: ``ft.grad(f)(*args)`` (and ``value_and_grad``, and their jit) returns what
``torch.autograd.grad`` of ``f`` returns and leaves every buffer ``f`` writes (a training
BatchNorm's running statistics and step counter) as eager's call of ``f`` leaves it, however
``f`` reaches the module: closing over it, or JAX-style through
``functional_call(model, params, x)`` with plain-tensor parameters (``torch.func.grad``
refuses that one: it writes a captured tensor). The property generates the model, the form,
the transform and the aux, and compares two steps with eager's.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call

import functrans as ft


def _model(norm: str, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers.append(nn.Linear(4, 4))
        if norm == "batch":
            layers.append(nn.BatchNorm1d(4))
        elif norm == "batch, no running stats":
            layers.append(nn.BatchNorm1d(4, track_running_stats=False))
        layers.append(nn.Tanh())
    return nn.Sequential(*layers).train()


def _loss(model: nn.Module, form: str, params: dict[str, torch.Tensor], x: torch.Tensor) -> Any:
    out = functional_call(model, params, (x,)) if form == "functional_call" else model(x)
    return out.square().mean()


def _eager(model: nn.Module, form: str, params: dict[str, torch.Tensor], x: torch.Tensor) -> Any:
    """The loss and the gradient eager autograd computes (in the parameters through
    ``functional_call``, in ``x`` for a closure), writing the model's buffers as a call does."""
    if form == "closure":
        xr = x.clone().requires_grad_()
        loss = _loss(model, form, {}, xr)
        return loss.detach(), torch.autograd.grad(loss, xr)[0]
    leaves = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    loss = _loss(model, form, leaves, x)
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return loss.detach(), dict(zip(params, grads, strict=True))


@settings(max_examples=8, deadline=None)
@given(
    norm=st.sampled_from(["batch", "batch, no running stats", "none"]),
    depth=st.integers(1, 2),
    form=st.sampled_from(["functional_call", "closure"]),
    transform=st.sampled_from(["grad", "value_and_grad", "jit(grad)"]),
    aux=st.booleans(),
)
@example(norm="batch", depth=2, form="functional_call", transform="grad", aux=False)
@example(norm="batch", depth=1, form="functional_call", transform="value_and_grad", aux=True)
@example(norm="batch", depth=1, form="functional_call", transform="jit(grad)", aux=False)
# found by this property: a staged step (its value returned beside gradients computed from
# it) took the batch norm's saved statistics as differentiated stage inputs, and raised
# "the derivative for 'native_batch_norm_backward save_invstd' is not implemented"
@example(norm="batch", depth=1, form="closure", transform="value_and_grad", aux=False)
def test_gradients_and_buffer_writes_are_eagers(
    norm: str, depth: int, form: str, transform: str, aux: bool
) -> None:
    mine, theirs = _model(norm, depth), _model(norm, depth)
    params = {k: v.detach().clone() for k, v in mine.named_parameters()}

    def loss(*args: torch.Tensor | dict[str, torch.Tensor]) -> Any:
        x = args[-1]
        assert isinstance(x, torch.Tensor)
        out = _loss(mine, "closure", {}, x) if form == "closure" else _loss(mine, form, *args)  # type: ignore[arg-type]  # (params, x)
        return (out, x.mean()) if aux else out

    run = {
        "grad": lambda: ft.grad(loss, has_aux=aux),
        "value_and_grad": lambda: ft.value_and_grad(loss, has_aux=aux),
        "jit(grad)": lambda: ft.jit(ft.grad(loss, has_aux=aux)),
    }[transform]()
    for step in range(2):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(step))
        want_loss, want = _eager(theirs, form, params, x)
        got = run(x) if form == "closure" else run(params, x)
        if transform == "value_and_grad":  # ((loss, aux), grads) with aux
            value, got = got
            loss_got, got_aux = value if aux else (value, x.mean())
            torch.testing.assert_close(loss_got, want_loss)
        elif aux:  # (grads, aux)
            got, got_aux = got
        if aux:
            torch.testing.assert_close(got_aux, x.mean())
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for (name, a), (_, b) in zip(mine.named_buffers(), theirs.named_buffers(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"{name} after {step}")
    assert all(p.grad is None for p in mine.parameters())


def test_jax_style_grad_over_a_training_batch_norm_writes_its_statistics() -> None:
    """The shrunk case: ``ft.grad(loss)(params, x)`` through ``functional_call`` over a
    train-mode BatchNorm, plain-tensor parameters. It was refused (the planned gradient's
    joint graph may not write a captured buffer), as ``torch.func.grad`` refuses it."""
    model = _model("batch", 1)
    twin = copy.deepcopy(model)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x = torch.randn(6, 4)

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (x,)).square().mean()

    with pytest.raises(RuntimeError, match="mutate a captured Tensor"):
        torch.func.grad(loss)(params, x)  # eager's transform refuses it (a copy: it may write)
    model.load_state_dict(twin.state_dict())
    got = ft.grad(loss)(params, x)
    _, want = _eager(twin, "functional_call", params, x)
    torch.testing.assert_close(got, want)
    for (name, a), (_, b) in zip(model.named_buffers(), twin.named_buffers(), strict=True):
        assert torch.equal(a, b), name
    assert int(model[1].num_batches_tracked) == 1
