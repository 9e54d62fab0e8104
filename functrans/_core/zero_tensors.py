"""Forward mode's zero tangents under fake tensors.

Forward-mode AD stands an "efficient zero tensor" (a ZeroTensor: no storage, its own kernels for
``add``, ``mul``, ``sub`` and ``div`` that skip the arithmetic) for a tangent it knows to be zero:
a constant's, the outer tangent of the derivative of ``2 * x``. torch (2.13) also registers
kernels of its own for three views of one, ``view``, ``_reshape_alias`` and ``as_strided``, and
those run ahead of FakeTensorMode: the view of a fake zero tangent, in any trace or under
:func:`~functrans.eval_shape`, comes out a plain tensor on the 'meta' device, which the next op
meets beside the fakes of the real device ("found at least two devices, meta and cpu"), or which
a traced function hands back.

:func:`views_reach_fake_modes` sends those three views of a ZeroTensor on to the kernels below,
as every other view of one goes already (what pytorch/pytorch#186160 does upstream): eager runs
the same function there (``at::native::view``...), so eager results are unchanged, and a fake's
view is a fake, on its own device, again.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

__all__ = ["views_reach_fake_modes"]

_VIEWS = ("view", "_reshape_alias", "as_strided")

_lib: list[Any] = []  # the registrations last as long as their library object


def views_reach_fake_modes() -> None:
    """Let ``view``, ``_reshape_alias`` and ``as_strided`` of a ZeroTensor dispatch on to the
    kernels below it (once per process; later calls do nothing).

    >>> import torch
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> views_reach_fake_modes()
    >>> with FakeTensorMode():
    ...     zero = torch._efficientzerotensor([2, 3])
    ...     type(zero.view(6)).__name__, zero.view(6).device
    ('FakeTensor', device(type='cpu'))
    """
    if _lib:
        return
    library: Any = torch.library.Library  # torch's class is untyped
    lib = library("aten", "IMPL")
    with warnings.catch_warnings():  # torch warns that a kernel of its own is replaced
        warnings.filterwarnings("ignore", "Warning only once for all operators", UserWarning)
        for name in _VIEWS:
            lib.impl(name, torch.library.fallthrough_kernel, "ZeroTensor")
    _lib.append(lib)
