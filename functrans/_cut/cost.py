"""Cost model: bytes of values, FLOPs of ops, and op classes that strategies reason with.

Op classes live in :mod:`functrans._core.ops` (tracing needs them too) and are re-exported here.

Bytes are counted per storage: a view lives in its base's storage, so saving a value and a view
of it (attention's output and the reshape the output projection reads) keeps one buffer alive,
not two. :func:`storage_of` is that rule; the liveness simulation (:mod:`functrans._cut.memory`),
the partition report and :func:`saved_activation_bytes` all use it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx

from functrans._core.flop_formulas import flop_registry
from functrans._core.graph import ROLE, Role
from functrans._core.ops import (
    COLLECTIVE_NAMESPACES,
    COMPUTE_INTENSIVE,
    RANDOM_UNLESS,
    OpClass,
    is_collective,
    is_getitem,
    is_random,
    op_class,
    overload_of,
)
from functrans._core.shapes import hint

__all__ = [
    "COLLECTIVE_NAMESPACES",
    "COMPUTE_INTENSIVE",
    "RANDOM_UNLESS",
    "OpClass",
    "Storage",
    "activation_bytes",
    "flops",
    "is_collective",
    "is_input_alias",
    "is_input_storage",
    "is_random",
    "nbytes",
    "nbytes_expr",
    "op_class",
    "read_bytes",
    "saved_activation_bytes",
    "storage_nbytes",
    "storage_of",
    "storage_value",
    "value_of",
]


aten = torch.ops.aten


def read_bytes(val: Any) -> int:
    """Bytes an op reads from a tensor: dims broadcast with stride 0 count once.

    >>> read_bytes(torch.empty(64, 1).expand(64, 64))
    256
    """
    if not isinstance(val, torch.Tensor):
        return 0
    distinct = math.prod(hint(n) for n, st in zip(val.shape, val.stride(), strict=True) if st)
    return distinct * val.element_size()


def nbytes(val: Any) -> int:
    """Bytes a value occupies: numel × itemsize for tensors (summed over tuples), 0 otherwise.

    >>> nbytes(torch.empty(64, 64))
    16384

    Symbolic sizes (a ``dynamic`` trace) count at the trace's example sizes, without adding a
    guard (see :func:`nbytes_expr` for the formula).
    """
    if isinstance(val, torch.Tensor):
        return hint(val.numel()) * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(nbytes(v) for v in val)
    return 0


#: Where a value lives: the node that allocates the storage and, for one output of an op with
#: several (``native_layer_norm``'s mean), that output's index.
Storage = tuple[fx.Node, int | None]


def storage_of(node: fx.Node) -> Storage:
    """The storage ``node``'s value lives in: a view (and ``getitem`` of a view op's list of
    views, and ``_unsafe_view``, which aliases its input too) lives in its base's; ``getitem``
    of a multi-output op in that output's own; every other node allocates its own.

    >>> import torch, functrans as ft
    >>> g = ft.trace(lambda x: (x.exp().t(), x.t()))(torch.ones(2, 2))
    >>> [(n.name, storage_of(n)[0].name) for n in g.fx_graph.nodes if n.op != "output"]
    [('x', 'x'), ('exp', 'exp'), ('permute', 'exp'), ('permute_1', 'x')]
    """
    while True:
        src = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        if src is None:
            return node, None
        if (  # one output of a multi-output op: its own storage
            is_getitem(node)
            and isinstance(src.meta.get("val"), (tuple, list))
            and op_class(src) is not OpClass.VIEW
        ):
            return src, int(node.args[1])  # type: ignore[arg-type]  # getitem's index: an int
        if op_class(node) is not OpClass.VIEW and node.target not in _ALIASING:
            return node, None
        node = src


#: Ops that return their input's memory though torch does not mark them as views:
#: ``_unsafe_view`` reshapes a fresh result (a matmul's) without copying it
_ALIASING = frozenset({aten._unsafe_view.default})


def nbytes_expr(val: Any) -> str | None:
    """The bytes of a tensor with symbolic sizes as a formula in the size symbols
    (``'8*s0*s1'``); None where the sizes are static.

    >>> nbytes_expr(torch.empty(4, 4)) is None
    True
    """
    if isinstance(val, torch.Tensor):
        n = val.numel() * val.element_size()
        return str(n) if isinstance(n, torch.SymInt) else None
    return None


def storage_value(node: fx.Node) -> Any:
    """The value of the storage ``node`` lives in (see :func:`storage_of`)."""
    return value_of(storage_of(node))


def value_of(storage: Storage) -> Any:
    """The value of ``storage`` (found by :func:`storage_of`)."""
    root, index = storage
    val = root.meta.get("val")
    if index is not None and isinstance(val, (tuple, list)):
        val = val[index]
    return val


def storage_nbytes(node: fx.Node) -> int:
    """Bytes of the storage ``node``'s value lives in (a view keeps all of its base alive).

    >>> import torch, functrans as ft
    >>> g = ft.trace(lambda x: x.exp()[0])(torch.ones(4, 4))
    >>> [(n.name, nbytes(n.meta["val"]), storage_nbytes(n)) for n in g.ops()]
    [('exp', 64, 64), ('select', 16, 64)]
    """
    return nbytes(storage_value(node))


def is_input_alias(node: fx.Node) -> bool:
    """True for a primal placeholder or a chain of view ops on one (it costs no extra memory).

    >>> import torch, functrans as ft
    >>> g = ft.trace(lambda x: x.t().exp())(torch.ones(2, 3))
    >>> [(n.name, is_input_alias(n)) for n in g.fx_graph.nodes if n.op != "output"]
    [('x', True), ('permute', True), ('exp', False)]
    """
    return is_input_storage(storage_of(node))


def is_input_storage(storage: Storage) -> bool:
    """True for the storage of a primal placeholder (see :func:`is_input_alias`)."""
    root, _ = storage
    return root.op == "placeholder" and root.meta.get(ROLE) in (Role.PRIMAL, None)


def activation_bytes(node: fx.Node) -> int:
    """Bytes saving ``node`` alone keeps alive: its storage's (a view keeps all of its base), 0
    for inputs and views of inputs.

    A per-value figure: a value and a view of it saved together share one storage, which
    :func:`saved_activation_bytes` counts once.

    >>> import torch, functrans as ft
    >>> g = ft.trace(lambda x: x.exp()[0])(torch.ones(4, 4))
    >>> [(n.name, activation_bytes(n)) for n in g.ops()]
    [('exp', 64), ('select', 64)]
    """
    return 0 if is_input_alias(node) else storage_nbytes(node)


def saved_activation_bytes(nodes: Iterable[fx.Node]) -> int:
    """Bytes saving all of ``nodes`` adds to memory: each storage counted once, whole (a view
    keeps its base alive), primal inputs and views of them not at all.

    >>> import torch, functrans as ft
    >>> g = ft.trace(lambda x: x.exp().t())(torch.ones(4, 4))
    >>> exp, t = g.ops()
    >>> activation_bytes(exp) + activation_bytes(t), saved_activation_bytes([exp, t])
    (128, 64)
    """
    storages = {storage_of(n): n for n in nodes if not is_input_alias(n)}
    return sum(storage_nbytes(n) for n in storages.values())


def flops(node: fx.Node) -> int:
    """Floating-point operations of one op, from torch's flop formulas where it has one.

    Pointwise ops count one per output element, reductions one per input element, views and
    inputs zero.

    >>> import torch, functrans as ft
    >>> g = ft.trace(lambda x, w: (x @ w).relu().sum())(torch.ones(2, 3), torch.ones(3, 4))
    >>> [(n.name, flops(n)) for n in g.ops()]  # mm: 2 * 2 * 3 * 4
    [('mm', 48), ('relu', 8), ('sum_1', 8)]
    """
    op = overload_of(node)
    if op is None:
        return 0
    vals = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    formula = flop_registry.get(op.overloadpacket)
    out = node.meta.get("val")
    if formula is not None:  # registered formulas take values and read their shapes
        args, kwargs = vals
        return hint(formula(*args, out_val=out, **kwargs))
    cls = op_class(node)
    if cls in (OpClass.VIEW, OpClass.INPUT):
        return 0
    if cls is OpClass.REDUCTION:
        first = vals[0][0] if vals[0] else None
        return _numel(first)
    return _numel(out)


def _numel(val: Any) -> int:
    if isinstance(val, torch.Tensor):
        return hint(val.numel())
    if isinstance(val, (tuple, list)):
        return sum(_numel(v) for v in val)
    return 0
