"""The CPU allocator's events while a function runs, from the profiler: live bytes in time order.

``torch.profiler.profile(profile_memory=True)`` records every allocation and free of the CPU
allocator with its address and size, but only on threads the profiler follows: a block that
another thread frees (a collective's buffer that gloo's worker thread releases after the
caller's ``wait``) or allocates is not an event. Summed event by event, such a block stayed
live to the end of the call, and a step's measured peak changed from run to run by the blocks
that thread happened to free (a whole FSDP2 unit's gradients on 2 gloo ranks).

So while profiling, c10's CPU memory reporter is switched to count every thread's
allocations (``FLAGS_caffe2_report_cpu_memory_usage``, which it reads on each allocation and
free): each event then carries the process's allocated total, other threads' allocations and
frees included, and the live bytes at an event are that total less the total when the call
began. Only blocks allocated while the function runs count: a free the caller's thread makes
of an older block (one the caller held) is added back, so the figure is what the function
allocated above what was live before it. Where the flag cannot be reached (a torch build
without it) the events alone are summed, as before. Used by
:func:`functrans.testing.measure_peak` and :mod:`functrans._cut.scratch`.
"""

from __future__ import annotations

import contextlib
import ctypes
import warnings
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

__all__ = ["cpu_allocations"]


class _Event(NamedTuple):
    """One allocator event: its time, the block's address, its bytes (< 0: a free) and the
    process's allocated total after it (None: the reporter's totals are not process-wide)."""

    time_ns: int
    ptr: int
    nbytes: int
    total: int | None


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
def _cpu_profile() -> Iterator[Callable[[], list[_Event]]]:
    """Profile CPU allocations, every thread's counted in the totals; yields a function
    returning the events of the profiled block, in time order."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    found: list[_Event] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_profiler(), _every_thread_counted() as counted, prof:
        marker = torch.empty(1, dtype=torch.uint8)  # its event dates the call's first total
        start = marker.data_ptr()
        del marker
        yield lambda: found
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    if results is None:
        return
    events: list[_Event] = []
    _allocations(results.experimental_event_tree(), events, counted)
    events.sort(key=lambda ev: ev.time_ns)  # stable: equal times keep their order
    found.extend(_after_marker(events, start))


def _after_marker(events: list[_Event], start: int) -> list[_Event]:
    """The marker's allocation (its total less its bytes is the total when the call began)
    and the events after it, the marker's free dropped."""
    first = next((i for i, ev in enumerate(events) if ev.ptr == start and ev.nbytes > 0), None)
    if first is None:
        return events
    rest = events[first + 1 :]
    freed = next((j for j, ev in enumerate(rest) if ev.ptr == start and ev.nbytes < 0), None)
    if freed is not None:
        del rest[freed]
    return [events[first], *rest]


def _allocations(nodes: Any, out: list[_Event], counted: bool) -> None:
    """The CPU allocator events anywhere in the profiler's event tree."""
    from torch._C._profiler import _EventType

    todo = list(nodes)
    while todo:
        e = todo.pop()
        if e.tag == _EventType.Allocation and str(e.extra_fields.device) == "cpu":
            f = e.extra_fields
            total = int(f.total_allocated) if counted else None
            out.append(_Event(e.start_time_ns, f.ptr, f.alloc_size, total))
        todo.extend(e.children)


@cache
def _report_flag() -> ctypes.c_bool | None:
    """c10's ``FLAGS_caffe2_report_cpu_memory_usage`` (None where this torch build does not
    export it)."""
    import torch

    lib = Path(torch.__file__).parent / "lib" / "libc10.so"
    try:
        return ctypes.c_bool.in_dll(ctypes.CDLL(str(lib)), "FLAGS_caffe2_report_cpu_memory_usage")
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def _every_thread_counted() -> Iterator[bool]:
    """While open, c10's CPU memory reporter counts every thread's allocations and frees
    (yields whether it could be switched on)."""
    flag = _report_flag()
    if flag is None:
        yield False
        return
    before = flag.value
    flag.value = True
    try:
        yield True
    finally:
        flag.value = before


@contextlib.contextmanager
def _quiet_profiler() -> Iterator[None]:
    """The profiler warns on each free of a block allocated before it started (a size it does
    not know): expected here, so not shown."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _live(events: list[_Event]) -> list[int]:
    """Live bytes after each event (the first is the marker, dating the call's start). Only
    blocks allocated during the call count: a free of one allocated before (the profiler may
    remember its size from an earlier profile, or not know it) changes nothing."""
    if not events:
        return []
    first, rest = events[0], events[1:]
    if first.total is None:
        return _summed(rest)
    began = first.total - first.nbytes
    out: list[int] = []
    mine: set[int] = set()
    older_freed = 0  # bytes of blocks from before the call that the caller's thread freed
    for ev in rest:
        if ev.nbytes > 0:
            mine.add(ev.ptr)
        elif ev.ptr in mine:
            mine.discard(ev.ptr)
        else:
            older_freed -= ev.nbytes
        assert ev.total is not None
        out.append(ev.total - began + older_freed)
    return out


def _summed(events: list[_Event]) -> list[int]:
    """Live bytes after each event, summed from the events alone."""
    out: list[int] = []
    mine: dict[int, int] = {}
    cur = 0
    for ev in events:
        nbytes = ev.nbytes
        if nbytes > 0:
            cur -= mine.pop(ev.ptr, 0)  # freed unseen (by another thread) before its reuse
            mine[ev.ptr] = nbytes
        elif nbytes < 0 and ev.ptr in mine:
            nbytes = -mine.pop(ev.ptr)
        else:
            continue
        cur += nbytes
        out.append(cur)
    return out
