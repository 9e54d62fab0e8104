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
