"""``"min_cut"``: save the fewest bytes that let backward recompute everything else it needs.

Which forward values cross to backward is a minimum s-t cut (the joint-graph article's
max-flow formulation). Every FORWARD-phase node ``v`` becomes an edge ``v_in -> v_out`` whose
capacity is what saving ``v`` costs; data edges are uncuttable; the source feeds the primal
inputs and every node that must not be recomputed; every value a BACKWARD node reads drains into
the sink. A cut edge ``v_in -> v_out`` is a saved value; forward nodes on the sink side are
recomputed in backward.

Capacities are activation bytes, so the saved set has the fewest bytes among cuts that recompute
only allowed ops. Ties between minimum cuts are broken in this order (a second max-flow on the
first one's residual graph, see ``partitioners._maxflow``):

1. save values a fused forward writes to memory anyway (:func:`is_materialized`: matmul
   outputs and what matmuls read, forward outputs), not pointwise values a fused forward
   kernel would never have materialized;
2. recompute the fewest ops (views are free): of a matmul output and the contiguous copy of it
   that the next matmul reads, both in memory, save the copy rather than redo it in backward;
3. the cut closest to the inputs.

Views of inputs are then saved as the views (free either way). The rules are the small
predicates below.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.fx as fx

from functrans.extend import (
    PHASE,
    ROLE,
    InvalidPartitionError,
    JointGraph,
    OpClass,
    Phase,
    Policy,
    Role,
    activation_bytes,
    check_names,
    check_number,
    check_option,
    nbytes,
    op_class,
    policy_of,
)

from . import register
from ._maxflow import INF
from ._maxflow import min_cut as solve_min_cut
from .default import forward_core

__all__ = ["MinCutOptions", "min_cut"]


@dataclass(frozen=True)
class MinCutOptions:
    """Options of ``min_cut`` (pass them as keywords to ``partition``)."""

    recompute_views: bool = True  # views may be recomputed in backward (they are free)
    ban_reductions: bool = True  # never recompute a reduction that shrinks its input a lot
    reduction_ratio: float = 4.0  # ... "a lot": input bytes > ratio * output bytes
    prefer_weight: int = (
        4  # PREFER_SAVE divides a value's save cost by this, PREFER_RECOMPUTE multiplies
    )

    def __post_init__(self) -> None:
        for name in ("recompute_views", "ban_reductions"):
            value = getattr(self, name)
            check_option("min_cut", name, value, isinstance(value, bool), "True or False")
        check_number("min_cut", "reduction_ratio", self.reduction_ratio, at_least=0, allow_inf=True)
        check_number("min_cut", "prefer_weight", self.prefer_weight, at_least=1, integer=True)


def is_compute_intensive(node: fx.Node) -> bool:
    """Matmul, conv, attention: redoing them costs real FLOPs, so they are never recomputed."""
    return op_class(node) is OpClass.COMPUTE


def is_random(node: fx.Node) -> bool:
    """A random op: re-running it draws new numbers, so recomputing it would change gradients."""
    return op_class(node) is OpClass.RANDOM


def is_effectful(node: fx.Node) -> bool:
    """An op with side effects: running it twice is not the same as running it once."""
    return op_class(node) is OpClass.EFFECTFUL


def is_shrinking_reduction(node: fx.Node, ratio: float) -> bool:
    """A reduction whose output is much smaller than its input: saving the small result is
    cheaper than keeping the big input alive to redo it (e.g. softmax's row max and sum)."""
    if op_class(node) is not OpClass.REDUCTION:
        return False
    inputs = sum(nbytes(a.meta.get("val")) for a in node.all_input_nodes)
    return inputs > ratio * nbytes(node.meta.get("val"))


def is_free_view(node: fx.Node) -> bool:
    """A view of a primal input: it aliases memory the caller keeps alive, so saving it costs
    0 bytes, and recomputing it is free too."""
    return (
        node.op != "placeholder" and activation_bytes(node) == 0 and op_class(node) is OpClass.VIEW
    )


def banned(node: fx.Node, opts: MinCutOptions) -> bool:
    """May ``node`` NOT be recomputed in backward? (Policy tags override the op rules; a
    MUST_SAVE value that backward depends on is moreover always saved itself.)"""
    policy = policy_of(node)
    if is_random(node) or is_effectful(node) or policy is Policy.MUST_SAVE:
        return True
    if policy is Policy.MUST_RECOMPUTE:
        return False
    if not opts.recompute_views and op_class(node) is OpClass.VIEW:
        return True
    return is_compute_intensive(node) or (
        opts.ban_reductions and is_shrinking_reduction(node, opts.reduction_ratio)
    )


def is_materialized(node: fx.Node, outputs: set[fx.Node]) -> bool:
    """Does a fused forward write ``node`` to memory anyway? Outputs of compute-intensive ops
    (extern calls), the values they read (through views), and the forward's outputs."""
    if node in outputs or is_compute_intensive(node):
        return True
    todo, seen = list(node.users), set()
    while todo:
        u = todo.pop()
        if u in seen:
            continue
        seen.add(u)
        if is_compute_intensive(u):
            return True
        if op_class(u) is OpClass.VIEW:
            todo.extend(u.users)
    return False


def save_cost(node: fx.Node, opts: MinCutOptions, weighted: bool) -> int:
    """Capacity of ``node``'s in->out edge: the activation bytes saving it costs."""
    policy = policy_of(node)
    if not isinstance(node.meta.get("val"), torch.Tensor):
        return INF
    if policy is Policy.MUST_RECOMPUTE and not is_random(node):  # random ops are never redone
        return INF
    cost = activation_bytes(node)
    if weighted:  # PREFER_* tags scale the byte cost around a neutral weight
        w = opts.prefer_weight
        cost *= {Policy.PREFER_SAVE: 1, Policy.PREFER_RECOMPUTE: w * w}.get(policy, w)  # type: ignore[arg-type]
    return cost


@dataclass(frozen=True)
class _Network:
    nodes: list[fx.Node]  # forward node i is network nodes 2i (in) and 2i+1 (out)
    src: list[int]
    dst: list[int]
    caps: list[int]
    tiebreak: list[int]


def _network(joint: JointGraph, opts: MinCutOptions) -> _Network:
    core = forward_core(joint)
    nodes = [
        n for n in joint.fx_graph.nodes if n.meta.get(PHASE) is Phase.FORWARD and n.op != "output"
    ]
    index = {n: i for i, n in enumerate(nodes)}
    source, sink = 2 * len(nodes), 2 * len(nodes) + 1
    weighted = any(policy_of(n) in (Policy.PREFER_SAVE, Policy.PREFER_RECOMPUTE) for n in nodes)
    outputs = {n for n in joint.forward_outputs() if isinstance(n, fx.Node)}
    edges: dict[tuple[int, int], int] = {}
    ties: dict[tuple[int, int], int] = {}  # second capacities: see the module docstring
    drains = {n for n in joint.grad_outputs() if isinstance(n, fx.Node) and n in index}
    for n, i in index.items():
        edges[(2 * i, 2 * i + 1)] = save_cost(n, opts, weighted)
        if not is_materialized(n, outputs):
            ties[(2 * i, 2 * i + 1)] = len(nodes) + 1  # outweighs any count of recomputed ops
        if n.meta.get(ROLE) is Role.PRIMAL or (n in core and banned(n, opts)):
            edges[(source, 2 * i)] = INF
        elif op_class(n) is not OpClass.VIEW:  # cut when n is recomputed: costs no bytes
            edges[(source, 2 * i)] = 0
            ties[(source, 2 * i)] = 1
        for user in n.users:
            if user in index:
                edges[(2 * i + 1, 2 * index[user])] = INF
            elif user.meta.get(PHASE) is Phase.BACKWARD:
                drains.add(n)
    drains |= {
        n
        for n in core
        if policy_of(n) is Policy.MUST_SAVE
        and isinstance(n.meta.get("val"), torch.Tensor)  # a tuple is saved as its getitems
        and _feeds_backward(n)
    }
    for n in drains:
        edges[(2 * index[n] + 1, sink)] = INF
    src, dst = zip(*edges, strict=True) if edges else ((), ())
    tiebreak = [ties.get(e, 0) for e in edges]
    return _Network(nodes, list(src), list(dst), list(edges.values()), tiebreak)


def _feeds_backward(node: fx.Node) -> bool:
    """Does any BACKWARD node depend on ``node``?"""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        for u in n.users:
            if u.meta.get(PHASE) is Phase.BACKWARD:
                return True
            if u not in seen:
                seen.add(u)
                todo.append(u)
    return False


def min_cut(joint: JointGraph, **options: object) -> list[fx.Node]:
    """Save a minimum-byte set of forward values (see the module docstring for the rules).

    >>> import torch, functrans as ft
    >>> jg = ft.joint(lambda x, w: torch.tanh(x @ w).sum())(torch.ones(8, 8), torch.ones(8, 8))
    >>> [s.name for s in ft.partition(jg, "min_cut").saved]  # split drops unneeded inputs
    ['mm', 'permute', 'permute_1']
    """
    check_names("min_cut", options, [f.name for f in fields(MinCutOptions)])
    opts = MinCutOptions(**options)  # type: ignore[arg-type]
    net = _network(joint, opts)
    order, n = net.nodes, 2 * len(net.nodes)
    cut = solve_min_cut(n + 2, net.src, net.dst, net.caps, n, n + 1, net.tiebreak)
    if not cut.finite:
        raise InvalidPartitionError(
            "min_cut: every cut crosses a value that may be neither saved nor recomputed: a "
            "value tagged MUST_RECOMPUTE that needs a random op, or a MUST_SAVE/random value "
            "that cannot be saved"
        )
    side = cut.source_side
    saved = [v for i, v in enumerate(order) if side[2 * i] and not side[2 * i + 1]]
    # views of inputs cost nothing either way: hand them over rather than redo them (unless a
    # remat policy said to recompute them)
    saved += [
        v
        for i, v in enumerate(order)
        if not side[2 * i] and is_free_view(v) and policy_of(v) is not Policy.MUST_RECOMPUTE
    ]
    return saved


register("min_cut", min_cut)
