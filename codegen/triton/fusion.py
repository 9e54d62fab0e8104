"""Graph -> ordered regions: Triton kernels, ATen extern calls and free views.

Every node of a graph ends in exactly one place:

* a :class:`Kernel` region, when it has a lowering (``lowering.LOWERINGS``). Producers fuse into
  their consumers when both map onto one *iteration space*: a shape ``space`` with a set of
  reduced dims ``rdims``; each member's output dims are mapped onto the space's dims
  (``fdims``), so a reduction, the pointwise ops feeding it and those using its result (a whole
  softmax or layer_norm) share one kernel. Views that only add, drop or broadcast size-1 dims
  fuse as index bookkeeping. Fusion never creates a cycle: two regions merge only when no path
  between them leaves them;
* a free view (:class:`Access`): a view of a materialized value is read in place by index
  arithmetic (its offset and strides, known from the trace), never copied;
* an extern region: matmuls, convolutions, attention, random ops and any op without a lowering
  run as the ATen op itself.

Recomputed forward ops in a backward graph are ordinary members: they fuse into the kernels that
consume them.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from .lowering import LOWERINGS, REDUCTIONS, triton_dtype

__all__ = ["Access", "Extern", "Kernel", "Plan", "View", "fuse"]

FDims = tuple[int | None, ...]


@dataclass(frozen=True)
class Access:
    """Where a value lives: ``root`` 's buffer at element ``offset`` with ``strides``."""

    root: fx.Node
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]


@dataclass
class Kernel:
    """Nodes computed by one Triton kernel over ``space`` (reducing ``rdims``)."""

    nodes: list[fx.Node]
    space: tuple[int, ...] = ()
    rdims: frozenset[int] = frozenset()
    fdims: dict[fx.Node, FDims] = field(default_factory=dict)
    stores: list[fx.Node] = field(default_factory=list)  # values other regions read


@dataclass(frozen=True)
class Extern:
    """One node run as its ATen op."""

    node: fx.Node


@dataclass(frozen=True)
class View:
    """A view run as its (free) torch op, because an extern or the output needs the tensor."""

    node: fx.Node


Region = Kernel | Extern | View


@dataclass(frozen=True)
class Plan:
    """The regions in execution order, and how every materialized value is addressed."""

    regions: list[Region]
    access: dict[fx.Node, Access]


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _shape(node: fx.Node) -> tuple[int, ...]:
    v = _val(node)
    if isinstance(v, (tuple, list)):
        v = v[0]
    return tuple(int(s) for s in v.shape)


def _is_view_op(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    if schema is None or len(schema.returns) != 1:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def _tensor_dtypes_ok(node: fx.Node) -> bool:
    vals = [_val(a) for a in node.all_input_nodes] + [_val(node)]
    flat: list[Any] = []
    for v in vals:
        flat.extend(v if isinstance(v, (tuple, list)) else [v])
    try:
        return all(isinstance(v, torch.Tensor) and bool(triton_dtype(v.dtype)) for v in flat)
    except KeyError:
        return False


def lowerable(node: fx.Node) -> bool:
    """Whether ``node`` can be computed inside a kernel."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        parent = node.args[0]
        return isinstance(parent, fx.Node) and parent.target in REDUCTIONS
    low = LOWERINGS.get(node.target)
    if low is None or not _tensor_dtypes_ok(node):
        return False
    return low.accepts is None or low.accepts(node)


def _reduced_dims(node: fx.Node, rank: int) -> tuple[list[int], bool]:
    pos, _ = REDUCTIONS[node.target]
    dims: Any = node.args[pos] if 0 <= pos < len(node.args) else node.kwargs.get("dim")
    keepdim = bool(
        node.kwargs.get("keepdim", node.args[pos + 1] if 0 <= pos < len(node.args) - 1 else False)
    )
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(rank)), keepdim
    if isinstance(dims, int):
        dims = [dims]
    return sorted({d % rank for d in dims}), keepdim


def _align(
    shape: Sequence[int], space: Sequence[int], known: Sequence[int | None] | None = None
) -> FDims | None:
    """Right-align ``shape`` to ``space`` (broadcasting) where ``known`` has no dim yet; None if
    a non-1 size does not match."""
    known = list(known) if known is not None else [None] * len(shape)
    used = {k for k in known if k is not None}
    off = len(space) - len(shape)
    out: list[int | None] = []
    for j, s in enumerate(shape):
        d = j + off
        if known[j] is not None:
            out.append(known[j])
        elif s == 1:
            out.append(None)
        elif d < 0 or space[d] != s or d in used:
            return None
        else:
            out.append(d)
    return tuple(out)


def layout(
    nodes: Sequence[fx.Node],
) -> tuple[tuple[int, ...], frozenset[int], dict[fx.Node, FDims]] | None:
    """The iteration space, reduced dims and dim maps of ``nodes`` fused together, or None."""
    members = set(nodes)
    reductions = [n for n in nodes if n.target in REDUCTIONS]
    if reductions:
        space = _shape(reductions[0].args[0])  # type: ignore[arg-type]
    else:
        space = max((_shape(n) for n in nodes), key=lambda s: _numel(s))
    rdims: set[int] | None = None
    fd: dict[fx.Node, FDims] = {}
    for n in nodes:
        out = _shape(n)
        if n.target is operator.getitem:
            fd[n] = fd[n.args[0]]  # type: ignore[index]
            continue
        kind = LOWERINGS[n.target].kind
        cand: list[int | None] = [None] * len(out)
        if kind == "reduction":
            src = n.args[0]
            assert isinstance(src, fx.Node)
            a_shape = _shape(src)
            fa = fd[src] if src in members else _align(a_shape, space)
            if fa is None:
                return None
            dims, keepdim = _reduced_dims(n, len(a_shape))
            mapped = {fa[d] for d in dims if a_shape[d] != 1}
            want = {d for d in range(len(space)) if d in mapped}
            if None in mapped or (rdims is not None and want != rdims):
                return None
            rdims = want
            cand = [
                None if d in dims else fa[d]
                for d in range(len(a_shape))
                if keepdim or d not in dims
            ]
            if len(cand) != len(out):
                return None
        elif kind == "reshape" and n.target is not torch.ops.aten.expand.default:
            src = n.args[0]
            assert isinstance(src, fx.Node)
            a_shape = _shape(src)
            if [s for s in a_shape if s != 1] != [s for s in out if s != 1]:
                return None
            if src in members:
                it = iter(f for f, s in zip(fd[src], a_shape, strict=True) if s != 1)
                cand = [next(it) if s != 1 else None for s in out]
        else:
            for a in n.all_input_nodes:
                if a not in members:
                    continue
                a_shape, off = _shape(a), len(out) - len(_shape(a))
                for ja, f in enumerate(fd[a]):
                    j = ja + off
                    if a_shape[ja] == 1 or j < 0:
                        continue
                    if cand[j] is None:
                        cand[j] = f
                    elif cand[j] != f:
                        return None
        if any(c is None and s != 1 for c, s in zip(cand, out, strict=True)):
            fill = _align(out, space, cand)
            if fill is None:
                return None
            cand = list(fill)
        for c, s in zip(cand, out, strict=True):
            if s != 1 and (c is None or space[c] != s):
                return None
        if len({c for c in cand if c is not None}) != sum(c is not None for c in cand):
            return None
        fd[n] = tuple(cand)
    return space, frozenset(rdims or ()), fd


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _is_reshape(n: fx.Node) -> bool:
    low = LOWERINGS.get(n.target)
    return low is not None and low.kind == "reshape"


def _shares_storage(a: Any, b: Any) -> bool:
    try:
        return bool(StorageWeakRef(a.untyped_storage()) == StorageWeakRef(b.untyped_storage()))  # type: ignore[no-untyped-call]
    except Exception:
        return False


class _Fuser:
    def __init__(self, graph: fx.Graph) -> None:
        self.nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
        self.index = {n: i for i, n in enumerate(graph.nodes)}
        self.lower = {n for n in self.nodes if lowerable(n)}
        self.group: dict[fx.Node, list[fx.Node]] = {n: [n] for n in self.lower}
        self.layouts: dict[int, Any] = {}
        self.output = next(n for n in graph.nodes if n.op == "output")

    def try_merge(self, a: fx.Node, b: fx.Node) -> None:
        ga, gb = self.group[a], self.group[b]
        if ga is gb:
            return
        merged = sorted(ga + gb, key=self.index.__getitem__)
        if self._path_outside(ga, gb) or (lay := layout(merged)) is None:
            return
        for n in merged:
            self.group[n] = merged
        self.layouts[id(merged)] = lay

    def _path_outside(self, ga: list[fx.Node], gb: list[fx.Node]) -> bool:
        """Whether a path from ``ga`` to ``gb`` (either way) passes a node outside both."""
        inside = set(ga) | set(gb)
        for src, dst in ((ga, gb), (gb, ga)):
            dst_set, limit = set(dst), max(self.index[n] for n in dst)
            stack = [u for n in src for u in n.users if u not in inside]
            seen: set[fx.Node] = set()
            while stack:
                u = stack.pop()
                if u in seen or self.index[u] > limit:
                    continue
                seen.add(u)
                if any(w in dst_set for w in u.users):
                    return True
                stack.extend(w for w in u.users if w not in inside)
        return False

    def run(self) -> list[list[fx.Node]]:
        for n in self.nodes:
            if n not in self.lower:
                continue
            if n.target is operator.getitem:
                self.try_merge(n.args[0], n)  # type: ignore[arg-type]
                continue
            for a in n.all_input_nodes:
                if a in self.lower:
                    self.try_merge(a, n)
        for v in self.index:  # siblings reading one value share its load: one kernel
            readers = [u for u in v.users if u in self.lower and not _is_reshape(u)]
            for u in readers[1:]:
                self.try_merge(readers[0], u)
        self._merge_equal_reductions()
        return self._groups()

    def _groups(self) -> list[list[fx.Node]]:
        groups: dict[int, list[fx.Node]] = {}
        for n in self.nodes:
            if n in self.lower:
                groups.setdefault(id(self.group[n]), self.group[n])
        return list(groups.values())

    def _merge_equal_reductions(self) -> None:
        """Reductions over one iteration space share a kernel even without a shared input
        (a layer's weight and bias gradients: two column sums)."""
        by_space: dict[Any, fx.Node] = {}
        for g in self._groups():
            lay = self.layouts.get(id(g)) or layout(g)
            if lay is None or not lay[1]:
                continue
            key = (lay[0], lay[1])
            first = by_space.setdefault(key, g[0])
            if first is not g[0]:
                self.try_merge(first, g[0])


def fuse(graph: fx.Graph) -> Plan:
    """Cut ``graph`` into kernels, extern calls and free views, in an order that runs."""
    fuser = _Fuser(graph)
    groups = fuser.run()
    member: dict[fx.Node, Kernel] = {}
    kernels: list[Kernel] = []
    for g in groups:
        if all(_is_reshape(n) for n in g):
            continue  # views of values in memory: read in place, no kernel
        lay = layout(g)
        if lay is None:  # a lone node whose shapes no kernel maps (cannot happen for merged)
            continue
        kernel = Kernel(g, lay[0], lay[1], lay[2])
        kernels.append(kernel)
        for n in g:
            member[n] = kernel
    access: dict[fx.Node, Access] = {}
    needs_tensor: set[fx.Node] = set()

    def materialize(n: fx.Node) -> Access:
        """Make ``n`` readable from memory; returns its access."""
        if n in access:
            return access[n]
        k = member.get(n)
        if k is not None and _is_reshape(n):
            src = n.args[0]
            assert isinstance(src, fx.Node)
            acc = _view_access(n, materialize(src))
            if acc is not None:
                access[n] = acc
                return acc
        if k is not None:
            if n not in k.stores:
                k.stores.append(n)
        elif n.op == "call_function" and _is_view_op(n) and isinstance(n.args[0], fx.Node):
            acc = _view_access(n, materialize(n.args[0]))
            if acc is not None:
                access[n] = acc
                return acc
            needs_tensor.add(n)  # a view we cannot address: run it (free in torch)
        v = _val(n)
        if not isinstance(v, torch.Tensor):  # a tuple of an extern's outputs: getitems read it
            return Access(n, 0, (), ())
        acc = Access(n, 0, tuple(v.shape), tuple(int(s) for s in v.stride()))
        access[n] = acc
        return acc

    for n in fuser.nodes:
        k: Kernel | None = member.get(n)
        for a in n.all_input_nodes:
            if k is None or member.get(a) is not k:
                materialize(a)
        if k is None and n.target is not operator.getitem and not _is_view_op(n):
            needs_tensor.update(n.all_input_nodes)
    for o in fuser.output.all_input_nodes:
        materialize(o)
        needs_tensor.add(o)
    return Plan(_order(graph, fuser.nodes, member, kernels, access, needs_tensor), access)


def _view_access(view: fx.Node, base: Access) -> Access | None:
    """The view read in place from ``base`` 's root, or None when the trace cannot tell."""
    v, r = _val(view), _val(base.root)
    if isinstance(v, torch.Tensor) and isinstance(r, torch.Tensor) and _shares_storage(v, r):
        return Access(
            base.root,
            int(v.storage_offset()) - int(r.storage_offset()),
            tuple(v.shape),
            tuple(v.stride()),
        )
    src = view.args[0]
    s = _val(src)
    if (
        isinstance(v, torch.Tensor)
        and isinstance(s, torch.Tensor)
        and s.is_contiguous()
        and base.strides == tuple(s.stride())
        and v.is_contiguous()  # a reshape of a contiguous value: same memory order
    ):
        return Access(base.root, base.offset, tuple(v.shape), tuple(v.stride()))
    return None


def _order(
    graph: fx.Graph,
    nodes: list[fx.Node],
    member: dict[fx.Node, Kernel],
    kernels: list[Kernel],
    access: dict[fx.Node, Access],
    needs_tensor: set[fx.Node],
) -> list[Region]:
    """Regions in an order where every region's inputs are ready (a topological sort)."""
    region_of: dict[fx.Node, Region] = {}
    regions: list[Region] = []
    for n in nodes:
        if n in needs_tensor and n in access and access[n].root is not n:
            region_of[n] = View(n)  # a free view some extern or the output needs as a tensor
        elif n in member:
            region_of[n] = member[n]
        elif n.target is operator.getitem and n.args[0] in member:
            region_of[n] = member[n.args[0]]  # type: ignore[index]
        elif _is_view_op(n) and n in access and access[n].root is not n:
            pass  # read in place by the kernels that use it
        else:
            region_of[n] = Extern(n)
    seen: set[int] = set()
    for r in region_of.values():
        if id(r) not in seen:
            seen.add(id(r))
            regions.append(r)
    deps: dict[int, set[int]] = {id(r): set() for r in regions}

    def producers(n: fx.Node) -> Iterable[fx.Node]:
        own = member.get(n) if region_of.get(n) is member.get(n) else None
        for a in n.all_input_nodes:
            if own is not None and member.get(a) is own:
                continue  # computed inside the same kernel
            if a in region_of:
                yield a
            elif a in access and access[a].root is not a:
                yield from producers(a)  # a free view: depends on what its root depends on
                if access[a].root in region_of:
                    yield access[a].root

    for n, r in region_of.items():
        members = [m for m in r.nodes if region_of.get(m) is r] if isinstance(r, Kernel) else [n]
        for m in members:
            for p in producers(m):
                pr = region_of[p]
                if pr is not r:
                    deps[id(r)].add(id(pr))
    random = [
        r
        for r in regions
        if isinstance(r, Extern)
        and torch.Tag.nondeterministic_seeded in getattr(r.node.target, "tags", ())
    ]
    for a, b in itertools.pairwise(random):  # random ops keep their order: same draws
        deps[id(b)].add(id(a))
    ordered: list[Region] = []
    done: set[int] = set()
    pending = list(regions)
    while pending:
        progress = [r for r in pending if deps[id(r)] <= done]
        if not progress:
            stuck = [_describe(r) for r in pending]
            raise AssertionError(f"fusion produced a cycle among {stuck}")
        for r in progress:
            ordered.append(r)
            done.add(id(r))
        pending = [r for r in pending if id(r) not in done]
    return ordered


def _describe(r: Region) -> str:
    return str([n.name for n in r.nodes][:3]) if isinstance(r, Kernel) else r.node.name
