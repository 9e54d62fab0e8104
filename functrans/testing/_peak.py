"""``measure_peak``: the peak memory a callable makes the allocator hold, as a user measures it.

On the CPU the figure comes from the profiler's allocator events
(``torch.profiler.profile(profile_memory=True)``): every allocation and free made while the
callable runs, summed in time order. On CUDA it is ``torch.cuda.max_memory_allocated()`` after
``reset_peak_memory_stats()``, less what was allocated before the call. Either way the figure is
the peak of the bytes allocated *during* the call above what was live when it started: the
parameters, the batch and anything else the caller already holds are not in it, while
everything the call leaves behind (gradients in ``.grad``, its outputs) is.

A free of memory allocated before the call (a ``.grad`` replaced, an input the callable drops)
is ignored, so the figure never falls below what it would be without it (the CPU allocator's
events carry addresses: only blocks allocated during the call are counted, freed or not).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from functrans._core.errors import InvalidArgumentError
from functrans._cut.allocator import cpu_allocations

__all__ = ["PeakMemory", "measure_peak"]


@dataclass(frozen=True)
class PeakMemory:
    """What :func:`measure_peak` measured.

    ``peak_bytes``: the most bytes allocated at once during the call, above what was live
    before it; ``end_bytes``: what the call left allocated (its outputs, gradients it stored);
    ``timeline``: on the CPU, the live bytes after each allocator event, in time order (empty
    on CUDA, whose allocator keeps only the peak); ``result``: the callable's return value.

    >>> import torch
    >>> from functrans.testing import measure_peak
    >>> def chain():
    ...     a = torch.empty(1000)  # 4000 bytes
    ...     b = torch.empty(2000)  # 8000 more: 12000 live
    ...     del a
    ...     return b
    >>> m = measure_peak(chain)
    >>> m.peak_bytes, m.end_bytes, m.timeline
    (12000, 8000, (4000, 12000, 8000))
    """

    peak_bytes: int
    end_bytes: int
    device: torch.device
    timeline: tuple[int, ...] = field(default=(), repr=False)
    result: Any = field(default=None, repr=False, compare=False)


def measure_peak(
    fn: Callable[..., Any], *args: Any, device: str | torch.device = "cpu", **kwargs: Any
) -> PeakMemory:
    """Run ``fn(*args, **kwargs)`` once and measure the peak bytes it made the allocator hold
    above what was live before (see the module docstring for what is counted).

    ``device`` is the device whose allocator is read: ``"cpu"`` (the profiler's events) or a
    CUDA device (the caching allocator's peak statistics).

    >>> import torch, functrans as ft
    >>> from functrans.testing import measure_peak
    >>> w = torch.randn(256, 256, requires_grad=True)
    >>> x = torch.randn(64, 256)
    >>> m = measure_peak(lambda: torch.tanh(x @ w).sum().backward())
    >>> m.peak_bytes >= 256 * 256 * 4  # w.grad at least
    True
    """
    if not callable(fn):
        raise InvalidArgumentError(
            f"measure_peak: fn={fn!r} is not accepted; pass the callable to measure"
        )
    dev = torch.device(device)
    if dev.type == "cuda":
        return _measure_cuda(fn, args, kwargs, dev)
    if dev.type != "cpu":
        raise InvalidArgumentError(
            f"measure_peak: device={device!r} is not accepted; the allocators measured are "
            "'cpu' (profiler events) and 'cuda' (caching-allocator statistics)"
        )
    gc.collect()
    result, timeline = cpu_allocations(fn, *args, **kwargs)
    return PeakMemory(
        peak_bytes=max(timeline, default=0),
        end_bytes=timeline[-1] if timeline else 0,
        device=dev,
        timeline=tuple(timeline),
        result=result,
    )


def _measure_cuda(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], dev: torch.device
) -> PeakMemory:
    gc.collect()
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    result = fn(*args, **kwargs)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - before
    end = torch.cuda.memory_allocated(dev) - before
    return PeakMemory(peak_bytes=peak, end_bytes=end, device=dev, result=result)
