"""The CPU allocator's events while a function runs, from the profiler: live bytes in time order.

``torch.profiler.profile(profile_memory=True)`` records every allocation and free of the CPU
allocator with its address and size. Summed in time order they give the live bytes at each
event. Only blocks allocated while the function runs count: a free of an older block (one the
caller held, or one an earlier profile saw) changes nothing, so the figure is what the
function allocated above what was live before it. Used by
:func:`functrans.testing.measure_peak` and :mod:`functrans._cut.scratch`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["cpu_allocations"]


def cpu_allocations(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, list[int]]:
    """``fn(*args, **kwargs)`` and the live bytes after each allocator event it caused.

    >>> import torch
    >>> _, live = cpu_allocations(lambda: torch.empty(10).exp())  # the exp outlives its input
    >>> live
    [40, 80, 40]
    """
    with _cpu_profile() as events:
        result = fn(*args, **kwargs)
    return result, _live(events())


@contextlib.contextmanager
def _cpu_profile() -> Iterator[Callable[[], list[tuple[int, int, int]]]]:
    """Profile CPU allocations; yields a function returning ``(time_ns, address, bytes)`` per
    allocator event (bytes < 0: a free), in time order."""
    from torch.profiler import ProfilerActivity, profile

    found: list[tuple[int, int, int]] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_profiler(), prof:
        yield lambda: found
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    if results is None:
        return
    events: list[tuple[int, int, int]] = []
    _allocations(results.experimental_event_tree(), events)
    found.extend(sorted(events, key=lambda ev: ev[0]))  # stable: equal times keep their order


def _allocations(nodes: Any, out: list[tuple[int, int, int]]) -> None:
    """The CPU allocator events anywhere in the profiler's event tree."""
    from torch._C._profiler import _EventType

    todo = list(nodes)
    while todo:
        e = todo.pop()
        if e.tag == _EventType.Allocation and str(e.extra_fields.device) == "cpu":
            f = e.extra_fields
            out.append((e.start_time_ns, f.ptr, f.alloc_size))
        todo.extend(e.children)


@contextlib.contextmanager
def _quiet_profiler() -> Iterator[None]:
    """The profiler warns on each free of a block allocated before it started (a size it does
    not know): expected here, so not shown."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _live(events: list[tuple[int, int, int]]) -> list[int]:
    """Live bytes after each event. Only blocks allocated during the call count: a free of one
    allocated before (the profiler may remember its size from an earlier profile, or not know
    it) changes nothing."""
    out: list[int] = []
    mine: dict[int, int] = {}
    cur = 0
    for _, ptr, nbytes in events:
        if nbytes > 0:
            mine[ptr] = nbytes
        elif nbytes < 0 and ptr in mine:
            nbytes = -mine.pop(ptr)
        else:
            continue
        cur += nbytes
        out.append(cur)
    return out
