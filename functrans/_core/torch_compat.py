"""What differs between torch 2.13 (what functrans is tested on) and 2.11 (what some GPU
images carry), in one place.

A name torch added or renamed after 2.11 is imported here, with its older spelling (or an
equivalent test) as the fallback, so the library imports, and runs static-shape transforms,
on either; the README says what does not work on 2.11.

>>> optimization_hint(3)
3
>>> is_device_mismatch(RuntimeError("out of memory"))
False
"""

from __future__ import annotations

from types import CodeType

import torch
import torch.fx.proxy

try:  # torch >= 2.13
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:  # torch 2.11, 2.12: the same hint, under its older name
    from torch.fx.experimental.symbolic_shapes import (  # type: ignore[attr-defined,no-redef]  # the 2.11 name, absent from 2.13
        size_hint as optimization_hint,
    )

try:  # torch >= 2.13: an error type of its own
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError as _Mismatch
except ImportError:  # older: a RuntimeError with this text
    _Mismatch = None  # type: ignore[assignment,misc]  # the class is absent on older torch

#: the text of the error older torch raises for an op whose inputs lie on two devices
_MISMATCH_TEXT = "Unhandled FakeTensor Device Propagation"


def is_device_mismatch(e: BaseException) -> bool:
    """Whether ``e`` is a fake tensor's "inputs on two devices" error, on any torch."""
    if _Mismatch is not None and isinstance(e, _Mismatch):
        return True
    return isinstance(e, RuntimeError) and _MISMATCH_TEXT in str(e)


def anchor_stack_traces(code: CodeType) -> None:
    """Keep the frames of ``code`` in the stack traces a trace records for its nodes (torch
    keeps only frames of functions named ``forward`` otherwise). Torch before 2.13 has no such
    anchors: there, a node made outside a ``forward`` has no user line in reports."""
    anchors = getattr(torch.fx.proxy, "_STACK_TRACE_ANCHORS", None)
    if anchors is not None:
        anchors.add((code.co_filename, code.co_name))


__all__ = ["anchor_stack_traces", "is_device_mismatch", "optimization_hint"]
