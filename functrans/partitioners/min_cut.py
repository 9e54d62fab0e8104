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
   outputs and what matmuls read, forward outputs) or that a block hands the next one
   (:attr:`functrans.extend.Segments.checkpoints`: the residual stream after each add), not
   pointwise values a fused forward kernel would never have materialized;
2. recompute the fewest ops (views are free): of a matmul output and the contiguous copy of it
   that the next matmul reads, both in memory, save the copy rather than redo it in backward;
   of a residual add and the output projection it adds, save the add: recomputing it would
   make backward's first step recompute every earlier block's residual stream and keep it
   alive to the end, which costs the step's peak what the cut saved;
3. the cut closest to the inputs.

Views of inputs are then saved as the views (free either way). The rules are the small
predicates below.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch.fx as fx

from functrans.extend import (
    CutProblem,
    ForwardValue,
    JointGraph,
    OpClass,
    Policy,
    check_number,
    check_option,
    cut_problem,
    flops,
    nbytes,
    op_class,
    parse_options,
    segments,
)

from . import register
from ._maxflow import INF
from ._maxflow import min_cut as solve_min_cut

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
    """Matmul, conv, attention: redoing them costs real FLOPs, so they are never recomputed
    (one with an empty operand, 0 FLOPs, is as free to redo as a view)."""
    return op_class(node) is OpClass.COMPUTE and flops(node) > 0


def is_shrinking_reduction(node: fx.Node, ratio: float) -> bool:
    """A reduction whose output is much smaller than its input: saving the small result is
    cheaper than keeping the big input alive to redo it (e.g. softmax's row max and sum)."""
    if op_class(node) is not OpClass.REDUCTION:
        return False
    inputs = sum(nbytes(a.meta.get("val")) for a in node.all_input_nodes)
    return inputs > ratio * nbytes(node.meta.get("val"))


def is_free_view(value: ForwardValue) -> bool:
    """A view of a primal input: it aliases memory the caller keeps alive, so saving it costs
    0 bytes, and recomputing it is free too."""
    return value.node.op != "placeholder" and value.bytes == 0 and value.op_class is OpClass.VIEW


def banned(value: ForwardValue, opts: MinCutOptions) -> bool:
    """May ``value`` NOT be recomputed in backward? The shared rules first (inputs, random and
    effectful ops, MUST_SAVE), then min_cut's preferences for a value the forward computes,
    which a MUST_RECOMPUTE tag overrides."""
    if not value.can_recompute:
        return True
    if not value.in_forward or value.tag is Policy.MUST_RECOMPUTE:
        return False
    if not opts.recompute_views and value.op_class is OpClass.VIEW:
        return True
    return is_compute_intensive(value.node) or (
        opts.ban_reductions and is_shrinking_reduction(value.node, opts.reduction_ratio)
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


#: powers of prefer_weight that scale a tagged value's save cost (untagged: 1)
_PREFER_WEIGHT: dict[Policy | None, int] = {Policy.PREFER_SAVE: 0, Policy.PREFER_RECOMPUTE: 2}


def save_cost(value: ForwardValue, opts: MinCutOptions, weighted: bool) -> int:
    """Capacity of the value's in->out edge: the activation bytes saving it costs."""
    if not value.can_save:
        return INF
    cost = value.bytes
    if weighted:  # PREFER_* tags scale the byte cost around a neutral weight
        cost *= opts.prefer_weight ** _PREFER_WEIGHT.get(value.tag, 1)
    return cost


@dataclass(frozen=True)
class _Network:
    values: tuple[ForwardValue, ...]  # forward value i is network nodes 2i (in) and 2i+1 (out)
    src: list[int]
    dst: list[int]
    caps: list[int]
    tiebreak: list[int]


def _network(problem: CutProblem, opts: MinCutOptions) -> _Network:
    values = problem.values
    source, sink = 2 * len(values), 2 * len(values) + 1
    weighted = any(v.tag in (Policy.PREFER_SAVE, Policy.PREFER_RECOMPUTE) for v in values)
    outputs = {n for n in problem.joint.forward_outputs() if isinstance(n, fx.Node)}
    edges: dict[tuple[int, int], int] = {}
    ties: dict[tuple[int, int], int] = {}  # second capacities: see the module docstring
    checkpoints = set(segments(problem.joint).checkpoints)
    for v in values:
        i = v.index
        edges[(2 * i, 2 * i + 1)] = save_cost(v, opts, weighted)
        if v.node not in checkpoints and not is_materialized(v.node, outputs):
            ties[(2 * i, 2 * i + 1)] = len(values) + 1  # outweighs any count of recomputed ops
        if banned(v, opts):
            edges[(source, 2 * i)] = INF
        elif v.op_class is not OpClass.VIEW:  # cut when v is recomputed: costs no bytes
            edges[(source, 2 * i)] = 0
            ties[(source, 2 * i)] = 1
        for user in v.node.users:
            if user in problem:
                edges[(2 * i + 1, 2 * problem.index[user])] = INF
        if v.read_by_backward or v.must_save:  # a MUST_SAVE value: hand it over itself
            edges[(2 * i + 1, sink)] = INF
    src, dst = zip(*edges, strict=True) if edges else ((), ())
    tiebreak = [ties.get(e, 0) for e in edges]
    return _Network(values, list(src), list(dst), list(edges.values()), tiebreak)


def min_cut(joint: JointGraph, **options: object) -> list[fx.Node]:
    """Save a minimum-byte set of forward values (see the module docstring for the rules).

    >>> import torch, functrans as ft
    >>> jg = ft.joint(lambda x, w: torch.tanh(x @ w).sum())(torch.ones(8, 8), torch.ones(8, 8))
    >>> [s.name for s in ft.partition(jg, "min_cut").saved]  # split drops unneeded inputs
    ['mm', 'permute', 'permute_1']
    """
    opts = _options(options)
    net = _network(cut_problem(joint), opts)
    order, n = net.values, 2 * len(net.values)
    cut = solve_min_cut(n + 2, net.src, net.dst, net.caps, n, n + 1, net.tiebreak)
    # the shared rules leave a value backward reads either savable or recomputable (cut_problem
    # raises otherwise), and a source-side value can always be saved: every cut is finite
    assert cut.finite, "min_cut: infinite cut despite the CutProblem's feasibility check"
    side = cut.source_side
    saved = [v.node for v in order if side[2 * v.index] and not side[2 * v.index + 1]]
    # views of inputs cost nothing either way: hand them over rather than redo them (unless a
    # remat policy said to recompute them)
    saved += [
        v.node
        for v in order
        if not side[2 * v.index] and is_free_view(v) and v.tag is not Policy.MUST_RECOMPUTE
    ]
    return saved


def _options(options: Mapping[str, object]) -> MinCutOptions:
    """``min_cut``'s options from ``partition``'s keywords (its declared option check: an
    unknown name or a bad value raises ``InvalidArgumentError`` when ``jit`` is made).

    >>> _options({"reduction_ratio": 2.0}).reduction_ratio
    2.0
    """
    return parse_options(MinCutOptions, "min_cut", options)


register("min_cut", min_cut, check_options=_options, local=True)
