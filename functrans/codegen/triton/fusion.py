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

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from .layout import Layout, layout
from .lowering import LOWERINGS, REDUCTIONS, triton_dtype
from .regions import Access, Kernel, Plan, is_slice, is_view_op
from .schedule import order
from .traced import traced_value

__all__ = ["fuse", "lowerable"]


def _tensor_dtypes_ok(node: fx.Node) -> bool:
    vals = [traced_value(a) for a in node.all_input_nodes] + [traced_value(node)]
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
        return isinstance(parent, fx.Node) and parent.target in REDUCTIONS and lowerable(parent)
    low = LOWERINGS.get(node.target)
    if low is None or not _tensor_dtypes_ok(node):
        return False
    return low.accepts is None or low.accepts(node)


def _inline(nodes: list[fx.Node], lower: set[fx.Node]) -> frozenset[fx.Node]:
    """Values each kernel recomputes where it reads them instead of loading them: those made
    from indices alone (``arange``, ``full`` and pointwise ops of them), pointwise values
    only concats read (``cat([-x2, x1])``: the negation is done at the shifted read), and
    pointwise values only slices read, with those slices (rotary's backward: the halves of
    ``g * sin`` are read at shifted indices, not stored by one kernel to be read by another),
    and one-op pointwise values of at most two loaded inputs that several ops read (a residual
    sum read by a gradient and by a LayerNorm recompute: each computes it, so neither is tied to
    the other's kernel)."""
    out: set[fx.Node] = set()
    pure: set[fx.Node] = set()  # made from indices alone: no loads at all

    def loaded(a: fx.Node) -> bool:  # read from memory (or recomputed), not made in-kernel
        if a not in lower or a in out:
            return True
        return _is_reshape(a) and all(loaded(b) for b in a.all_input_nodes)

    for n in nodes:
        low = LOWERINGS.get(n.target)
        if n not in lower or low is None or low.kind == "reduction":
            continue
        if all(a in pure for a in n.all_input_nodes):
            pure.add(n)
            out.add(n)
            continue
        loads_only = all(loaded(a) for a in n.all_input_nodes)
        concat_read = bool(n.users) and all(_is_concat(u) and u in lower for u in n.users)
        slices = _slices(n)
        shared = len(n.users) > 1 and len(n.all_input_nodes) <= 2
        if low.kind == "pointwise" and loads_only and (concat_read or slices or shared):
            out.add(n)
            out.update(slices)
    changed = True
    while changed:  # drop any whose value something else needs in memory, and any that
        changed = False  # read a value through one just dropped (it is made in-kernel now)
        for n in reversed(nodes):
            if n in out and (
                any((u not in lower or _is_reshape(u)) and u not in out for u in n.users)
                or (n not in pure and not all(loaded(a) for a in n.all_input_nodes))
            ):
                out.discard(n)
                changed = True
    return frozenset(out)


def _slices(n: fx.Node) -> list[fx.Node]:
    """The slices (and slices of them) that read ``n``, when slices are all that read it."""
    found: list[fx.Node] = []
    todo = list(n.users)
    if not todo or not all(is_slice(u) and u.args[0] is n for u in todo):
        return []
    while todo:
        u = todo.pop()
        found.append(u)
        todo.extend(w for w in u.users if is_slice(w) and w.args[0] is u)
    return found


def _is_concat(n: fx.Node) -> bool:
    low = LOWERINGS.get(n.target)
    return low is not None and low.kind == "concat"


def _is_reshape(n: fx.Node) -> bool:
    low = LOWERINGS.get(n.target)
    return low is not None and low.kind == "reshape"


def _shares_storage(a: Any, b: Any) -> bool:
    try:
        return bool(StorageWeakRef(a.untyped_storage()) == StorageWeakRef(b.untyped_storage()))  # type: ignore[no-untyped-call]  # torch's StorageWeakRef is unannotated
    except Exception:
        return False


@dataclass(eq=False)
class _Group:
    """Nodes fused so far, in graph order, and their layout (None until a merge computed it).
    Every member maps to its group object; groups are compared and hashed as objects."""

    nodes: list[fx.Node]
    layout: Layout | None = None


class _Fuser:
    def __init__(self, graph: fx.Graph) -> None:
        self.nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
        self.index = {n: i for i, n in enumerate(graph.nodes)}
        self.lower = {n for n in self.nodes if lowerable(n)}
        self.inline = _inline(self.nodes, self.lower)
        self.lower -= self.inline
        self.group: dict[fx.Node, _Group] = {n: _Group([n]) for n in self.lower}
        self.output = next(n for n in graph.nodes if n.op == "output")

    def try_merge(self, a: fx.Node, b: fx.Node) -> bool:
        """Fuse the regions of ``a`` and ``b`` if one kernel can compute both, acyclically."""
        ga, gb = self.group[a], self.group[b]
        if ga is gb:
            return True
        nodes = sorted(ga.nodes + gb.nodes, key=self.index.__getitem__)
        if self._path_outside(ga.nodes, gb.nodes) or (lay := layout(nodes)) is None:
            return False
        merged = _Group(nodes, lay)
        for n in nodes:
            self.group[n] = merged
        return True

    def _path_outside(self, ga: list[fx.Node], gb: list[fx.Node]) -> bool:
        """Whether a path from ``ga`` to ``gb`` (either way) passes through anything else: a
        node, or a region whose members it enters and leaves (regions run as a whole)."""
        inside = set(ga) | set(gb)
        for src, dst in ((ga, gb), (gb, ga)):
            dst_set = set(dst)
            # a view an inline value reads is read from memory (its root), not made here
            stack = [
                u
                for n in src
                for u in n.users
                if u not in inside and not (u in self.inline and _is_reshape(n))
            ]
            seen: set[fx.Node] = set()
            while stack:
                u = stack.pop()
                if u in seen:
                    continue
                region = self.group[u].nodes if u in self.group else [u]
                seen.update(region)
                for m in region:
                    if any(w in dst_set for w in m.users):
                        return True
                    stack.extend(w for w in m.users if w not in inside and w not in seen)
        return False

    def run(self) -> list[list[fx.Node]]:
        for n in self.nodes:
            if n not in self.lower:
                continue
            if n.target is operator.getitem:
                self.try_merge(n.args[0], n)
                continue
            for a in n.all_input_nodes:
                if a in self.lower:
                    self.try_merge(a, n)
        for v in self.index:  # siblings reading one value share its load: one kernel
            readers = [u for u in v.users if u in self.lower and not _is_reshape(u)]
            for u in readers[1:]:
                self.try_merge(readers[0], u)
        self._merge_equal_spaces()
        return [g.nodes for g in self._groups()]

    def _groups(self) -> list[_Group]:
        return list(dict.fromkeys(self.group[n] for n in self.nodes if n in self.lower))

    def _merge_equal_spaces(self) -> None:
        """Kernels over one iteration space share a launch even without a shared input (a
        layer's weight and bias gradients: two column sums; recomputed copies of q, k and v)."""
        by_space: dict[tuple[tuple[int, ...], frozenset[int]], list[fx.Node]] = {}
        for g in self._groups():  # as they were before these merges
            lay = g.layout or layout(g.nodes)
            if lay is None:
                continue
            reps = by_space.setdefault((lay.space, lay.rdims), [])
            if not any(self.try_merge(r, g.nodes[0]) for r in reps):
                reps.append(g.nodes[0])


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
        kernel = Kernel(g, lay.space, lay.rdims, lay.fdims)
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
        elif n.op == "call_function" and is_view_op(n) and isinstance(n.args[0], fx.Node):
            acc = _view_access(n, materialize(n.args[0]))
            if acc is not None:
                access[n] = acc
                return acc
            needs_tensor.add(n)  # a view we cannot address: run it (free in torch)
        v = traced_value(n)
        if not isinstance(v, torch.Tensor):  # a tuple of an extern's outputs: getitems read it
            return Access(n, 0, (), ())
        acc = Access(n, 0, tuple(v.shape), tuple(int(s) for s in v.stride()))
        access[n] = acc
        return acc

    for kernel in kernels:  # views of outside values: read in place through their access
        for n in list(kernel.nodes):
            src = n.args[0] if _is_reshape(n) else None
            if not isinstance(src, fx.Node) or member.get(src) is kernel or src in fuser.inline:
                continue
            acc = _view_access(n, materialize(src))
            if acc is not None:
                access[n] = acc
            else:  # not addressable: run the view op, and load its result
                kernel.nodes.remove(n)
                del kernel.fdims[n], member[n]
    for n in fuser.nodes:
        if n in fuser.inline:  # recomputed by its readers, which read its inputs
            for a in n.all_input_nodes:
                if a not in fuser.inline:
                    materialize(a)
            continue
        k: Kernel | None = member.get(n)
        for a in n.all_input_nodes:
            if (k is None or member.get(a) is not k) and a not in fuser.inline:
                materialize(a)
        if k is None and n.target is not operator.getitem and not is_view_op(n):
            needs_tensor.update(n.all_input_nodes)
    for o in fuser.output.all_input_nodes:
        materialize(o)
        needs_tensor.add(o)
    nodes = [n for n in fuser.nodes if n not in fuser.inline]
    regions = order(nodes, member, access, needs_tensor, fuser.inline)
    return Plan(regions, access, fuser.inline)


def _view_access(view: fx.Node, base: Access) -> Access | None:
    """The view read in place from ``base`` 's root, or None when the trace cannot tell."""
    v, r = traced_value(view), traced_value(base.root)
    if not (isinstance(v, torch.Tensor) and isinstance(r, torch.Tensor)) or v.dtype != r.dtype:
        return None  # a view that reinterprets the bytes (view_as_real, view(dtype)): run it
    if v.is_complex() or v.is_conj() or v.is_neg():
        return None  # complex views carry conj/neg bits strides cannot express: run them
    if _shares_storage(v, r):
        return Access(
            base.root,
            int(v.storage_offset()) - int(r.storage_offset()),
            tuple(v.shape),
            tuple(v.stride()),
        )
    return _replay(view, base, tuple(v.shape))


def _replay(view: fx.Node, base: Access, want: tuple[int, ...]) -> Access | None:
    """The view op run on an empty meta tensor laid out like ``base``: where its elements are
    (None when the op cannot view that layout, e.g. merging dims a permute interleaved)."""
    if any(isinstance(a, fx.Node) for a in (*view.args[1:], *view.kwargs.values())):
        return None
    extent = 1 + sum((n - 1) * st for n, st in zip(base.shape, base.strides, strict=True))
    size = base.offset + (extent if all(base.shape) else 0)
    try:
        t = torch.empty(size, device="meta").as_strided(base.shape, base.strides, base.offset)
        out = view.target(t, *view.args[1:], **view.kwargs)  # type: ignore[operator]  # fx types target as str | Callable; here it is an op
    except (RuntimeError, TypeError, ValueError, IndexError):
        return None
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
        return None
    return Access(base.root, int(out.storage_offset()), want, tuple(int(x) for x in out.stride()))
