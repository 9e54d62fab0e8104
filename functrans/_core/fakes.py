"""Fake tensors made from metadata, without an ATen call.

A fake tensor made by an op under a ``FakeTensorMode`` (``torch.empty_strided`` included) goes
through the mode's dispatch: about 0.2 ms. Code that only needs a value with given sizes,
strides and dtype on a given storage (a copied node, a node read back from disk) builds the
meta tensor directly and wraps it, about 8x cheaper. Static sizes only: a symbolic size needs
the mode's shape environment, so callers make those under the mode.

>>> from torch._subclasses.fake_tensor import FakeTensorMode
>>> mode = FakeTensorMode()
>>> t = fake_empty(mode, (2, 3), (1, 2), torch.float32, torch.device("cpu"))
>>> type(t).__name__, t.shape, t.stride(), t.device
('FakeTensor', torch.Size([2, 3]), (1, 2), device(type='cpu'))
>>> v = fake_empty(mode, (3,), (1,), torch.float32, t.device, offset=3, storage=t)
>>> v.untyped_storage()._cdata == t.untyped_storage()._cdata
True
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._mode_utils import no_dispatch

__all__ = ["fake_empty", "trace_as_themselves"]


def fake_empty(
    mode: FakeTensorMode,
    shape: Sequence[int | torch.SymInt],
    stride: Sequence[int | torch.SymInt],
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    offset: int | torch.SymInt = 0,
    storage: torch.Tensor | None = None,
    nbytes: int | torch.SymInt | None = None,
) -> FakeTensor:
    """A fake tensor of ``mode`` with these sizes, strides and storage offset, on the storage
    of ``storage`` (a fake tensor) or on a new one of ``nbytes`` bytes (by default, just what
    the sizes reach). Sizes, strides and offset may be symbolic (a ``SymInt`` of the mode's
    shape environment). Its values are never read: it is metadata."""
    with no_dispatch():
        if storage is not None:
            untyped = storage.untyped_storage()
        else:
            if nbytes is None:
                reach = 1 + offset + sum((s - 1) * st for s, st in zip(shape, stride, strict=True))
                nbytes = 0 if 0 in shape else reach * dtype.itemsize
            untyped = torch.empty(nbytes, dtype=torch.uint8, device="meta").untyped_storage()
        meta = torch.empty(0, dtype=dtype, device="meta")
        meta.set_(untyped, offset, list(shape), list(stride))
    return FakeTensor(mode, meta, torch.device(device))


def trace_as_themselves(fakes: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``fakes``, each remembered by its mode as its own fake: ``make_fx`` (which converts its
    inputs with ``mode.from_tensor``) then traces them as they are instead of building a fake
    of each fake (two fakes per parameter, half a millisecond each, on every trace).

    >>> mode = FakeTensorMode()
    >>> (t,) = trace_as_themselves([mode.from_tensor(torch.ones(2))])
    >>> mode.from_tensor(t) is t
    True
    """
    for t in fakes:
        if isinstance(t, FakeTensor):
            t.fake_mode.fake_tensor_converter.set_tensor_memo(t, t)
    return list(fakes)
