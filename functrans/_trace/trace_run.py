"""One ``make_fx`` run of a traced function: the lock, the modes inside it, its errors.

:func:`run_traced` runs a trace (``make_fx`` over the function: see
:mod:`functrans._trace.trace`) one at a time process-wide (:data:`TRACE_LOCK`), with the
caller's saved-tensor hooks set aside and the contexts the trace extensions declare
(:mod:`functrans._trace.extensions`) entered around it, and translates what fails inside into a
:class:`~functrans.TraceError` that names the user's line (a value-dependent branch, inputs on
two devices). :func:`in_traced_function` wraps the traced function itself in the modes that
must see only its calls: differentiated RNNs sent down torch's unfused path, fake tensors'
device queries answered early, torch calls shown to the watchers bound with :func:`watching`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
)
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils._python_dispatch import TorchDispatchMode

from functrans._core.context import _TRACING, LIBRARY_DIRS, culprit, user_line
from functrans._core.dynamo_skip import inline_compiled
from functrans._core.errors import TraceError
from functrans._core.ops import is_random
from functrans._core.torch_compat import anchor_stack_traces, is_device_mismatch

from .extensions import TraceExtension, active, register_trace_extension
from .record import stack_traces
from .rng import seeded_then_drew, tracing_guard
from .session import Slot
from .stops import note, note_detach

__all__ = [
    "TRACE_LOCK",
    "WATCHERS",
    "in_traced_function",
    "lazy_modules",
    "no_saved_tensor_hooks",
    "run_traced",
    "watching",
]

_DATA_DEPENDENT = (
    GuardOnDataDependentSymNode,
    DataDependentOutputException,
    DynamicOutputShapeException,
)


def _data_dependent_error(fn: Callable[..., Any], exc: BaseException) -> TraceError:
    name = getattr(fn, "__qualname__", repr(fn))
    return TraceError(
        f"{name} depends on the value of a tensor{user_line(exc)}{culprit(exc)}.\n"
        "Tracing records one straight-line graph and cannot follow Python control flow (or "
        "output shapes) that depend on tensor values. Compute both branches and pick with "
        "torch.where(cond, a, b), or pass the value as a Python scalar marked static with "
        "static_argnums=(...)."
    )


def _device_error(fn: Callable[..., Any], exc: BaseException) -> TraceError:
    """An op's inputs on two devices (eager would fail too, on the same op)."""
    name = getattr(fn, "__qualname__", repr(fn))
    return TraceError(
        f"{name}: {exc}{user_line(exc)}{culprit(exc)}. Put every input, parameter and buffer on "
        "one device; a model built on the 'meta' device has no data yet: materialize it first "
        "(module.to_empty(device=...), then load or initialize its weights)"
    )


# make_fx is not thread-safe (torch.fx keeps its patcher in a global): one trace at a time,
# process-wide; compiled graphs still run in parallel
TRACE_LOCK = threading.RLock()


# what other parts of functrans add to every trace (contexts around the body, passes over the
# raw graph) is declared in :mod:`functrans._trace.extensions`; :class:`_PlainRNNs`, below,
# which sends differentiated RNN calls down torch's unfused path, is entered inside the traced
# function (:func:`in_traced_function`)


@contextlib.contextmanager
def no_saved_tensor_hooks() -> Iterator[None]:
    """No saved-tensor hooks while the body runs (they are restored after): set aside, not
    replaced, because torch.func's grad refuses to run under any hooks."""
    autograd = torch._C._autograd
    popped = []
    while (top := autograd._top_saved_tensors_default_hooks(True)) is not None:
        popped.append(top)
        autograd._pop_saved_tensors_default_hooks()
    try:
        yield
    finally:
        for pack, unpack in reversed(popped):
            autograd._push_saved_tensors_default_hooks(pack, unpack)


# Recurrent layers whose fused kernels (oneDNN's ``mkldnn_rnn_layer`` on CPU, cuDNN's
# ``_cudnn_rnn`` on GPU) return a workspace that only a forward run under grad mode fills: a
# compiled forward runs without it (the autograd Function's), and the fake workspace is sized
# 0 where the real one is not. Traced through torch's plain path (matmuls and pointwise ops, as
# with the fused kernels disabled), their backward is ordinary ops; AOTAutograd does the same.
_RNNS = frozenset(
    getattr(torch._C._VariableFunctions, name) for name in ("lstm", "gru", "rnn_tanh", "rnn_relu")
)


#: Called (with no arguments) at every torch function a traced function calls, before it runs:
#: what :class:`functrans._jit.disk.code_deps.Recorder` watches the running code with; a slot
#: of the trace session, bound by :func:`watching` (this thread's, for the block)
WATCHERS: Slot[tuple[Callable[[], None], ...]] = Slot("torch call watchers", ())


@contextlib.contextmanager
def watching(watch: Callable[[], None]) -> Iterator[None]:
    """``watch`` is called at every torch function a trace run in this context calls (beside
    the watchers already bound)."""
    with WATCHERS.bound((*WATCHERS.get(), watch)):
        yield


class _PlainRNNs(torch.overrides.TorchFunctionMode):
    """While a trace runs: a differentiated LSTM/GRU/RNN call takes the unfused path (and the
    watchers bound with :func:`watching` see each torch call)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for watch in WATCHERS.get():
            watch()
        kwargs = kwargs or {}
        if func in _DETACHES:
            out = func(*args, **kwargs)
            note_detach(args, out)  # the code stops autograd here
            return out
        if func not in _RNNS or not torch.is_grad_enabled() or not _requires_grad(args):
            return func(*args, **kwargs)
        ctx = torch._C
        mkldnn, cudnn = ctx._get_mkldnn_enabled(), ctx._get_cudnn_enabled()
        ctx._set_mkldnn_enabled(False)
        ctx._set_cudnn_enabled(False)
        try:
            return func(*args, **kwargs)
        finally:
            ctx._set_mkldnn_enabled(mkldnn)
            ctx._set_cudnn_enabled(cudnn)


#: what the traced code calls to stop autograd (noted: :mod:`functrans._trace.stops`)
_DETACHES = frozenset({torch.Tensor.detach, torch.detach})


class _FakeDevices(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's mode base is unannotated
    """While a trace runs: a fake tensor's device, which autograd asks of the inputs and
    outputs of every op it records and of the gradients its engine passes on (three dozen
    times for a block's backward), answered here as the fake mode answers it, before the
    tracing modes see the query (through each, about 10 us). Every op's nodes are noted where
    autograd stops (:func:`functrans._trace.stops.note`)."""

    #: a higher-order op (a random op replayed from a saved generator state, in a traced
    #: partition) runs as it is: the mode only answers device queries
    supports_higher_order_operators = True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _DEVICE:
            t = args[0]
            if type(t) is FakeTensor and not t.fake_mode.in_kernel_invocation:
                return t.fake_device
        out = func(*args, **(kwargs or {}))
        note(func, args, kwargs, out)  # where autograd stops (no_grad, detach)
        return out


_DEVICE = torch.ops.prim.device.default


def in_traced_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, the function make_fx traces, run under :class:`_PlainRNNs`: entered inside it,
    not around make_fx, so the mode (and its watchers) sees the calls of the traced code and
    not the twenty-odd metadata reads make_fx makes per input as it sets up its placeholders
    (5 ms per 13 parameters, most of what a block's parameters cost a trace). Stack traces are
    recorded from here on too: make_fx is called without them, so that its placeholders, which
    have no user line, do not walk the stack (0.1 ms each)."""

    def run(*args: Any) -> Any:
        with _PlainRNNs(), stack_traces(), _FakeDevices():  # type: ignore[no-untyped-call]  # torch's mode base is unannotated
            return fn(*args)

    return run


def lazy_modules(_traced: Any = None) -> contextlib.AbstractContextManager[None]:
    """make_fx's graphs generate their Python code when first run: a trace's raw graph goes
    through the passes below and is never run itself."""
    return _use_lazy_graph_module(True)


def _compiled_as_written(_traced: Any = None) -> contextlib.AbstractContextManager[None]:
    return inline_compiled()


register_trace_extension(
    TraceExtension(
        "lazy graph modules",
        10,
        lazy_modules,
        doc="a raw graph's code is generated when first run, and it never runs",
    )
)
register_trace_extension(
    TraceExtension(
        "torch.compile-d code as written",
        20,
        _compiled_as_written,
        doc="a compiled function inside the traced one is traced as the function it wraps",
    )
)


def _requires_grad(args: Any) -> bool:
    leaves: list[Any] = optree.tree_leaves(list(args), none_is_leaf=True)  # type: ignore[arg-type]  # optree's PyTree type is narrower than Any
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves)


def run_traced(fn: Callable[..., Any], user_fn: Callable[..., Any]) -> Any:
    """Call ``fn`` (which traces ``user_fn``), translating tracing failures into TraceErrors."""
    fn_or_wrapper: Any = user_fn
    while fn_or_wrapper is not None:  # anchor user frames, through functools.wraps layers
        target = getattr(fn_or_wrapper, "forward", fn_or_wrapper)
        code = getattr(target, "__code__", None)
        if code is not None and not code.co_filename.startswith(LIBRARY_DIRS):
            anchor_stack_traces(code)
        fn_or_wrapper = getattr(fn_or_wrapper, "__wrapped__", None)
    token = _TRACING.set(True)
    owner = lambda: getattr(user_fn, "__qualname__", repr(user_fn))  # noqa: E731
    try:
        # saved-tensor hooks of the caller (an eager remat/checkpoint around this call) are
        # not for the trace's own autograd
        with (
            TRACE_LOCK,
            tracing_guard(owner) as seeding,
            no_saved_tensor_hooks(),
            contextlib.ExitStack() as contexts,
        ):
            for extension in active():
                if extension.context is not None:
                    contexts.enter_context(extension.context(user_fn))
            result = fn()
        if (
            seeding.call is not None
            and isinstance(result, fx.GraphModule)
            and any(map(is_random, result.graph.nodes))
        ):
            raise seeded_then_drew(owner, seeding)
    except _DATA_DEPENDENT as e:
        raise _data_dependent_error(user_fn, e) from e
    except RuntimeError as e:
        if is_device_mismatch(e):
            raise _device_error(user_fn, e) from e
        if "data is not allocated yet" not in str(e):  # C++ read the data of a fake tensor
            raise
        raise _data_dependent_error(user_fn, e) from e
    finally:
        _TRACING.reset(token)
    return result
