"""A traced function must not reseed the global random number generator.

Traced graphs draw random numbers from the caller's generator when they run; a function that
calls ``torch.manual_seed`` while being traced would get a graph that ignores the seed. Under
fake tensors nothing else touches the generator, so the calls that (re)set it are what to
catch. Comparing the generator's state before and after the trace is not enough on its own:
other threads may draw random numbers meanwhile, which is legal. So:

- the seeding functions (``torch.manual_seed``, ``torch.seed``, ``torch.set_rng_state``, and
  their ``torch.random`` and ``torch.cuda`` twins) are wrapped, once, by wrappers that raise
  only in a thread (context) that is tracing; everywhere else they are the originals;
- the state comparison still runs when no other Python thread exists, to catch the generator
  object's own methods (``torch.default_generator.manual_seed``).

>>> with tracing_guard(lambda: "f"):
...     pass
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ._errors import TraceError

__all__ = ["tracing_guard"]

_OWNER: contextvars.ContextVar[Callable[[], str] | None] = contextvars.ContextVar(
    "functrans_rng_owner", default=None
)
_INSTALL = threading.Lock()
_installed = False

# (module, attribute) of every function that reseeds or restores a global generator
_SEEDERS = (
    (torch, "manual_seed"),
    (torch, "seed"),
    (torch, "set_rng_state"),
    (torch.random, "manual_seed"),
    (torch.random, "seed"),
    (torch.random, "set_rng_state"),
    (torch.cuda, "manual_seed"),
    (torch.cuda, "manual_seed_all"),
    (torch.cuda, "seed"),
    (torch.cuda, "seed_all"),
    (torch.cuda, "set_rng_state"),
    (torch.cuda, "set_rng_state_all"),
)


def _error(owner: Callable[[], str], what: str) -> TraceError:
    return TraceError(
        f"{owner()} changed the global random number generator while being traced ({what}). "
        "Traced graphs draw random numbers from the caller's generator and cannot record such "
        "side effects: seed before calling the function."
    )


def _wrap(module: Any, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    qualified = f"{module.__name__}.{name}"

    @functools.wraps(original)
    def seeder(*args: Any, **kwargs: Any) -> Any:
        owner = _OWNER.get()
        if owner is not None and not _restores_same_state(name, args, kwargs):
            raise _error(owner, f"{qualified} was called")
        return original(*args, **kwargs)

    seeder.__functrans_original__ = original  # type: ignore[attr-defined]
    return seeder


def _restores_same_state(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``torch.random.fork_rng`` sets back the state it saved: a no-op when nothing drew."""
    if name != "set_rng_state" or not args or kwargs:
        return False
    new = args[0]
    return isinstance(new, torch.Tensor) and _bytes(new) == _bytes(torch.random.get_rng_state())


def _install() -> None:
    global _installed
    with _INSTALL:
        if _installed:
            return
        for module, name in _SEEDERS:
            original = getattr(module, name, None)
            if original is not None and not hasattr(original, "__functrans_original__"):
                setattr(module, name, _wrap(module, name, original))
        _installed = True


def _bytes(state: torch.Tensor) -> bytes:
    # plain bytes, not torch.equal, and no modes: an outer fake or tracing mode (a transform
    # around this trace) would intercept the comparison of two real tensors
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        return bytes(state.numpy().tobytes())


@contextlib.contextmanager
def tracing_guard(owner: Callable[[], str]) -> Iterator[None]:
    """Within this context (this thread's), reseeding raises a TraceError naming ``owner()``."""
    _install()
    alone = threading.active_count() == 1
    before = _bytes(torch.random.get_rng_state()) if alone else b""
    token = _OWNER.set(owner)
    try:
        yield
    finally:
        _OWNER.reset(token)
    if alone and threading.active_count() == 1:
        after = torch.random.get_rng_state()
        if _bytes(after) != before:
            torch.random.set_rng_state(torch.frombuffer(bytearray(before), dtype=torch.uint8))
            raise _error(owner, "its state differs after the trace")
