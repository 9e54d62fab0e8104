"""Recording into a ``make_fx`` trace without dispatching: inputs, late inputs and opaque calls.

make_fx records an op by dispatching it through its modes, which then snapshot and describe
every result (about 0.1 ms a tensor), and records an input by snapshotting it. Where the trace
already knows what a call returns (a region call, :mod:`functrans._trace.regions`) or what an
input is (a fake made for the trace), the nodes are written here directly, as make_fx would
write them; the tests compare both ways graph for graph.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import (
    _ProxyTensor,
    disable_proxy_modes_tracing,
    get_proxy_mode,
    get_proxy_slot,
    set_proxy_slot,
    track_tensor_tree,
)

from functrans._core.errors import TraceError
from functrans._core.shapes import is_symbolic

__all__ = [
    "CallRecorder",
    "call_recorder",
    "inputs_first",
    "inputs_recorded",
    "known_inputs",
    "late_inputs",
    "no_stack_traces",
    "stack_traces",
    "untraced",
]


@contextlib.contextmanager
def no_stack_traces() -> Iterator[None]:
    """Inside a trace: the nodes made meanwhile record no Python stack (0.1 ms a node). For the
    backward's ops, whose stacks hold no user line (torch keeps none of them), and for
    placeholder ops that copies replace."""
    mode = get_proxy_mode()
    tracer = getattr(mode, "tracer", None)
    if tracer is None or not tracer.record_stack_traces:
        yield
        return
    tracer.record_stack_traces = False
    try:
        yield
    finally:
        tracer.record_stack_traces = True


@contextlib.contextmanager
def stack_traces() -> Iterator[None]:
    """Inside a trace: the nodes made meanwhile record the Python stack they come from."""
    tracer = getattr(get_proxy_mode(), "tracer", None)
    if tracer is None or tracer.record_stack_traces or fx.config.do_not_emit_stack_traces:
        yield
        return
    # as make_fx(record_stack_traces=True) sets its tracer up: frames of user code only
    tracer.record_stack_traces = tracer._record_forward_stack_traces_only = True
    try:
        yield
    finally:
        tracer.record_stack_traces = tracer._record_forward_stack_traces_only = False


def untraced() -> contextlib.AbstractContextManager[Any]:
    """Inside a trace: tensor ops run on the fake tensors without being recorded."""
    return disable_proxy_modes_tracing()


def late_inputs(like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Inside a trace (:func:`trace_module`): new inputs of the graph, contiguous tensors
    shaped like ``like``, for values the traced function learns only while it runs (a joint
    graph's tangents are shaped like the outputs: making them here spares running the
    function once more beforehand). The trace puts their placeholders after the others."""
    mode = get_proxy_mode()
    if mode is None:
        raise TraceError("late_inputs() is called inside a trace only")
    tracer = mode.tracer
    with untraced():
        made = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in like]
        proxies = [tracer.create_proxy("placeholder", "late_input", (), {}) for _ in made]
        track_tensor_tree(made, proxies, constant=None, tracer=tracer)
    return made


@dataclass(frozen=True)
class CallRecorder:
    """Records calls of opaque ops whose inputs a trace knows into that trace's graph
    (:func:`call_recorder`)."""

    tracer: Any  # make_fx's tracer
    args: tuple[fx.Node, ...]  # the inputs' nodes

    def record(
        self,
        op: torch._ops.OpOverload,
        statics: tuple[Any, ...],
        results: Sequence[torch.Tensor],
    ) -> list[torch.Tensor]:
        """Record ``op(*statics, list(inputs))`` returning ``results`` (fake tensors the caller
        made) as the op's node and one ``getitem`` node per result, without dispatching the
        op; the results. Needs no dispatch mode: a caller may record with them off."""
        tracer = self.tracer
        graph: fx.Graph = tracer.graph
        node = graph.create_node(
            "call_function", op, (*statics, list(self.args)), {}, op.overloadpacket.__name__
        )
        made = list(results)
        node.meta["val"] = made
        for i, r in enumerate(made):
            item = graph.call_function(operator.getitem, (node, i))
            item.meta["val"] = r
            set_proxy_slot(r, tracer, _ProxyTensor(fx.Proxy(item, tracer), None))
        return made


def call_recorder(tensors: Sequence[torch.Tensor]) -> CallRecorder | None:
    """Inside a trace: what records a call of an opaque op on ``tensors`` whose results the
    caller knows (a region call), without dispatching it. make_fx's dispatch would run the
    op's fake kernel and then snapshot and describe every result, about 1.5 ms for a block's
    forward and as much for its backward's gradients. None outside a trace, for an input the
    trace does not know, or for inputs with symbolic sizes (whose results' sizes make_fx
    tracks too): dispatch the op then."""
    mode = get_proxy_mode()
    if mode is None or any(is_symbolic(t) for t in tensors):
        return None
    tracer = mode.tracer
    args: list[fx.Node] = []
    for t in tensors:
        slot = get_proxy_slot(t, tracer, None)
        if slot is None:
            return None
        args.append(slot.proxy.node)
    return CallRecorder(tracer, tuple(args))


def known_inputs(inputs: Sequence[torch.Tensor]) -> bool:
    """Whether ``inputs`` can be recorded by :func:`inputs_recorded`: at least two, fake
    tensors of one mode (made for the trace, :func:`functrans._core.fakes.trace_as_themselves`),
    with static sizes, leaves of autograd."""
    if len(inputs) < 2 or not all(type(t) is FakeTensor and t.grad_fn is None for t in inputs):
        return False
    mode = cast(FakeTensor, inputs[0]).fake_mode
    return all(cast(FakeTensor, t).fake_mode is mode and not is_symbolic(t) for t in inputs)


def inputs_recorded(body: Callable[..., Any], inputs: Sequence[torch.Tensor]) -> Callable[..., Any]:
    """``body`` for make_fx to trace with only ``inputs[0]`` passed: it records the other
    inputs as placeholders itself and calls ``body(*inputs)``. make_fx snapshots every input
    and describes its metadata twice (``meta["tensor_meta"]``, which no pass here reads), about
    0.1 ms a tensor, most of what a block's dozen parameters cost a trace. Here a placeholder
    is a node whose value is the fake input itself: the trace's fakes are made for it and
    never change (a graph that mutates an input is refused); :func:`trace_module` turns their
    ``requires_grad`` off once traced, as make_fx's snapshots have it. Static sizes only:
    make_fx also tracks a symbolic input's sizes."""
    rest = list(inputs[1:])

    def run(first: torch.Tensor) -> Any:
        mode = get_proxy_mode()
        assert mode is not None, "inputs recorded outside make_fx"
        tracer = mode.tracer
        for i, t in enumerate(rest):
            node = tracer.graph.placeholder(f"input_{i + 1}")
            node.meta["val"] = t
            set_proxy_slot(t, tracer, _ProxyTensor(fx.Proxy(node, tracer), None))
        return body(first, *rest)

    return run


def inputs_first(gm: fx.GraphModule) -> None:
    """Move the placeholders :func:`late_inputs` made to the end of the others (in place)."""
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    for node in list(gm.graph.nodes):
        if node.op == "placeholder" and node > first:
            first.prepend(node)
