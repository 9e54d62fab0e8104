"""How offloaded values move: the graph ops ``functrans::to_host``, ``functrans::to_device``
and ``functrans::wait_copy``, and :class:`Transfer`, the object that makes the copies.

The ops are torch custom ops, so every executor runs them through the dispatcher and graphs
print them plainly. They call the current :class:`Transfer` (:func:`use_transfer` swaps it;
graphs read it when they run, not when they are traced). The default, :class:`PinnedHost`:

- on CUDA, ``to_host`` copies to pinned host memory on a side stream after the compute
  stream's work so far (the forward goes on meanwhile); ``to_device`` copies back on that
  stream, issued ahead of the value's first use (a prefetch), and ``wait_copy``, right before
  the first use, makes the compute stream wait for that copy only;
- on the CPU, where host and device are one memory, both copies are plain copies and
  ``wait_copy`` does nothing: what a test of the wiring needs.

>>> import torch
>>> x = torch.arange(3.0)
>>> back = torch.ops.functrans.to_device(torch.ops.functrans.to_host(x), x.device)
>>> torch.ops.functrans.wait_copy(back)
tensor([0., 1., 2.])
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, Protocol, TypeVar

import torch
import torch.fx as fx
from torch.utils.weak import WeakIdKeyDictionary

from functrans._core.errors import FunctransError, InvalidArgumentError
from functrans._core.validate import describe

__all__ = [
    "OFFLOAD_OPS",
    "PinnedHost",
    "Transfer",
    "copy_back",
    "copy_out",
    "current",
    "is_transfer",
    "maker",
    "use_transfer",
    "wait",
]


class Transfer(Protocol):
    """How offloaded values are copied out and back (see :func:`use_transfer`). ``wait`` runs
    right before a copied-back value's first use: it returns once the copy may be read.

    >>> class Copy:
    ...     def to_host(self, x):
    ...         return x.to("cpu", copy=True)
    ...     def to_device(self, x, device):
    ...         return x.to(device, copy=True)
    ...     def wait(self, x):
    ...         pass
    >>> t: Transfer = Copy()
    """

    def to_host(self, x: torch.Tensor) -> torch.Tensor: ...

    def to_device(self, x: torch.Tensor, device: torch.device) -> torch.Tensor: ...

    def wait(self, x: torch.Tensor) -> None: ...


class PinnedHost:
    """The default :class:`Transfer` (see the module docstring).

    >>> import torch
    >>> t = PinnedHost()
    >>> x = torch.ones(2)
    >>> host = t.to_host(x)  # on the CPU: a copy
    >>> host is x, t.to_device(host, x.device).tolist()
    (False, [1.0, 1.0])
    """

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}
        self._pending: dict[int, Any] = {}  # data_ptr of a copy back -> its completion event

    def _stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            new: Any = torch.cuda.Stream  # torch's class is untyped
            self._streams[device] = new(device)
        return self._streams[device]

    def to_host(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cuda":
            return x.clone()
        side = self._stream(x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        out = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=True)
        with torch.cuda.stream(side):
            out.copy_(x, non_blocking=True)
        x.record_stream(side)  # the caching allocator must not reuse x before the copy ends
        return out

    def to_device(self, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        if device.type != "cuda":
            return x.clone() if x.device == device else x.to(device)
        side = self._stream(device)
        out = torch.empty(x.shape, dtype=x.dtype, device=device)  # on the compute stream
        with torch.cuda.stream(side):
            out.copy_(x, non_blocking=True)  # after the copy out: same stream
            event: Any = torch.cuda.Event  # torch's class is untyped
            done = event()
            done.record(side)
        self._pending[out.data_ptr()] = done
        return out

    def wait(self, x: torch.Tensor) -> None:
        done = self._pending.pop(x.data_ptr(), None)
        if done is not None:
            torch.cuda.current_stream(x.device).wait_event(done)


_DEFAULT = PinnedHost()
#: the transfers :func:`use_transfer` entered in this thread (or task), innermost last
_STACK: contextvars.ContextVar[tuple[Transfer, ...]] = contextvars.ContextVar(
    "functrans_transfers", default=()
)
#: which transfer made each copy: a copy goes back through the transfer that made it, whichever
#: is current when backward runs (another thread, or after the ``use_transfer`` block)
_MADE_BY: Any = WeakIdKeyDictionary()


def current() -> Transfer:
    """The transfer new copies go through: the innermost :func:`use_transfer` of this thread,
    else :class:`PinnedHost`."""
    stack = _STACK.get()
    return stack[-1] if stack else _DEFAULT


def maker(x: torch.Tensor) -> Transfer:
    """The transfer that made the copy ``x`` (the current one for a tensor it did not make)."""
    found: Transfer | None = _MADE_BY.get(x)
    return found if found is not None else current()


_T = TypeVar("_T", bound=Transfer)


@contextlib.contextmanager
def use_transfer(transfer: _T) -> Iterator[_T]:
    """Copy offloaded values with ``transfer`` in this thread meanwhile (graphs read it when
    they run, not when they are traced). A copy comes back through the transfer that made it,
    so a backward run after the block (or in autograd's own thread) still uses ``transfer``.

    >>> import torch
    >>> class Counting(PinnedHost):
    ...     out = 0
    ...     def to_host(self, x):
    ...         self.out += 1
    ...         return super().to_host(x)
    >>> with use_transfer(Counting()) as t:
    ...     _ = torch.ops.functrans.to_host(torch.ones(2))
    >>> t.out
    1
    """
    missing = [
        m for m in ("to_host", "to_device", "wait") if not callable(getattr(transfer, m, None))
    ]
    if missing:
        raise InvalidArgumentError(
            f"use_transfer: transfer={describe(transfer)} has no {', '.join(missing)} method; a "
            "Transfer has to_host(x), to_device(x, device) and wait(x) (e.g. a subclass of "
            "functrans.extend.PinnedHost)"
        )
    token = _STACK.set((*_STACK.get(), transfer))
    try:
        yield transfer
    finally:
        _STACK.reset(token)


def _on(t: torch.Tensor, device: torch.device) -> bool:
    """``t`` is on ``device`` (any index of its kind when ``device`` names none)."""
    return t.device.type == device.type and device.index in (None, t.device.index)


def _checked(
    transfer: Transfer, method: str, x: torch.Tensor, out: Any, device: Any
) -> torch.Tensor:
    """``out``, the copy ``transfer.method`` made of ``x``, or an error naming the transfer."""
    if not isinstance(out, torch.Tensor):
        got = f"a {type(out).__name__}"
    elif out.shape != x.shape or out.dtype != x.dtype or not _on(out, torch.device(device)):
        got = f"{out.dtype} {list(out.shape)} on {out.device}"
    else:
        _MADE_BY[out] = transfer
        return out
    raise FunctransError(
        f"transfer {type(transfer).__name__}.{method} returned {got} for a {x.dtype} "
        f"{list(x.shape)} tensor; a copy must be a tensor of the same shape and dtype on "
        f"{torch.device(device)}"
    )


def copy_out(x: torch.Tensor) -> torch.Tensor:
    """``x`` copied to host memory by the current transfer (remembered as the copy's maker)."""
    transfer = current()
    return _checked(transfer, "to_host", x, transfer.to_host(x), "cpu")


def copy_back(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The host copy ``x`` copied back to ``device`` by the transfer that made it."""
    transfer = maker(x)
    out = transfer.to_device(x, device)
    return _checked(transfer, "to_device", x, out, device)


def wait(x: torch.Tensor) -> None:
    """Return once the copy back ``x`` may be read (its maker's ``wait``)."""
    maker(x).wait(x)


@torch.library.custom_op("functrans::to_host", mutates_args=())
def _to_host(x: torch.Tensor) -> torch.Tensor:
    return copy_out(x)


@_to_host.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, device="cpu")


@torch.library.custom_op("functrans::to_device", mutates_args=())
def _to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    return copy_back(x, device)


@_to_device.register_fake
def _(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty_like(x, device=device)


# wait_copy returns its input (an alias, which custom_op forbids): defined with an aliasing
# schema instead, so graphs and the liveness simulation see it as a view of the copy
_library: Any = torch.library.Library  # torch's class is untyped
_LIB = _library("functrans", "FRAGMENT")
_LIB.define("wait_copy(Tensor(a) x) -> Tensor(a)")


def _wait_copy(x: torch.Tensor) -> torch.Tensor:
    wait(x)
    return x


def _wait_copy_fake(x: torch.Tensor) -> torch.Tensor:
    return x  # the same tensor, also with symbolic sizes


_LIB.impl("wait_copy", _wait_copy, "CompositeExplicitAutograd")
torch.library.register_fake("functrans::wait_copy", _wait_copy_fake, lib=_LIB)

#: The graph ops that copy an offloaded value out (forward), back (backward, ahead of its
#: first use), and wait for the copy back (right before its first use).
OFFLOAD_OPS = (
    torch.ops.functrans.to_host.default,
    torch.ops.functrans.to_device.default,
    torch.ops.functrans.wait_copy.default,
)


def is_transfer(node: fx.Node) -> bool:
    """Whether ``node`` copies a value to or from host memory (or waits for a copy).

    >>> import torch, functrans as ft
    >>> from functrans.extend import Cut
    >>> p = ft.partition(ft.joint(lambda x: x.exp().sin().sum())(torch.ones(3)),
    ...                  lambda jg: Cut(offloaded=["exp"]))
    >>> [n.name for n in p.backward.ops() if is_transfer(n)]
    ['to_device_default', 'wait_copy_default']
    """
    return node.op == "call_function" and node.target in OFFLOAD_OPS
