"""Cost model: bytes of values, FLOPs of ops, and op classes that strategies reason with.

Op classes come from torch's own op tags where they exist (``torch.Tag.pointwise``,
``torch.Tag.reduction``, ``torch.Tag.nondeterministic_seeded``) and from op schemas (views,
mutation), so new ATen ops are classified without a hand-written list. Only the
compute-intensive class is a list: those are the ops worth saving instead of redoing.
"""

from __future__ import annotations

import enum
import math
import operator
from typing import Any

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from ._graph import ROLE, Role

__all__ = [
    "COMPUTE_INTENSIVE",
    "OpClass",
    "activation_bytes",
    "flops",
    "is_input_alias",
    "nbytes",
    "op_class",
    "read_bytes",
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


class OpClass(enum.Enum):
    """What kind of work an op does; strategies decide what to save from this."""

    INPUT = "input"  # placeholder
    VIEW = "view"  # metadata only: aliases its input
    POINTWISE = "pointwise"
    REDUCTION = "reduction"
    COMPUTE = "compute"  # compute-intensive: matmul, conv, attention
    RANDOM = "random"  # draws from the RNG: recomputing changes the value
    EFFECTFUL = "effectful"  # mutates or has side effects
    OTHER = "other"  # everything else (copies, scatter, indexing, ...)


def read_bytes(val: Any) -> int:
    """Bytes an op reads from a tensor: dims broadcast with stride 0 count once.

    >>> read_bytes(torch.empty(64, 1).expand(64, 64))
    256
    """
    if not isinstance(val, torch.Tensor):
        return 0
    distinct = math.prod(int(n) for n, st in zip(val.shape, val.stride(), strict=True) if st)
    return distinct * val.element_size()


def nbytes(val: Any) -> int:
    """Bytes a value occupies: numel × itemsize for tensors (summed over tuples), 0 otherwise.

    >>> nbytes(torch.empty(64, 64))
    16384
    """
    if isinstance(val, torch.Tensor):
        return int(val.numel()) * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(nbytes(v) for v in val)
    return 0


def _overload(node: fx.Node) -> torch._ops.OpOverload | None:
    t = node.target
    return t if node.op == "call_function" and isinstance(t, torch._ops.OpOverload) else None


def op_class(node: fx.Node) -> OpClass:
    """Classify ``node``'s op (see :class:`OpClass`)."""
    if node.op == "placeholder":
        return OpClass.INPUT
    op = _overload(node)
    if op is None:
        return OpClass.VIEW if node.op == "call_function" and _is_getitem(node) else OpClass.OTHER
    tags = set(op.tags)
    if torch.Tag.nondeterministic_seeded in tags:
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


def _is_getitem(node: fx.Node) -> bool:
    return node.target is operator.getitem


def is_input_alias(node: fx.Node) -> bool:
    """True for a primal placeholder or a chain of view ops on one (it costs no extra memory)."""
    while op_class(node) is OpClass.VIEW and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node.op == "placeholder" and node.meta.get(ROLE) in (Role.PRIMAL, None)


def activation_bytes(node: fx.Node) -> int:
    """Bytes saving ``node`` adds to memory: 0 for inputs and views of inputs."""
    return 0 if is_input_alias(node) else nbytes(node.meta.get("val"))


def flops(node: fx.Node) -> int:
    """Floating-point operations of one op, from torch's flop formulas where it has one.

    Pointwise ops count one per output element, reductions one per input element, views and
    inputs zero.
    """
    op = _overload(node)
    if op is None:
        return 0
    vals = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    formula = flop_registry.get(op.overloadpacket)
    out = node.meta.get("val")
    if formula is not None:  # registered formulas take values and read their shapes
        args, kwargs = vals
        return int(formula(*args, out_val=out, **kwargs))
    cls = op_class(node)
    if cls in (OpClass.VIEW, OpClass.INPUT):
        return 0
    if cls is OpClass.REDUCTION:
        first = vals[0][0] if vals[0] else None
        return _numel(first)
    return _numel(out)


def _numel(val: Any) -> int:
    if isinstance(val, torch.Tensor):
        return int(val.numel())
    if isinstance(val, (tuple, list)):
        return sum(_numel(v) for v in val)
    return 0
