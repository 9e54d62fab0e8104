"""Which tensors autograd differentiates: the one predicate every transform asks.

Eager autograd gives a gradient to floating-point and complex tensors (a complex one gets the
conjugate Wirtinger derivative, what ``loss.backward()`` leaves in ``.grad``); integer and
boolean tensors never require grad. Every place that decides which inputs are differentiated,
which outputs take a cotangent or which outputs require grad asks :func:`differentiable`, so
complex parameters train under every strategy and backend exactly as in eager.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["differentiable", "differentiable_dtype"]


def differentiable_dtype(dtype: torch.dtype) -> bool:
    """Whether autograd differentiates tensors of ``dtype`` (floating point or complex).

    >>> import torch
    >>> [differentiable_dtype(d) for d in (torch.float16, torch.complex64, torch.int64)]
    [True, True, False]
    """
    return dtype.is_floating_point or dtype.is_complex


def differentiable(t: Any) -> bool:
    """Whether ``t`` is a tensor autograd differentiates (floating point or complex).

    >>> import torch
    >>> differentiable(torch.ones(2, dtype=torch.cfloat)), differentiable(torch.ones(2).long())
    (True, False)
    """
    return isinstance(t, torch.Tensor) and differentiable_dtype(t.dtype)
