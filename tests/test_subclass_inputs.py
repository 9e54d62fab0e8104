"""Tensor-subclass inputs without torch.distributed: a subclass functrans cannot take apart
(more than one inner tensor) is refused naming the argument, never baked in as a constant;
``jit`` runs it as written. DTensor (taken apart) is tested on 2 ranks in
tests/test_distributed.py."""

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
