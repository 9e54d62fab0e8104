"""``split(joint, saved)``: the one place that cuts a joint graph into forward and backward.

Any valid set of forward values to save yields a forward graph ``(primals) -> (outputs, saved)``
and a backward graph ``(saved, tangents) -> grads``. Whatever backward needs that is neither
saved nor a tangent is re-emitted inside backward from the saved values. Strategies only choose
the saved set; this function does all graph surgery, so one property test covers them all.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from functrans._core.errors import InvalidArgumentError, InvalidPartitionError
from functrans._core.graph import (
    PHASE,
    RECOMPUTED,
    ROLE,
    Graph,
    JointGraph,
    Phase,
    Role,
    ancestors,
    check_tensors,
)
from functrans._core.ops import is_getitem
from functrans._core.pytree import check_matches, flatten, unflatten
from functrans._core.validate import check_joint, check_saved

from .problem import cut_problem
from .recompute_forms import RecomputeForm, recompute_form

__all__ = ["BackwardGraph", "Split", "ancestors", "resolve_nodes", "split"]

_VALUE_OPS = ("call_function", "get_attr")


class BackwardGraph(Graph):
    """A backward graph ``(saved, tangents) -> grads`` that consumes its saved values.

    ``saved`` is what the forward graph returned beside the outputs, a list. Called with that
    list, the backward empties it and frees each saved value after its last use, as eager
    autograd frees a node's saved tensors once the node ran and as ``jit`` runs it, so that
    :attr:`~functrans.Partition.peak_bytes` is what a profiler measures. Pass a tuple (or
    ``list(saved)``, a copy) to keep the values for another backward.

    >>> import torch, functrans as ft
    >>> p = ft.partition(ft.joint(lambda x: x.exp().sum())(torch.ones(3)), "default")
    >>> out, saved = p.forward(torch.zeros(3))
    >>> p.backward(tuple(saved), (torch.tensor(1.0),))  # saved kept
    (tensor([1., 1., 1.]),)
    >>> p.backward(saved, (torch.tensor(1.0),)), saved  # saved consumed
    ((tensor([1., 1., 1.]),), [])
    """

    _boxed: fx.GraphModule | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        saved = args[0] if len(args) == 2 and not kwargs else None
        if not isinstance(saved, list):
            return super().__call__(*args, **kwargs)
        if not saved and self._num_saved():
            raise InvalidArgumentError(
                f"backward: saved is an empty list where the forward saved {self._num_saved()} "
                "values: an earlier backward call consumed it (a backward empties the list it "
                "is given, freeing each value after its last use); pass tuple(saved) or "
                "list(saved) to run backward more than once"
            )
        tensors = check_matches(self.in_flat, ((tuple(saved), args[1]), {}), "BackwardGraph")
        saved.clear()
        tensors = check_tensors(self.placeholders(), tensors)
        return unflatten(self.out_flat, self._run_boxed(tensors))

    def _num_saved(self) -> int:
        return sum(n.meta.get(ROLE) is Role.SAVED for n in self.placeholders())

    def _run_boxed(self, tensors: list[Any]) -> list[Any]:
        if self._boxed is None:
            from torch.fx.graph import _BoxedCodeGen

            graph = fx.Graph()
            graph.output(graph.graph_copy(self.fx_graph, {}))
            graph.set_codegen(_BoxedCodeGen())
            self._boxed = fx.GraphModule(self.graph_module, graph)
        return list(self._boxed(tensors))


@dataclass(frozen=True)
class Split:
    """The result of :func:`split`."""

    forward: Graph
    backward: Graph
    saved: tuple[fx.Node, ...]  # joint-graph nodes handed from forward to backward, in order
    recomputed: tuple[fx.Node, ...]  # joint-graph nodes computed in forward AND again in backward


def resolve_nodes(joint: JointGraph, saved: Iterable[str | fx.Node]) -> set[fx.Node]:
    """Map names or nodes to the joint graph's nodes, rejecting anything that cannot be saved."""
    by_name = {n.name: n for n in joint.fx_graph.nodes}
    out: set[fx.Node] = set()
    for item in saved:
        name = item.name if isinstance(item, fx.Node) else item
        node = by_name.get(name)
        if node is None or (isinstance(item, fx.Node) and node is not item):
            raise InvalidPartitionError(f"saved value {name!r} is not a node of this joint graph")
        if node.op == "output":
            raise InvalidPartitionError("the output node cannot be saved")
        if node.meta.get(PHASE) is not Phase.FORWARD:
            raise InvalidPartitionError(
                f"cannot save {name!r}: it depends on a tangent ({_tangent_path(node)}), so it "
                "does not exist when the forward pass ends. Only FORWARD-phase values can be saved."
            )
        out.add(node)
    return out


def _tangent_path(node: fx.Node) -> str:
    chain = [node.name]
    while node.meta.get(ROLE) is not Role.TANGENT:
        node = next(a for a in node.all_input_nodes if a.meta.get(PHASE) is Phase.BACKWARD)
        chain.append(node.name)
    return " <- ".join(chain)


def split(joint: JointGraph, saved: Iterable[str | fx.Node]) -> Split:
    """Cut ``joint`` into forward and backward graphs that pass exactly ``saved`` between them.

    ``saved`` holds FORWARD-phase nodes (or their names). Primal inputs that backward needs to
    recompute something are added to the saved set (they are inputs: saving them is free).
    Random ops are never silently recomputed: if backward would have to re-run a random op the
    forward already ran, :class:`InvalidPartitionError` asks to save its output instead.

    >>> import torch, functrans as ft
    >>> jg = ft.joint(lambda x: x.sin().sum())(torch.ones(3))
    >>> s = ft.split(jg, saved=["primals_1"])
    >>> [n.name for n in s.saved], [n.name for n in s.recomputed]
    (['primals_1'], [])
    """
    check_joint("split", joint)
    check_saved("split", saved)
    chosen = _unpack_tuples(resolve_nodes(joint, saved))
    tangents = set(joint.tangents())
    bwd, forms = _needed_in_backward(joint, chosen | tangents)
    chosen |= {n for n in bwd if n.op == "placeholder" and n.meta.get(ROLE) is Role.PRIMAL}
    bwd_inputs = [n for n in joint.fx_graph.nodes if n in chosen and n in bwd]
    fwd = ancestors(list(joint.forward_outputs()) + bwd_inputs, set())
    recomputed = [n for n in joint.fx_graph.nodes if n in bwd and n in fwd and n not in chosen]
    recomputed = [n for n in recomputed if n.op != "placeholder"]
    _check_rules(joint, bwd_inputs, recomputed)
    forward = _forward_graph(joint, fwd, bwd_inputs)
    backward = _backward_graph(joint, bwd, bwd_inputs, set(recomputed), forms)
    return Split(forward, backward, tuple(bwd_inputs), tuple(recomputed))


def _needed_in_backward(
    joint: JointGraph, stop: set[fx.Node]
) -> tuple[set[fx.Node], dict[fx.Node, RecomputeForm]]:
    """What the backward reads or recomputes, walking a recomputed op's cheaper form
    (:mod:`functrans._cut.recompute_forms`) where it has one, and those forms. A form that
    turns out not to give a result the backward reads is dropped, and the walk redone."""
    written: set[fx.Node] = set()  # nodes re-run as written, whatever their form

    def form_of(node: fx.Node) -> RecomputeForm | None:
        if node in written or node.meta.get(PHASE) is not Phase.FORWARD:
            return None
        return recompute_form(node, ())

    def inputs(node: fx.Node) -> list[fx.Node]:
        form = form_of(node)
        if form is None:
            return node.all_input_nodes
        return form.inputs(node)

    while True:
        bwd = ancestors(joint.grad_outputs(), stop, inputs)
        walked = [n for n in bwd if n not in stop and form_of(n) is not None]
        dropped = {n for n in walked if recompute_form(n, bwd) is None}
        if not dropped:
            return bwd, {n: f for n in walked if (f := form_of(n)) is not None}
        written |= dropped


def _unpack_tuples(nodes: set[fx.Node]) -> set[fx.Node]:
    """Saving a multi-output op (e.g. ``native_layer_norm``) means saving its tensor parts."""
    out: set[fx.Node] = set()
    for n in nodes:
        if isinstance(n.meta.get("val"), (tuple, list)):
            out |= {u for u in n.users if is_getitem(u)}
        else:
            out.add(n)
    return out


def _check_rules(joint: JointGraph, saved: list[fx.Node], recomputed: list[fx.Node]) -> None:
    """The shared save/recompute rules (:class:`~functrans.extend.CutProblem`): e.g. a random op
    re-run in backward would draw different numbers than forward did."""
    broken = cut_problem(joint).violations(saved, recomputed)
    if broken:
        raise InvalidPartitionError(f"this saved set {broken[0]}")


def just_in_time(body: list[fx.Node]) -> list[fx.Node]:
    """Order backward so forward-phase work (recomputation) runs right before its first use.

    Backward-phase nodes keep their joint order (the order autograd produced them); each pulls
    in, depth-first, the forward-phase values it needs that are not yet computed. Recomputing
    everything up front instead would keep all of it alive at once and raise peak memory.
    """
    members = set(body)
    done: set[fx.Node] = set()
    order: list[fx.Node] = []

    def pull(node: fx.Node) -> None:
        stack = [(node, False)]
        while stack:
            n, expanded = stack.pop()
            if n in done:
                continue
            if expanded:
                done.add(n)
                order.append(n)
                for u in n.users:  # a multi-output op unpacked at once: its tuple dies here
                    if is_getitem(u) and u in members and u not in done:
                        done.add(u)
                        order.append(u)
                continue
            stack.append((n, True))
            stack.extend((a, False) for a in reversed(n.all_input_nodes) if a in members)

    for n in body:
        if n.meta.get(PHASE) is Phase.BACKWARD:
            pull(n)
    for n in body:  # forward-phase values the outputs need directly (e.g. zero gradients)
        pull(n)
    return order


def _emit(
    graph: fx.Graph,
    nodes: Iterable[fx.Node],
    env: dict[fx.Node, fx.Node],
    mark: set[fx.Node],
    forms: Mapping[fx.Node, RecomputeForm] | None = None,
) -> None:
    for n in nodes:
        form = forms.get(n) if forms else None
        if form is None:
            copied = graph.node_copy(n, lambda a: env[a])
        else:  # re-run in its cheaper form, which gives the first results of the op's
            args = fx.node.map_arg(form.args(n), lambda a: env[a])
            copied = graph.call_function(form.target, tuple(args))
            copied.meta.update(n.meta)
            copied.meta["val"] = tuple(n.meta["val"][: form.results])
        if n in mark:
            copied.meta[RECOMPUTED] = True
        env[n] = copied


def _forward_graph(joint: JointGraph, needed: set[fx.Node], saved: list[fx.Node]) -> Graph:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for p in joint.primals():
        env[p] = g.placeholder(p.name)
        env[p].meta.update(p.meta)
    body = [n for n in joint.fx_graph.nodes if n in needed and n.op in _VALUE_OPS]
    _emit(g, body, env, set())
    outs = joint.forward_outputs()
    g.output(tuple(env[o] for o in outs) + tuple(env[s] for s in saved))
    out_tree = unflatten(joint.fn_out, [o.meta["val"] for o in outs])
    # saved values come back as a list, which the backward may empty (BackwardGraph)
    _, out_flat = flatten((out_tree, [s.meta["val"] for s in saved]))
    return Graph(g, joint.fn_in, out_flat, root=joint.graph_module)


def _backward_graph(
    joint: JointGraph,
    needed: set[fx.Node],
    saved: list[fx.Node],
    recomputed: set[fx.Node],
    forms: Mapping[fx.Node, RecomputeForm],
) -> Graph:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for s in saved:
        env[s] = g.placeholder(s.name)
        env[s].meta.update(s.meta)
        env[s].meta[ROLE] = Role.SAVED
    for t in joint.tangents():
        env[t] = g.placeholder(t.name)
        env[t].meta.update(t.meta)
    body = [n for n in joint.fx_graph.nodes if n in needed and n not in env and n.op in _VALUE_OPS]
    _emit(g, just_in_time(body), env, recomputed, forms)
    g.output(tuple(env[o] for o in joint.grad_outputs()))
    vals = (tuple(s.meta["val"] for s in saved), tuple(t.meta["val"] for t in joint.tangents()))
    _, in_flat = flatten((vals, {}))
    return BackwardGraph(g, in_flat, joint.grads_flat, root=joint.graph_module)
