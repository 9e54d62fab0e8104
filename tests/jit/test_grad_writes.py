"""A gradient transform over a function that writes state: eager's gradient and eager's writes.

The rule: ``ft.grad(f)(*args)`` (and ``value_and_grad``, and their jit) returns what
``torch.autograd.grad`` of ``f`` returns and leaves every buffer ``f`` writes (a training
BatchNorm's running statistics and step counter) as eager's call of ``f`` leaves it, however
``f`` reaches the module: closing over it, or JAX-style through
``functional_call(model, params, x)`` with plain-tensor parameters (``torch.func.grad``
refuses that one: it writes a captured tensor). The property generates the model, the form,
the transform and the aux, and compares two steps with eager's. A model a trace cannot follow
(a BatchNorm with ``momentum=None``) runs torch's autograd eagerly, with the same results.
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
    for _ in range(depth):  # the norm last: the model's output is the norm's own output
        layers += [nn.Linear(4, 4), nn.Tanh()]
        if norm == "batch":
            layers.append(nn.BatchNorm1d(4))
        elif norm == "batch, no running stats":
            layers.append(nn.BatchNorm1d(4, track_running_stats=False))
        elif norm == "batch, momentum=None":  # a cumulative average: runs eagerly
            layers.append(nn.BatchNorm1d(4, momentum=None))
    return nn.Sequential(*layers).train()


def _output(model: nn.Module, form: str, params: dict[str, torch.Tensor], x: torch.Tensor) -> Any:
    return functional_call(model, params, (x,)) if form == "functional_call" else model(x)


def _loss(model: nn.Module, form: str, params: dict[str, torch.Tensor], x: torch.Tensor) -> Any:
    return _output(model, form, params, x).square().mean()


def _eager(model: nn.Module, form: str, params: dict[str, torch.Tensor], x: torch.Tensor) -> Any:
    """The loss, the gradient eager autograd computes (in the parameters through
    ``functional_call``, in ``x`` for a closure) and the model's output, writing the model's
    buffers as a call does."""
    if form == "closure":
        xr = x.clone().requires_grad_()
        out = _output(model, form, {}, xr)
        loss = out.square().mean()
        return loss.detach(), torch.autograd.grad(loss, xr)[0], out.detach()
    leaves = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    out = _output(model, form, leaves, x)
    loss = out.square().mean()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return loss.detach(), dict(zip(params, grads, strict=True)), out.detach()


@settings(max_examples=8, deadline=None)
@given(
    norm=st.sampled_from(["batch", "batch, no running stats", "batch, momentum=None", "none"]),
    depth=st.integers(1, 2),
    form=st.sampled_from(["functional_call", "closure"]),
    transform=st.sampled_from(["grad", "value_and_grad", "jit(grad)"]),
    aux=st.sampled_from(["none", "input", "output"]),
)
@example(norm="batch", depth=2, form="functional_call", transform="grad", aux="none")
@example(norm="batch", depth=1, form="functional_call", transform="value_and_grad", aux="input")
@example(norm="batch", depth=1, form="functional_call", transform="jit(grad)", aux="none")
# found by this property: a staged step (its value returned beside gradients computed from
# it) took the batch norm's saved statistics as differentiated stage inputs, and raised
# "the derivative for 'native_batch_norm_backward save_invstd' is not implemented"
@example(norm="batch", depth=1, form="closure", transform="value_and_grad", aux="none")
# found by a user's try: the aux the batch norm's output (the loss computed from it) made a
# staged step hand the norm's tuple of results to its next stage (AttributeError)
@example(norm="batch", depth=1, form="closure", transform="grad", aux="output")
# a user's try: momentum=None (its update reads the batch counter as a Python number) was
# refused under every gradient transform (InputMutation): the call a trace cannot follow now
# runs torch's autograd eagerly
@example(norm="batch, momentum=None", depth=1, form="functional_call", transform="grad", aux="none")
@example(
    norm="batch, momentum=None", depth=2, form="closure", transform="value_and_grad", aux="input"
)
@example(
    norm="batch, momentum=None",
    depth=1,
    form="functional_call",
    transform="jit(grad)",
    aux="output",
)
def test_gradients_and_buffer_writes_are_eagers(
    norm: str, depth: int, form: str, transform: str, aux: str
) -> None:
    mine, theirs = _model(norm, depth), _model(norm, depth)
    params = {k: v.detach().clone() for k, v in mine.named_parameters()}

    def loss(*args: torch.Tensor | dict[str, torch.Tensor]) -> Any:
        x = args[-1]
        assert isinstance(x, torch.Tensor)
        out = _output(mine, "closure", {}, x) if form == "closure" else _output(mine, form, *args)  # type: ignore[arg-type]  # (params, x)
        value = out.square().mean()
        return (value, {"input": x.mean(), "output": out}[aux]) if aux != "none" else value

    has_aux = aux != "none"
    run = {
        "grad": lambda: ft.grad(loss, has_aux=has_aux),
        "value_and_grad": lambda: ft.value_and_grad(loss, has_aux=has_aux),
        "jit(grad)": lambda: ft.jit(ft.grad(loss, has_aux=has_aux)),
    }[transform]()
    for step in range(2):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(step))
        want_loss, want, want_out = _eager(theirs, form, params, x)
        want_aux = {"none": None, "input": x.mean(), "output": want_out}[aux]
        got = run(x) if form == "closure" else run(params, x)
        got_aux = None
        if transform == "value_and_grad":  # ((loss, aux), grads) with aux
            value, got = got
            loss_got, got_aux = value if has_aux else (value, None)
            torch.testing.assert_close(loss_got, want_loss)
        elif has_aux:  # (grads, aux)
            got, got_aux = got
        torch.testing.assert_close(got_aux, want_aux, rtol=1e-5, atol=1e-6)
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
    _, want, _ = _eager(twin, "functional_call", params, x)
    torch.testing.assert_close(got, want)
    for (name, a), (_, b) in zip(model.named_buffers(), twin.named_buffers(), strict=True):
        assert torch.equal(a, b), name
    assert int(model[2].num_batches_tracked) == 1


@pytest.mark.parametrize("transform", ["grad", "jit(grad)"])
def test_an_argument_written_from_a_value_with_a_gradient_is_eagers(transform: str) -> None:
    """``s.copy_((x @ w).mean(0))`` inside ``f``, the gradient taken in ``w``: eager and
    ``torch.func.grad`` compute it; functrans raised "you can only change requires_grad flags
    of leaf variables" from its own trace (found by a user's try)."""

    def f(w: torch.Tensor, s: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        s.copy_((x @ w).mean(0))
        return (s * s).sum()

    torch.manual_seed(0)
    w, x = torch.randn(4, 3), torch.randn(5, 4)
    s_eager, s_mine = torch.zeros(3), torch.zeros(3)
    wl = w.clone().requires_grad_()
    (want,) = torch.autograd.grad(f(wl, s_eager, x), wl)
    run = ft.grad(f) if transform == "grad" else ft.jit(ft.grad(f))
    torch.testing.assert_close(run(w, s_mine, x), want)
    torch.testing.assert_close(s_mine, s_eager.detach())


def test_the_eager_fallback_is_differentiable_again_as_eager() -> None:
    """The eager fallback (a BatchNorm with ``momentum=None``) gives gradients that are
    differentiable in inputs that require grad, as the traced transform's are: a second
    derivative through them is eager's, and so are the statistics after both calls."""
    mine, theirs = _model("batch, momentum=None", 1), _model("batch, momentum=None", 1)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))

    def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}

    ours, ref = params_of(mine), params_of(theirs)
    grads = ft.grad(lambda p, x: _loss(mine, "functional_call", p, x))(ours, x)
    want = torch.autograd.grad(
        _loss(theirs, "functional_call", ref, x), list(ref.values()), create_graph=True
    )
    assert all(g.requires_grad for g in grads.values())
    second = torch.autograd.grad(sum((g * g).sum() for g in grads.values()), list(ours.values()))
    want_second = torch.autograd.grad(sum((g * g).sum() for g in want), list(ref.values()))
    torch.testing.assert_close(list(grads.values()), list(want), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(second, want_second, rtol=1e-5, atol=1e-6)
    for a, b in zip(mine.buffers(), theirs.buffers(), strict=True):
        torch.testing.assert_close(a, b)
