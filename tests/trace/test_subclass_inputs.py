"""Tensor-subclass inputs without torch.distributed: a subclass functrans cannot take apart
(more than one inner tensor) is refused naming the argument, never baked in as a constant;
``jit`` runs it as written. DTensor (taken apart) is tested on 2 ranks in
tests/integration/test_distributed.py."""

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

import functrans as ft


def f(x, w):
    return (x * w).sum()


@pytest.mark.parametrize("transform", [ft.trace, ft.joint])
def test_subclass_with_two_inner_tensors_is_named(transform):
    w = TwoTensor(torch.ones(2), torch.full((2,), 2.0))
    with pytest.raises(ft.UnsupportedOpError, match="input w: a TwoTensor holds 2 inner"):
        transform(f)(torch.ones(2), w)


def test_grad_of_unsupported_subclass_is_named():
    w = TwoTensor(torch.ones(2), torch.full((2,), 2.0))
    with pytest.raises(ft.UnsupportedOpError, match=r"argument 1 \(w\): a TwoTensor"):
        ft.grad(f, argnums=1)(torch.ones(2), w)


def test_jit_runs_an_unsupported_subclass_as_written():
    w = TwoTensor(torch.ones(2), torch.full((2,), 2.0))
    with pytest.warns(UserWarning, match="runs as written"):
        out = ft.jit(f)(torch.ones(2), w)
    assert isinstance(out, TwoTensor)
    torch.testing.assert_close((out.a, out.b), (torch.tensor(2.0), torch.tensor(4.0)))


class OneTensor(torch.Tensor):
    """A traceable wrapper subclass with one inner tensor (as DTensor has), for tests."""

    @staticmethod
    def __new__(cls, a, meta=None):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            a.shape,
            strides=a.stride(),
            dtype=a.dtype,
            device=a.device,
            requires_grad=a.requires_grad,
        )

    def __init__(self, a, meta=None):
        self.a, self.meta = a, meta

    def __repr__(self):
        return f"OneTensor({self.a})"

    def __tensor_flatten__(self):
        return ["a"], self.meta

    @staticmethod
    def __tensor_unflatten__(inner, meta, size, stride):
        return OneTensor(inner["a"], meta)

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        from torch.utils._python_dispatch import return_and_correct_aliasing
        from torch.utils._pytree import tree_map_only

        kwargs = kwargs or {}
        unwrapped = func(
            *tree_map_only(OneTensor, lambda x: x.a, args),
            **tree_map_only(OneTensor, lambda x: x.a, kwargs),
        )
        out = tree_map_only(torch.Tensor, OneTensor, unwrapped)
        return return_and_correct_aliasing(func, args, kwargs, out)


def test_jit_trains_through_a_subclass_output():
    """Found in review: the subclass output's inner tensor never requires grad, so jit compiled
    an inference entry and the gradient was silently lost."""
    x = torch.randn(3)
    w = OneTensor(torch.randn(3)).requires_grad_()
    ref = OneTensor(w.a.clone()).requires_grad_()
    out = ft.jit(lambda x, w: (x * w).sin())(x, w)
    assert isinstance(out, OneTensor) and out.requires_grad
    (out * 2).sum().backward()
    ((x * ref).sin() * 2).sum().backward()
    torch.testing.assert_close(w.grad.a, ref.grad.a)


def test_jit_runs_a_subclass_with_unhashable_metadata_as_written():
    """Found in review: a flatten context that cannot be hashed crashed the cache lookup."""
    w = OneTensor(torch.randn(3), meta=["tag"])
    with pytest.warns(UserWarning, match="runs as written"):
        out = ft.jit(lambda x, w: x * w)(torch.ones(3), w)
    torch.testing.assert_close(out.a, w.a)
