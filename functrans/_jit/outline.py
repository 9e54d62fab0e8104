"""Repeated regions compiled once (``ft.jit``'s default): one block's forward and
backward compiled once and called for every block, instead of pasted into the step's graph.

A stack of identical blocks is traced once (:mod:`functrans._trace.regions`); pasted back
into the step's joint graph block by block (``FUNCTRANS_REGIONS=unrolled``, and what
:func:`functrans.joint` gives), partitioning and code generation would still pay once per
block. Here the step's joint graph keeps one opaque op per block call instead:

1. each region (one per structural key) becomes a joint graph of its own, cut with the
   step's strategy (:func:`cut_region`; a step planned for a peak,
   :mod:`functrans._jit.step_plan`, may cut one region several ways, one per block call), and
   its forward and backward graphs are compiled once by the step's backend
   (:meth:`Outlined.compile`);
2. in the step's joint graph, a block call's ``region_fwd`` becomes ``outlined_fwd(id,
   inputs)``, which returns the block's outputs and the values its backward reads (its
   residuals), and its ``region_bwd`` becomes ``outlined_bwd(id, [*residuals,
   *cotangents])`` (:func:`outline`); inputs the backward reads are passed in as themselves;
3. the step is then partitioned as usual: the outlined forward is a compute-intensive op whose
   FLOPs are the region forward's (a strategy saves its residuals rather than rerun the block,
   and a block drawing random numbers is never rerun), and compiled as usual: the ops run the
   region's compiled graphs. The ``aten`` backend's executors call them with their inputs
   handed over (:data:`functrans.extend.HANDOVER_OPS`), so an input whose last use a call is
   dies inside it; other backends call them through the dispatcher.

Each block runs the same ATen ops as the unrolled step (recomputation inside a block may be
chosen differently, which changes no value; random numbers are drawn in the same order), so
the results are the unrolled step's bit for bit. What the step's plan no longer sees is the
inside of a block: its cut is the region's own (the same in every block), and the memory
simulation counts a block call's outputs and residuals, and its temporaries (with the inputs
handed to it) as the op's scratch, read from the region's graphs simulated alone.

Outlining applies to training steps traced with static shapes under strategies that cut a
block by itself (registered ``local=True``) or state a goal for the step's peak (registered
with a ``peak_goal``, planned by :mod:`functrans._jit.step_plan`); anything else is unrolled
as before.

>>> import torch, functrans as ft
>>> ops = [torch.ops.functrans.outlined_fwd.default, torch.ops.functrans.outlined_bwd.default]
>>> [op.name() for op in ops]
['functrans::outlined_fwd', 'functrans::outlined_bwd']
"""

from __future__ import annotations

import functools
import itertools
import operator
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from functrans._core.backends import Backend
from functrans._core.boxed import Picked, boxed, register_handover
from functrans._core.flop_formulas import register_flops
from functrans._core.format import op_name
from functrans._core.graph import (
    HANDED_OVER,
    MADE_BY,
    PHASE,
    SOURCE,
    Attachment,
    JointGraph,
    Phase,
    Role,
    assign_phases,
    copy_joint,
)
from functrans._core.ops import is_getitem, is_random, register_compute_call
from functrans._core.pytree import flatten
from functrans._cut.cost import flops, storage_of
from functrans._cut.memory import call_scratch
from functrans._cut.offload import Cut
from functrans._cut.partition import Partition, Strategy, apply_cut, partition
from functrans._cut.scratch import CallMemory, register_call_memory
from functrans._trace.passes import InputSpec, canonicalize
from functrans._trace.regions import BACKWARD_OP, FORWARD_OP
from functrans._trace.regions.graph import REGIONS, Region, Storages, results_like

__all__ = ["OUTLINED", "Outlined", "copy_joint", "cut_region", "inner_graph", "outline", "uniform"]

_LIB = torch.library.Library("functrans", "FRAGMENT")  # type: ignore[no-untyped-call]  # torch.library is unannotated
_LIB.define("outlined_fwd(int id, Tensor[] inputs) -> Tensor[]")  # type: ignore[no-untyped-call]  # torch.library is unannotated
# a block that draws random numbers: the tag keeps every strategy from running it again
_LIB.define(  # type: ignore[no-untyped-call]  # torch.library is unannotated
    "outlined_fwd_random(int id, Tensor[] inputs) -> Tensor[]",
    tags=(torch.Tag.nondeterministic_seeded,),
)
_LIB.define("outlined_bwd(int id, Tensor[] inputs) -> Tensor[]")  # type: ignore[no-untyped-call]  # torch.library is unannotated
_OPS = torch.ops.functrans
FORWARD = _OPS.outlined_fwd.default
FORWARD_RANDOM = _OPS.outlined_fwd_random.default
BACKWARD = _OPS.outlined_bwd.default


class Residual(NamedTuple):
    """Where one value the region's backward reads comes from in a call."""

    from_input: bool  # one of the call's inputs (else one of the outlined forward's results)
    position: int  # the input's position, or the result's


@dataclass(frozen=True, eq=False)
class Outlined:
    """One region, cut (and compiled on first use, or by :meth:`compile`): what its two ops
    run."""

    id: int
    partition: Partition
    backend: Backend
    examples: tuple[Any, ...]  # the region's primals (fake): what its forward is compiled for
    kept: tuple[int, ...]  # positions of the forward's results the op returns
    residuals: tuple[Residual, ...]  # the backward's saved inputs, in its order
    returned: tuple[torch.Tensor, ...]  # fake values of the forward op's results
    grads: tuple[torch.Tensor, ...]  # fake values of the backward op's results
    forward_flops: int
    random: bool
    #: per result of the forward op: the op that made it in the block, and its source line
    made_by: tuple[tuple[str, str | None], ...]
    #: what a call holds beyond its inputs and results (the region's graphs simulated on
    #: their own): its temporaries, which the step's simulation cannot see; by (backward,
    #: positions of the inputs it may own), filled as asked
    _memory: dict[tuple[bool, tuple[tuple[int, int], ...]], CallMemory] = field(
        default_factory=dict, repr=False, compare=False
    )

    @functools.cached_property
    def forward(self) -> Callable[[list[Any]], list[Any]]:
        """Boxed: ``[*inputs] -> [*outputs, *saved]``."""
        return boxed(self.backend.compile(self.partition.forward, list(self.examples)))

    @functools.cached_property
    def backward(self) -> Callable[[list[Any]], list[Any]]:
        """Boxed: ``[*saved, *cotangents] -> gradients``."""
        return boxed(self.backend.compile(self.partition.backward, []))

    def compile(self) -> None:
        """Compile both graphs now (a candidate cut a planner discards is never compiled)."""
        _ = self.forward, self.backward

    def call_memory(self, backward: bool, candidates: tuple[tuple[int, int], ...]) -> CallMemory:
        """What a call of the forward or ``backward`` graph holds beyond its results and the
        inputs its caller keeps: the inputs in ``candidates`` (position, bytes of its storage)
        are handed to it and die inside it, except those its graph returns (a residual that
        is an input: the forward op drops it, but it lives until the graph returns)."""
        key = (backward, candidates)
        if key not in self._memory:
            graph = (self.partition.backward if backward else self.partition.forward).fx_graph
            inputs = [n for n in graph.nodes if n.op == "placeholder"]
            returned = set(
                next(n for n in reversed(graph.nodes) if n.op == "output").all_input_nodes
            )
            owned = {i: size for i, size in candidates if inputs[i] not in returned}
            self._memory[key] = CallMemory(call_scratch(graph, owned), frozenset(owned))
        return self._memory[key]

    @property
    def run_forward(self) -> Picked:
        """The forward op's results: ``inputs`` (a list this call empties) through the
        compiled forward, the results the op returns picked out."""
        return Picked(self.forward, self.kept)


#: on an outlined step's joint graph (:func:`outline`): the cut regions its calls run, held
#: as long as the graph lives; copied with the graph
OUTLINED: Attachment[tuple[Outlined, ...]] = Attachment("outlined", (), copied=True)

#: the outlined regions alive in this process, by id (the compiled step's ops name them by id;
#: the step's joint graph, which its entry keeps, holds them: its :data:`OUTLINED`)
_OUTLINED: weakref.WeakValueDictionary[int, Outlined] = weakref.WeakValueDictionary()
_IDS = itertools.count()


def inner_graph(node: torch.fx.Node) -> torch.fx.GraphModule | None:
    """The graph a call of an outlined block runs (its region's compiled forward or
    backward), or None for any other node (or a block no longer alive)."""
    if node.target not in (FORWARD, FORWARD_RANDOM, BACKWARD) or not node.args:
        return None
    outlined = _OUTLINED.get(cast(int, node.args[0]))
    if outlined is None:
        return None
    p = outlined.partition
    return (p.backward if node.target is BACKWARD else p.forward).graph_module


def _run_forward(id: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return _OUTLINED[id].run_forward(list(inputs))


def _run_backward(id: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(_OUTLINED[id].backward(list(inputs)))


def _fake_forward(id: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return results_like(_OUTLINED[id].returned, inputs)


def _fake_backward(id: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return results_like(_OUTLINED[id].grads, inputs)


for _name, _run, _fake in (
    ("outlined_fwd", _run_forward, _fake_forward),
    ("outlined_fwd_random", _run_forward, _fake_forward),
    ("outlined_bwd", _run_backward, _fake_backward),
):
    _LIB.impl(_name, _run, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]  # torch.library is unannotated
    torch.library.register_fake(f"functrans::{_name}", _fake, lib=_LIB)


def _forward_flops(id: int, inputs: Any, out_val: Any = None) -> int:
    """FLOPs of one call of an outlined region's forward (its cut's forward graph)."""
    return _OUTLINED[id].forward_flops


def _scratch(node: fx.Node, candidates: tuple[tuple[int, int], ...]) -> CallMemory:
    o = _OUTLINED[cast(int, node.args[0])]
    return o.call_memory(node.target is BACKWARD, candidates)


def _handover(node: fx.Node) -> Callable[[list[Any]], list[Any]]:
    """The function an executor calls for ``node`` with its inputs handed over (see
    :data:`functrans.extend.HANDOVER_OPS`): the region's compiled graph, run boxed, which frees
    each input after its last use in the block (a block's residuals die in its backward as the
    unrolled step frees them; through the dispatcher they would live until it returns)."""
    o = _OUTLINED[cast(int, node.args[0])]
    return o.backward if node.target is BACKWARD else o.run_forward


def _backward_recompute(node: fx.Node) -> int:
    return _OUTLINED[cast(int, node.args[0])].partition.recompute_flops


for _packet in (_OPS.outlined_fwd, _OPS.outlined_fwd_random):
    register_compute_call(_packet)
    register_flops(_packet, _forward_flops)
for _op in (FORWARD, FORWARD_RANDOM, BACKWARD):
    register_call_memory(
        _op, scratch=_scratch, recompute=_backward_recompute if _op is BACKWARD else None
    )
    register_handover(_op, _handover)


def _region_joint(r: Region) -> JointGraph:
    """The region's own joint graph, as :func:`functrans.joint` would give it."""
    specs = [InputSpec(f"primals_{i + 1}", Role.PRIMAL, f"[{i}]") for i in range(len(r.primals))]
    specs += [
        InputSpec(f"tangents_{i + 1}", Role.TANGENT, f"tangent of output[{i}]")
        for i in range(len(r.tangents))
    ]
    gm = canonicalize(r.gm, specs)
    assign_phases(gm.graph)
    primals = [p.meta["val"] for p in r.primals]
    tangents = [t.meta["val"] for t in r.tangents]
    outs = [o.meta["val"] for o in r.outputs]
    grads = [g.meta["val"] for _, g in r.grads]
    return JointGraph(
        gm,
        flatten(((tuple(primals), tuple(tangents)), {}))[1],
        flatten((outs, grads))[1],
        fn_in=flatten((tuple(primals), {}))[1],
        fn_out=flatten(outs)[1],
        grads_flat=flatten(grads)[1],
        num_outputs=len(outs),
        argnums=(0,),
        differentiable=tuple(r.differentiable),
    )


def cut_region(
    r: Region, strategy: str | Strategy, options: dict[str, Any], backend: Backend
) -> Outlined:
    """Region ``r`` cut with ``strategy`` (compiled by ``backend`` when first run)."""
    jg = _region_joint(r)
    p = _bases_not_views(partition(jg, strategy, **options))
    cut = p.joint  # the graph it cut (random ops made replayable: a copy of jg)
    primals, outputs = cut.primals(), cut.forward_outputs()
    n_out = cut.num_outputs
    kept, residuals = list(range(n_out)), []
    for i, s in enumerate(p.saved):
        if s.node in primals:
            residuals.append(Residual(True, primals.index(s.node)))
        elif s.node in outputs:  # handed out once, as the output
            residuals.append(Residual(False, outputs.index(s.node)))
        else:
            residuals.append(Residual(False, len(kept)))
            kept.append(n_out + i)
    results = [n.meta["val"] for n in p.forward.output_nodes()]
    o = Outlined(
        id=next(_IDS),
        partition=p,
        backend=backend,
        examples=tuple(n.meta["val"] for n in primals),
        kept=tuple(kept),
        residuals=tuple(residuals),
        made_by=tuple(_made_by(p.forward.output_nodes()[i]) for i in kept),
        returned=tuple(results[i] for i in kept),
        grads=tuple(n.meta["val"] for n in p.backward.output_nodes()),
        forward_flops=sum(flops(n) for n in p.forward.ops()),
        random=any(is_random(n) for n in p.forward.ops()),
    )
    _OUTLINED[o.id] = o
    return o


def _bases_not_views(p: Partition) -> Partition:
    """``p`` with each saved view saved as the value it views (an input, an output, another
    saved value or a value of its own), the view redone in the backward. The results of an
    outlined call are tensors of their own to the step's memory simulation: a saved view of a
    parameter (free unrolled) would count as one, and a saved value and its view twice. A
    view keeps its base alive anyway, so saving the base costs nothing more."""
    host = {s.node for s in p.offloaded}
    swaps = {}
    for s in p.saved:
        base = _base(s.node)
        if base is not s.node and s.node not in host:
            swaps[s.node] = base
    if not swaps:
        return p
    saved = [swaps.get(s.node, s.node) for s in p.saved if s.node not in host]
    return apply_cut(p.joint, Cut(tuple(dict.fromkeys(saved)), tuple(host)), p.strategy)


def _base(node: fx.Node) -> fx.Node:
    """The node whose value holds ``node``'s storage (``node`` itself, if it allocates it)."""
    root, index = storage_of(node)
    if index is None:
        return root
    # one output of a multi-output op: its getitem
    return next((u for u in root.users if is_getitem(u) and u.args[1] == index), node)


#: how a step's block calls are cut: ``(region key, call number) -> the region's cut``
CutOf = Callable[[int, int], Outlined]


def uniform(
    jg: JointGraph, strategy: str | Strategy, options: dict[str, Any], backend: Backend
) -> CutOf:
    """Every call of a region cut one way: ``strategy``'s cut of the region."""
    cuts: dict[int, Outlined] = {}

    def cut_of(key: int, call: int) -> Outlined:
        if key not in cuts:
            region = jg.attached(REGIONS)[key]
            assert region is not None, "a region op without its region"
            cuts[key] = cut_region(region, strategy, options, backend)
        return cuts[key]

    return cut_of


def region_calls(jg: JointGraph) -> list[tuple[int, int]]:
    """``(region key, call number)`` of each block call in ``jg``, in forward order."""
    return [
        (cast(int, n.args[0]), cast(int, n.args[1]))
        for n in jg.fx_graph.nodes
        if n.op == "call_function" and n.target is FORWARD_OP
    ]


def outline(jg: JointGraph, cut_of: CutOf, hands_over: bool) -> JointGraph:
    """A copy of ``jg`` (traced with its region ops kept,
    :func:`functrans._trace.regions.deferred`, its regions in ``jg.regions``) with each
    region call turned into calls of its region's cut forward and backward, ``cut_of(key,
    call)`` (see the module docstring); ``hands_over``: the backend's executor runs those
    calls with their inputs handed over. The copy holds the cut regions (:data:`OUTLINED`) as
    long as it lives; ``jg`` is left as it is."""
    jg = copy_joint(jg)
    used: dict[int, Outlined] = {}
    graph = jg.fx_graph
    forward_of: dict[int, tuple[fx.Node, list[fx.Node], Outlined]] = {}  # by call
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (FORWARD_OP, BACKWARD_OP):
            continue
        key, call, args = cast(tuple[int, int, list[fx.Node]], node.args)
        if node.target is FORWARD_OP:
            o = cut_of(key, call)
            used[o.id] = o
            op = FORWARD_RANDOM if o.random else FORWARD
            new = _replace(graph, node, op, (o.id, args), list(o.returned))
            new.meta[HANDED_OVER] = hands_over
            forward_of[call] = (new, args, o)
            continue
        fwd, inputs, o = forward_of.pop(call)
        saved = [
            inputs[r.position] if r.from_input else _result(graph, fwd, r.position)
            for r in o.residuals
        ]
        bwd = _replace(graph, node, BACKWARD, (o.id, [*saved, *args]), list(o.grads))
        bwd.meta[HANDED_OVER] = hands_over
        _say_made_by(fwd, o)
    graph.lint()
    jg.graph_module.recompile()
    jg.attach(OUTLINED, tuple(used.values()))
    return jg


def _replace(
    graph: fx.Graph, node: fx.Node, op: Any, args: tuple[Any, ...], vals: list[torch.Tensor]
) -> fx.Node:
    """A call of ``op`` in ``node``'s place (its users and meta), returning values like
    ``vals``."""
    with graph.inserting_before(node):
        new = graph.call_function(op, args)
    new.meta.update(node.meta)
    # the region op's results keep their values (and their getitems); residuals get fresh ones
    old = cast(list[Any], node.meta["val"])
    storages = Storages(_fake_mode(node))
    out = [*old, *(storages.fresh(v) for v in vals[len(old) :])]
    # a tensor the region returns twice (one gradient of two inputs) is one result: one value
    for i, v in enumerate(vals):
        first = next(j for j in range(i + 1) if vals[j] is v)
        out[i] = out[first]
    new.meta["val"] = out
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    for user in new.users:
        if is_getitem(user) and isinstance(user.args[1], int):
            user.meta["val"] = out[user.args[1]]
    return new


def _result(graph: fx.Graph, fwd: fx.Node, index: int) -> fx.Node:
    """The ``index``-th result of the outlined forward ``fwd`` (a getitem node after it)."""
    for user in fwd.users:
        if is_getitem(user) and user.args[1] == index:
            return user
    with graph.inserting_after(fwd):
        item = graph.call_function(operator.getitem, (fwd, index))
    item.meta["val"] = cast(list[Any], fwd.meta["val"])[index]
    item.meta[PHASE] = Phase.FORWARD
    return item


def _made_by(node: fx.Node) -> tuple[str, str | None]:
    """The op that made ``node`` (``aten.native_layer_norm.default[1]`` for one output of a
    multi-output op) and its source line."""
    said = node.meta.get(MADE_BY)  # where a pass said it (a replayed op's generator state)
    if isinstance(said, str):
        return said, node.meta.get(SOURCE)
    src = node.args[0] if is_getitem(node) else None
    if isinstance(src, fx.Node) and src.op == "call_function":
        return f"{op_name(src.target)}[{node.args[1]}]", node.meta.get(SOURCE)
    return op_name(node.target), node.meta.get(SOURCE)


def _say_made_by(fwd: fx.Node, o: Outlined) -> None:
    """Each result of the outlined forward ``fwd`` says which op of the block made it, and
    where: what a report shows for a saved block output or residual."""
    for user in fwd.users:
        if is_getitem(user):
            op, source = o.made_by[cast(int, user.args[1])]
            user.meta[MADE_BY] = f"{op} (in a block)"
            if source is not None:
                user.meta.setdefault(SOURCE, source)


def _fake_mode(node: fx.Node) -> Any:
    for a in node.all_input_nodes:
        v = a.meta.get("val")
        if isinstance(v, FakeTensor):
            return v.fake_mode
    raise AssertionError("a region op without fake inputs")
