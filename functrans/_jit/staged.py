"""Returned intermediates stay on the path of what is computed from them: a step in stages.

Eager autograd records every op, so an intermediate ``h`` that a function returns beside a loss
computed from it is on the loss's path: ``h.retain_grad()`` gets the loss's gradient at ``h``, a
hook on ``h`` sees it (and may change what flows on), ``torch.autograd.grad(loss, h)`` answers.
A compiled step is one autograd node, whose outputs are siblings: none of that would hold. So
a training step with such outputs (:func:`cuts`) is compiled in stages: its ATen forward is cut
in program order after each of them, each stage is traced to its own joint graph, partitioned
with the step's strategy and compiled (:func:`stage_graphs` gives the pieces, the builder the
entries), and a call chains the stages through autograd (:meth:`Stages.run`): a stage's
outputs are inputs of the stages after it, as in eager. Random ops keep their order (the cuts
follow the program), so the numbers drawn are eager's.

The forward computes what the unstaged one does; the backward of a stage starts once autograd
has the gradient of everything computed from its outputs, as eager's does.

>>> import torch, functrans as ft
>>> f = ft.jit(lambda x: (h := x.sin(), (h * h).sum())[::-1])
>>> x = torch.tensor([0.5, 1.0], requires_grad=True)
>>> loss, h = f(x)
>>> torch.autograd.grad(loss, h)[0]  # 2 h, as eager's
tensor([0.9589, 1.6829])
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from functrans._core.dtypes import differentiable
from functrans._core.graph import (
    NO_GRAD,
    PHASE,
    STOPPED,
    JointGraph,
    Phase,
    ancestors,
    argument_nodes,
    copy_joint,
)

from .apply import OVERWRITES, Entry, Twice

__all__ = ["Source", "Stage", "StageGraph", "Stages", "cuts", "stage_graphs"]


@dataclass(frozen=True, slots=True)
class Source:
    """Where a value of a staged step comes from: input ``at`` of the call (``stage`` -1) or
    flat output ``at`` of stage ``stage``."""

    stage: int
    at: int


@dataclass(frozen=True)
class StageGraph:
    """One stage's ATen forward: a graph over its inputs (the differentiated ones first) that
    returns its outputs, and where each input comes from."""

    graph_module: fx.GraphModule
    takes: tuple[Source, ...]
    num_diff: int

    def __call__(self, diff: tuple[torch.Tensor, ...], other: tuple[torch.Tensor, ...]) -> Any:
        """The stage run on its inputs (the function its joint graph is traced from)."""
        return tuple(self.graph_module(*diff, *other))

    def examples(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Tensors shaped like its inputs, to trace it on (the trace runs on fakes of them)."""
        vals = [_like(n.meta["val"]) for n in self.graph_module.graph.find_nodes(op="placeholder")]
        return tuple(vals[: self.num_diff]), tuple(vals[self.num_diff :])


@dataclass(frozen=True)
class Stage:
    """A compiled stage: its entry, where its inputs come from, and its forward graph (what a
    ``create_graph`` backward runs again, eagerly: :class:`~functrans._jit.apply.Twice`;
    None for a first stage that is the whole step, which the step's own function reruns)."""

    entry: Entry
    takes: tuple[Source, ...]
    graph: StageGraph | None = None


@dataclass(frozen=True)
class Stages:
    """A training step compiled in stages (:attr:`Entry.stages`): each stage one autograd node,
    its outputs inputs of later ones; ``gives``: where each flat output of the step is."""

    stages: tuple[Stage, ...]
    gives: tuple[Source, ...]

    def twice(self, make: Callable[[Entry, StageGraph | None], Twice]) -> Stages:
        """These stages, each differentiated again by ``make(entry, graph)``."""
        stages = tuple(
            dataclasses.replace(s, entry=dataclasses.replace(s.entry, twice=make(s.entry, s.graph)))
            for s in self.stages
        )
        return Stages(stages, self.gives)

    def run(
        self, entry: Entry, apply: Callable[..., Any], inputs: Sequence[torch.Tensor]
    ) -> list[Any]:
        """The step's flat outputs: each stage applied (``apply``: ``Apply.apply`` or its
        fast path) to its inputs, in order. The inputs the caller overwrites once the step
        returns (:data:`OVERWRITES`) are told to each stage by its own input positions."""
        hook = OVERWRITES.get()
        written = set(entry.writes)
        if hook is not None:
            written |= hook(entry, inputs)
        values: list[list[Any]] = []

        def value(s: Source) -> Any:
            return inputs[s.at] if s.stage < 0 else values[s.stage][s.at]

        own = [self.gives[i] for i in entry.own_nodes]  # each on a node of its own, as the
        for k, stage in enumerate(self.stages):  # step's are (Entry.own_nodes), before use
            token = OVERWRITES.set(_told(stage, written))
            try:
                values.append(list(apply(stage.entry, *map(value, stage.takes))))
            finally:
                OVERWRITES.reset(token)
            outs = values[-1]
            for s in own:
                if s.stage == k:
                    outs[s.at] = outs[s.at].view_as(outs[s.at])
        return [value(s) for s in self.gives]


def _told(stage: Stage, written: set[int]) -> Callable[[Entry, Sequence[torch.Tensor]], set[int]]:
    """What :data:`OVERWRITES` tells ``stage``: its inputs among the step's ``written``."""
    mine = {j for j, s in enumerate(stage.takes) if s.stage < 0 and s.at in written}
    return lambda _entry, _inputs: mine


def cuts(jg: JointGraph, requires_grad: Sequence[bool]) -> list[fx.Node]:
    """The flat outputs of ``jg``'s forward (those that ``requires_grad``) that another such
    output is computed from, in program order: where a step is cut into stages."""
    outs = jg.forward_outputs()
    wanted = [
        o
        for o, r in zip(outs, requires_grad, strict=True)
        if r and isinstance(o, fx.Node) and o.meta.get(PHASE) is Phase.FORWARD
    ]
    targets = set(wanted)
    found = []
    for o in dict.fromkeys(wanted):
        seen: set[fx.Node] = set()
        todo = list(o.users)
        while todo:
            n = todo.pop()
            if n in seen or n.meta.get(PHASE) is not Phase.FORWARD:
                continue
            if n in targets:
                found.append(o)
                break
            seen.add(n)
            todo.extend(n.users)
    order = {n: i for i, n in enumerate(jg.fx_graph.nodes)}
    return sorted(found, key=order.__getitem__)


@dataclass(frozen=True)
class Cut:
    """A step's forward cut into stages: a graph per stage, where each flat output of the
    step is, and the values of the first stage the later ones read (its graph's outputs)."""

    graphs: list[StageGraph]
    gives: tuple[Source, ...]
    head: tuple[fx.Node, ...]


def stage_graphs(jg: JointGraph, at: Sequence[fx.Node], num_diff: int) -> Cut | None:
    """``jg``'s forward cut after each node of ``at`` (:func:`cuts`); None where a flat output
    is not a traced value."""
    outs = jg.forward_outputs()
    if not all(isinstance(o, fx.Node) for o in outs):
        return None
    primals = {n: i for i, n in enumerate(jg.primals())}
    stage_of: dict[fx.Node, int] = {}
    cut, k = set(at), 0
    used = ancestors(outs, set())  # not the forward values only the backward reads
    forward = [
        n
        for n in jg.fx_graph.nodes
        if n in used and n.op == "call_function" and n.meta.get(PHASE) is Phase.FORWARD
    ]
    for n in forward:
        src = n.args[0] if n.target is operator.getitem else None
        # an item of a multi-output op stays in that op's stage: a stage hands on tensors,
        # not the op's tuple (batch norm's statistics, read after a cut at its output)
        stage_of[n] = stage_of[src] if isinstance(src, fx.Node) and src in stage_of else k
        k += n in cut
    # values that require grad in the forward: computed from a differentiated input, as
    # autograd marks them (a batch norm's saved mean and inverse deviation do not)
    reached = {n for n, i in primals.items() if i < num_diff}
    for n in forward:
        if any(a in reached for a in _differentiated(n)) and _autograd_output(n, reached):
            reached.add(n)
    grad_of = {n for n in reached if differentiable(n.meta.get("val"))}
    needed = {o for o in outs if o in stage_of}
    for n in forward:
        needed.update(a for a in n.all_input_nodes if a in stage_of and stage_of[a] < stage_of[n])
    exports: list[list[fx.Node]] = [[] for _ in range(k + 1)]
    for n in forward:
        if n in needed:
            exports[stage_of[n]].append(n)
    where: dict[fx.Node, Source] = {n: Source(-1, i) for n, i in primals.items()}
    graphs = []
    for s in range(k + 1):
        nodes = [n for n in forward if stage_of[n] == s]
        graphs.append(_stage(jg, nodes, exports[s], where, grad_of, stage_of))
        where.update((n, Source(s, j)) for j, n in enumerate(exports[s]))
    return Cut(graphs, tuple(where[o] for o in outs), tuple(exports[0]))


def _stopped(n: fx.Node, i: int) -> bool:
    """Whether autograd did not differentiate ``n`` in its ``i``-th argument (in the order of
    :func:`~functrans._core.graph.argument_nodes`): ``n`` ran under ``no_grad`` (or is a
    detach), or that argument came through a detach."""
    return bool(n.meta.get(NO_GRAD)) or i in n.meta.get(STOPPED, ())


def _differentiated(n: fx.Node) -> list[fx.Node]:
    """The arguments of ``n`` autograd differentiated ``n`` in."""
    return [a for i, a in enumerate(argument_nodes(n)) if not _stopped(n, i)]


#: per op, output index and which inputs require grad: whether that output does
_DIFFERENTIABLE_OUTPUT: dict[tuple[Any, int, tuple[bool, ...]], bool] = {}


def _autograd_output(n: fx.Node, reached: set[fx.Node]) -> bool:
    """Whether autograd makes ``n`` (a forward value computed from the values ``reached``,
    which require grad) require grad: False for an output an op declares not differentiable
    (the saved mean and inverse deviation of ``_native_batch_norm_legit_functional``), which
    eager's autograd never differentiates through, and which a stage must not take as a
    differentiated input (no op has a derivative in them). Found by running the op once on
    its fake values, those ``reached`` requiring grad."""
    if n.target is not operator.getitem:
        return True
    src, index = n.args
    if not (isinstance(src, fx.Node) and isinstance(src.target, torch._ops.OpOverload)):
        return True
    assert isinstance(index, int)
    wants = tuple(a in reached for a in src.all_input_nodes)
    key = (src.target, index, wants)
    if key not in _DIFFERENTIABLE_OUTPUT:
        _DIFFERENTIABLE_OUTPUT[key] = _probe(src, index, reached)
    return _DIFFERENTIABLE_OUTPUT[key]


def _probe(src: fx.Node, index: int, reached: set[fx.Node]) -> bool:
    op = src.target
    assert isinstance(op, torch._ops.OpOverload)
    vals = [a.meta.get("val") for a in src.all_input_nodes]
    mode = next((v.fake_mode for v in vals if isinstance(v, FakeTensor)), None)
    if mode is None:
        return True

    def leaf(a: Any) -> Any:
        v = a.meta.get("val") if isinstance(a, fx.Node) else a
        if not isinstance(v, torch.Tensor):
            return v
        v = v.detach().clone()
        return v.requires_grad_() if a in reached and differentiable(v) else v

    try:
        with mode, torch.enable_grad():
            args, kwargs = fx.node.map_aggregate((src.args, src.kwargs), leaf)
            out = op(*args, **kwargs)
    except Exception:  # a probe that cannot run changes nothing
        return True
    value = out[index] if isinstance(out, tuple | list) else None
    return not isinstance(value, torch.Tensor) or value.requires_grad


@dataclass(frozen=True)
class Headed:
    """A cut whose first stage is the step's own joint graph, with no gradient taken from the
    outputs later stages give (:func:`headed`)."""

    joint: JointGraph
    later: tuple[StageGraph, ...]
    gives: tuple[Source, ...]


def headed(jg: JointGraph, cut: Cut) -> Headed | None:
    """``cut`` with its first stage the whole step's joint graph (so its repeated regions stay
    compiled once) whose backward takes no gradient from the outputs later stages give
    (:func:`without_tangents`), the later stages reading the first one's values from the
    step's outputs; None where one they read is not an output of the step, or where a later
    stage holds a region."""
    outs = jg.forward_outputs()
    index: dict[fx.Node, int] = {}
    for i, o in enumerate(outs):
        index.setdefault(o, i)
    if not all(v in index for v in cut.head) or any(map(_holds_regions, cut.graphs[1:])):
        return None

    def rewired(s: Source) -> Source:
        return Source(0, index[cut.head[s.at]]) if s.stage == 0 else s

    later = tuple(
        StageGraph(g.graph_module, tuple(map(rewired, g.takes)), g.num_diff) for g in cut.graphs[1:]
    )
    gives = tuple(Source(0, i) if s.stage == 0 else s for i, s in enumerate(cut.gives))
    tangent_of = [i for i, v in enumerate(outs) if differentiable(v.meta.get("val"))]
    dead = [t for t, i in enumerate(tangent_of) if gives[i].stage != 0]
    head = without_tangents(jg, dead)
    _hollow(head, [i for i, s in enumerate(gives) if s.stage != 0])
    return Headed(head, later, gives)


def _hollow(jg: JointGraph, at: Sequence[int]) -> None:
    """Make ``jg``'s forward outputs ``at`` (what later stages give) uninitialized tensors of
    their type, so that the first stage does not compute them: they are not read, and the
    random numbers a later stage draws are drawn there only."""
    graph = jg.fx_graph
    out = graph.output_node()
    returned: Any = out.args[0]
    flat = list(returned)
    for i in at:
        val = flat[i].meta["val"]
        with graph.inserting_before(out):
            empty = graph.call_function(
                torch.ops.aten.empty_strided.default,
                (list(val.shape), list(val.stride())),
                {"dtype": val.dtype, "device": val.device},
            )
        empty.meta.update(val=val, **{PHASE: Phase.FORWARD})
        flat[i] = empty
    out.args = (type(returned)(flat), *out.args[1:])
    graph.eliminate_dead_code()
    jg.graph_module.recompile()


def _holds_regions(g: StageGraph) -> bool:
    """Whether a stage calls a region (functrans' own ops): its graph cannot be traced again."""
    return any(
        getattr(n.target, "namespace", None) == "functrans"
        for n in g.graph_module.graph.nodes
        if n.op == "call_function"
    )


_ADD = torch.ops.aten.add.Tensor
_SUB = torch.ops.aten.sub.Tensor


def without_tangents(jg: JointGraph, dead: Sequence[int]) -> JointGraph:
    """A copy of ``jg`` whose backward takes no gradient from the tangents ``dead`` (indices
    into :meth:`~functrans._core.graph.JointGraph.tangents`): they are zero, and so is every
    backward value computed from no other tangent (a backward is linear in its tangents), so
    those nodes go; a sum with one such term is its other term, and another op reading one
    reads zeros made in the backward. The forward and the signature are unchanged.

    >>> import torch, functrans as ft
    >>> jg = ft.joint(lambda x: (x.sin(), x.sin().sum() * 3))(torch.ones(2))
    >>> g = without_tangents(jg, [1])
    >>> g((torch.zeros(2),), (torch.ones(2), torch.tensor(1.0)))[1]  # cos(0), not cos(0) + 3
    (tensor([1., 1.]),)
    """
    copy = copy_joint(jg)
    graph = copy.fx_graph
    tangents = copy.tangents()
    zero = {tangents[i] for i in dead}
    if not zero:
        return copy
    some = tangents[dead[0]]
    reached = set(tangents)
    for n in list(graph.nodes):
        ins = [a for a in n.all_input_nodes if a in reached]
        if not ins:
            continue
        zs = [a for a in ins if a in zero]
        if n.op == "output":
            for z in dict.fromkeys(zs):
                n.replace_input_with(z, _zeros(graph, n, z, some))
            continue
        reached.add(n)
        if len(zs) == len(ins):
            zero.add(n)
        elif zs:
            other = _sum_term(n, zero)
            if other is not None:
                n.replace_all_uses_with(other)
            else:
                for z in dict.fromkeys(zs):
                    n.replace_input_with(z, _zeros(graph, n, z, some))
    graph.eliminate_dead_code()
    copy.graph_module.recompile()
    return copy


def _sum_term(n: fx.Node, zero: set[fx.Node]) -> fx.Node | None:
    """The term ``n`` equals where it adds a zero (or subtracts one) of its own type."""
    if n.target not in (_ADD, _SUB) or n.kwargs or len(n.args) != 2:
        return None
    a, b = n.args
    keep = a if b in zero else b if n.target is _ADD and a in zero else None
    if not isinstance(keep, fx.Node):
        return None
    mine, its = n.meta.get("val"), keep.meta.get("val")
    if not isinstance(mine, torch.Tensor) or not isinstance(its, torch.Tensor):
        return None
    same = mine.shape == its.shape and mine.dtype == its.dtype and mine.stride() == its.stride()
    return keep if same else None


def _zeros(graph: fx.Graph, before: fx.Node, like: fx.Node, tangent: fx.Node) -> fx.Node:
    """Zeros shaped like ``like``'s value, made in the backward (from ``tangent``, so that
    they are allocated there, not saved from the forward)."""
    val = like.meta["val"]
    with graph.inserting_before(before):
        z = graph.call_function(
            torch.ops.aten.new_zeros.default,
            (tangent, list(val.shape)),
            {"dtype": val.dtype, "device": val.device},
        )
    z.meta.update(like.meta)
    z.meta[PHASE] = Phase.BACKWARD
    return z


def _stage(
    jg: JointGraph,
    nodes: list[fx.Node],
    exports: list[fx.Node],
    where: dict[fx.Node, Source],
    grad_of: set[fx.Node],
    stage_of: dict[fx.Node, int],
) -> StageGraph:
    """One stage's graph: ``nodes`` over the values from earlier stages and the inputs they
    read (those that require grad first), returning ``exports``."""
    mine = set(nodes)
    inputs = list(
        dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in mine and a in where)
    )
    inputs = [a for a in inputs if a in grad_of] + [a for a in inputs if a not in grad_of]
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = g.placeholder(a.name)
        env[a].meta.update(a.meta)
    for n in nodes:
        env[n] = g.node_copy(n, _reading(g, n, env))
    g.output(tuple(env[n] for n in exports))
    gm = fx.GraphModule(jg.graph_module, g)
    num_diff = sum(a in grad_of for a in inputs)
    return StageGraph(gm, tuple(where[a] for a in inputs), num_diff)


def _reading(g: fx.Graph, n: fx.Node, env: dict[fx.Node, fx.Node]) -> Callable[[fx.Node], fx.Node]:
    """How ``n``'s copy in a stage reads each argument, in order (``node_copy`` maps them in
    the order of :func:`~functrans._core.graph.argument_nodes`): its value in the stage,
    detached where autograd did not differentiate ``n`` in it (:func:`_stopped`), so that
    the stage's own joint graph stops there as eager's autograd did."""
    position = itertools.count()

    def read(a: fx.Node) -> fx.Node:
        value = env[a] if a in env else _outside(g, a, env)
        if not _stopped(n, next(position)) or not differentiable(a.meta.get("val")):
            return value
        detached = g.call_function(torch.ops.aten.detach.default, (value,))
        detached.meta["val"] = a.meta.get("val")
        return detached

    return read


def _outside(g: fx.Graph, a: fx.Node, env: dict[fx.Node, fx.Node]) -> fx.Node:
    """A constant a stage reads (a ``get_attr`` of the step's graph), copied into it."""
    if a.op != "get_attr":
        raise AssertionError(f"stage reads {a.op} {a.name} from outside its inputs")
    env[a] = g.node_copy(a)
    return env[a]


def _like(val: Any) -> torch.Tensor:
    """A zero tensor with ``val``'s sizes, strides, dtype and device."""
    t = torch.empty_strided(val.size(), val.stride(), dtype=val.dtype, device=val.device)
    return t.zero_()
