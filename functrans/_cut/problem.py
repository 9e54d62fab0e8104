"""One save/recompute model for every strategy: :class:`CutProblem`.

A partition strategy chooses which forward values cross to backward; everything else backward
needs is recomputed there. What *may* be saved and what *may* be recomputed is not the
strategy's business: it follows from what each op is (its :class:`OpClass`) and from what a
remat policy said about it (its tag). This module holds those rules, once:

1. **Op classes** (:data:`OP_RULES`, one row per class): inputs are given to backward (never
   recomputed, saving them is free); random ops never re-run (new numbers would change the
   gradients); effectful ops never re-run (the effect would happen twice); collectives never
   re-run unless tagged ``MUST_RECOMPUTE`` (every rank must issue the same collectives, so
   only a rule decides, never bytes), and then their waits, views and casts re-run with
   them. Every other class may be saved or recomputed; a strategy may still prefer not to
   (``min_cut`` never recomputes a matmul) -- preferences stay in the strategy.
2. **Tags**: ``MUST_SAVE`` forbids recomputing a value the forward computes (so it is saved
   when backward needs it, and only then: unlike eager selective checkpointing, which keeps
   every MUST_SAVE output, a traced graph knows what backward reads); ``MUST_RECOMPUTE``
   forbids saving it. When a class forbids recomputing, the class wins over
   a ``MUST_RECOMPUTE`` tag and the value is saved (``nothing_saveable`` on a block with
   dropout saves the mask): :attr:`ForwardValue.tag_overridden` records it. A save decision
   on a view follows its base's tag (saving a view keeps its whole base, and eager remat
   re-runs views rather than caching them).
3. **Only tensors are saved**: a multi-output op is saved as its ``getitem`` parts.
4. **Recomputing is running twice**: a value the forward pass does not compute (it only feeds
   backward) is computed by backward once, which is no recomputation; ``MUST_SAVE`` binds only
   values the forward computes.
5. **Contradictions** -- backward reads a value that may be neither saved nor recomputed -- are
   one :class:`~functrans.InvalidPartitionError` naming the op, its class and its tag, raised
   when the problem is built.

Every built-in strategy, :func:`functrans.split`'s validation and
:func:`functrans.testing.check_partition` read the same :class:`CutProblem`, and
:func:`functrans.partition` passes every strategy's choice through :meth:`CutProblem.legalize`,
so a third-party strategy honours remat tags by construction. A new op class is a row of
:data:`OP_RULES`.

>>> import torch, functrans as ft
>>> from functrans.extend import cut_problem
>>> jg = ft.joint(lambda x: torch.tanh(x).sum())(torch.ones(3))
>>> p = cut_problem(jg)
>>> for v in p:
...     print(v.node.name, v.op_class.value, v.in_forward, v.read_by_backward)
primals_1 input True False
tanh pointwise True False
sum_1 reduction True False
mul pointwise False False
sub pointwise False True
>>> p[jg.primals()[0]].can_recompute, p[jg.primals()[0]].why_not_recompute
(False, 'it is an input of the graph')
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.fx as fx

from functrans._core.errors import InvalidPartitionError
from functrans._core.graph import PHASE, Attachment, JointGraph, Phase, Role, ancestors
from functrans._core.graph import ROLE as _ROLE
from functrans._core.ops import is_view_op
from functrans._core.shapes import planned_sizes
from functrans._core.tags import SAVE_TAGS, Policy, policy_of

from .cost import OpClass, Storage, activation_bytes, flops, op_class, storage_of
from .offload import why_not_offload

__all__ = [
    "OP_RULES",
    "CostModel",
    "CutProblem",
    "ForwardValue",
    "OpRule",
    "cut_problem",
]

#: A cost model: the cost of running one op (in backward, when it is recomputed).
CostModel = Callable[[fx.Node], float]


@dataclass(frozen=True)
class OpRule:
    """What a class of ops allows: may its values be saved, may backward re-run it, and why not.

    >>> OP_RULES[OpClass.RANDOM].recompute, OP_RULES[OpClass.RANDOM].why_not_recompute
    (False, 're-running it would draw different random numbers')
    """

    save: bool = True
    recompute: bool = True
    why_not_save: str = ""
    why_not_recompute: str = ""
    #: a ``MUST_RECOMPUTE`` tag lifts ``recompute=False`` (a re-gathered weight); only the
    #: tag, never a strategy's choice, so every rank decides alike
    recompute_when_tagged: bool = False


#: The save/recompute rule of every op class (a new class is a new row).
OP_RULES: Mapping[OpClass, OpRule] = MappingProxyType(
    {
        OpClass.INPUT: OpRule(recompute=False, why_not_recompute="it is an input of the graph"),
        OpClass.VIEW: OpRule(),
        OpClass.POINTWISE: OpRule(),
        OpClass.REDUCTION: OpRule(),
        OpClass.COMPUTE: OpRule(),
        OpClass.RANDOM: OpRule(
            recompute=False, why_not_recompute="re-running it would draw different random numbers"
        ),
        OpClass.EFFECTFUL: OpRule(
            recompute=False, why_not_recompute="re-running it would repeat its side effect"
        ),
        OpClass.COLLECTIVE: OpRule(
            recompute=False,
            why_not_recompute=(
                "re-running it would issue a collective the other ranks may not issue (a "
                "hang); tag it MUST_RECOMPUTE (policies.reshard_after_forward) to re-gather"
            ),
            recompute_when_tagged=True,
        ),
        OpClass.SIZE: OpRule(
            recompute=False,
            why_not_recompute=(
                "it is a size: handing backward the int costs nothing, and recomputing it "
                "would keep the tensor it is read from alive for backward"
            ),
        ),
        OpClass.OTHER: OpRule(),
    }
)


@dataclass(frozen=True)
class ForwardValue:
    """The facts about one forward value that every strategy decides from.

    ``in_forward``: the plain forward pass computes it (the forward outputs need it).
    ``read_by_backward``: a backward op reads it, or it is a gradient output itself.
    ``must_save``: tagged MUST_SAVE, computed by the forward and needed (even indirectly) by
    backward; a fact for strategies' preferences (``min_cut`` hands such a value over itself
    rather than values computed from it), not a constraint.
    ``bytes``: activation bytes saving it alone keeps alive (``storage``: the buffer it lives
    in; values sharing a storage cost it once when saved together).
    ``inputs``: indices (in :attr:`CutProblem.values`) of its forward-phase inputs.

    >>> import torch, functrans as ft
    >>> jg = ft.joint(lambda x: torch.nn.functional.dropout(x, 0.5).sum())(torch.ones(4))
    >>> v = next(v for v in cut_problem(jg) if v.op_class is OpClass.RANDOM)
    >>> v.describe(), v.can_save, v.can_recompute
    ('the random op bernoulli (aten.bernoulli.p)', True, False)
    >>> v.why_not_recompute
    're-running it would draw different random numbers'
    """

    node: fx.Node
    index: int
    op_class: OpClass
    tag: Policy | None
    in_forward: bool
    read_by_backward: bool
    must_save: bool
    can_save: bool
    can_recompute: bool
    tag_overridden: bool
    bytes: int
    storage: Storage
    inputs: tuple[int, ...]
    #: why it may not be kept in host memory between the passes ("" if it may): see
    #: :func:`functrans._cut.offload.why_not_offload`
    why_not_offload: str = ""

    @property
    def can_offload(self) -> bool:
        """It may be saved to host memory (copied out in forward, back in backward)."""
        return self.can_save and not self.why_not_offload

    @property
    def save_forbidden(self) -> bool:
        """A rule (its class or its tag) forbids saving it; unlike :attr:`can_save`, a
        multi-output op is not forbidden: it is saved as its ``getitem`` parts."""
        tagged = self.tag is Policy.MUST_RECOMPUTE and not self.tag_overridden
        return tagged or not OP_RULES[self.op_class].save

    @property
    def why_not_save(self) -> str:
        """Why this value may not be saved ("" if it may)."""
        if self.can_save:
            return ""
        if not isinstance(self.node.meta.get("val"), torch.Tensor):
            return "it is not a tensor"
        return OP_RULES[self.op_class].why_not_save or f"it is tagged {self.tag.name}"  # type: ignore[union-attr]  # tag set: only a tag or the class forbids

    @property
    def why_not_recompute(self) -> str:
        """Why backward may not recompute this value ("" if it may)."""
        if self.can_recompute:
            return ""
        return OP_RULES[self.op_class].why_not_recompute or f"it is tagged {self.tag.name}"  # type: ignore[union-attr]  # as above

    def describe(self) -> str:
        """``the <class> op <name> (<target>, tagged <tag>)``, for error messages."""
        tag = f", tagged {self.tag.name}" if self.tag is not None else ""
        if self.op_class is OpClass.INPUT:
            return f"the input {self.node.name}{tag and f' ({tag[2:]})'}"
        return f"the {self.op_class.value} op {self.node.name} ({self.node.target}{tag})"


@dataclass(frozen=True, eq=False)
class CutProblem:
    """Every forward value of a joint graph with what may be done with it (see the module
    docstring for the rules). Build it with :func:`cut_problem` (cached per graph).

    >>> import torch, functrans as ft
    >>> jg = ft.joint(lambda x, w: torch.tanh(x @ w).sum())(torch.ones(2, 2), torch.ones(2, 2))
    >>> p = cut_problem(jg)
    >>> [p[i].node.name for i in p.drains()]  # sub = 1 - tanh**2, the permutes transpose x and w
    ['sub', 'permute', 'permute_1']
    """

    joint: JointGraph
    values: tuple[ForwardValue, ...]
    index: Mapping[fx.Node, int]

    def __iter__(self) -> Iterator[ForwardValue]:
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values)

    def __contains__(self, node: object) -> bool:
        return node in self.index

    def __getitem__(self, node: fx.Node | int) -> ForwardValue:
        return self.values[node if isinstance(node, int) else self.index[node]]

    def drains(self) -> list[int]:
        """Indices of the values backward reads directly: each is saved or recomputed."""
        return [v.index for v in self.values if v.read_by_backward]

    def costs(self, cost: CostModel | None = None) -> tuple[float, ...]:
        """Recompute cost of each value under ``cost`` (default: FLOPs); 0 for values the
        forward does not compute (backward computing them is no extra work)."""
        if cost is None:
            return self._flops
        return tuple(cost(v.node) if v.in_forward else 0.0 for v in self.values)

    @functools.cached_property
    def _flops(self) -> tuple[float, ...]:
        return tuple(float(flops(v.node)) if v.in_forward else 0.0 for v in self.values)

    def legalize(
        self, saved: Iterable[fx.Node], *, recompute: Callable[[ForwardValue], bool] | None = None
    ) -> list[fx.Node]:
        """The saved set closest to ``saved`` that obeys the rules: a value that may not be
        saved is replaced by its inputs (backward recomputes it from them), and a value that
        may not be recomputed but that backward would need is added. ``recompute`` names more
        values to recompute from their inputs rather than save, where the rules allow (``default``
        passes PREFER_RECOMPUTE). Returns graph order.

        >>> import torch, functrans as ft
        >>> def f(x):
        ...     return torch.nn.functional.dropout(x, 0.5).sin().sum()
        >>> jg = ft.joint(f)(torch.ones(4))
        >>> [n.name for n in cut_problem(jg).legalize([])]  # the random mask must be saved
        ['bernoulli']
        """
        chosen: set[fx.Node] = set()
        todo = list(saved)
        while todo:
            n = todo.pop()
            if n in chosen:
                continue
            v = self.values[self.index[n]] if n in self.index else None
            wanted = v is not None and (
                v.save_forbidden or (recompute is not None and recompute(v))
            )
            if v is not None and wanted and v.can_recompute:
                todo.extend(self.values[i].node for i in v.inputs)
            else:
                chosen.add(n)
        fixed = {v.node for v in self.values if not v.can_recompute}
        stop = chosen | fixed | set(self.joint.tangents())
        for n in ancestors(self.joint.grad_outputs(), stop):
            if n in fixed and n.op != "placeholder":
                chosen.add(n)
        return [n for n in self.joint.fx_graph.nodes if n in chosen]

    def violations(self, saved: Iterable[fx.Node], recomputed: Iterable[fx.Node]) -> list[str]:
        """What a split with this saved and recomputed set does against the rules (empty if
        nothing): one sentence per value, naming it and the rule."""
        out = []
        for n in saved:
            v = self.values[self.index[n]] if n in self.index else None
            if v is not None and v.save_forbidden and n.meta.get(_ROLE) is not Role.PRIMAL:
                out.append(f"saves {v.describe()}, which may not be saved: {v.why_not_save}")
        for n in recomputed:
            v = self.values[self.index[n]] if n in self.index else None
            if v is not None and not v.can_recompute:
                out.append(
                    f"recomputes {v.describe()} in backward, which may not be recomputed: "
                    f"{v.why_not_recompute}; save it (or a value computed from it) instead"
                )
        return out


#: tags that forbid recomputing a value the forward computes (it is saved, on device or host)
_KEEP_TAGS = (Policy.MUST_SAVE, Policy.MUST_OFFLOAD)


def _base_tag(node: fx.Node) -> Policy | None:
    """The tag of the value a chain of views starts from (eager remat never caches a view: it
    re-runs the view from its base, which its base's decision saves or recomputes)."""
    while is_view_op(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return policy_of(node)


@dataclass(frozen=True)
class _Step:
    """What a forward value's rules read of the whole joint graph (found once)."""

    index: Mapping[fx.Node, int]  # forward nodes, in order
    core: set[fx.Node]  # the nodes the forward's own outputs need
    read: set[fx.Node]  # read by the backward
    feeds: set[fx.Node]  # some backward node depends on them
    regathered: set[fx.Node]  # gathered again in the backward (a reshard policy)
    outputs: frozenset[fx.Node]  # the forward's outputs


def _value(node: fx.Node, i: int, step: _Step) -> ForwardValue:
    index, regathered = step.index, step.regathered
    cls, tag = op_class(node), policy_of(node)
    if tag in SAVE_TAGS and is_view_op(node):
        tag = _base_tag(node)  # saving a view keeps its base: the view follows its base
        if tag is Policy.MUST_OFFLOAD:  # ...unless the base goes to host: a saved view would
            tag = Policy.PREFER_RECOMPUTE  # keep it on the device; re-view the copy instead
    if node in regathered:
        tag = Policy.MUST_RECOMPUTE
    rule = OP_RULES[cls]
    in_forward = node in step.core
    reruns = rule.recompute or (rule.recompute_when_tagged and tag is Policy.MUST_RECOMPUTE)
    recompute = reruns and not (tag in _KEEP_TAGS and in_forward)
    # a class that never re-runs wins over MUST_RECOMPUTE: the value is saved instead
    overridden = tag is Policy.MUST_RECOMPUTE and not reruns
    save = (
        rule.save
        and (isinstance(node.meta.get("val"), torch.Tensor) or cls is OpClass.SIZE)
        and (tag is not Policy.MUST_RECOMPUTE or overridden)
    )
    return ForwardValue(
        node=node,
        index=i,
        op_class=cls,
        tag=tag,
        in_forward=in_forward,
        read_by_backward=node in step.read,
        must_save=tag in _KEEP_TAGS and in_forward and node in step.feeds and save,
        can_save=save,
        can_recompute=recompute,
        tag_overridden=overridden,
        bytes=activation_bytes(node),
        storage=storage_of(node),
        inputs=tuple(index[a] for a in node.all_input_nodes if a in index),
        why_not_offload=why_not_offload(node, step.outputs),
    )


def _feeds_backward(nodes: list[fx.Node]) -> set[fx.Node]:
    """The forward nodes some backward node depends on (``nodes`` in graph order)."""
    out: set[fx.Node] = set()
    for n in reversed(nodes):
        if any(u in out or u.meta.get(PHASE) is Phase.BACKWARD for u in n.users):
            out.add(n)
    return out


_CASTS = frozenset({torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default})


def _regathered(nodes: list[fx.Node]) -> set[fx.Node]:
    """Collectives tagged MUST_RECOMPUTE, and what backward would otherwise keep of them: every
    value computed from them alone (their waits, and the views, casts, chunks and concatenations
    that rebuild a weight sharded on another dim), ``nodes`` in graph order. Re-gathering a weight
    but saving its rebuilt copy would keep the full weight alive after all (FSDP's
    reshard-after-forward frees the gathered weight and everything that holds it)."""
    out: set[fx.Node] = set()
    for n in nodes:
        if n.op != "call_function":
            continue
        tag, cls = policy_of(n), op_class(n)
        if cls is OpClass.COLLECTIVE and tag is Policy.MUST_RECOMPUTE:
            out.add(n)
            continue
        sources, rule = n.all_input_nodes, OP_RULES[cls]
        derived = bool(sources) and all(a in out for a in sources)
        if derived and tag not in _KEEP_TAGS and (rule.recompute or rule.recompute_when_tagged):
            out.add(n)
    return out


def _build(joint: JointGraph) -> CutProblem:
    nodes = [n for n in joint.forward_nodes() if n.op != "output"]
    index = {n: i for i, n in enumerate(nodes)}
    core = ancestors(joint.forward_outputs(), set())
    read = {n for n in joint.grad_outputs() if isinstance(n, fx.Node)}
    read |= {n for n in nodes if any(u.meta.get(PHASE) is Phase.BACKWARD for u in n.users)}
    outputs = frozenset(o for o in joint.forward_outputs() if isinstance(o, fx.Node))
    step = _Step(index, core, read, _feeds_backward(nodes), _regathered(nodes), outputs)
    values = tuple(_value(n, i, step) for i, n in enumerate(nodes))
    problem = CutProblem(joint, values, MappingProxyType(index))
    for v in values:
        if v.read_by_backward and not v.can_save and not v.can_recompute:
            raise InvalidPartitionError(
                f"backward reads {v.describe()}, which may be neither saved ({v.why_not_save}) "
                f"nor recomputed ({v.why_not_recompute})"
            )
    return problem


#: a joint graph's cut problem and the stamp it was built for (its own: not copied)
_PROBLEM: Attachment[tuple[tuple[object, ...], CutProblem] | None] = Attachment("cut problem", None)


def cut_problem(joint: JointGraph) -> CutProblem:
    """The :class:`CutProblem` of ``joint``, built once per graph (and again if its remat tags
    change).

    >>> import torch, functrans as ft
    >>> jg = ft.joint(lambda x: torch.tanh(x).sum())(torch.ones(3))
    >>> cut_problem(jg) is cut_problem(jg)
    True
    """
    stamp = (planned_sizes(), *(policy_of(n) for n in joint.fx_graph.nodes))
    found = joint.attached(_PROBLEM)
    if found is not None and found[0] == stamp:
        problem: CutProblem = found[1]
        return problem
    problem = _build(joint)
    joint.attach(_PROBLEM, (stamp, problem))
    return problem
