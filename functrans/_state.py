"""Global state a trace reads besides its arguments, as one comparable value.

A traced graph bakes in more than its inputs: autocast inserts casts, grad mode decides whether
a backward exists, the default dtype types every ``torch.zeros(3)``, a module's ``training`` flag
picks dropout or not. :func:`capture` reads all of it in one tuple (a few C calls) so a cache
can compare it on every call; :func:`describe` names what changed between two captures for the
recompile log. State deliberately *not* captured, with the reason:

- ``torch.backends.*`` math flags (TF32, reduced-precision reductions): read by kernels when the
  compiled graph runs, never by the trace, so a compiled graph follows them like eager does.
- ``torch.use_deterministic_algorithms``: captured, though the aten backend only reads it at
  run time, because decompositions and generated kernels may pick an algorithm by it.
- RNG state: graphs draw from the caller's generator at run time (see ``run_traced``).

>>> s = capture(())
>>> with torch.no_grad():
...     describe(s, capture(()))
['grad mode True -> False']
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch

__all__ = [
    "AUTOCAST_DEVICES",
    "ModuleFlags",
    "State",
    "autocast_off",
    "capture",
    "describe",
    "no_autocast",
]

#: Device types whose autocast state is part of every capture.
AUTOCAST_DEVICES = ("cpu", "cuda")

# the readable names of the process-wide (thread-local) flags, in State's order
_FLAGS = ("grad mode", "inference mode", "default dtype", "deterministic algorithms")


def _autocast(device: str) -> torch.dtype | None:
    """The autocast dtype for ``device``, or None when autocast is off there."""
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


#: ``(module, module.training)`` for every module a function reaches, in walk order.
ModuleFlags = tuple[tuple[torch.nn.Module, bool], ...]


class State(NamedTuple):
    """One capture of the global state a trace reads (a tuple: hashed and compared on every
    jitted call; built by :func:`capture`)."""

    grad: bool
    inference: bool
    default_dtype: torch.dtype
    deterministic: bool
    autocast_cpu: torch.dtype | None  # the autocast dtype, None when autocast is off
    autocast_cuda: torch.dtype | None
    modules: ModuleFlags

    @property
    def autocast(self) -> tuple[torch.dtype | None, torch.dtype | None]:
        """Autocast per device of :data:`AUTOCAST_DEVICES`."""
        return (self.autocast_cpu, self.autocast_cuda)


_any_autocast = torch._C._is_any_autocast_enabled
_grad = torch.is_grad_enabled
_inference = torch.is_inference_mode_enabled
_default_dtype = torch.get_default_dtype
_deterministic = torch.are_deterministic_algorithms_enabled


# tuple.__new__ skips NamedTuple's Python-level __new__ (0.13 us instead of 0.33 us a call):
# capture() runs on every jitted call and takes about 0.4 us either way
_new_state: Any = tuple.__new__


def capture(module_flags: ModuleFlags) -> State:
    """Everything global a trace depends on, right now (``module_flags``: see
    :data:`ModuleFlags`). About half a microsecond: it runs on every call of a jitted function.
    """
    if _any_autocast():
        cpu, cuda = _autocast("cpu"), _autocast("cuda")
    else:
        cpu = cuda = None
    state: State = _new_state(
        State, (_grad(), _inference(), _default_dtype(), _deterministic(), cpu, cuda, module_flags)
    )
    return state


def grad_enabled(state: State) -> bool:
    return state.grad


def describe(old: State, new: State, names: Sequence[str] = ()) -> list[str]:
    """What changed from ``old`` to ``new``, one phrase per difference (``names``: the module
    names of the module flags, in :data:`ModuleFlags` order)."""
    flags = len(_FLAGS)  # the first fields of State
    out = [
        f"{name} {_fmt(a)} -> {_fmt(b)}"
        for name, a, b in zip(_FLAGS, old[:flags], new[:flags], strict=True)
        if a != b
    ]
    for device, a, b in zip(AUTOCAST_DEVICES, old.autocast, new.autocast, strict=True):
        if a != b:
            out.append(f"autocast({device!r}) {_fmt_autocast(a)} -> {_fmt_autocast(b)}")
    before, after = old.modules, new.modules
    if len(before) != len(after) or any(
        m is not n for (m, _), (n, _) in zip(before, after, strict=True)
    ):
        out.append("the module tree changed (a submodule was added, removed or replaced)")
    else:
        for i, ((_, was), (_, now)) in enumerate(zip(before, after, strict=True)):
            if was != now:
                name = names[i] if i < len(names) else f"module {i}"
                out.append(f"{name or 'the module'}.training {was} -> {now}")
    return out


def _fmt(v: Any) -> str:
    return str(v).replace("torch.", "")


def _fmt_autocast(v: torch.dtype | None) -> str:
    return "off" if v is None else _fmt(v)


def autocast_off() -> contextlib.AbstractContextManager[None]:
    """:func:`no_autocast` for the state right now."""
    return no_autocast(capture(()))


@contextlib.contextmanager
def no_autocast(state: State) -> Iterator[None]:
    """Run a compiled graph without autocast: the graph already holds the casts its trace
    recorded, and autocast applied again at run time would change a float32 graph's results."""
    with contextlib.ExitStack() as stack:
        for device, dtype in zip(AUTOCAST_DEVICES, state.autocast, strict=True):
            if dtype is not None:
                stack.enter_context(torch.autocast(device, enabled=False))
        yield
