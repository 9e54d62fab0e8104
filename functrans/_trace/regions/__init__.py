"""Repeated regions: a block called many times with the same structure is traced once.

A joint trace (forward and backward, :func:`functrans.joint`, what ``ft.jit`` traces for a
training step) spends most of its time running Python, autograd and decompositions op by op;
for a stack of identical blocks it does the same work once per block. Here a block call is
traced once to its own joint graph (its inputs, parameters and buffers as placeholders, its
forward ops before its backward ops) and cached under a structural key; each call of a block
with that key, the first one too, becomes two opaque nodes in the outer trace (one in the
forward, one in the backward, through an autograd Function), which :func:`expand` then
replaces by copies of the cached graph's forward and backward nodes, with that call's inputs
and parameters substituted. The result is the graph unrolled tracing gives: the same ATen ops,
in the same order inside a block, each copy with fresh node names and fresh fake values; CSE,
partitioning and the memory model see the whole step.

The key holds everything the block's trace reads: the module class and forward code, the
``training`` flag and every non-tensor attribute of the block and its submodules that the
trace read (plain values by value, functions by their code and what they close over, other
objects by identity; :mod:`.keys`), the metadata of each input, parameter and buffer (shape,
stride, dtype, device, requires_grad, how they alias), the non-tensor arguments, and the
decomposition table. A block's writes to its buffers (batch norm's running statistics) are
more outputs, written back by each call (:class:`~.graph.Region`), and a key/value cache it
fills is a stand-in in its trace (:mod:`.state`). A block with a forward hook (or any module
hook, global ones included), under autocast, inside a functorch transform, without anything
to differentiate, with outputs that alias its inputs, or that mutates an input, writes a
buffer through a view or changes one of its attributes while traced, is traced inline as
before (a block whose forward changed an attribute gets it back).

Blocks are found in ``nn.ModuleList``, ``nn.Sequential`` and ``nn.ModuleDict`` (a member with
a sibling of the same class; :mod:`.finding`), as plain functions called repeatedly
(:mod:`.functions`) and where :func:`region` marks a function or module. ``ft.jit`` goes further
where it can and cuts and compiles a region once (:mod:`functrans._jit.outline`); the regions
mode ``"unrolled"`` (``FUNCTRANS_REGIONS=unrolled``, or ``ft.jit(..., regions="unrolled")``)
pastes the copies instead, and ``"off"`` traces every block inline (both for A/B comparisons).
All of it is one trace extension, :mod:`.extension`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar, cast

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes

from functrans._core.graph import lazy_module
from functrans._core.logs import log
from functrans._core.stack import ControlFlow

from ..extensions import active
from ..options import options
from ..record import CallRecorder, call_recorder, no_stack_traces
from ..session import Slot
from .graph import (
    Region,
    Storages,
    copy_backward,
    copy_forward,
    results_like,
    trace_region,
)
from .keys import (
    PLAIN,
    Attr,
    Reads,
    SideEffect,
    aliasing,
    matches,
    reading,
    replay,
    tensor_key,
    value_key,
)
from .state import StateCall, Update, index_attribute, state_kind

__all__ = [
    "BACKWARD_OP",
    "FORWARD_OP",
    "Deferred",
    "FunctionCall",
    "SideEffect",
    "Undifferentiable",
    "call_region",
    "deferred",
    "enabled",
    "expand",
    "function_call",
    "mode",
    "session",
    "stats",
]

_T = TypeVar("_T")
_F = TypeVar("_F", bound=Callable[..., Any])

_LIB = torch.library.Library("functrans", "FRAGMENT")  # type: ignore[no-untyped-call]  # torch.library is unannotated
# ``call`` numbers the calls of one trace: expand() finds a backward's forward by it
_LIB.define("region_fwd(int key, int call, Tensor[] inputs) -> Tensor[]")  # type: ignore[no-untyped-call]  # torch.library is unannotated
_LIB.define("region_bwd(int key, int call, Tensor[] inputs) -> Tensor[]")  # type: ignore[no-untyped-call]  # torch.library is unannotated
_FWD = torch.ops.functrans.region_fwd.default
_BWD = torch.ops.functrans.region_bwd.default
FORWARD_OP, BACKWARD_OP = _FWD, _BWD


class _Variant(NamedTuple):
    """One region traced for a key: the attributes its trace read (and their values), the
    block it traced (a block reusing the region replays its reads), and the updates of a
    state object its trace made (the slot from the attribute ``index`` of the calling block,
    where found; :mod:`functrans._trace.regions.state`)."""

    reads: Reads
    attrs: dict[Attr, Any]
    rid: int
    block: torch.nn.Module | None
    updates: tuple[Update, ...] = ()
    index_attr: Attr | None = None


@dataclass
class _Session:
    """The regions of one joint trace."""

    table: Any
    # per key, the regions traced for it and what each trace read
    by_key: dict[Any, list[_Variant]] = field(default_factory=dict)
    regions: list[Region | None] = field(default_factory=list)
    calls: int = 0
    #: per plain function called as a block and its arguments' structure
    #: (:mod:`functrans._trace.regions.functions`), the ops its first, inline call made
    functions: dict[Any, int] = field(default_factory=dict)


@dataclass
class Stats:
    """Process-wide counters: blocks traced as a region, and calls that reused one."""

    traced: int = 0
    reused: int = 0


stats = Stats()
#: the regions of the running joint trace (None: blocks are traced inline)
_SESSION: Slot[_Session | None] = Slot("regions", None)
#: True while a region's own trace runs (a block inside it is traced inline)
_INSIDE: Slot[bool] = Slot("inside a region", False)


def mode() -> str:
    """The running trace's regions mode (:class:`~functrans._trace.options.TraceOptions`, read
    from ``FUNCTRANS_REGIONS`` when its transform was built): ``"compiled"`` (the default:
    ``ft.jit`` cuts and compiles a region once and calls it per block where it can, see
    :mod:`functrans._jit.outline`; regions are traced once everywhere), ``"unrolled"`` (traced
    once, pasted into the step's graph) or ``"off"`` (every block traced inline)."""
    return options().regions


def enabled() -> bool:
    """Whether region reuse is on (regions mode ``"off"`` turns it off)."""
    return mode() != "off"


@dataclass
class Deferred:
    """The regions of a trace whose region ops :func:`expand` left in place, and the module
    each block call ran (by call number: what an eager plan checkpoints)."""

    regions: list[Region | None] = field(default_factory=list)
    blocks: dict[int, torch.nn.Module] = field(default_factory=dict)


_DEFER: Slot[Deferred | None] = Slot("regions deferred", None)


@contextlib.contextmanager
def deferred() -> Iterator[Deferred]:
    """Traces inside keep their region ops (``region_fwd``, ``region_bwd``) unexpanded; the
    regions they call are left in the yielded :class:`Deferred`."""
    held = Deferred()
    with _DEFER.bound(held):
        yield held


class Undifferentiable(ControlFlow):
    """A region's backward ran with grad mode on: the trace differentiates a gradient again
    (``torch.autograd.grad(..., create_graph=True)`` in the traced function, an ``ft.grad``
    of an ``ft.grad``), and a region's backward is one opaque op with no derivative. Raised
    from the region's backward; the joint trace starts again with regions off
    (:func:`session` ``on=False``), every block inline, so the second derivative holds every
    term (MAML's second-order one among them)."""


@contextlib.contextmanager
def session(table: Any, on: bool = True) -> Iterator[None]:
    """Regions are traced and reused while this is entered (one joint trace); ``on=False``:
    every block is traced inline meanwhile, in an enclosing session's trace too."""
    if on and (not enabled() or _SESSION.get() is not None):
        yield
        return
    with _SESSION.bound(_Session(table) if on else None):
        yield


# ---------------------------------------------------------------------------------------------
# The opaque ops: fake kernels give the outputs' metadata; expand() replaces them


def _lookup(key: int) -> Region:
    s = _SESSION.get()
    assert s is not None, "a region op outside its trace"
    r = s.regions[key]
    assert r is not None
    return r


@torch.library.register_fake("functrans::region_fwd")  # type: ignore[untyped-decorator]  # torch's decorator is unannotated
def _fwd_fake(key: int, call: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    r = _lookup(key)
    return results_like([n.meta["val"] for n in r.outputs], inputs)


@torch.library.register_fake("functrans::region_bwd")  # type: ignore[untyped-decorator]  # torch's decorator is unannotated
def _bwd_fake(key: int, call: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    r = _lookup(key)
    return results_like([g.meta["val"] for _, g in r.grads], inputs)


#: how the region call being made is recorded (None: dispatched)
_RECORDER: Slot[CallRecorder | None] = Slot("region call recorder", None)


class _Apply(torch.autograd.Function):
    """One region call: the forward op, and the backward op autograd runs for it."""

    @staticmethod
    def forward(ctx: Any, key: int, call: int, *inputs: torch.Tensor) -> Any:
        r = _lookup(key)
        recorder = _RECORDER.get()
        if recorder is not None:
            made = results_like([n.meta["val"] for n in r.outputs], inputs)
            got = recorder.record(_FWD, (key, call), made)
        else:
            with no_stack_traces():
                got = _FWD(key, call, list(inputs))
        ctx.key, ctx.call = key, call
        ctx.mark_non_differentiable(
            *[o for o, d in zip(got, r.differentiable, strict=False) if not d]
        )
        return tuple(got)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        if torch.is_grad_enabled():  # its backward is differentiated: see Undifferentiable
            raise Undifferentiable
        with _no_torch_functions():
            return _Apply._backward(ctx, *grads)

    @staticmethod
    def _backward(ctx: Any, *grads: torch.Tensor) -> Any:
        r = _lookup(ctx.key)
        # the region's backward was traced with contiguous cotangents: what it gets here is
        # made so (a no-op, and no node, for the usual contiguous gradient)
        cots = [g.contiguous() for g, d in zip(grads, r.differentiable, strict=False) if d]
        recorder = call_recorder(cots)
        if recorder is not None:
            made = results_like([g.meta["val"] for _, g in r.grads], cots)
            got = recorder.record(_BWD, (ctx.key, ctx.call), made)
        else:
            with no_stack_traces():
                got = _BWD(ctx.key, ctx.call, cots)
        out: list[torch.Tensor | None] = [None] * len(r.primals)
        for (i, _), g in zip(r.grads, got, strict=False):
            out[i] = g
        return (None, None, *out)


# ---------------------------------------------------------------------------------------------
# Tracing one region


@contextlib.contextmanager
def _outside_outer_trace() -> Iterator[None]:
    """No dispatch or torch-function modes of the enclosing trace while the block is traced
    on its own (the trace contexts are entered again, fresh, inside)."""
    popped = []
    with _disable_current_modes():
        while torch._C._len_torch_function_stack() > 0:
            popped.append(torch._C._pop_torch_function_stack())
        try:
            with _INSIDE.bound(True), contextlib.ExitStack() as stack:
                for extension in active():
                    if extension.context is not None:
                        stack.enter_context(extension.context(None))
                yield
        finally:
            for mode in reversed(popped):
                torch._C._push_on_torch_function_stack(mode)


# ---------------------------------------------------------------------------------------------
# Calling a region


def _no_torch_functions() -> contextlib.AbstractContextManager[Any]:
    """No torch-function handling (modes, subclasses) meanwhile: a region call is one op of the
    trace, recorded by the dispatch-level tracer; the torch-function modes of the trace (and
    the disk cache's watch of the user's code) would otherwise see each of the few hundred
    metadata reads and internal calls the region op makes, about 4 ms a block."""
    return torch._C.DisableTorchFunction()


def call_region(
    key_parts: Any,
    tensors: list[torch.Tensor],
    call: Callable[[list[torch.Tensor]], Any],
    eager: Callable[[], _T],
    what: str,
    block: tuple[torch.nn.Module, dict[Attr, Any]] | None = None,
    tolerant: bool = False,
    state: StateCall | None = None,
) -> _T | Any:
    """``call(tensors)`` as a region (``eager()`` where it cannot be one). ``block``: the
    module called and its attributes' values (a call reuses a region whose trace read the same
    values; see :mod:`functrans._trace.regions.keys`). ``tolerant``: a block that fails to trace
    on its own (a region nobody asked for) is traced inline, where its error, if any, is the
    user's. ``state``: the state object the block updates (``block`` given too; see
    :mod:`functrans._trace.regions.state`), told which updates to replay."""
    s = _SESSION.get()
    assert s is not None
    with _no_torch_functions():  # metadata reads: no mode needs to see them
        key = (key_parts, tuple(tensor_key(t) for t in tensors), aliasing(tensors), id(s.table))
    attrs = block[1] if block is not None else {}
    variants = s.by_key.setdefault(key, [])
    found = next((v for v in variants if _serves(v, attrs, state, block)), None)
    if found is not None and found.block is not None and block is not None:
        replay(found.reads, found.block, block[0])  # what the step reads of this block
    if found is None:
        rid = len(s.regions)
        found, region = _trace_variant(call, tensors, s.table, rid, attrs, block, tolerant, state)
        variants.append(found)
        s.regions.append(region)
        if region is not None:
            stats.traced += 1
            log("recompiles", f"region {what}", lambda: f"traced once, key #{rid}")
    elif s.regions[found.rid] is not None:
        stats.reused += 1
        log("recompiles", f"region {what}", lambda: f"reused (key #{found.rid})")
    rid = found.rid
    region = s.regions[rid]
    if region is None:
        return eager()
    if state is not None:
        state.chosen = (found.updates, found.index_attr)
    s.calls += 1
    held = _DEFER.get()
    if held is not None and block is not None:
        held.blocks[s.calls] = block[0]
    recorder = call_recorder(tensors)
    # recorded (not dispatched): the call runs with the trace's dispatch modes off, which
    # would otherwise see each of the two dozen device queries autograd makes of its inputs
    # and outputs (0.2 ms a call)
    modes = _disable_current_modes() if recorder is not None else nullcontext()
    with _RECORDER.bound(recorder), _no_torch_functions(), modes:
        outs = _Apply.apply(rid, s.calls, *tensors)  # type: ignore[no-untyped-call]  # autograd.Function.apply is unannotated
    mine = len(outs) - len(region.writes)
    if region.writes:  # what the block wrote in place (running statistics), written back
        with torch.no_grad(), _no_torch_functions():
            for i, value in zip(region.writes, outs[mine:], strict=True):
                tensors[i].copy_(value)
    return pytree.tree_unflatten(list(outs[:mine]), region.out_spec)


def _serves(
    v: _Variant,
    attrs: dict[Attr, Any],
    state: StateCall | None,
    block: tuple[torch.nn.Module, dict[Attr, Any]] | None,
) -> bool:
    """Whether the region of ``v`` may serve a call with ``attrs`` (and ``state``)."""
    if not matches(v.attrs, v.reads, attrs):
        return False
    return state is None or block is None or state.accepts(v.updates, v.index_attr, block[0])


def _trace_variant(
    call: Callable[[list[torch.Tensor]], Any],
    tensors: list[torch.Tensor],
    table: Any,
    rid: int,
    attrs: dict[Attr, Any],
    block: tuple[torch.nn.Module, dict[Attr, Any]] | None,
    tolerant: bool,
    state: StateCall | None,
) -> tuple[_Variant, Region | None]:
    """Trace ``call`` as region ``rid``: the variant that records it, and the region (None:
    the block is traced inline)."""
    reads = Reads()
    region: Region | None = None
    try:
        with _outside_outer_trace(), reading(block[0]) if block else nullcontext() as seen:
            region = trace_region(call, tensors, table)
        reads = seen or reads
    except SideEffect:
        region = None
    except ControlFlow:
        raise
    except Exception:
        if not tolerant:
            raise
        region = None
    traced = block[0] if block is not None else None
    updates = tuple(state.last.updates) if state is not None and state.last is not None else ()
    index = None
    if region is not None and updates and block is not None and state is not None:

        def retrace() -> Region | None:
            with _outside_outer_trace():
                return trace_region(call, tensors, table)

        index = index_attribute(block[0], reads, updates, state, retrace, _graph_text, region)
        if index is not None:  # the slot's index is no part of the key
            reads = dataclasses.replace(reads, attrs=reads.attrs - {index})
    kept = {a: attrs.get(a) for a in reads.attrs}
    variant = _Variant(reads, kept, rid, traced, updates if region is not None else (), index)
    return variant, region


def _graph_text(region: Region) -> str:
    """What a region computes, as text: each node's op, target and arguments (nodes by
    position), and the output's structure."""
    at = {x: i for i, x in enumerate(region.gm.graph.nodes)}
    lines = [
        f"{x.op} {x.target} {fx.map_arg((x.args, x.kwargs), lambda a: at[a])}"
        for x in region.gm.graph.nodes
    ]
    return "\n".join([*lines, str(region.out_spec)])


def _usable(tensors: list[Any]) -> bool:
    """Inputs a region can take: fake tensors of the enclosing trace, something to
    differentiate, grad mode on, no autocast or functorch transform around."""
    if _SESSION.get() is None or _INSIDE.get() or not torch.is_grad_enabled():
        return False
    if any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda")):
        return False
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    if not all(isinstance(t, FakeTensor) and type(t) is FakeTensor for t in tensors):
        return False
    return any(t.requires_grad for t in tensors)


@dataclass(frozen=True)
class FunctionCall:
    """A function's call that may be a region: its tensor arguments, the key of the rest (the
    arguments' pytree and plain values) and their leaves, to call it again with other
    tensors."""

    tensors: list[torch.Tensor]
    statics: Any
    leaves: list[Any]

    def rebuild(self, flat: list[torch.Tensor]) -> tuple[Any, Any]:
        """``(args, kwargs)`` with ``flat`` in the tensors' places."""
        return _rebuild(self.leaves, self.statics, flat)


def function_call(args: Any, kwargs: Any) -> FunctionCall | None:
    """The call of a function with ``args`` and ``kwargs`` as a possible region; None where it
    runs as written: outside a trace's regions, inside a region, with an argument neither a
    tensor nor a plain value, or with tensors no region takes (:func:`_usable`)."""
    if _SESSION.get() is None or _INSIDE.get():
        return None
    split = _split_args(args, kwargs)
    if split is None:
        return None
    tensors, statics, leaves = split
    return FunctionCall(tensors, statics, leaves) if _usable(tensors) else None


def _split_args(
    args: Any, kwargs: Any, states: list[StateCall] | None = None
) -> tuple[list[torch.Tensor], Any, Any] | None:
    """Tensor leaves of ``(args, kwargs)``, the key of the rest, and the spec (None: a leaf
    that is neither a tensor nor a plain value, nor, where ``states`` collects them, a state
    object a stand-in answers for: at most one)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    statics: list[Any] = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            statics.append(None)
        elif isinstance(leaf, PLAIN):
            statics.append(value_key(leaf))
        elif states is not None and not states and (kind := state_kind(leaf)) is not None:
            states.append(StateCall(kind, leaf, i))
            statics.append(("state", type(leaf)))
        else:
            return None
    return [x for x in leaves if isinstance(x, torch.Tensor)], (spec, tuple(statics)), leaves


def _rebuild(leaves: list[Any], spec: Any, tensors: list[torch.Tensor]) -> tuple[Any, Any]:
    it = iter(tensors)
    filled = [next(it) if isinstance(x, torch.Tensor) else x for x in leaves]
    args, kwargs = pytree.tree_unflatten(filled, spec[0])
    return args, kwargs


# ---------------------------------------------------------------------------------------------
# Expansion: opaque region nodes -> copies of the region's nodes


def expand(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with every region call replaced by copies of its region's nodes (``gm`` is
    returned as it is where it holds none; else a new GraphModule)."""
    s = _SESSION.get()
    if s is None or not any(n.target in (_FWD, _BWD) for n in gm.graph.nodes):
        return gm
    held = _DEFER.get()
    if held is not None:
        held.regions = list(s.regions)
        return gm
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    # the region ops' fake outputs -> the copies' values: the ops that read a region's
    # outputs (views among them) are laid onto the copies' storages too
    moved = Storages(_fake_mode(gm), keep_symbolic=True)
    carried: dict[int, dict[fx.Node, fx.Node]] = {}  # per call: what its backward reads
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is _FWD:
            key, call, inputs = node.args
            r = _region(s, key)
            outs, carried[cast(int, call)] = copy_forward(
                graph, r, [env[i] for i in cast(list[fx.Node], inputs)], moved.mode
            )
            env[node] = outs
        elif node.op == "call_function" and node.target is _BWD:
            key, call, cots = node.args
            env[node] = copy_backward(
                graph,
                _region(s, key),
                carried.pop(cast(int, call)),
                [env[c] for c in cast(list[fx.Node], cots)],
                moved.mode,
            )
        elif node.op == "call_function" and _region_item(node):
            env[node] = env[node.args[0]][node.args[1]]
            moved.bind(node.meta.get("val"), env[node].meta.get("val"))
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
            if "val" in node.meta:
                env[node].meta["val"] = moved.moved(node.meta["val"])
    return lazy_module(gm, graph)


def _region(s: _Session, key: Any) -> Region:
    r = s.regions[cast(int, key)]
    assert r is not None
    return r


def _region_item(node: fx.Node) -> bool:
    src = node.args[0] if node.args else None
    return (
        node.target is operator.getitem and isinstance(src, fx.Node) and src.target in (_FWD, _BWD)
    )


def _fake_mode(gm: fx.GraphModule) -> FakeTensorMode:
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, FakeTensor):
            return v.fake_mode
    return FakeTensorMode()
