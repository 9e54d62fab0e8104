"""Cost model: bytes of values, FLOPs of ops, and op classes that strategies reason with.

Op classes come from torch's own op tags where they exist (``torch.Tag.pointwise``,
``torch.Tag.reduction``, ``torch.Tag.nondeterministic_seeded``) and from op schemas (views,
mutation), so new ATen ops are classified without a hand-written list. Two classes are tables:
the compute-intensive ops (worth saving instead of redoing) and the seeded ops that draw random
numbers only when an argument asks for it (attention with ``dropout_p > 0``).

Bytes are counted per storage: a view lives in its base's storage, so saving a value and a view
of it (attention's output and the reshape the output projection reads) keeps one buffer alive,
not two. :func:`storage_of` is that rule; the liveness simulation (:mod:`functrans._memory`), the
partition report and :func:`saved_activation_bytes` all use it.
"""

from __future__ import annotations

import enum
import functools
import math
import operator
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.fx as fx

from ._dynamic import hint
from ._flop_formulas import flop_registry
from ._graph import ROLE, Role

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
    "is_random",
    "nbytes",
    "nbytes_expr",
    "op_class",
    "read_bytes",
    "saved_activation_bytes",
    "storage_nbytes",
    "storage_of",
    "storage_value",
]

aten = torch.ops.aten

#: Op packets whose outputs are worth saving rather than recomputing (matmul, conv, attention).
COMPUTE_INTENSIVE: frozenset[Any] = frozenset(
    getattr(aten, name)
    for name in (
        "mm",
        "bmm",
        "addmm",
        "baddbmm",
        "matmul",
        "convolution",
        "convolution_backward",
        "_convolution",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
    if hasattr(aten, name)
)


#: Seeded ops (``torch.Tag.nondeterministic_seeded``) that draw no random numbers, and leave the
#: generator alone, when an argument (read by name through the op's schema) has the given value:
#: the attention kernels apply dropout only when ``dropout_p`` is not 0, and ``native_dropout``
#: with ``train=False`` returns its input and a mask of ones. A seeded op not listed here is
#: always random; so is a listed one whose argument is symbolic or another node's value.
#: Op namespaces of torch.distributed's functional collectives (and their ``wait_tensor``).
COLLECTIVE_NAMESPACES = frozenset(
    {"_c10d_functional", "_c10d_functional_autograd", "c10d_functional", "_dtensor"}
)


def is_collective(node: fx.Node) -> bool:
    """Whether ``node`` is a collective (or the wait on one): it talks to the other ranks.

    >>> import torch.fx as fx
    >>> g = fx.Graph()
    >>> is_collective(g.call_function(torch.ops.aten.sin.default, (g.placeholder("x"),)))
    False
    """
    return op_class(node) is OpClass.COLLECTIVE


RANDOM_UNLESS: Mapping[Any, tuple[str, object]] = {
    getattr(aten, name): rule
    for name, rule in (
        ("_scaled_dot_product_flash_attention", ("dropout_p", 0.0)),
        ("_scaled_dot_product_flash_attention_for_cpu", ("dropout_p", 0.0)),
        ("_scaled_dot_product_efficient_attention", ("dropout_p", 0.0)),
        ("_scaled_dot_product_efficient_attention_backward", ("dropout_p", 0.0)),
        ("_scaled_dot_product_cudnn_attention", ("dropout_p", 0.0)),
        ("_scaled_dot_product_cudnn_attention_backward", ("dropout_p", 0.0)),
        ("_scaled_dot_product_fused_attention_overrideable", ("dropout_p", 0.0)),
        ("_scaled_dot_product_attention_math_for_mps", ("dropout_p", 0.0)),
        ("_flash_attention_forward", ("dropout_p", 0.0)),
        ("_efficient_attention_forward", ("dropout_p", 0.0)),
        ("native_dropout", ("train", False)),
    )
    if hasattr(aten, name)
}


class OpClass(enum.Enum):
    """What kind of work an op does; strategies decide what to save from this.

    >>> import torch, functrans as ft
    >>> from functrans.extend import OpClass, op_class
    >>> g = ft.trace(lambda x: (x @ x.t()).exp().sum())(torch.ones(2, 2))
    >>> [(n.name, op_class(n).name) for n in g.ops()]  # doctest: +NORMALIZE_WHITESPACE
    [('permute', 'VIEW'), ('mm', 'COMPUTE'), ('exp', 'POINTWISE'), ('sum_1', 'REDUCTION')]
    >>> OpClass.COMPUTE.value
    'compute'
    """

    INPUT = "input"  # placeholder
    VIEW = "view"  # metadata only: aliases its input
    POINTWISE = "pointwise"
    REDUCTION = "reduction"
    COMPUTE = "compute"  # compute-intensive: matmul, conv, attention
    RANDOM = "random"  # draws from the RNG: recomputing changes the value
    EFFECTFUL = "effectful"  # mutates or has side effects
    COLLECTIVE = "collective"  # talks to other ranks: every rank must issue the same sequence
    SIZE = "size"  # an int computed from symbolic sizes (``sym_size``, ``s0 * 4``)
    OTHER = "other"  # everything else (copies, scatter, indexing, ...)


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


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _overload(node: fx.Node) -> torch._ops.OpOverload | None:
    t = node.target
    return t if node.op == "call_function" and isinstance(t, torch._ops.OpOverload) else None


def op_class(node: fx.Node) -> OpClass:
    """Classify ``node``'s op (see :class:`OpClass`).

    >>> import torch, functrans as ft
    >>> g = ft.trace(lambda x, w: (x @ w).relu().sum())(torch.ones(2, 3), torch.ones(3, 4))
    >>> [(n.name, op_class(n).name) for n in g.fx_graph.nodes if n.op != "output"]
    [('x', 'INPUT'), ('w', 'INPUT'), ('mm', 'COMPUTE'), ('relu', 'POINTWISE'),
     ('sum_1', 'REDUCTION')]
    """
    if node.op == "placeholder":
        return OpClass.INPUT
    if isinstance(node.meta.get("val"), _SYMBOLIC):
        return OpClass.SIZE
    op = _overload(node)
    if op is None:
        return OpClass.VIEW if node.op == "call_function" and _is_getitem(node) else OpClass.OTHER
    found = _class_of(op)
    if found is OpClass.RANDOM and op.overloadpacket in RANDOM_UNLESS and not is_random(node):
        return _class_of(op, seeded=False)
    return found


@functools.cache
def _class_of(op: torch._ops.OpOverload, *, seeded: bool = True) -> OpClass:
    """The class of every call of ``op`` (``seeded=False``: as if it drew no random numbers);
    cached per op, as strategies ask about thousands of nodes."""
    if op.namespace in COLLECTIVE_NAMESPACES:
        return OpClass.COLLECTIVE
    tags = set(op.tags)
    if seeded and torch.Tag.nondeterministic_seeded in tags:
        return OpClass.RANDOM
    if op._schema.is_mutable:
        return OpClass.EFFECTFUL
    if op.overloadpacket in COMPUTE_INTENSIVE:
        return OpClass.COMPUTE
    if op.is_view:
        return OpClass.VIEW
    if torch.Tag.pointwise in tags:
        return OpClass.POINTWISE
    if torch.Tag.reduction in tags:
        return OpClass.REDUCTION
    return OpClass.OTHER


def is_random(node: fx.Node) -> bool:
    """Whether ``node`` draws random numbers (recomputing it would change its value).

    Seeded ops are random unless :data:`RANDOM_UNLESS` says their arguments turn the randomness
    off, as attention without dropout:

    >>> import torch, functrans as ft
    >>> def attention(q, p):
    ...     return torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=p)
    >>> g = ft.trace(attention, static_argnums=(1,))(torch.ones(1, 1, 4, 8), 0.0)
    >>> [(n.target.__name__, is_random(n)) for n in g.ops()]
    [('_scaled_dot_product_flash_attention_for_cpu.default', False), ('getitem', False)]
    """
    op = _overload(node)
    if op is None or torch.Tag.nondeterministic_seeded not in op.tags:
        return False
    rule = RANDOM_UNLESS.get(op.overloadpacket)
    if rule is None:
        return True
    name, off = rule
    value = _argument(node, op, name)
    return not (isinstance(value, (bool, int, float)) and value == off)


_MISSING = object()


def _argument(node: fx.Node, op: torch._ops.OpOverload, name: str) -> Any:
    """The value ``node`` passes for ``op``'s argument ``name`` (its default if not passed)."""
    for i, arg in enumerate(op._schema.arguments):
        if arg.name != name:
            continue
        if name in node.kwargs:
            return node.kwargs[name]
        if not arg.kwarg_only and i < len(node.args):
            return node.args[i]
        return arg.default_value if arg.has_default_value() else _MISSING
    return _MISSING


def _is_getitem(node: fx.Node) -> bool:
    return node.target is operator.getitem


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
        multi = isinstance(src.meta.get("val"), (tuple, list)) and op_class(src) is not OpClass.VIEW
        if _is_getitem(node) and multi:  # one output of a multi-output op: its own storage
            return src, int(node.args[1])  # type: ignore[arg-type]
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
    root, index = storage_of(node)
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
    root, _ = storage_of(node)
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
    op = _overload(node)
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
