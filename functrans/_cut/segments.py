"""Where a forward pass narrows to one value: the boundaries between its blocks.

A stack of blocks (transformer layers, residual MLPs) hands one activation from each block to
the next: the residual stream. Right after a residual add, that add's output is the only
activation the rest of the forward reads from everything computed so far. Such a value is a
*boundary*, and the forward values between two boundaries are one *segment*. Recomputation that
starts from saved boundaries stays inside a segment's backward (what ``torch.utils.checkpoint``
per block achieves by hand); recomputing a boundary instead would drag the recomputation of every
earlier segment it depends on into the first backward step that needs it, and keep all of it
alive from there.

Which values count: *activations*, the forward values computed from the differentiated inputs
(parameters, or inputs that take a gradient). Values computed only from other inputs or from
nothing (attention masks from ``attention_mask``, rotary tables from positions and a buffer,
constants) are *shared*: every block may read them, so they cross every boundary and belong to
none. Inputs and views of inputs cost nothing and are not values here at all.

A boundary is an activation ``c`` such that, right after ``c`` is computed, every activation
computed so far that a later forward op reads is ``c`` or a view of it.

>>> import torch, functrans as ft
>>> def f(w1, w2, x):
...     x = x + torch.tanh(x @ w1)  # a residual block
...     x = x + torch.tanh(x @ w2)
...     return x.sum()
>>> jg = ft.joint(f, argnums=(0, 1))(torch.ones(4, 4), torch.ones(4, 4), torch.ones(2, 4))
>>> s = segments(jg)
>>> [n.name for n in s.boundaries]  # before the first add, x is read again only as an input
['mm', 'tanh', 'add', 'add_1']
>>> [s.index[n] for n in s.boundaries], len(s)
([0, 1, 2, 3], 5)
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.fx as fx

from functrans._core.dtypes import differentiable
from functrans._core.graph import PHASE, JointGraph, Phase, ancestors

from .cost import OpClass, Storage, is_input_alias, nbytes, op_class, storage_of

__all__ = ["SHARED", "Segments", "differentiated_primals", "segments"]

#: :attr:`Segments.index` of a shared value (computed from no differentiated input)
SHARED = -1


@dataclass(frozen=True, eq=False)
class Segments:
    """The boundaries of a joint graph's forward pass and the segment of every forward value.

    ``boundaries`` holds the boundary values in forward order; ``index`` maps every forward
    value to its segment: ``k`` for the values computed after boundary ``k - 1`` up to and
    including boundary ``k`` (the last segment, ``len(boundaries)``, runs to the outputs), or
    :data:`SHARED` for values computed from no differentiated input. A graph with no
    boundaries is one segment.

    >>> import torch, functrans as ft
    >>> from functrans.extend import SHARED, segments
    >>> def f(w, x):
    ...     mask = torch.ones(2, 4).tril()  # computed from no input: shared
    ...     return (x + torch.tanh(x @ w) * mask).sum()
    >>> s = segments(ft.joint(f, argnums=0)(torch.ones(4, 4), torch.ones(2, 4)))
    >>> [n.name for n, k in s.index.items() if k == SHARED][:1]  # the mask's first op
    ['full']
    """

    boundaries: tuple[fx.Node, ...]
    index: Mapping[fx.Node, int]

    def __len__(self) -> int:
        """The number of segments."""
        return len(self.boundaries) + 1

    @functools.cached_property
    def checkpoints(self) -> tuple[fx.Node, ...]:
        """The boundaries worth saving, where recomputation should start: those that close a
        segment holding a compute-intensive op (a matmul, a convolution) and are no wider than
        the median such boundary (the residual stream). A segment of only cheap ops (the
        LayerNorm after a residual add) is better recomputed from the boundary before it
        than kept as a second value per block, and a wide boundary (an MLP's hidden
        activation before the first residual add, the logits) is cheaper recomputed than
        kept to the end of backward.

        >>> import torch, functrans as ft
        >>> def f(w1, w2, x):
        ...     x = x + torch.tanh(x @ w1)
        ...     x = x + torch.tanh(x @ w2)
        ...     return x.sum()
        >>> jg = ft.joint(f, argnums=(0, 1))(torch.ones(4, 4), torch.ones(4, 4), torch.ones(2, 4))
        >>> [n.name for n in segments(jg).checkpoints]  # the segment closed by add is add alone
        ['mm', 'add_1']
        """
        heavy = {k for n, k in self.index.items() if k != SHARED and op_class(n) is OpClass.COMPUTE}
        closing = [b for k, b in enumerate(self.boundaries) if k in heavy]
        if not closing:
            return ()
        widths = sorted(nbytes(b.meta.get("val")) for b in closing)
        median = widths[(len(widths) - 1) // 2]
        return tuple(b for b in closing if nbytes(b.meta.get("val")) <= median)


def differentiated_primals(joint: JointGraph) -> list[fx.Node]:
    """The primal inputs the joint graph differentiates: floating-point and complex tensor
    leaves of its ``argnums`` arguments.

    >>> import torch, functrans as ft
    >>> jg = ft.joint(lambda w, x: (x @ w).sum(), argnums=0)(torch.ones(2, 2), torch.ones(2, 2))
    >>> [n.name for n in differentiated_primals(jg)]
    ['primals_1']
    """
    primals = joint.primals()
    paths = joint.fn_in.spec.accessors()
    if len(paths) != len(joint.fn_in.is_tensor):
        return [p for p in primals if _floating(p)]
    accessors = [a for a, t in zip(paths, joint.fn_in.is_tensor, strict=True) if t]
    if len(accessors) != len(primals):  # not a function's own inputs: count every float one
        return [p for p in primals if _floating(p)]
    out = []
    for p, path in zip(primals, accessors, strict=True):
        entries = list(path)
        in_args = len(entries) >= 2 and entries[0].entry == 0
        if in_args and entries[1].entry in joint.argnums and _floating(p):
            out.append(p)
    return out


def _floating(node: fx.Node) -> bool:
    return differentiable(node.meta.get("val"))


_CACHE: weakref.WeakKeyDictionary[JointGraph, Segments] = weakref.WeakKeyDictionary()


def segments(joint: JointGraph) -> Segments:
    """The :class:`Segments` of ``joint``'s forward pass (see the module docstring), computed
    once per graph.

    >>> import torch, functrans as ft
    >>> jg = ft.joint(lambda w, x: (x + x @ w).sum(), argnums=0)(torch.ones(4, 4), torch.ones(2, 4))
    >>> [n.name for n in segments(jg).boundaries]
    ['mm', 'add']
    """
    found = _CACHE.get(joint)
    if found is None:
        found = _CACHE[joint] = _segments(joint)
    return found


def _segments(joint: JointGraph) -> Segments:
    # the forward pass proper: what the outputs are computed from (forward-phase values only
    # backward reads, such as a weight's transpose, come after it in the joint graph)
    core = ancestors(joint.forward_outputs(), set())
    nodes = [n for n in joint.fx_graph.nodes if n in core and n.meta.get(PHASE) is Phase.FORWARD]
    active = _activations(nodes, set(differentiated_primals(joint)))
    pos = {n: i for i, n in enumerate(nodes)}
    owner: dict[Storage, fx.Node] = {}  # each storage's first node: the value that made it
    for n in nodes:
        if _is_tensor(n):
            owner.setdefault(storage_of(n), n)
    # where the forward reads each activation's storage last
    last: dict[fx.Node, int] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            made = owner.get(storage_of(a)) if a in core else None
            if made in active:
                last[made] = max(last.get(made, -1), pos[n])
    boundaries: list[fx.Node] = []
    live: set[fx.Node] = set()
    dies: dict[int, list[fx.Node]] = {}
    for i, n in enumerate(nodes):
        if owner.get(storage_of(n)) is n and n in active and last.get(n, -1) > i:
            live.add(n)
            dies.setdefault(last[n], []).append(n)
        for done in dies.pop(i, ()):
            live.discard(done)
        if live == {n}:
            boundaries.append(n)
    index: dict[fx.Node, int] = {}
    k = 0
    for n in nodes:
        if is_input_alias(n):
            continue  # the caller's memory: in no segment
        made = owner.get(storage_of(n), n)  # a view belongs where its base does
        index[n] = SHARED if made not in active else index.get(made, k)
        if k < len(boundaries) and n is boundaries[k]:
            k += 1
    return Segments(tuple(boundaries), MappingProxyType(index))


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _activations(nodes: list[fx.Node], sources: set[fx.Node]) -> set[fx.Node]:
    """Forward values computed from a differentiated input (not inputs or views of them)."""
    dependent: set[fx.Node] = set()
    for n in nodes:
        if n in sources or any(a in dependent for a in n.all_input_nodes):
            dependent.add(n)
    return {n for n in dependent if not is_input_alias(n)}
