"""ATen overload -> Triton expression: the table every fused kernel is rendered from.

An entry is a :class:`Lowering`: its ``kind`` (``"pointwise"``, ``"reduction"``, ``"index"``
for ops that make values from the iteration index, ``"reshape"`` for views that only add,
remove or broadcast size-1 dims) and a ``render`` function from the node's operands, already
rendered as Triton expressions (tensor operands) or Python constants (everything else), to an
expression. Floating values are computed in float32 (float64 stays float64) and rounded to the
node's dtype only where the graph converts explicitly or stores; ``cast`` says which dtype the
tensor operands are converted to first.

>>> import torch
>>> LOWERINGS[torch.ops.aten.mul.Tensor].render(["tmp0", "tmp1"])
'(tmp0 * tmp1)'
>>> triton_dtype(torch.bfloat16)
'tl.bfloat16'
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
import torch.fx as fx

__all__ = [
    "LOWERINGS",
    "REDUCTIONS",
    "Concat",
    "Lowering",
    "Piece",
    "Reduction",
    "as_dtype",
    "compute_dtype",
    "compute_triton_dtype",
    "concat_pieces",
    "literal",
    "pointer_type",
    "triton_dtype",
]

aten = torch.ops.aten
Kind = Literal["pointwise", "reduction", "index", "reshape", "concat"]
Cast = Literal["out", "values", "promote", "none"]  # "values": all operands but the first

_TL = {
    torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16",
    torch.float32: "tl.float32",
    torch.float64: "tl.float64",
    torch.int8: "tl.int8",
    torch.uint8: "tl.uint8",
    torch.int16: "tl.int16",
    torch.int32: "tl.int32",
    torch.int64: "tl.int64",
    torch.bool: "tl.int1",
}
_PTR = {
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.float32: "*fp32",
    torch.float64: "*fp64",
    torch.int8: "*i8",
    torch.uint8: "*u8",
    torch.int16: "*i16",
    torch.int32: "*i32",
    torch.int64: "*i64",
    torch.bool: "*i1",
}


def triton_dtype(dtype: torch.dtype) -> str:
    """The ``tl`` dtype spelling of a torch dtype."""
    return _TL[dtype]


def pointer_type(dtype: torch.dtype) -> str:
    """Triton signature type of a pointer to ``dtype`` elements (``"*fp32"``)."""
    return _PTR[dtype]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a value of ``dtype`` is computed in: half types widen to float32."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def compute_triton_dtype(dtype: torch.dtype) -> str:
    """The ``tl`` dtype a value of ``dtype`` is computed in.

    >>> compute_triton_dtype(torch.bfloat16), compute_triton_dtype(torch.float64)
    ('tl.float32', 'tl.float64')
    """
    return triton_dtype(compute_dtype(dtype))


def as_dtype(expr: str, dtype: torch.dtype) -> str:
    """``expr`` as a value of ``dtype``, held in its compute dtype. Half types are rounded to
    ``dtype`` first, as eager rounds every op's result: a recomputed value must equal the
    stored one bit for bit (``eq`` against a saved ``amax``, a clamp at its bound).

    >>> as_dtype("tmp0", torch.bfloat16)
    '(tmp0).to(tl.bfloat16).to(tl.float32)'
    """
    if compute_dtype(dtype) != dtype:
        return f"({expr}).to({triton_dtype(dtype)}).to({compute_triton_dtype(dtype)})"
    return f"({expr}).to({compute_triton_dtype(dtype)})"


def literal(value: Any) -> str:
    """A Python constant as Triton source text."""
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, float):
        if math.isnan(value):
            return 'float("nan")'
        if math.isinf(value):
            return 'float("inf")' if value > 0 else 'float("-inf")'
        return repr(value)
    if isinstance(value, int):
        return str(value)
    raise TypeError(f"cannot render constant {value!r}")


Render = Callable[[Sequence[Any]], str]


@dataclass(frozen=True)
class Lowering:
    """How one overload becomes Triton source (see the module docstring)."""

    kind: Kind
    render: Render
    cast: Cast = "out"
    accepts: Callable[[fx.Node], bool] | None = None  # None: every call of the overload


def _e(x: Any) -> str:
    """An operand as source: rendered tensors are strings already, constants become literals."""
    return x if isinstance(x, str) else literal(x)


def _unary(fn: str) -> Lowering:
    return Lowering("pointwise", lambda a: f"{fn}({_e(a[0])})")


def _binary(op: str, cast: Cast = "out") -> Lowering:
    return Lowering("pointwise", lambda a: f"({_e(a[0])} {op} {_e(a[1])})", cast)


def _logical(op: str) -> Lowering:  # operands of any dtype: nonzero is true
    return Lowering("pointwise", lambda a: f"(({_e(a[0])} != 0) {op} ({_e(a[1])} != 0))", "none")


def _alpha(op: str) -> Lowering:
    def render(a: Sequence[Any]) -> str:
        alpha = a[2] if len(a) > 2 else 1
        other = _e(a[1]) if alpha == 1 else f"({_e(a[1])} * {literal(alpha)})"
        return f"({_e(a[0])} {op} {other})"

    return Lowering("pointwise", render)


_POW = {
    0.5: "tl.sqrt({0})",
    -0.5: "(1.0 / tl.sqrt({0}))",
    1: "{0}",
    2: "({0} * {0})",
    3: "({0} * {0} * {0})",
    -1: "(1.0 / {0})",
    -2: "(1.0 / ({0} * {0}))",
}


def _pow(a: Sequence[Any]) -> str:  # pow.Tensor_Scalar: exponents in _POW only
    return _POW[a[1]].format(a[0])


def _scalar_pow(a: Sequence[Any]) -> str:  # pow.Scalar(self: Scalar, exponent: Tensor), self > 0
    return f"tl.exp({a[1]} * {literal(math.log(a[0]))})"


def _where(a: Sequence[Any]) -> str:
    return f"tl.where({_e(a[0])}, {_e(a[1])}, {_e(a[2])})"


def _clamp(a: Sequence[Any]) -> str:
    out = a[0]
    if len(a) > 1 and a[1] is not None:
        out = f"tl.maximum({out}, {literal(a[1])})"
    if len(a) > 2 and a[2] is not None:
        out = f"tl.minimum({out}, {literal(a[2])})"
    return str(out)


def _identity(a: Sequence[Any]) -> str:
    return str(a[0])


def _sigmoid(a: Sequence[Any]) -> str:
    return f"(1.0 / (1.0 + tl.exp(-{a[0]})))"


def _const(index: int) -> Lowering:
    return Lowering("index", lambda a: literal(a[index]), "none")


def _arange(a: Sequence[Any]) -> str:  # a = [index_expr, start, end, step]
    return f"({literal(a[1])} + {a[0]} * {literal(a[3])})"


def _same_dtype(n: fx.Node) -> bool:
    vals = [a.meta.get("val") for a in n.all_input_nodes] + [n.meta.get("val")]
    return len({getattr(v, "dtype", None) for v in vals}) == 1


def _unit_step(n: fx.Node) -> bool:
    step: Any = n.args[5] if len(n.args) > 5 else n.kwargs.get("step", 1)
    return bool(step == 1)


class Piece(NamedTuple):
    """An operand of a concat placed at ``start`` along the concat dim, ``size`` long."""

    node: fx.Node
    start: int
    size: int


class Concat(NamedTuple):
    """The ``pieces`` a concat places along ``dim``, over ``base`` (None for ``cat``)."""

    dim: int
    pieces: list[Piece]
    base: fx.Node | None


def concat_pieces(n: fx.Node) -> Concat:
    """Where the operands of concat node ``n`` go: ``cat`` places its operands one after
    another; ``slice_scatter`` places ``src`` over ``base``.

    >>> import functrans as ft
    >>> g = ft.trace(lambda a, b: torch.cat([a, b], 1))(torch.ones(2, 3), torch.ones(2, 5))
    >>> cat = concat_pieces(next(g.ops()))
    >>> cat.dim, [(p.node.name, p.start, p.size) for p in cat.pieces], cat.base
    (1, [('a', 0, 3), ('b', 3, 5)], None)
    """
    out = n.meta["val"]
    rank = out.dim()
    args: Any = n.args
    if n.target is aten.cat.default:
        dim = int(args[1]) % rank if len(args) > 1 else 0
        pieces, start = [], 0
        for a in args[0]:
            val = a.meta["val"]
            size = int(val.shape[dim]) if val.dim() == rank else 0  # legacy empty 1-d pieces
            pieces.append(Piece(a, start, size))
            start += size
        return Concat(dim, pieces, None)
    base, src = args[0], args[1]
    dim = int(args[2]) % rank if len(args) > 2 else 0
    start_arg = args[3] if len(args) > 3 else None
    first = 0 if start_arg is None else int(start_arg)
    first = first + int(out.shape[dim]) if first < 0 else min(first, int(out.shape[dim]))
    return Concat(dim, [Piece(src, first, int(src.meta["val"].shape[dim]))], base)


LOWERINGS: dict[Any, Lowering] = {
    # arithmetic: operands converted to the result's compute dtype first
    aten.add.Tensor: _alpha("+"),
    aten.sub.Tensor: _alpha("-"),
    aten.mul.Tensor: _binary("*"),
    aten.div.Tensor: _binary("/"),
    aten.add.Scalar: _alpha("+"),
    aten.sub.Scalar: _alpha("-"),
    aten.mul.Scalar: _binary("*"),
    aten.div.Scalar: _binary("/"),
    aten.maximum.default: Lowering("pointwise", lambda a: f"tl.maximum({_e(a[0])}, {_e(a[1])})"),
    aten.minimum.default: Lowering("pointwise", lambda a: f"tl.minimum({_e(a[0])}, {_e(a[1])})"),
    aten.pow.Tensor_Scalar: Lowering("pointwise", _pow, accepts=lambda n: n.args[1] in _POW),
    aten.pow.Scalar: Lowering(
        "pointwise",
        _scalar_pow,
        accepts=lambda n: isinstance(n.args[0], (int, float)) and n.args[0] > 0,
    ),
    aten.neg.default: Lowering("pointwise", lambda a: f"(-{a[0]})"),
    aten.abs.default: _unary("tl.abs"),
    aten.exp.default: _unary("tl.exp"),
    aten.log.default: _unary("tl.log"),
    aten.sqrt.default: _unary("tl.sqrt"),
    aten.rsqrt.default: Lowering("pointwise", lambda a: f"(1.0 / tl.sqrt({a[0]}))"),
    aten.reciprocal.default: Lowering("pointwise", lambda a: f"(1.0 / {a[0]})"),
    aten.sin.default: _unary("tl.sin"),
    aten.cos.default: _unary("tl.cos"),
    # libdevice's tanh: 2 / (1 + exp(-2x)) - 1 cancels near 0 (mish was 30x eager's error)
    aten.tanh.default: _unary("libdevice.tanh"),
    aten.erf.default: _unary("tl.erf"),
    aten.sigmoid.default: Lowering("pointwise", _sigmoid),
    aten.relu.default: Lowering("pointwise", lambda a: f"tl.maximum({a[0]}, 0)"),
    aten.clamp.default: Lowering("pointwise", _clamp),
    aten.sign.default: Lowering(
        "pointwise", lambda a: f"((0 < {a[0]}).to({a[0]}.dtype) - ({a[0]} < 0).to({a[0]}.dtype))"
    ),
    # comparisons and logic: operands converted to their common dtype
    aten.eq.Tensor: _binary("==", "promote"),
    aten.ne.Tensor: _binary("!=", "promote"),
    aten.lt.Tensor: _binary("<", "promote"),
    aten.le.Tensor: _binary("<=", "promote"),
    aten.gt.Tensor: _binary(">", "promote"),
    aten.ge.Tensor: _binary(">=", "promote"),
    aten.eq.Scalar: _binary("==", "promote"),
    aten.ne.Scalar: _binary("!=", "promote"),
    aten.lt.Scalar: _binary("<", "promote"),
    aten.le.Scalar: _binary("<=", "promote"),
    aten.gt.Scalar: _binary(">", "promote"),
    aten.ge.Scalar: _binary(">=", "promote"),
    aten.logical_and.default: Lowering(
        "pointwise", lambda a: f"(({_e(a[0])} != 0) & ({_e(a[1])} != 0))", "none"
    ),
    aten.logical_or.default: Lowering(
        "pointwise", lambda a: f"(({_e(a[0])} != 0) | ({_e(a[1])} != 0))", "none"
    ),
    aten.logical_not.default: Lowering("pointwise", lambda a: f"({a[0]} == 0)", "none"),
    aten.where.self: Lowering("pointwise", _where, "values"),
    # copies and conversions: the value, converted to the result's dtype
    aten.clone.default: Lowering("pointwise", _identity),
    aten._to_copy.default: Lowering("pointwise", _identity),
    aten.alias.default: Lowering("pointwise", _identity),
    torch.ops.prims.copy_strided.default: Lowering("pointwise", _identity),  # relayout.py
    # values made from the index
    aten.full.default: _const(1),
    aten.scalar_tensor.default: _const(0),
    aten.arange.start_step: Lowering("index", _arange, "none"),
    # views that only add, drop or broadcast size-1 dims, inside a kernel
    aten.view.default: Lowering("reshape", _identity, "none"),
    aten._unsafe_view.default: Lowering("reshape", _identity, "none"),
    aten.unsqueeze.default: Lowering("reshape", _identity, "none"),
    aten.squeeze.dim: Lowering("reshape", _identity, "none"),
    aten.squeeze.dims: Lowering("reshape", _identity, "none"),
    aten.squeeze.default: Lowering("reshape", _identity, "none"),
    aten.expand.default: Lowering("reshape", _identity, "none"),
    # pieces of other values placed along one dim: each read at a shifted index (shifted.py)
    aten.cat.default: Lowering("concat", _identity, "none", accepts=lambda n: _same_dtype(n)),
    aten.slice_scatter.default: Lowering(
        "concat", _identity, "none", accepts=lambda n: _same_dtype(n) and _unit_step(n)
    ),
}

Combine = Literal["sum", "mean", "max", "min", "var_mean", "var"]


class Reduction(NamedTuple):
    """A reduction overload: the position of its ``dim`` argument (-1: it has none, and
    reduces everything) and how it combines a row. Rendered by :mod:`.reduce`."""

    dim_arg: int
    combine: Combine


REDUCTIONS: dict[Any, Reduction] = {
    aten.sum.dim_IntList: Reduction(1, "sum"),
    aten.sum.default: Reduction(-1, "sum"),
    aten.mean.dim: Reduction(1, "mean"),
    aten.mean.default: Reduction(-1, "mean"),
    aten.amax.default: Reduction(1, "max"),
    aten.amin.default: Reduction(1, "min"),
    aten.var_mean.correction: Reduction(1, "var_mean"),
    aten.var.correction: Reduction(1, "var"),
}
for _op in REDUCTIONS:
    LOWERINGS[_op] = Lowering("reduction", _identity)
