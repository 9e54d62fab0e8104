"""Scratch memory: what an op allocates and frees inside itself, measured once per signature.

Some kernels need working memory beyond their inputs and outputs: a convolution on the CPU
unfolds its input into a column buffer (channels x kernel x output positions, as large as the
activation many times over), LayerNorm's backward keeps per-thread partial sums of its weight
gradients. A liveness simulation that counts only values misses them, and a step's measured
peak lands above the reported one. On the CPU, an op whose tensor inputs are not all of its
result's dtype (``mul`` of a float by a bool mask, ``sum`` of a bool tensor into int64)
first copies each such input to the common dtype, a temporary as large as the input. These
ops (:data:`SCRATCH_OPS`, and mixed-dtype ops on the CPU) are run once per argument
signature on tensors of the traced shapes, on the traced device, and the allocator's peak
above their outputs is their scratch. Every other op counts none: scratch of a few bytes (a
scalar wrapped into a tensor) is below what the peak figures resolve.

Nothing is measured while a profiler is already running (a user's, or
:func:`functrans.testing.measure_peak`'s): the ops then count no scratch, and are measured the
next time.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.fx as fx

from functrans._core.shapes import hint

from .allocator import cpu_allocations

__all__ = [
    "CALL_RECOMPUTE",
    "CALL_SCRATCH",
    "KNOWN_SCRATCH",
    "SCRATCH_OPS",
    "CallMemory",
    "inner_recompute",
    "register_call_memory",
    "scratch_bytes",
]

aten = torch.ops.aten

#: Ops whose kernels allocate working memory of their own, with where it goes.
SCRATCH_OPS: dict[Any, str] = {
    aten.convolution.default: "the CPU kernel's im2col column buffer",
    aten.convolution_backward.default: "the column buffers of the input and weight gradients",
    aten.native_layer_norm_backward.default: "per-thread partial sums of the weight gradients",
    aten.native_group_norm_backward.default: "per-group partial sums",
    aten.native_batch_norm_backward.default: "per-channel partial sums",
}


class CallMemory(NamedTuple):
    """What a call of a compiled graph holds while it runs, beyond its inputs and results."""

    scratch: int  # bytes at its peak: temporaries, and the inputs it owns until their last use
    owned: frozenset[int]  # positions of the inputs that die inside it


#: Ops that run a compiled graph (an outlined region, :mod:`functrans._jit.outline`), with
#: what a call holds beyond its inputs and outputs: read from the graph's own simulation, not
#: measured. The rule gets the inputs the call may own (handed over,
#: :data:`functrans.extend.HANDOVER_OPS`, and used last by it), as (position, bytes of its
#: storage) pairs, and says which of them die inside it (not one the graph returns, which
#: lives until the call ends) and the bytes. Filled by the modules that define the ops.
CALL_SCRATCH: dict[Any, Callable[[fx.Node, tuple[tuple[int, int], ...]], CallMemory]] = {}

#: Ops whose scratch is known without measuring, by a rule on the node (a random op replayed
#: from a saved generator state holds the state it restores: :mod:`functrans._cut.replay`).
#: Filled by the modules that define the ops.
KNOWN_SCRATCH: dict[Any, Callable[[fx.Node], int]] = {}

#: Ops that run a compiled graph, with the FLOPs a call recomputes inside it (an outlined
#: region's backward reruns what its own cut chose to recompute): a step's
#: :attr:`~functrans.Partition.recompute_flops` adds them to what its backward recomputes.
CALL_RECOMPUTE: dict[Any, Callable[[fx.Node], int]] = {}


def register_call_memory(
    op: Any,
    *,
    scratch: Callable[[fx.Node, tuple[tuple[int, int], ...]], CallMemory] | None = None,
    known: Callable[[fx.Node], int] | None = None,
    recompute: Callable[[fx.Node], int] | None = None,
) -> None:
    """Declare what a call of ``op`` holds and recomputes (the rules of :data:`CALL_SCRATCH`,
    :data:`KNOWN_SCRATCH` and :data:`CALL_RECOMPUTE`): how the module defining the op
    declares it."""
    if scratch is not None:
        CALL_SCRATCH[op] = scratch
    if known is not None:
        KNOWN_SCRATCH[op] = known
    if recompute is not None:
        CALL_RECOMPUTE[op] = recompute


def inner_recompute(graph: fx.Graph) -> int:
    """FLOPs the calls of compiled graphs in ``graph`` recompute inside them
    (:data:`CALL_RECOMPUTE`); 0 for a graph without such calls."""
    return sum(
        CALL_RECOMPUTE[n.target](n)
        for n in graph.nodes
        if n.op == "call_function" and n.target in CALL_RECOMPUTE
    )


_MEASURED: dict[tuple[Any, ...], int] = {}
_LOCK = threading.Lock()


def scratch_bytes(node: fx.Node) -> int:
    """The bytes ``node``'s op allocates inside itself beyond its outputs (0 for ops outside
    :data:`SCRATCH_OPS`), measured once per signature.

    >>> import torch, functrans as ft
    >>> x, w = torch.ones(1, 4, 6, 6), torch.ones(4, 4, 3, 3)
    >>> g = ft.trace(lambda x, w: torch.conv2d(x, w))(x, w)
    >>> conv = next(g.ops())
    >>> scratch_bytes(conv) >= 4 * 9 * 16 * 4  # a column per output position, on the CPU
    True
    """
    rule = CALL_SCRATCH.get(node.target) if node.op == "call_function" else None
    if rule is not None:
        return rule(node, ()).scratch
    known = KNOWN_SCRATCH.get(node.target) if node.op == "call_function" else None
    if known is not None:
        return known(node)
    if node.op != "call_function" or not (node.target in SCRATCH_OPS or _casts_inputs(node)):
        return 0
    key = _signature(node)
    if key is None:
        return 0
    found = _MEASURED.get(key)
    if found is None:
        measured = _measure(node)
        if measured is None:
            return 0
        with _LOCK:
            found = _MEASURED.setdefault(key, measured)
    return found


def _casts_inputs(node: fx.Node) -> bool:
    """Whether ``node`` runs on the CPU with inputs the kernel copies to a common dtype first:
    tensor inputs of different dtypes (``mul`` of a float by a bool mask), or one of another
    dtype than a non-bool result (``sum`` of a bool tensor into int64). Comparisons of inputs of
    one dtype into a bool result cast nothing."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.device.type != "cpu":
        return False
    dtypes = {
        t.dtype
        for a in node.all_input_nodes
        if isinstance(t := a.meta.get("val"), torch.Tensor) and t.dim() > 0
    }
    return len(dtypes) > 1 or (val.dtype != torch.bool and bool(dtypes - {val.dtype}))


def _signature(node: fx.Node) -> tuple[Any, ...] | None:
    parts: list[Any] = [node.target]
    for a in [*node.args, *node.kwargs.values()]:
        val = a.meta.get("val") if isinstance(a, fx.Node) else a
        if isinstance(val, torch.Tensor):
            try:
                shape = tuple(int(hint(s)) for s in val.shape)
                stride = tuple(int(hint(s)) for s in val.stride())
            except (TypeError, ValueError):
                return None
            parts.append((shape, stride, val.dtype, str(val.device)))
        elif isinstance(val, (list, tuple)):
            parts.append(tuple(repr(v) for v in val))
        else:
            parts.append(repr(val))
    return tuple(parts)


def _real(val: Any) -> Any:
    """A real tensor shaped, strided and typed like the traced ``val``."""
    if not isinstance(val, torch.Tensor):
        return val
    shape = [int(hint(s)) for s in val.shape]
    stride = [int(hint(s)) for s in val.stride()]
    span = 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) if all(shape) else 1
    if val.is_floating_point():
        # a generator of its own: compiling must not move the caller's random numbers (a
        # compiled step with dropout would draw others than eager on its first call)
        gen = torch.Generator(device=val.device).manual_seed(0)
        base = torch.randn(span, dtype=val.dtype, device=val.device, generator=gen)
    else:
        base = torch.zeros(span, dtype=val.dtype, device=val.device)
    return base.as_strided(shape, stride)


def _measure(node: fx.Node) -> int | None:
    """The op's allocator peak above its outputs, or None if it cannot be measured now."""
    device = _device(node)
    if device is None or torch.autograd.profiler._is_profiler_enabled:
        return None
    try:
        args = fx.node.map_arg(node.args, lambda a: _real(a.meta.get("val")))
        kwargs = fx.node.map_arg(node.kwargs, lambda a: _real(a.meta.get("val")))
    except (RuntimeError, TypeError, ValueError):
        return None
    target = node.target
    assert callable(target)
    try:
        with torch.no_grad(), _quiet():
            if device.type == "cuda":
                return _measure_cuda(target, args, kwargs, device)
            return _measure_cpu(target, args, kwargs)
    except Exception:  # an op that refuses random values: count no scratch
        return None


def _device(node: fx.Node) -> torch.device | None:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    for v in vals:
        if isinstance(v, torch.Tensor):
            return None if v.device.type == "meta" else v.device
    return None


def _outputs(result: Any) -> int:
    outs = result if isinstance(result, (list, tuple)) else [result]
    storages = {
        o.untyped_storage().data_ptr(): o.untyped_storage().nbytes()
        for o in outs
        if isinstance(o, torch.Tensor)
    }
    return sum(storages.values())


def _measure_cpu(target: Any, args: Any, kwargs: Any) -> int:
    result, live = cpu_allocations(target, *args, **kwargs)
    return max(0, max(live, default=0) - _outputs(result))


def _measure_cuda(target: Any, args: Any, kwargs: Any, device: torch.device) -> int:
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = target(*args, **kwargs)
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - before - _outputs(result))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
