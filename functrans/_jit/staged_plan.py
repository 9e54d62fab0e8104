"""The partition of a step compiled in stages, as its stages run (:mod:`functrans._jit.staged`).

Each stage of a staged step has its own partition; what the user pays is their run together:
the forwards in order, each stage's outputs live until the stages after it are done with
them, then the backwards in reverse order, a stage's output gradient the sum of the user's and
those the later stages give, and each input's gradient the sum over the stages that read it
(as autograd adds them). :func:`stitched` writes that as one forward and one backward graph,
so the step's :class:`~functrans.Partition` (``jit(f).partitions()``, its ``peak_bytes``,
report and timeline) describes what runs, and what ``measure_peak`` measures.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from functrans._core.graph import ROLE, Graph, JointGraph, Role
from functrans._core.pytree import flatten, unflatten
from functrans._cut.partition import Partition, SavedValue
from functrans._cut.split import BackwardGraph

from .staged import Source, Stages

__all__ = ["stitched"]


def stitched(jg: JointGraph, stages: Stages, strategy: str) -> Partition:
    """The partition of ``jg``'s step run as ``stages`` (see the module docstring). Its
    backward takes the tangents of the outputs no later stage reads (``loss.backward()``
    passes none for the others: autograd hands their stage the gradient the later stages
    give; one the user passes too is added to it, a tensor this plan does not count).

    >>> import torch, functrans as ft
    >>> f = ft.jit(lambda x: (h := x.sin(), (h * h).sum())[::-1])
    >>> _ = f(torch.ones(256, requires_grad=True))
    >>> [p.peak_bytes > 0 for p in f.partitions()]
    [True]
    """
    root = torch.nn.Module()
    fwd = fx.Graph()
    values: list[list[fx.Node]] = []
    primals = []
    for node in jg.primals():
        primals.append(fwd.placeholder(node.name))
        primals[-1].meta.update(node.meta)

    def value(s: Source) -> fx.Node:
        return primals[s.at] if s.stage < 0 else values[s.stage][s.at]

    saved: dict[fx.Node, None] = {}  # in order, once each
    stage_saved: list[list[fx.Node]] = []
    for k, stage in enumerate(stages.stages):
        p = _partition(stage)
        n = len(stage.entry.out_meta)
        outs = _copied(fwd, p.forward.fx_graph, [value(s) for s in stage.takes], root, f"s{k}_")
        values.append(outs[:n])
        stage_saved.append(outs[n:])
        saved.update(dict.fromkeys(outs[n:]))
    user = [value(s) for s in stages.gives]
    fwd.output(tuple(user) + tuple(saved))
    out_tree = unflatten(jg.fn_out, [o.meta["val"] for o in user])
    _, out_flat = flatten((out_tree, [v.meta["val"] for v in saved]))
    forward = Graph(fx.GraphModule(root, fwd), jg.fn_in, out_flat)
    backward = _backward(jg, stages, saved, stage_saved, root)
    ps = [_partition(s) for s in stages.stages]
    return Partition(
        joint=jg,
        strategy=strategy,
        forward=forward,
        backward=backward,
        saved=tuple(SavedValue.of(v) for v in saved),
        recomputed=tuple(n for p in ps for n in p.recomputed),
        recompute_flops=sum(p.recompute_flops for p in ps),
    )


def _partition(stage: Any) -> Partition:
    p = stage.entry.partition
    assert p is not None, "a compiled stage has its partition"
    return p  # type: ignore[no-any-return]  # Stage.entry is an Entry: its partition a Partition


def _backward(
    jg: JointGraph,
    stages: Stages,
    saved: dict[fx.Node, None],
    stage_saved: list[list[fx.Node]],
    root: torch.nn.Module,
) -> Graph:
    """The stages' backwards in reverse order, as autograd runs them."""
    bwd = fx.Graph()
    held = {}
    for v in saved:
        held[v] = bwd.placeholder(v.name)
        held[v].meta.update(v.meta)
        held[v].meta[ROLE] = Role.SAVED
    flowing: dict[Source, fx.Node] = {}  # gradients at stage outputs and inputs
    read = {s for stage in stages.stages for s in stage.takes}
    tangents = iter(jg.tangents())
    taken = []
    for o, s in zip(jg.forward_outputs(), stages.gives, strict=True):
        if _takes_tangent(o):  # a user output's tangent, by where it is
            t = next(tangents)
            if s in read:  # its gradient comes from the stages that read it (see stitched)
                continue
            taken.append(t)
            node = bwd.placeholder(t.name)
            node.meta.update(t.meta)
            before = flowing.get(s)
            flowing[s] = node if before is None else _add(bwd, before, node)
    for k in reversed(range(len(stages.stages))):
        stage = stages.stages[k]
        p = _partition(stage)
        ins = [held[v] for v in stage_saved[k]]
        for i, m in enumerate(stage.entry.out_meta):
            if m.takes_tangent:
                g = flowing.get(Source(k, i))
                ins.append(g if g is not None else _zeros(bwd, m.shape, m.dtype, m.device))
        grads = _copied(bwd, p.backward.fx_graph, ins, root, f"b{k}_")
        for g in ins[len(stage_saved[k]) :]:  # autograd holds a node's gradients until it
            if g.op != "placeholder":  # returns (a user's tangent: the whole backward)
                _held(bwd, g)
        for s, g in zip(stage.takes[: stage.entry.num_diff], grads, strict=True):
            if isinstance(g, fx.Node):
                before = flowing.get(s)
                flowing[s] = g if before is None else _add(bwd, before, g)
    num_diff = len(jg.grad_outputs())
    bwd.output(tuple(flowing.get(Source(-1, i)) for i in range(num_diff)))
    vals = (tuple(v.meta["val"] for v in saved), tuple(t.meta["val"] for t in taken))
    _, in_flat = flatten((vals, {}))
    return BackwardGraph(fx.GraphModule(root, bwd), in_flat, jg.grads_flat)


def _takes_tangent(o: Any) -> bool:
    val = o.meta.get("val") if isinstance(o, fx.Node) else None
    return isinstance(val, torch.Tensor) and (val.is_floating_point() or val.is_complex())


def _copied(
    into: fx.Graph, graph: fx.Graph, inputs: list[fx.Node], root: torch.nn.Module, prefix: str
) -> list[Any]:
    """``graph``'s body copied into ``into`` over ``inputs`` (its placeholders' values); its
    outputs. Constants it reads become attributes of ``root`` under ``prefix``."""
    env: dict[fx.Node, Any] = {}
    phs = [n for n in graph.nodes if n.op == "placeholder"]
    env.update(zip(phs, inputs, strict=True))
    owner = graph.owning_module
    for n in graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            returned: Any = n.args[0]  # a graph returns a flat tuple
            return [env[a] if isinstance(a, fx.Node) else a for a in returned]
        if n.op == "get_attr" and owner is not None:
            name = prefix + str(n.target).replace(".", "_")
            setattr(root, name, getattr(owner, str(n.target)))
            env[n] = into.get_attr(name)
            env[n].meta.update(n.meta)
            continue
        env[n] = into.node_copy(n, lambda a: env[a])
    raise AssertionError("a graph has an output node")


def _zeros(graph: fx.Graph, shape: Any, dtype: torch.dtype, device: torch.device) -> fx.Node:
    """The zeros autograd passes for an output no gradient reached."""
    z = graph.call_function(
        torch.ops.aten.zeros.default, (list(shape),), {"dtype": dtype, "device": device}
    )
    z.meta["val"] = torch.empty(shape, dtype=dtype, device="meta")
    return z


def _held(graph: fx.Graph, value: fx.Node) -> None:
    """A use of ``value`` here: the simulation keeps its storage alive until now."""
    use = graph.call_function(torch.ops.aten.alias.default, (value,))
    use.meta.update(value.meta)


def _add(graph: fx.Graph, a: fx.Node, b: fx.Node) -> fx.Node:
    """Two gradients of one value added, as autograd accumulates them."""
    s = graph.call_function(torch.ops.aten.add.Tensor, (a, b))
    s.meta.update(a.meta)
    return s
