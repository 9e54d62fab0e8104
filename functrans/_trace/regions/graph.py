"""One block's joint graph, traced once, and its copies (see :mod:`functrans._trace.regions`).

:func:`trace_region` traces a block on fresh fake tensors to a :class:`Region`: its joint
graph, split into the forward and backward nodes, with what the backward reads from the
forward. :func:`copy_forward` and :func:`copy_backward` paste a region's nodes into another
graph for one call, with that call's inputs and cotangents, and give each copy fresh fake values
laid onto storages as the region's lie on its own (:class:`Storages`), without running an op.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.utils._mode_utils import no_dispatch

from functrans._core.fake_rules import SymbolicFakeMode
from functrans._core.fakes import fake_empty
from functrans._core.graph import Attachment
from functrans._core.shapes import is_symbolic, shape_env_of

from ..passes import writes_out_of_place
from ..record import inputs_first, late_inputs, no_stack_traces
from ..trace import in_traced_function, view_base

__all__ = [
    "REGIONS",
    "Region",
    "Storages",
    "copy_backward",
    "copy_forward",
    "results_like",
    "trace_region",
]


@dataclass
class Region:
    """One traced block: its joint graph split into forward and backward nodes."""

    gm: fx.GraphModule
    primals: list[fx.Node]  # placeholders of inputs, parameters and buffers, in call order
    tangents: list[fx.Node]  # one per differentiable output
    forward: list[fx.Node]  # call_function nodes the forward ran, in trace order
    backward: list[fx.Node]
    outputs: list[fx.Node]  # the block's output leaves
    # primals and forward values (tensors and sizes) the backward reads: they pass from a
    # call's forward copy to its backward copy in expand(), not through the region ops
    read: list[fx.Node]
    grads: list[tuple[int, fx.Node]]  # (primal position, gradient node)
    differentiable: list[bool]  # per output
    out_spec: pytree.TreeSpec
    # the primal positions the block writes in place (a batch norm's running statistics), in
    # order: the last len(writes) outputs are their final values, which each call writes back
    writes: list[int] = field(default_factory=list)


def _empty_constants_made(gm: fx.GraphModule) -> None:
    """Constants with no elements (``torch.tensor([])``, an empty cache slot's start) made
    by an op instead: they hold no data, and a region takes no constants."""
    for x in list(gm.graph.nodes):
        if x.op != "get_attr":
            continue
        value = getattr(gm, str(x.target), None)
        if not isinstance(value, torch.Tensor) or value.numel() != 0 or "val" not in x.meta:
            continue
        with gm.graph.inserting_before(x):
            made = gm.graph.call_function(
                torch.ops.aten.empty.memory_format,
                (list(value.shape),),
                {"dtype": value.dtype, "device": x.meta["val"].device},
            )
        made.meta.update(x.meta)
        x.replace_all_uses_with(made)
        gm.graph.erase_node(x)
        delattr(gm, str(x.target))
    gm.recompile()


def _fresh(val: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)


def _writes_placeholder(body: list[fx.Node]) -> bool:
    """Whether an op writes to a placeholder or a view of one (in-place ops on the region's
    own intermediates are functionalized with the whole graph)."""
    for x in body:
        target = x.target
        if not isinstance(target, torch._ops.OpOverload) or not target._schema.is_mutable:
            continue
        for i, arg in enumerate(target._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = view_base(x.args[i] if i < len(x.args) else x.kwargs.get(arg.name))
            if not isinstance(value, fx.Node) or value.op == "placeholder":
                return True
    return False


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(a.untyped_storage()._cdata == b.untyped_storage()._cdata)


_FORWARD = "functrans.region_forward"  # on a region's nodes the forward ran


class _NotARegion(Exception):
    """The block returns no tensor to differentiate (or something else than tensors)."""


class _Seen(NamedTuple):
    """What a region's trace learned of the block as it ran it."""

    outputs: int  # flat output leaves
    spec: pytree.TreeSpec
    differentiable: list[bool]  # per output
    forward: set[str]  # names of the nodes the forward made
    grads: list[bool]  # per differentiated input: whether it got a gradient


def trace_region(
    call: Callable[[list[torch.Tensor]], Any], metas: list[torch.Tensor], table: Any
) -> Region | None:
    """The joint graph of ``call`` on fresh fakes like ``metas`` (None: not a region)."""
    # the enclosing trace's shape environment: a symbolic block's sizes are its symbols, and
    # the guards its trace records are the whole trace's
    env = shape_env_of(metas)
    mode = (FakeTensorMode if env is None else SymbolicFakeMode)(
        allow_non_fake_inputs=False, shape_env=env
    )
    # symbolic fakes: the fake-tensor cache's entries cost more than they save (as in
    # ``symbolic_fakes``)
    if env is not None:
        mode.cache_enabled = False
    with mode:
        probe = [_fresh(t).requires_grad_(t.requires_grad) for t in metas]
    wrt = [i for i, t in enumerate(metas) if t.requires_grad]
    if not wrt:
        return None
    n = len(metas)
    seen: list[_Seen] = []

    def joint(*primals: torch.Tensor) -> list[torch.Tensor]:
        with torch.enable_grad():
            leaves, spec = pytree.tree_flatten(call(list(primals)))
            if not leaves or not all(isinstance(t, torch.Tensor) for t in leaves):
                raise _NotARegion
            diff = [bool(t.requires_grad) and t.is_floating_point() for t in leaves]
            if not any(diff):
                raise _NotARegion
            tracer = get_proxy_mode()
            assert tracer is not None
            forward = {node.name for node in tracer.tracer.graph.nodes}
            # contiguous, as most backward formulas make a gradient (and as the region ops
            # hand them in): the copies of the backward are then valid for the cotangents
            # they read, whose layout the forward cannot know. Made once the outputs are
            # known (the block runs once)
            diff_outs = [o for o, d in zip(leaves, diff, strict=True) if d]
            cots = late_inputs(diff_outs)
            with no_stack_traces():  # a backward op has no user line: nothing to record
                grads = torch.autograd.grad(
                    diff_outs, [primals[i] for i in wrt], cots, allow_unused=True
                )
        seen.append(_Seen(len(leaves), spec, diff, forward, [g is not None for g in grads]))
        return [*leaves, *[g for g in grads if g is not None]]

    try:
        gm = make_fx(
            in_traced_function(joint),
            table,
            tracing_mode="fake",
            record_stack_traces=False,  # on inside: in_traced_function
            _allow_non_fake_inputs=True,
        )(*probe)
    except _NotARegion:
        return None
    inputs_first(gm)
    ((n_leaves, spec, diff, forward_names, present),) = seen
    for x in gm.graph.nodes:
        if x.name in forward_names:
            x.meta[_FORWARD] = True
    _empty_constants_made(gm)  # after: the op made takes its constant's phase
    # in-place ops on the region's own buffers (dropout's bernoulli_) made functional once
    # here, not in every copy: the expanded graph then needs no functionalization pass; and
    # writes to its inputs (a batch norm's running statistics) too: their final values are
    # more outputs, which the call writes back (see Region.writes)
    done = writes_out_of_place(gm)
    written: dict[str, fx.Node] = {}
    if done is not None:
        gm, written = done.gm, done.written
    nodes = list(gm.graph.nodes)
    placeholders = [x for x in nodes if x.op == "placeholder"]
    primals, tangents = placeholders[:n], placeholders[n:]
    body = [x for x in nodes if x.op == "call_function"]
    if any(x.op not in ("placeholder", "call_function", "output") for x in nodes):
        return None  # constants baked in (get_attr): traced inline
    if _writes_placeholder(body):  # an input, buffer or parameter written in place
        return None
    ran_forward = {x for x in nodes if x.meta.pop(_FORWARD, False)}  # placeholders too
    fwd = [x for x in body if x in ran_forward]
    bwd = [x for x in body if x not in ran_forward]
    (result,) = [x for x in nodes if x.op == "output"]
    returned = list(result.args[0])
    writes = [i for i, p in enumerate(primals) if p.name in written]
    if any(metas[i].requires_grad or written[primals[i].name] not in ran_forward for i in writes):
        return None  # a differentiated input written, or a write in the backward
    if writes:  # the written values are outputs after the block's own
        new_values = [written[primals[i].name] for i in writes]
        returned = [*returned[:n_leaves], *new_values, *returned[n_leaves:]]
        result.args = (returned,)
        gm.recompile()
        n_leaves += len(writes)
        diff = [*diff, *[False] * len(writes)]
    outputs, grad_nodes = returned[:n_leaves], returned[n_leaves:]
    if any(not isinstance(o, fx.Node) or o.op != "call_function" for o in outputs):
        return None
    if any(g.op != "call_function" or g not in set(bwd) for g in grad_nodes):
        return None
    vals = [o.meta["val"] for o in outputs]
    ins = [p.meta["val"] for p in primals]
    for i, v in enumerate(vals):
        if any(_aliases(v, p) for p in ins) or any(_aliases(v, w) for w in vals[:i]):
            return None
    fwd_set = set(fwd)
    bwd_set = set(bwd)
    read: dict[fx.Node, None] = {}  # ordered
    outside = fwd_set | set(primals)
    for x in bwd:
        read.update((a, None) for a in x.all_input_nodes if a in outside)
    for g in grad_nodes:  # a gradient that is a forward value (or a primal) is not handled
        if g not in bwd_set:
            return None
    grad_of = [i for i, p in zip(wrt, present, strict=False) if p]
    return Region(
        gm=gm,
        primals=primals,
        tangents=tangents,
        forward=fwd,
        backward=bwd,
        outputs=cast(list[fx.Node], outputs),
        read=list(read),
        grads=list(zip(grad_of, grad_nodes, strict=False)),
        differentiable=diff,
        out_spec=spec,
        writes=writes,
    )


class Storages:
    """Values laid onto new storages: each old storage gets one new storage (or a given one,
    :meth:`bind`), and each value lies on it as the old value lay on its own. This is how a
    region's copy gets fresh fake values without running its ops (an ATen call on fake
    tensors costs about 8x building the fake directly).

    With ``keep_symbolic``, a value with symbolic sizes, strides or offset keeps its storage
    instead: :meth:`fresh` gives a new fake tensor of the same metadata on the old storage,
    :meth:`moved` the value itself. Laying a symbolic value onto another storage recomputes
    its contiguity and bounds in sympy (about 0.3 ms a value: a fifth of a symbolic GPT
    compile went to it), and a graph's passes find aliasing from its view ops, never from its
    values' fake storages (a graph read back from disk has a storage per value too); what
    reads fake storages (a Triton view's fast path) falls back when they differ."""

    def __init__(self, mode: FakeTensorMode, *, keep_symbolic: bool = False) -> None:
        self.mode = mode
        self.keep_symbolic = keep_symbolic
        self.by_storage: dict[int, torch.Tensor] = {}  # old storages, by identity

    def bind(self, old: Any, new: Any) -> None:
        """The old value ``old`` is ``new`` here (a region's primal and the call's argument)."""
        if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
            self.by_storage.setdefault(old.untyped_storage()._cdata, new)

    def fresh(self, val: Any) -> Any:
        """A value like ``val`` on the new storages (non-tensors are shared)."""
        return self._lay(val, fresh=True)

    def moved(self, val: Any) -> Any:
        """``val`` laid onto the new storage of its storage, where it has one; else itself."""
        return self._lay(val, fresh=False)

    def _lay(self, val: Any, fresh: bool) -> Any:
        if isinstance(val, (list, tuple)):
            return type(val)(self._lay(v, fresh) for v in val)
        if not isinstance(val, FakeTensor):
            return val
        if self.keep_symbolic and _symbolic_layout(val):
            return _same_storage(val, self.mode) if fresh else val
        key = val.untyped_storage()._cdata
        base = self.by_storage.get(key)
        if base is None and not fresh:
            return val
        # sizes, strides and offset may be symbolic: set_ on a meta tensor takes them, and
        # skips the fake mode's dispatch (half the cost of an as_strided through it)
        offset, nbytes = val.storage_offset(), val.untyped_storage().nbytes()
        out = fake_empty(
            self.mode,
            val.shape,
            val.stride(),
            val.dtype,
            val.device,
            offset=offset,
            storage=base,
            nbytes=nbytes,
        )
        if base is None:
            self.by_storage[key] = out
        return out


def _symbolic_layout(val: torch.Tensor) -> bool:
    """Whether a tensor's sizes, strides or storage offset are symbolic."""
    return is_symbolic(val) or isinstance(val.storage_offset(), torch.SymInt)


def _same_storage(val: FakeTensor, mode: FakeTensorMode) -> FakeTensor:
    """A new fake tensor of ``mode`` with ``val``'s metadata, on ``val``'s storage: the meta
    tensor's shallow copy keeps its computed symbolic metadata (about 11 us)."""
    with no_dispatch():
        meta = torch.Tensor.detach(val)
    return FakeTensor(mode, meta, val.device)


def results_like(vals: Sequence[Any], inputs: Sequence[torch.Tensor]) -> list[Any]:
    """The fake results of an opaque functional op (a region call) that returns values like
    ``vals``: in its inputs' fake mode, each on a storage of its own (such an op's results
    alias neither its inputs nor each other), built directly."""
    mode = cast(FakeTensor, inputs[0]).fake_mode
    return [Storages(mode).fresh(v) for v in vals]


def _paste(
    graph: fx.Graph, nodes: list[fx.Node], local: dict[fx.Node, Any], mode: FakeTensorMode
) -> None:
    """Copy ``nodes`` (a region's) into ``graph``: fresh names, and fresh fake values laid
    onto storages as the region's lie on its own (its inputs' storages are the call's)."""
    storages = Storages(mode, keep_symbolic=True)
    for old, new in local.items():
        storages.bind(old.meta.get("val"), new.meta.get("val"))
    for x in nodes:
        new = graph.node_copy(x, lambda n: local[n])
        new.meta["val"] = storages.fresh(x.meta.get("val"))
        local[x] = new


def copy_forward(
    graph: fx.Graph, region: Region, inputs: list[fx.Node], mode: FakeTensorMode
) -> tuple[list[fx.Node], dict[fx.Node, fx.Node]]:
    """Paste ``region``'s forward for a call with ``inputs``: its outputs, and what the same
    call's backward reads (for :func:`copy_backward`)."""
    local: dict[fx.Node, Any] = dict(zip(region.primals, inputs, strict=True))
    _paste(graph, region.forward, local, mode)
    return [local[x] for x in region.outputs], {x: local[x] for x in region.read}


def copy_backward(
    graph: fx.Graph,
    region: Region,
    carried: dict[fx.Node, fx.Node],
    cotangents: list[fx.Node],
    mode: FakeTensorMode,
) -> list[fx.Node]:
    """Paste ``region``'s backward for one call: ``carried`` is what :func:`copy_forward`
    handed over for it; the gradients, one per entry of ``region.grads``."""
    local: dict[fx.Node, Any] = dict(carried)
    local.update(zip(region.tangents, cotangents, strict=True))
    _paste(graph, region.backward, local, mode)
    return [local[g] for _, g in region.grads]


#: on a joint graph traced with its region ops kept (:func:`functrans._trace.regions.deferred`,
#: ``ft.jit``'s default): the regions those ops call, by key (None: a key whose region was
#: given up); copied with the graph
REGIONS: Attachment[tuple[Region | None, ...]] = Attachment("regions", (), copied=True)
