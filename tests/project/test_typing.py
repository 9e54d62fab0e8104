"""The public transforms keep the types of what they wrap.

mypy checks this file (``make typecheck``: it is in pyproject's mypy ``files``, with
``warn_unused_ignores`` on, so each ``# type: ignore`` below must catch a real error: a transform
that forgot its wrapped signature would make the call type-check and the ignore unused). pytest
runs it too: the calls are real.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
from typing_extensions import assert_type

import functrans as ft
from functrans import policies
from functrans._jit.jitted import Jitted
from functrans._jit.module import JitModule
from functrans._transforms.remat import RematModule


def loss(x: torch.Tensor, w: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
    return (torch.tanh(x @ w) * scale).sum()


class Loss(Protocol):
    """``loss``'s exact signature: a wrapper assignable to it kept every parameter."""

    def __call__(self, x: torch.Tensor, w: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor: ...


def pair(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    return x.sin(), 3


X, W = torch.ones(2, 3), torch.ones(3, 3, requires_grad=True)


def test_jit_keeps_the_signature() -> None:
    f = ft.jit(loss)
    same: Loss = f
    jitted: Jitted[..., torch.Tensor] = f
    assert_type(f(X, W, scale=2.0), torch.Tensor)
    assert same(X, W).shape == () and jitted is f
    assert_type(ft.jit(pair)(X), tuple[torch.Tensor, int])
    assert f.cache_info().misses == 2  # scale is static: 2.0 and 1.0 compile two entries


def test_jit_with_options_is_a_decorator_that_keeps_the_signature() -> None:
    @ft.jit(partition="default", backend="aten")
    def g(x: torch.Tensor, n: int) -> torch.Tensor:
        return x * n

    assert_type(g(X, 2), torch.Tensor)
    assert_type(ft.jit(partition="full_remat")(loss)(X, W), torch.Tensor)


def test_jit_of_a_module_is_a_jit_module() -> None:
    net = torch.nn.Linear(3, 2)
    assert_type(ft.jit(net), JitModule)
    assert_type(ft.jit(cache_size=4)(net), JitModule)
    assert isinstance(ft.jit(net), JitModule)


def test_remat_keeps_the_signature() -> None:
    f: Loss = ft.remat(loss, policy=policies.dots_saveable)
    assert_type(f(X, W, scale=2.0), torch.Tensor)

    @ft.remat(policy=policies.save_only_these_names("h"))
    def g(x: torch.Tensor) -> torch.Tensor:
        return ft.checkpoint_name(x.sin(), "h").cos()

    assert_type(g(X), torch.Tensor)
    assert_type(ft.remat(torch.nn.Linear(3, 2)), RematModule)


def test_policies_are_policy_fns() -> None:
    def mine(op: Any, *args: Any, **kwargs: Any) -> bool:
        return op is torch.ops.aten.mm.default

    for policy in (mine, policies.dots_saveable, policies.save_ops(torch.ops.aten.mm)):
        p: policies.PolicyFn = policy
        assert p(torch.ops.aten.mm.default, X, W) is True
    ft.remat(loss, policy=[torch.ops.aten.mm])  # a list of ops is a policy too


def test_autodiff_transforms_keep_the_parameters() -> None:
    assert_type(ft.grad(loss)(X, W, scale=2.0), Any)
    value, grads = ft.value_and_grad(loss, argnums=1)(X, W)
    assert_type(value, torch.Tensor)
    out, vjp_fn = ft.vjp(pair, X)
    assert_type(out, tuple[torch.Tensor, int])
    assert_type(ft.joint(loss)(X, W), ft.JointGraph)
    assert_type(ft.checkpoint_name(X, "x"), torch.Tensor)
    assert grads.shape == W.shape and len(vjp_fn((torch.ones(2, 3), 0))) == 1


if TYPE_CHECKING:  # errors mypy must report: the wrapped signatures are enforced

    def _wrong_calls() -> None:
        ft.jit(loss)(X)  # type: ignore[call-arg]
        ft.jit(loss)(X, W, scale="big")  # type: ignore[arg-type]
        ft.jit(partition="default")(loss)(X, 1)  # type: ignore[arg-type]
        ft.remat(loss)(X, W, 3)  # type: ignore[call-arg]
        ft.grad(loss)(X)  # type: ignore[call-arg]
        ft.value_and_grad(loss)(W, scale=None)  # type: ignore[call-arg, arg-type]
        ft.joint(loss)(X, W, bias=1)  # type: ignore[call-arg]
        ft.remat(loss, policy=3)  # type: ignore[call-overload]
