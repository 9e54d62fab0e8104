"""A traced function must not reseed the global random number generator.

Traced graphs draw random numbers from the caller's generator when they run; a function that
calls ``torch.manual_seed`` while being traced would get a graph that ignores the seed. Under
fake tensors nothing else touches the generator, so the calls that (re)set it are what to
catch. Comparing the generator's state before and after the trace is not enough on its own:
other threads may draw random numbers meanwhile, which is legal. So:

- the seeding functions (``torch.manual_seed``, ``torch.seed``, ``torch.set_rng_state``, and
  their ``torch.random`` and ``torch.cuda`` twins) are wrapped, once, by wrappers that record
  the call in the :class:`Seeding` of the thread (context) that is tracing; everywhere else
  they are the originals;
- a trace that reseeded must leave the generator as it found it (``fork_rng``,
  ``freeze_rng_state``), and its graph must draw no random numbers (the seed would not reach
  them): ``run_traced`` checks the graph;
- the state comparison also runs when no other Python thread exists, to catch the generator
  object's own methods (``torch.default_generator.manual_seed``).

>>> with tracing_guard(lambda: "f") as seeding:
...     pass
>>> seeding.call is None
True
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from functrans._core.errors import TraceError
from functrans._core.marks import leave, marked

from .session import Slot

__all__ = ["Seeding", "seeded_then_drew", "tracing_guard"]


@dataclass
class Seeding:
    """What a traced function did to the global generator."""

    call: str | None = None  # the first reseeding call (``torch.manual_seed``), if any


#: what the running trace did to the global generator (None: not watched)
_CURRENT: Slot[Seeding | None] = Slot("rng seeding", None)
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


@dataclass(frozen=True)
class Seeder:
    """The record on our wrapper of a seeding function, holding the function it wraps: a
    seeding function that carries it is ours and is never wrapped again."""

    original: Callable[..., Any]


def _wrap(module: Any, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    qualified = f"{module.__name__}.{name}"

    @functools.wraps(original)
    def seeder(*args: Any, **kwargs: Any) -> Any:
        seeding = _CURRENT.get()
        recording = seeding is not None and seeding.call is None  # the first reseeding only
        if seeding is not None and recording and not _restores_same_state(name, args, kwargs):
            seeding.call = qualified
        return original(*args, **kwargs)

    leave(seeder, Seeder(original))
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
            if original is not None and not marked(original, Seeder):
                setattr(module, name, _wrap(module, name, original))
        _installed = True


def _bytes(state: torch.Tensor) -> bytes:
    # plain bytes, not torch.equal, and no modes: an outer fake or tracing mode (a transform
    # around this trace) would intercept the comparison of two real tensors
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        return bytes(state.numpy().tobytes())


@contextlib.contextmanager
def tracing_guard(owner: Callable[[], str]) -> Iterator[Seeding]:
    """Within this context (this thread's), reseeding calls are recorded in the yielded
    :class:`Seeding`; a TraceError naming ``owner()`` if the generator is not left as found."""
    _install()
    alone = threading.active_count() == 1
    before = _bytes(torch.random.get_rng_state())
    seeding = Seeding()
    with _CURRENT.bound(seeding):
        yield seeding
    checked = seeding.call is not None or (alone and threading.active_count() == 1)
    if checked and _bytes(torch.random.get_rng_state()) != before:
        torch.random.set_rng_state(torch.frombuffer(bytearray(before), dtype=torch.uint8))
        what = f"{seeding.call} was called" if seeding.call else "its state differs after it"
        raise _error(owner, what)


def seeded_then_drew(owner: Callable[[], str], seeding: Seeding) -> TraceError:
    """The error for a trace that reseeded (and restored) the generator, then drew from it."""
    return TraceError(
        f"{owner()} reseeds the global random number generator ({seeding.call}) and draws "
        "random numbers while being traced: the compiled graph would draw them from the "
        "caller's generator, not from that seed. Seed before calling the function."
    )
