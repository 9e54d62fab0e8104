"""Op classes: what kind of work an ATen op does, the vocabulary tracing and strategies share.

Classes come from torch's own op tags where they exist (``torch.Tag.pointwise``,
``torch.Tag.reduction``, ``torch.Tag.nondeterministic_seeded``) and from op schemas (views,
mutation), so new ATen ops are classified without a hand-written list. Two classes are tables:
the compute-intensive ops (worth saving instead of redoing) and the seeded ops that draw random
numbers only when an argument asks for it (attention with ``dropout_p > 0``).
"""

from __future__ import annotations

import enum
import functools
import operator
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx
from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

__all__ = [
    "COLLECTIVE_NAMESPACES",
    "COMPUTE_CALLS",
    "COMPUTE_INTENSIVE",
    "RANDOM_UNLESS",
    "OpClass",
    "cancelled_transposes",
    "is_collective",
    "is_getitem",
    "is_random",
    "is_view_op",
    "op_class",
    "overload_of",
    "permutation",
    "register_compute_call",
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

#: Op packets that run a compiled graph worth saving the results of rather than running again
#: (an outlined region's forward, :mod:`functrans._jit.outline`): compute-intensive whatever
#: they hold. Filled by the modules that define them, before any graph holds one.
COMPUTE_CALLS: set[Any] = set()


def register_compute_call(packet: Any) -> None:
    """Count ``packet`` (an op that runs a compiled graph) among :data:`COMPUTE_CALLS`: how
    the module defining it declares it."""
    COMPUTE_CALLS.add(packet)


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


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def overload_of(node: fx.Node) -> torch._ops.OpOverload | None:
    """The ATen overload ``node`` calls, or None for placeholders, getitem and Python calls."""
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
    if node.target is run_and_save_rng_state or _state_of_a_draw(node):
        return OpClass.RANDOM  # a random op run, and the generator state it started from
    if node.target is run_with_rng_state:  # a random op run again from a kept state
        inner = node.args[1]
        return (
            _class_of(inner, seeded=False)
            if isinstance(inner, torch._ops.OpOverload)
            else OpClass.OTHER
        )
    op = overload_of(node)
    if op is None:
        return OpClass.VIEW if node.op == "call_function" and is_getitem(node) else OpClass.OTHER
    found = _class_of(op)
    if found is OpClass.RANDOM and op.overloadpacket in RANDOM_UNLESS and not is_random(node):
        return _class_of(op, seeded=False)
    return found


def _state_of_a_draw(node: fx.Node) -> bool:
    """The generator state a random op run by ``run_and_save_rng_state`` started from: part
    of the draw (recomputing it would draw again), as the op's result is."""
    src = node.args[0] if node.target is operator.getitem and node.args else None
    return bool(
        isinstance(src, fx.Node) and src.target is run_and_save_rng_state and node.args[1] == 0
    )


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
    if op.overloadpacket in COMPUTE_INTENSIVE or op.overloadpacket in COMPUTE_CALLS:
        return OpClass.COMPUTE
    if is_view_op(op):
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
    if node.target is run_and_save_rng_state:
        return True
    op = overload_of(node)
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


def is_view_op(node_or_target: fx.Node | object) -> bool:
    """Whether a node's op (or the op ``node_or_target`` itself) is an ATen view: its output
    aliases its first argument's storage (``view``, ``permute``, ``t``, ``expand``...).
    ``operator.getitem`` is not one (:class:`OpClass` counts it as ``VIEW`` all the same).

    >>> is_view_op(torch.ops.aten.t.default), is_view_op(torch.ops.aten.sin.default)
    (True, False)
    """
    target = node_or_target.target if isinstance(node_or_target, fx.Node) else node_or_target
    return isinstance(target, torch._ops.OpOverload) and target.is_view


def is_getitem(node: fx.Node) -> bool:
    """Whether ``node`` takes one element of a multi-output op's result (``operator.getitem``)."""
    return node.target is operator.getitem


def permutation(node: fx.Node) -> list[int] | None:
    """The dim permutation a transposing node (``t``, ``transpose``, ``permute``) applies, or
    None for any other node.

    >>> import torch, functrans as ft
    >>> g = ft.trace(lambda x: x.transpose(0, 2) * 2)(torch.ones(2, 3, 4))
    >>> [permutation(n) for n in g.ops()]
    [[2, 1, 0], None]
    """
    val = node.meta.get("val")
    rank = val.dim() if isinstance(val, torch.Tensor) else None
    if rank is None:
        return None
    if node.target is aten.t.default:
        return [1, 0] if rank == 2 else list(range(rank))
    if node.target is aten.transpose.int:
        dims: Any = node.args[1:3]
        a, b = (int(d) % max(rank, 1) for d in dims)
        p = list(range(rank))
        p[a], p[b] = p[b], p[a]
        return p
    if node.target is aten.permute.default:
        order: Any = node.args[1]
        return [int(d) % max(rank, 1) for d in order]
    return None


def cancelled_transposes(node: fx.Node) -> fx.Node | None:
    """What ``node`` reads back unchanged through a transpose pair that cancels (None: it
    does not). Traced graphs have none left (:func:`functrans.trace` drops them); passes that
    build graphs of their own use it.

    >>> import torch
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> gm = make_fx(lambda x: x.t().t() * 2)(torch.ones(2, 3))
    >>> [(n.name, getattr(cancelled_transposes(n), "name", None)) for n in gm.graph.nodes][1:4]
    [('t', None), ('t_1', 'x_1'), ('mul', None)]
    """
    outer = permutation(node) if node.op == "call_function" else None
    inner_node = node.args[0] if outer is not None else None
    if outer is None or not isinstance(inner_node, fx.Node):
        return None
    inner = permutation(inner_node) if inner_node.op == "call_function" else None
    if inner is None or len(inner) != len(outer):
        return None
    if [inner[o] for o in outer] != list(range(len(outer))):
        return None
    base = inner_node.args[0]
    assert isinstance(base, fx.Node)
    return base
