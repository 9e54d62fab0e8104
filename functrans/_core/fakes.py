"""Fake tensors made from metadata, without an ATen call.

A fake tensor made by an op under a ``FakeTensorMode`` (``torch.empty_strided`` included) goes
through the mode's dispatch: about 0.2 ms. Code that only needs a value with given sizes,
strides and dtype on a given storage (a copied node, a node read back from disk, a trace's
inputs) builds the meta tensor directly and wraps it, about 8x cheaper. Sizes may be symbolic
(``SymInt``s of the mode's shape environment).

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

__all__ = ["fake_empty", "fakes_of", "trace_as_themselves"]


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
            # symbolic sizes are not compared (that would add guards)
            sizes = (*shape, *stride, offset, 0 if nbytes is None else nbytes)
            static = all(type(s) is int for s in sizes)
            if nbytes is None:
                nbytes, alone = _reached(shape, stride, offset, dtype), static
            else:
                alone = static and nbytes == _reached(shape, stride, offset, dtype)
            if alone and offset == 0:
                # alone on a storage of its own size (most values): one call
                meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
                return FakeTensor(mode, meta, torch.device(device))
            untyped = torch.empty(nbytes, dtype=torch.uint8, device="meta").untyped_storage()
        meta = torch.empty(0, dtype=dtype, device="meta")
        meta.set_(untyped, offset, list(shape), list(stride))
    return FakeTensor(mode, meta, torch.device(device))


def _reached(
    shape: Sequence[int | torch.SymInt],
    stride: Sequence[int | torch.SymInt],
    offset: int | torch.SymInt,
    dtype: torch.dtype,
) -> int | torch.SymInt:
    """Bytes of storage a tensor of this layout reaches."""
    reach = 1 + offset + sum((s - 1) * st for s, st in zip(shape, stride, strict=True))
    return 0 if 0 in shape else reach * dtype.itemsize


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


def _plain(t: torch.Tensor) -> bool:
    """A dense tensor that is its own base, with nothing :func:`fake_empty` would drop (a
    subclass, a view, a conjugate or negative bit, a sparse or quantized layout, inference
    mode's mark)."""
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.layout is torch.strided
        and t._base is None
        and not t.is_quantized
        and not t.is_conj()
        and not t.is_neg()
        and not t.is_inference()  # from_tensor keeps the flag: autograd refuses such a tensor
        and t.device.type in ("cpu", "cuda")
    )


def fakes_of(mode: FakeTensorMode, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Fakes of ``tensors`` in ``mode``, detached, as ``mode.from_tensor(t.detach())`` makes
    them (tensors that share a storage get fakes that share one), a plain dense tensor built
    from its metadata at an eighth of the cost. Where any is not plain (a view, a subclass...),
    all go through ``from_tensor``, which relates a view to its base's storage.

    >>> w = torch.ones(4, 3)
    >>> a, b = fakes_of(FakeTensorMode(), [w, w.T.contiguous().T])
    >>> a.shape, a.requires_grad, b.stride()
    (torch.Size([4, 3]), False, (1, 4))
    >>> a, b = fakes_of(FakeTensorMode(), [w, w])  # one storage: one fake storage
    >>> a.untyped_storage()._cdata == b.untyped_storage()._cdata
    True
    """
    if not all(map(_plain, tensors)):
        return [mode.from_tensor(t.detach()) for t in tensors]
    storages: dict[int, torch.Tensor] = {}
    out: list[torch.Tensor] = []
    for t in tensors:
        key = t.untyped_storage()._cdata
        base = storages.get(key)
        fake = fake_empty(
            mode,
            t.shape,
            t.stride(),
            t.dtype,
            t.device,
            offset=t.storage_offset(),
            storage=base,
            nbytes=t.untyped_storage().nbytes(),
        )
        storages.setdefault(key, fake)
        out.append(fake)
    return out
