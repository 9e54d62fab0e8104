"""A symbolic graph from two static traces: anti-unification of sizes.

A symbolic trace costs several static ones (torch's symbolic shape arithmetic runs in every meta
kernel, through Python, autograd and decompositions). When ``jit(dynamic="auto")`` meets a
second shape, it already holds a static trace at the first; :func:`generalise` compares it, node
by node, with a static trace at the new shape. Where the two are the same program (the same
ops on the same inputs, the same non-size arguments), each integer argument that differs
between them is explained as a size expression of the symbolic input dimensions: ``c * M + d``
for a product ``M`` of at most three dimensions (``batch * tokens`` for a flattened view, a
size passed as a scalar). The generalised graph is the new trace with those arguments computed
from the inputs' sizes (``sym_size`` and ``operator`` nodes, as a symbolic trace writes them).

It is then checked: propagated with fake tensors over one shape environment symbolic in those
dimensions, which records the guards the graph's ops assume (``Eq(s0*s1, s2*s3)`` for a
cross-entropy of a flattened batch, ``2 <= s0`` for torch's 0/1 specialisation), and every
node's sizes, strides and offset must reproduce both static traces at their sizes (and both
shapes must pass the recorded guards). Dimensions whose sizes agree at both shapes are one
symbol (their equality is a guard: the traces cannot tell them apart).

Anything unexplained, ambiguous or structurally different (a shape-dependent branch that
changes the ops) returns a :class:`Mismatch`, and the caller traces symbolically. A Python
condition on a size that both traces satisfy alike (``if T > 16:`` with both ``T`` above 16)
leaves no trace in either graph, so it cannot be guarded here: the entry assumes what the graph
assumes.

>>> import torch, functrans as ft
>>> f = lambda x: x.flatten() * x.shape[0]
>>> a = ft.trace(f)(torch.ones(3, 5))
>>> b = ft.trace(f)(torch.ones(4, 7))
>>> g = generalise(a, b, ({0: None, 1: None},))
>>> print(g)
def forward(x: "f32[s0, s1]"):
    sym_size_int: "Sym(s0)" = aten.sym_size.int(x, 0)
    sym_size_int_1: "Sym(s1)" = aten.sym_size.int(x, 1)
    mul_1: "Sym(s0*s1)" = mul(sym_size_int, sym_size_int_1)
    view: "f32[s0*s1]" = aten.view.default(x, [mul_1])
    mul: "f32[s0*s1]" = aten.mul.Tensor(view, sym_size_int)
    return (mul,)
>>> g(torch.ones(2, 3))
tensor([2., 2., 2., 2., 2., 2.])
"""

from __future__ import annotations

import copy
import itertools
import math
import operator
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from functrans._core.graph import PHASE, Graph, JointGraph, assign_phases
from functrans._core.logs import log
from functrans._core.pytree import Flat
from functrans._core.shapes import Dims, shape_env_of, symbolic_fakes

__all__ = [
    "Mismatch",
    "Pairs",
    "SizeExpr",
    "SymbolClass",
    "explain",
    "generalise",
    "symbol_classes",
]

_G = TypeVar("_G", bound=Graph)
_T = TypeVar("_T")

#: products of at most this many dimensions explain a size (``B * T * H`` for a head split)
MAX_DEGREE = 3


@dataclass(frozen=True)
class Mismatch:
    """Why two static traces do not generalise (the caller traces symbolically)."""

    reason: str


@dataclass(frozen=True)
class SizeExpr:
    """``coeff * prod(dims) + offset`` over symbol classes (indices into the classes).

    >>> e = SizeExpr(2, (0, 1), -1)
    >>> e.at((3, 5))
    29
    """

    coeff: int
    factors: tuple[int, ...]
    offset: int = 0

    def at(self, values: Sequence[int]) -> int:
        """The expression's value with the classes at ``values``."""
        return self.coeff * math.prod(values[k] for k in self.factors) + self.offset


@dataclass(frozen=True)
class SymbolClass:
    """Input dimensions ``(input, dim)`` that are one symbol, and their sizes in the new
    trace (``new``, the symbol's hint) and the old one."""

    members: tuple[tuple[int, int], ...]
    new: int
    old: int


def symbol_classes(
    dims: Dims, new: Sequence[Sequence[int]], old: Sequence[Sequence[int]]
) -> list[SymbolClass] | Mismatch:
    """The symbols of ``dims`` (per input: its symbolic dimensions) given the input sizes of
    the two traces: dimensions named alike, or of equal sizes in both traces, share one; a
    dimension of size 0 or 1 in both is static (torch specialises it). A dimension whose size
    is the same in both traces cannot be explained: a :class:`Mismatch`.

    >>> for c in symbol_classes(({0: None, 1: None}, {0: None}), [(4, 7), (4,)], [(3, 5), (3,)]):
    ...     print(c)
    SymbolClass(members=((0, 0), (1, 0)), new=4, old=3)
    SymbolClass(members=((0, 1),), new=7, old=5)
    """
    by_key: dict[Any, list[tuple[int, int]]] = {}
    values: dict[Any, tuple[int, int]] = {}
    for i, ds in enumerate(dims):
        for d, name in ds.items():
            vn, vo = int(new[i][d]), int(old[i][d])
            if vn <= 1 and vo == vn:
                continue
            if vn <= 1 or vo <= 1:
                return Mismatch(f"input {i} dimension {d}: sizes {vo} and {vn} (0/1 specialise)")
            if vn == vo:
                return Mismatch(f"input {i} dimension {d} has size {vn} in both traces")
            key: Any = ("name", name) if name is not None else ("sizes", vn, vo)
            if key in values and values[key] != (vn, vo):
                return Mismatch(f"dimensions named {name!r} differ: {values[key]} and {(vn, vo)}")
            values[key] = (vn, vo)
            by_key.setdefault(key, []).append((i, d))
    # a named class and an unnamed one of equal sizes are one symbol too
    merged: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for key, members in by_key.items():
        merged.setdefault(values[key], []).extend(members)
    return [SymbolClass(tuple(m), vn, vo) for (vn, vo), m in merged.items()]


def _monomials(n: int) -> Iterator[tuple[int, ...]]:
    for degree in range(1, MAX_DEGREE + 1):
        yield from itertools.combinations_with_replacement(range(n), degree)


def explain(new: int, old: int, classes: Sequence[SymbolClass]) -> SizeExpr | Mismatch | None:
    """The one size expression that is ``new`` at the new trace's sizes and ``old`` at the old
    one's (None: a constant, ``new == old``): ``c * M`` first, then ``±M + d``; none, or more
    than one of a kind, is a :class:`Mismatch`.

    >>> cls = [SymbolClass(((0, 0),), 4, 3), SymbolClass(((0, 1),), 7, 5)]
    >>> explain(28 * 64, 15 * 64, cls)
    SizeExpr(coeff=64, factors=(0, 1), offset=0)
    >>> explain(6, 4, cls)  # tokens - 1
    SizeExpr(coeff=1, factors=(1,), offset=-1)
    >>> explain(9, 9, cls) is None
    True
    """
    if new == old:
        return None
    hn = [c.new for c in classes]
    ho = [c.old for c in classes]
    exact: set[SizeExpr] = set()
    shifted: set[SizeExpr] = set()
    for m in _monomials(len(classes)):
        mn, mo = math.prod(hn[k] for k in m), math.prod(ho[k] for k in m)
        if new % mn == 0 and old % mo == 0 and new // mn == old // mo:
            exact.add(SizeExpr(new // mn, m))
        for c in (1, -1):  # a shifted size (tokens - 1): a unit coefficient only
            if c * (mn - mo) == new - old:
                shifted.add(SizeExpr(c, m, new - c * mn))
    for found in (exact, shifted):
        if len(found) == 1:
            return next(iter(found))
        if found:
            return Mismatch(f"size {old} -> {new} is ambiguous: {sorted(map(str, found))}")
    return Mismatch(f"size {old} -> {new} is no size expression of the symbolic dimensions")


class _Builder:
    """Nodes computing size expressions from the inputs, placed before the first op."""

    def __init__(
        self, graph: fx.Graph, inputs: list[fx.Node], classes: Sequence[SymbolClass]
    ) -> None:
        self.graph, self.inputs, self.classes = graph, inputs, classes
        first = next(n for n in graph.nodes if n.op != "placeholder")
        self.at = first
        self.sizes: dict[int, fx.Node] = {}
        self.made: dict[SizeExpr, fx.Node] = {}

    def node(self, e: SizeExpr) -> fx.Node:
        found = self.made.get(e)
        if found is not None:
            return found
        with self.graph.inserting_before(self.at):
            out: fx.Node | None = None
            for k in e.factors:
                s = self._size(k)
                out = s if out is None else self.graph.call_function(operator.mul, (out, s))
            assert out is not None
            if e.coeff != 1:
                out = self.graph.call_function(operator.mul, (out, e.coeff))
            if e.offset:
                out = self.graph.call_function(operator.add, (out, e.offset))
        self.made[e] = out
        return out

    def _size(self, k: int) -> fx.Node:
        if k not in self.sizes:
            i, d = self.classes[k].members[0]
            with self.graph.inserting_before(self.at):
                self.sizes[k] = self.graph.call_function(
                    torch.ops.aten.sym_size.int, (self.inputs[i], d)
                )
        return self.sizes[k]


def _leaves(x: Any) -> tuple[list[Any], Any]:
    """The leaves of an FX argument (tuples, lists, dicts) and its structure."""
    if isinstance(x, list | tuple):
        parts = [_leaves(v) for v in x]
        return [leaf for ls, _ in parts for leaf in ls], (type(x) is tuple, [s for _, s in parts])
    if isinstance(x, dict):
        parts = [_leaves(v) for v in x.values()]
        return [leaf for ls, _ in parts for leaf in ls], (list(x), [s for _, s in parts])
    return [x], None


def _rebuild(structure: Any, leaves: Iterator[Any]) -> Any:
    if structure is None:
        return next(leaves)
    head, parts = structure
    if isinstance(head, list):
        return {k: _rebuild(p, leaves) for k, p in zip(head, parts, strict=True)}
    out = [_rebuild(p, leaves) for p in parts]
    return tuple(out) if head else out


def _pair_args(
    a: Any,
    b: Any,
    where_old: dict[fx.Node, int],
    where_new: dict[fx.Node, int],
    env: dict[fx.Node, fx.Node],
    explain_int: Callable[[int, int], fx.Node | int | Mismatch],
) -> Any:
    """``b``'s arguments for the generalised graph (``a``: the old trace's), or a Mismatch."""
    la, sa = _leaves(a)
    lb, sb = _leaves(b)
    if sa != sb:
        return Mismatch(f"argument structure {sa} differs from {sb}")
    out: list[Any] = []
    for x, y in zip(la, lb, strict=True):
        if isinstance(y, fx.Node) or isinstance(x, fx.Node):
            if not (isinstance(x, fx.Node) and isinstance(y, fx.Node)):
                return Mismatch(f"a value {x!r} against {y!r}")
            if where_old[x] != where_new[y]:
                return Mismatch(f"{y.name} reads other values than {x.name}")
            out.append(env[y])
        elif type(x) is int and type(y) is int:
            made = explain_int(y, x)
            if isinstance(made, Mismatch):
                return made
            out.append(made)
        elif type(x) is not type(y) or x != y:
            if not (isinstance(x, float) and math.isnan(x) and math.isnan(y)):
                return Mismatch(f"argument {x!r} against {y!r}")
            out.append(y)
        else:
            out.append(y)
    return _rebuild(sb, iter(out))


def _sizes_of(v: Any) -> tuple[Any, ...] | None:
    if isinstance(v, torch.Tensor):
        return (*v.shape, "|", *v.stride(), "|", v.storage_offset(), v.dtype)
    if isinstance(v, int | torch.SymInt):
        return (v,)
    return None


def generalise(old: _G, new: _G, dims: Dims) -> _G | Mismatch:
    """``new`` (a static trace) made symbolic in ``dims`` (per primal input, its dimensions)
    by anti-unification with ``old`` (a static trace of the same function at other sizes of
    those dimensions), checked against both; a :class:`Mismatch` says why not. Neither graph
    is modified."""
    if type(old) is not type(new):
        return Mismatch("graphs of different kinds")
    if not _same_flat(old.in_flat, new.in_flat) or not _same_flat(old.out_flat, new.out_flat):
        return Mismatch("the traced function's inputs or outputs differ in structure")
    if isinstance(old, JointGraph) and isinstance(new, JointGraph):
        same = (old.differentiable, old.num_outputs) == (new.differentiable, new.num_outputs)
        if not same or not _same_flat(old.fn_out, new.fn_out):
            return Mismatch("the joint graphs' outputs differ")
    na, nb = list(old.fx_graph.nodes), list(new.fx_graph.nodes)
    if len(na) != len(nb):
        return Mismatch(f"{len(na)} nodes against {len(nb)}: a shape-dependent program")
    pa, pb = old.placeholders(), new.placeholders()
    if len(pa) != len(pb) or len(dims) > len(pb):
        return Mismatch("the traces take different inputs")
    va = [p.meta["val"] for p in pa]
    vb = [p.meta["val"] for p in pb]
    shapes_a = [tuple(v.shape) for v in va[: len(dims)]]
    shapes_b = [tuple(v.shape) for v in vb[: len(dims)]]
    classes = symbol_classes(dims, shapes_b, shapes_a)
    if isinstance(classes, Mismatch):
        return classes
    if not classes:
        return Mismatch("no dimension differs between the traces")

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    env[nb[-1]] = graph.output(graph.graph_copy(new.fx_graph, env))
    inputs = [env[p] for p in pb]
    builder = _Builder(graph, inputs, classes)

    def explain_int(y: int, x: int) -> fx.Node | int | Mismatch:
        e = explain(y, x, classes)
        if e is None or isinstance(e, Mismatch):
            return y if e is None else e
        return builder.node(e)

    where_a = {n: i for i, n in enumerate(na)}
    where_b = {n: i for i, n in enumerate(nb)}
    for x, y in zip(na, nb, strict=True):
        if x.op != y.op or x.target != y.target:
            return Mismatch(f"{x.format_node()} against {y.format_node()}")
        if y.op in ("placeholder", "get_attr"):
            continue
        args = _pair_args(x.args, y.args, where_a, where_b, env, explain_int)
        kwargs = _pair_args(x.kwargs, y.kwargs, where_a, where_b, env, explain_int)
        if isinstance(args, Mismatch) or isinstance(kwargs, Mismatch):
            return args if isinstance(args, Mismatch) else kwargs
        env[y].args, env[y].kwargs = tuple(args), kwargs
    if not builder.made and not builder.sizes and not _sizes_differ(va, vb):
        return Mismatch("no size reaches the graph")
    if any(n.meta.get(PHASE) is not None for n in nb):
        assign_phases(graph)
    points = _propagate(graph, new.graph_module, va, vb, len(dims), classes)
    if isinstance(points, Mismatch):
        return points
    wrong = _check(na, nb, env, points)
    if wrong is not None:
        return wrong
    for n in graph.nodes:  # make_fx's static metadata, copied with the nodes
        n.meta.pop("tensor_meta", None)
    out = copy.copy(new)
    gm = fx.GraphModule(new.graph_module, graph)
    out._gm, out._graph = gm, gm.graph  # the same calling convention, the generalised graph
    log("dynamic", "symbolic graph from two static traces", lambda: str(out))
    return out


def _same_flat(a: Flat, b: Flat) -> bool:
    """Whether two pytree flattenings are alike: static leaves equal, or of one type and
    printed alike (an output spec object compares by identity)."""
    if (a.spec, a.is_tensor, a.static_argnums, a.wrappers) != (
        b.spec,
        b.is_tensor,
        b.static_argnums,
        b.wrappers,
    ):
        return False
    return all(
        x == y or (type(x) is type(y) and repr(x) == repr(y))
        for x, y in zip(a.static, b.static, strict=True)
    )


def _sizes_differ(va: Sequence[Any], vb: Sequence[Any]) -> bool:
    return any(_sizes_of(x) != _sizes_of(y) for x, y in zip(va, vb, strict=True))


def _propagate(
    graph: fx.Graph,
    root: torch.nn.Module,
    va: Sequence[Any],
    vb: Sequence[Any],
    n_primals: int,
    classes: Sequence[SymbolClass],
) -> tuple[Any, dict[Any, int], dict[Any, int]] | Mismatch:
    """Fake-propagate ``graph`` symbolic in ``classes`` (its meta ``val`` set in place): the
    shape environment and the symbols' values at the new and the old trace."""
    reals = [
        torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
        for v in vb[:n_primals]
    ]
    names: list[dict[int, str | None]] = [{} for _ in reals]
    for k, c in enumerate(classes):
        for i, d in c.members:
            names[i][d] = f"unify{k}"
    primal = symbolic_fakes(reals, tuple(names))
    shape_env = shape_env_of(primal)
    if shape_env is None:
        return Mismatch("no symbolic input")
    mode = primal[0].fake_mode  # type: ignore[attr-defined]
    sizes: list[Any] = [primal[c.members[0][0]].shape[c.members[0][1]] for c in classes]
    symbols = [shape_env.replace(s.node.expr) for s in sizes]
    at_new = {s: c.new for s, c in zip(symbols, classes, strict=True)}
    at_old = {s: c.old for s, c in zip(symbols, classes, strict=True)}
    rest: list[torch.Tensor] = []
    for x, y in zip(va[n_primals:], vb[n_primals:], strict=True):
        # a joint graph's tangents: contiguous, shaped like their outputs
        if not isinstance(y, torch.Tensor) or not y.is_contiguous():
            return Mismatch("an input after the primals that is not a contiguous tensor")
        shape: list[Any] = []
        for m, n in zip(x.shape, y.shape, strict=True):
            e = explain(int(n), int(m), classes)
            if isinstance(e, Mismatch):
                return e
            shape.append(int(n) if e is None else _symbolic(e, sizes))
        with mode:
            rest.append(torch.empty(shape, dtype=y.dtype, device=y.device))
    gm = fx.GraphModule(root, graph)
    try:
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*primal, *rest)
    except Exception as e:  # the generalised program is not valid at symbolic sizes
        return Mismatch(f"propagation failed: {type(e).__name__}: {e}")
    for g in shape_env.guards:
        if not bool(shape_env.replace(g.expr).xreplace(at_old)):
            return Mismatch(f"the old trace's sizes break the guard {g.expr}")
    return shape_env, at_new, at_old


def _symbolic(e: SizeExpr, sizes: Sequence[Any]) -> Any:
    out: Any = e.coeff
    for k in e.factors:
        out = out * sizes[k]
    return out + e.offset


def _at(v: Any, shape_env: Any, point: dict[Any, int]) -> Any:
    """``_sizes_of(v)`` with its symbols at ``point``."""
    sizes = _sizes_of(v)
    if sizes is None:
        return None
    return tuple(
        int(shape_env.replace(s.node.expr).xreplace(point)) if isinstance(s, torch.SymInt) else s
        for s in sizes
    )


def _check(
    na: Sequence[fx.Node],
    nb: Sequence[fx.Node],
    env: dict[fx.Node, fx.Node],
    points: tuple[Any, dict[Any, int], dict[Any, int]],
) -> Mismatch | None:
    """Every node's sizes, strides and offset, at each trace's sizes, are that trace's."""
    shape_env, at_new, at_old = points
    for x, y in zip(na, nb, strict=True):
        if y.op == "output":
            continue
        v = env[y].meta.get("val")
        for point, static in ((at_new, y), (at_old, x)):
            want = _sizes_of(static.meta.get("val"))
            got = _at(v, shape_env, point)
            if want != got:
                return Mismatch(f"{y.name}: generalised {got} where the trace has {want}")
    return None


class Pairs:
    """The last static trace of each group of calls (a group: calls whose traces may differ
    only in sizes, as ``jit`` files them), to generalise against when the group wants a
    symbolic trace. Holds the ``size`` most recently used groups.

    >>> import torch, functrans as ft
    >>> pairs = Pairs()
    >>> f = lambda x: x * x.shape[0]
    >>> def make(x):
    ...     return lambda dims: ft.trace(f, dynamic=dims)(x)
    >>> _ = pairs.make("f", make(torch.ones(3)), None)()  # static, remembered
    >>> g = pairs.make("f", make(torch.ones(5)), ({0: None},))()  # generalised
    >>> g(torch.ones(4))
    tensor([4., 4., 4., 4.])
    """

    def __init__(self, size: int = 8) -> None:
        self._size = size
        self._last: OrderedDict[Any, Any] = OrderedDict()

    def make(
        self, group: Any, make: Callable[[Dims | None], _T], dims: Dims | None
    ) -> Callable[[], _T]:
        """A trace of ``make`` (``make(dims)`` traces symbolic in ``dims``, ``make(None)``
        statically) symbolic in ``dims``: generalised from the group's last static trace and
        a static one now where they unify, else ``make(dims)``."""

        def run() -> _T:
            if dims is None:
                return self._remember(group, make(None))
            old = self._last.get(group)
            if old is None:
                return make(dims)
            new = self._remember(group, make(None))
            out = generalise(old, cast(Graph, new), dims)
            if isinstance(out, Mismatch):
                why = out.reason
                log("dynamic", "no symbolic graph from two static traces", lambda: why)
                return make(dims)
            return cast(_T, out)

        return run

    def _remember(self, group: Any, g: _T) -> _T:
        self._last[group] = g
        self._last.move_to_end(group)
        while len(self._last) > self._size:
            self._last.popitem(last=False)
        return g
