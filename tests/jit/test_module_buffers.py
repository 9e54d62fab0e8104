"""Module buffers a jitted function reads from outside its arguments are inputs from the start.

The torch.func idiom ``functional_call(model, params, x)`` passes the parameters and leaves the
buffers (position ids, rotary frequencies, normalization statistics) to be read from the module.
jit lifts them to graph inputs before the first trace, so the function is traced once (not once
to find them and once more with them as inputs), and a replaced or updated buffer is seen.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import functional_call

import functrans as ft


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0))
        self.register_buffer("unused", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


@pytest.fixture
def traces(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the joint traces jit makes."""
    import functrans._jit.build as build

    made: list[int] = []
    real = build.joint

    def counting(*a: Any, **k: Any) -> Any:
        traced = real(*a, **k)

        def run(*args: Any, **kwargs: Any) -> Any:
            made.append(1)
            return traced(*args, **kwargs)

        return run

    monkeypatch.setattr(build, "joint", counting)
    return made


def _loss(model: torch.nn.Module) -> Any:
    def loss(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, params, (x,)).pow(2).sum()

    return loss


def test_functional_call_is_traced_once_with_eager_gradients(traces: list[int]) -> None:
    torch.manual_seed(0)
    model = Scaled()
    params = {k: v.detach().requires_grad_() for k, v in model.named_parameters()}
    x = torch.randn(3, 4)
    f = ft.jit(_loss(model))
    loss = f(params, x)
    loss.backward()
    assert len(traces) == 1  # was 2: one to find the buffer, one with it as an input
    eager_params = {k: v.detach().requires_grad_() for k, v in model.named_parameters()}
    expected = _loss(model)(eager_params, x)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for k in params:
        torch.testing.assert_close(params[k].grad, eager_params[k].grad)


def test_a_replaced_buffer_is_read_on_the_next_call(traces: list[int]) -> None:
    model = Scaled()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(3, 4)
    f = ft.jit(_loss(model))
    f(params, x)
    model.scale = torch.full((4,), -1.0)  # a new buffer of the same metadata
    torch.testing.assert_close(f(params, x), _loss(model)(params, x))
    assert len(traces) == 0  # inference: forward traces only, no joint
    assert f.cache_info().misses == 1


def test_a_buffer_the_forward_updates_in_place_is_written_back() -> None:
    # BatchNorm in training mode updates its running statistics; under functional_call the
    # buffers are not arguments: refused until issue 49, now lifted to inputs (its one-element
    # counter too) and written back after each call, as eager updates them
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    twin = copy.deepcopy(model)
    params = {k: v.detach().requires_grad_() for k, v in model.named_parameters()}
    twin_params = {k: v.detach().requires_grad_() for k, v in twin.named_parameters()}
    f = ft.jit(_loss(model))
    for _ in range(3):
        x = torch.randn(8, 4)
        got, want = f(params, x), _loss(twin)(twin_params, x)
        torch.testing.assert_close(got, want)
        got.backward()
        want.backward()
    for (name, a), b in zip(model.named_buffers(), twin.buffers(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
    for k in params:
        torch.testing.assert_close(params[k].grad, twin_params[k].grad)
    assert f.cache_info().hits >= 1


def test_buffers_passed_as_detached_arguments_alias_the_lifted_originals() -> None:
    # functional_call(model, {**params, **buffers}) with buffers detached from the module's:
    # the originals are lifted too (unread, sharing storage with arguments); results, gradients
    # and a later in-place update of the argument follow eager
    torch.manual_seed(0)
    model = Scaled()
    params = {k: v.detach().requires_grad_() for k, v in model.named_parameters()}
    bufs = {k: v.detach() for k, v in model.named_buffers()}

    def loss(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor], x: torch.Tensor) -> Any:
        return functional_call(model, {**p, **b}, (x,)).pow(2).sum()

    f = ft.jit(loss)
    x = torch.randn(3, 4)
    out = f(params, bufs, x)
    out.backward()
    eager_params = {k: v.detach().requires_grad_() for k, v in model.named_parameters()}
    expected = loss(eager_params, bufs, x)
    expected.backward()
    torch.testing.assert_close(out, expected)
    for k in params:
        torch.testing.assert_close(params[k].grad, eager_params[k].grad)
    bufs["scale"].mul_(3)
    with torch.no_grad():
        torch.testing.assert_close(f(params, bufs, x), loss(params, bufs, x))


def test_a_module_changed_after_a_first_call_run_as_written_compiles() -> None:
    # the first call runs as written (a hook is registered), so the walk jit made then is
    # stale when it first compiles: a buffer it found is gone (found in review)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).eval()
    f = ft.jit(lambda x: net(x))
    hook = net.register_forward_hook(lambda *a: None)
    x = torch.randn(3, 4)
    with pytest.warns(UserWarning, match="hook"):
        f(x)
    hook.remove()
    net[1] = torch.nn.Identity()
    torch.testing.assert_close(f(x), net(x))


def test_a_one_element_buffer_read_as_a_python_value_still_traces() -> None:
    # a flag buffer read by Python control flow (Glow's ActNorm `initialized`) is not lifted
    # before the trace: a traced input has no value to branch on (found in review)
    class ActNorm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("initialized", torch.tensor(True))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x if not self.initialized else x * 2

    m = ActNorm()
    torch.testing.assert_close(ft.jit(lambda x: m(x))(torch.ones(2)), torch.full((2,), 2.0))


@pytest.fixture
def every_trace(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names the traces jit makes: ``"forward"`` (an inference trace) or ``"joint"``."""
    import functrans._jit.build as build

    made: list[str] = []
    for name, kind in (("joint", "joint"), ("trace", "forward")):
        real = getattr(build, name)

        def wrapped(*a: Any, _real: Any = real, _kind: str = kind, **k: Any) -> Any:
            traced = _real(*a, **k)

            def run(*args: Any, **kwargs: Any) -> Any:
                made.append(_kind)
                return traced(*args, **kwargs)

            return run

        monkeypatch.setattr(build, name, wrapped)
    return made


def test_a_loss_closing_over_its_model_is_traced_once(every_trace: list[str]) -> None:
    """``lambda x: model(x)...``: the parameters are inputs from the first trace, which is
    the training step's (it was an inference trace, thrown away once it found them)."""
    torch.manual_seed(0)
    model = Scaled()
    want = copy.deepcopy(model)
    x = torch.randn(3, 4)
    f = ft.jit(lambda x: model(x).pow(2).sum())
    for _ in range(2):
        f(x).backward()
        want(x).pow(2).sum().backward()
    assert every_trace == ["joint"]
    for (name, a), (_, b) in zip(model.named_parameters(), want.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


@settings(max_examples=25, deadline=None)
@given(
    used=st.lists(st.booleans(), min_size=3, max_size=3),
    via=st.sampled_from(["closure", "functional_call", "detached_params"]),
    x_grad=st.booleans(),
    grad_mode=st.booleans(),
    frozen=st.booleans(),
)
def test_lifting_before_the_first_trace_changes_no_result(
    used: list[bool], via: str, x_grad: bool, grad_mode: bool, frozen: bool
) -> None:
    """Whatever the function reads of the modules it reaches (some layers, none; through a
    closure or ``functional_call``), with or without grad, jit's outputs, their
    ``requires_grad`` and every gradient are eager's: lifting a tensor before the first
    trace (or not) is never seen in a result."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
    if frozen:
        layers[0].requires_grad_(False)
    mine, eager = layers, copy.deepcopy(layers)

    def body(ls: Any, params: dict[str, torch.Tensor] | None, x: torch.Tensor) -> torch.Tensor:
        h = x
        for i, (layer, on) in enumerate(zip(ls, used, strict=True)):
            if not on:
                continue
            if params is None:
                h = torch.tanh(layer(h))
            else:
                sub = {k.split(".", 1)[1]: v for k, v in params.items() if k.startswith(f"{i}.")}
                h = torch.tanh(functional_call(layer, sub, (h,)))
        return h.sum()

    def call(ls: Any, x: torch.Tensor, compiled: bool) -> Any:
        if via == "closure":
            fn: Any = lambda x: body(ls, None, x)  # noqa: E731
            return (ft.jit(fn) if compiled else fn)(x)
        params = dict(ls.named_parameters())
        if via == "detached_params":
            params = {k: v.detach() for k, v in params.items()}
        fn = lambda p, x: body(ls, p, x)  # noqa: E731
        return (ft.jit(fn) if compiled else fn)(params, x)

    x = torch.randn(2, 4)
    xs = [x.clone().requires_grad_(x_grad) for _ in range(2)]
    with torch.set_grad_enabled(grad_mode):
        got, want = call(mine, xs[0], True), call(eager, xs[1], False)
    torch.testing.assert_close(got, want)
    assert got.requires_grad == want.requires_grad
    if want.requires_grad:
        got.backward()
        want.backward()
        torch.testing.assert_close(xs[0].grad, xs[1].grad)
        for a, b in zip(mine.parameters(), eager.parameters(), strict=True):
            assert (a.grad is None) == (b.grad is None)
            if a.grad is not None:
                torch.testing.assert_close(a.grad, b.grad)


def test_a_prelifted_parameter_replaced_after_the_first_call_is_read() -> None:
    """A parameter lifted before the first trace is read through its path on every call:
    a caller that replaces it later (a new ``nn.Parameter``, a loaded checkpoint's) gets
    eager's result and the gradient lands on the new one."""
    torch.manual_seed(0)
    model = Scaled()
    x = torch.randn(3, 4)
    f = ft.jit(lambda x: model(x).pow(2).sum())
    f(x).backward()
    new = torch.nn.Parameter(torch.randn(4, 4))
    model.lin.weight = new
    got = f(x)
    want = model(x).pow(2).sum()
    torch.testing.assert_close(got, want)
    (expected,) = torch.autograd.grad(want, new)
    got.backward()
    torch.testing.assert_close(new.grad, expected)
