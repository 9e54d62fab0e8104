"""Fast metadata rules for the ops whose torch fake kernels dominate a symbolic trace.

With symbolic sizes, torch's fake kernels run Python reference implementations over sympy
expressions: ``view`` of a contiguous tensor walks torch's general reshape algorithm (a
``split_dim``/``collapse_view`` per dimension, each a tensor whose contiguity is recomputed in
sympy: about 1 ms), ``native_layer_norm`` and its backward, ``gelu_backward`` and the
cross-entropy ops run their whole decompositions on fake tensors (5-30 ms each), and a
pointwise op of two tensors or a matmul recomputes broadcasting and strides (1-3 ms). A 2-block
GPT's symbolic compile spent about 40% of its time in these ops (0.50 s -> 0.31 s with the
rules).

:class:`SymbolicFakeMode` is the fake-tensor mode of symbolic traces (``symbolic_fakes``,
region traces). For these ops it builds the outputs directly, in the cases where their layout
is plain, and hands every other case to torch's kernel unchanged:

- ``view`` of a contiguous tensor to a shape of the same element count (the counts equal as
  expressions, so torch would add no guard either) is the input's storage with contiguous
  strides, as torch's reshape algorithm lays it out;
- ``native_layer_norm`` (float32/float64, static normalized sizes) gives a contiguous output
  like its input and contiguous mean and rstd of the input's leading sizes with ones for the
  normalized dimensions; its backward gives contiguous gradients like the input, the weight
  and the bias (or None where the output mask or a missing weight or bias says so);
- a pointwise op (``add``, ``sub``, ``mul``, ``div``, ``gelu``, ``gelu_backward``) of tensors
  of one shape and float dtype, all contiguous (no broadcasting, no promotion), gives a
  contiguous result like them;
- ``mm`` of 2-D float tensors whose inner sizes are equal as expressions, and ``addmm`` with
  a bias of the output's last size (a linear layer's), give a contiguous result;
- ``t`` and ``transpose`` (pure metadata) are a view with the sizes and strides swapped;
- ``_log_softmax`` and its backward of a contiguous float tensor give one like it;
  ``nll_loss_forward`` with a mean or sum over 2-D logits and 1-D int64 targets of as many
  rows (equal as expressions or by an earlier guard), without class weights, gives two 0-dim
  values of the logits' dtype, and its backward a contiguous gradient like the logits.

Every rule needs strided fakes of this mode, on one device, without data-dependent sizes; a
rule that makes a new tensor needs its inputs laid out exactly as new contiguous tensors
(size-one dimensions included) with sizes that are products of symbols; Python numbers as
operands, complex ``alpha``, bad dims and unknown options go to torch's kernel, which
promotes or raises.

The rules add no guard. One case where torch's kernel adds some: ``view`` of a contiguous
``(s0, s1)`` as ``(s1, s0)``, where torch's reshape algorithm asks whether the sizes are equal
or divide each other; the result is the same contiguous view either way, so the rule's holds
at every size. Each rule is checked against torch's own kernel, output by output (sizes,
strides, offset, dtype, device as expressions, and the guards each adds), in
``tests/core/test_fake_rules.py``, with the cases a review found; a symbolic GPT traces to the
same tensor ops with the same metadata and guards with and without them.

>>> import torch
>>> from functrans._core.shapes import symbolic_fakes
>>> (x,) = symbolic_fakes([torch.ones(4, 6, 64)], ({0: None, 1: None},))
>>> type(x.fake_mode).__name__
'SymbolicFakeMode'
>>> v = x.view(x.shape[0], x.shape[1], 4, 16)
>>> v.shape, v.stride()
(torch.Size([s0, s1, 4, 16]), (64*s1, 64, 16, 1))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sympy  # type: ignore[import-untyped]  # sympy ships no type stubs
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, in_kernel_invocation_manager
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, statically_known_true

__all__ = ["RULES", "SymbolicFakeMode"]

aten = torch.ops.aten

#: A rule: the op's outputs for these arguments, or None (torch's kernel decides).
Rule = Callable[["SymbolicFakeMode", Sequence[Any], Mapping[str, Any]], Any]

_FLOATS = (torch.float32, torch.float64)


class SymbolicFakeMode(FakeTensorMode):  # type: ignore[no-untyped-call]  # torch: unannotated
    """The fake-tensor mode of a symbolic trace: torch's, with :data:`RULES` tried first."""

    #: off in tests that compare the rules with torch's kernels
    rules_enabled: bool = True

    def dispatch(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> object:
        rule = RULES.get(func) if self.rules_enabled else None
        if rule is not None and not self.in_kernel_invocation:
            out = rule(self, args, kwargs or {})
            if out is not None:
                return out
        return super().dispatch(func, types, args, kwargs or {})


def _fake(mode: SymbolicFakeMode, t: Any) -> bool:
    """A strided fake tensor of ``mode`` without a constant value (torch propagates those)
    and without sizes that depend on data (torch lays those out with ``Max(1, u0)``)."""
    return (
        isinstance(t, FakeTensor)
        and t.fake_mode is mode
        and t.constant is None
        and t.layout == torch.strided
        and not free_unbacked_symbols(t)
    )


def _one_device(*tensors: Any) -> bool:
    """Whether the tensors (None skipped) are on one device (else torch's kernel raises)."""
    devices = {t.device for t in tensors if t is not None}
    return len(devices) <= 1


def _expr(s: int | torch.SymInt) -> sympy.Expr:
    return s.node.expr if isinstance(s, torch.SymInt) else sympy.Integer(s)


def _equal(a: int | torch.SymInt, b: int | torch.SymInt) -> bool:
    """Whether two sizes are equal without a guard: as expressions, or by what the shape
    environment already knows (a guard an earlier op added)."""
    if _expr(a) == _expr(b):
        return True
    return isinstance(a, torch.SymInt) and statically_known_true(a == b)


def _size_like(s: Any) -> bool:
    """An int >= 0, or a SymInt that is a product of symbols and a positive integer (what a
    size is): never -1, never negative."""
    if type(s) is int:
        return s >= 0
    if not isinstance(s, torch.SymInt):
        return False
    if free_unbacked_symbols(s):
        return False
    expr = s.node.expr
    factors = expr.args if isinstance(expr, sympy.Mul) else (expr,)
    return all(f.is_Symbol or (f.is_Integer and f > 0) for f in factors)


def _contiguous_strides(shape: Sequence[int | torch.SymInt]) -> list[int | torch.SymInt]:
    """Row-major strides of ``shape`` as torch makes them (a size 0 counts as 1)."""
    strides: list[int | torch.SymInt] = []
    step: int | torch.SymInt = 1
    for size in reversed(shape):
        strides.append(step)
        step = step * (max(size, 1) if type(size) is int else size)
    return strides[::-1]


def _is_contiguous(t: torch.Tensor) -> bool:
    """Whether ``t``'s strides are the row-major ones as expressions (without a guard), on
    every dimension: size-one dimensions too, unlike torch's contiguity (torch keeps an odd
    stride of a size-one dimension in a view of the same shape, and in a result laid out like
    its input). False where the expressions differ (torch's kernel then decides)."""
    step = sympy.Integer(1)
    for size, stride in zip(reversed(t.shape), reversed(t.stride()), strict=True):
        if _expr(stride) != step:
            return False
        step = step * (sympy.Integer(max(size, 1)) if type(size) is int else _expr(size))
    return True


def _plain(t: torch.Tensor) -> bool:
    """Whether ``t`` lies exactly as a new contiguous tensor would (:func:`_is_contiguous`)
    and its sizes are sizes (products of symbols and positive integers: torch guards on a size
    like ``s0 - 1`` being one)."""
    return all(_size_like(s) for s in t.shape) and _is_contiguous(t)


def _new(mode: SymbolicFakeMode, shape: Sequence[Any], like: torch.Tensor) -> FakeTensor:
    """A fresh contiguous fake tensor of ``shape`` with ``like``'s dtype and device."""
    with in_kernel_invocation_manager(mode):
        meta = torch.empty(list(shape), dtype=like.dtype, device="meta")
    return FakeTensor(mode, meta, like.device)


def _view(
    mode: SymbolicFakeMode, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> FakeTensor | None:
    if len(args) != 2 or kwargs:
        return None
    a, shape = args
    if not _fake(mode, a) or a.dim() == 0 or not isinstance(shape, (list, tuple)) or not shape:
        return None
    if not all(_size_like(s) for s in shape) or not _is_contiguous(a):
        return None
    if sympy.Mul(*map(_expr, a.shape)) != sympy.Mul(*map(_expr, shape)):
        return None  # counts that differ as expressions: torch's kernel guards or raises
    if sympy.Mul(*map(_expr, a.shape)) == 0:
        return None
    with in_kernel_invocation_manager(mode):
        meta = aten.as_strided.default(
            a, list(shape), _contiguous_strides(shape), a.storage_offset()
        )
    return FakeTensor(mode, meta, a.device)


def _normalized(
    mode: SymbolicFakeMode, x: Any, normalized: Any, *params: Any
) -> tuple[list[Any], int] | None:
    """``x``'s sizes and the first normalized dimension, where a layer norm's rule applies: a
    float32/float64 fake of ``mode`` whose trailing sizes are ``normalized`` (static), with
    ``params`` (weight, bias) None or fakes of that shape and dtype."""
    if not _fake(mode, x) or x.dtype not in _FLOATS or not isinstance(normalized, (list, tuple)):
        return None
    k = len(normalized)
    if not 1 <= k <= x.dim() or any(type(n) is not int for n in normalized):
        return None
    shape = list(x.shape)
    if any(type(s) is not int for s in shape[-k:]) or shape[-k:] != list(normalized):
        return None
    if not _plain(x) or any(type(s) is int and s == 0 for s in shape):
        return None  # torch's kernel lays out a result like an odd input, and empty ones apart
    if not _one_device(x, *params):
        return None
    for p in params:
        if p is not None and not (
            _fake(mode, p) and p.dtype == x.dtype and list(p.shape) == list(normalized)
        ):
            return None
    return shape, x.dim() - k


def _layer_norm(
    mode: SymbolicFakeMode, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> tuple[FakeTensor, ...] | None:
    if len(args) != 5 or kwargs:
        return None
    x, normalized, weight, bias, _eps = args
    found = _normalized(mode, x, normalized, weight, bias)
    if found is None:
        return None
    shape, axis = found
    stats = [*shape[:axis], *([1] * (len(shape) - axis))]
    return _new(mode, shape, x), _new(mode, stats, x), _new(mode, stats, x)


def _layer_norm_backward(
    mode: SymbolicFakeMode, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> tuple[FakeTensor | None, ...] | None:
    if len(args) != 8 or kwargs:
        return None
    grad, x, normalized, mean, rstd, weight, bias, mask = args
    found = _normalized(mode, x, normalized, weight, bias)
    if found is None or not isinstance(mask, (list, tuple)) or len(mask) != 3:
        return None
    shape, _axis = found
    for t in (grad, mean, rstd):
        if not _fake(mode, t) or t.dtype != x.dtype:
            return None
    if not _one_device(grad, x, mean, rstd):
        return None
    if [_expr(s) for s in grad.shape] != [_expr(s) for s in shape] or not _plain(grad):
        return None
    return (
        _new(mode, shape, x) if mask[0] else None,
        _new(mode, list(normalized), x) if mask[1] and weight is not None else None,
        _new(mode, list(normalized), x) if mask[2] and bias is not None else None,
    )


def _same_layout(tensors: Sequence[Any], mode: SymbolicFakeMode) -> bool:
    """Fakes of ``mode`` of one float dtype and one shape (as expressions), all laid out as
    new contiguous tensors (:func:`_plain`)."""
    first = tensors[0]
    if not all(_fake(mode, t) for t in tensors) or first.dtype not in _FLOATS:
        return False
    shape = [_expr(s) for s in first.shape]
    return _one_device(*tensors) and all(
        t.dtype == first.dtype and [_expr(s) for s in t.shape] == shape and _plain(t)
        for t in tensors
    )


def _pointwise(operands: int, option: str | None) -> Rule:
    """The rule of a pointwise op of ``operands`` tensors of one shape and float dtype, laid
    out as new contiguous tensors (no broadcasting, no type promotion): a contiguous result
    like them. Its only other argument is ``option``: a real ``alpha`` (``add``, ``sub``) or
    gelu's ``approximate``, which do not change the result's layout; anything else (a
    Python number as an operand, a complex ``alpha``, an unknown approximation) goes to
    torch's kernel, which promotes or raises."""

    def rule(
        mode: SymbolicFakeMode, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> FakeTensor | None:
        tensors, extra = args[:operands], dict(kwargs)
        if len(args) > operands:
            if len(args) > operands + 1 or option != "alpha":
                return None
            extra["alpha"] = args[operands]
        if len(tensors) != operands or set(extra) - {option}:
            return None
        if "alpha" in extra and type(extra["alpha"]) not in (int, float):
            return None
        if "approximate" in extra and extra["approximate"] not in ("none", "tanh"):
            return None
        if not _same_layout(tensors, mode):
            return None
        return _new(mode, list(tensors[0].shape), tensors[0])

    return rule


def _log_softmax(
    mode: SymbolicFakeMode, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> FakeTensor | None:
    if len(args) != 3 or kwargs or args[2] is not False or not _same_layout(args[:1], mode):
        return None
    if not _a_dim(args[1], args[0]):
        return None
    return _new(mode, list(args[0].shape), args[0])


def _a_dim(dim: Any, t: torch.Tensor) -> bool:
    """Whether ``dim`` is a dimension of ``t`` (which has one at least); else torch raises."""
    return type(dim) is int and t.dim() >= 1 and -t.dim() <= dim < t.dim()


def _log_softmax_backward(
    mode: SymbolicFakeMode, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> FakeTensor | None:
    if len(args) != 4 or kwargs or not _same_layout(args[:2], mode):
        return None
    if args[3] != args[0].dtype or not _a_dim(args[2], args[0]):
        return None
    return _new(mode, list(args[0].shape), args[0])


def _nll_inputs(mode: SymbolicFakeMode, x: Any, target: Any, weight: Any, reduction: Any) -> bool:
    """nll_loss's common case: 2-D float logits, 1-D int64 targets of as many rows, no class
    weights, a mean or sum (a 0-dim loss)."""
    return (
        _same_layout([x], mode)
        and x.dim() == 2
        and _fake(mode, target)
        and target.dtype == torch.int64
        and target.dim() == 1
        and _equal(target.shape[0], x.shape[0])
        and _one_device(x, target)
        and weight is None
        and reduction in (1, 2)
    )


def _nll_loss(
    mode: SymbolicFakeMode, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> tuple[FakeTensor, FakeTensor] | None:
    if len(args) != 5 or kwargs or not _nll_inputs(mode, *args[:4]):
        return None
    return _new(mode, [], args[0]), _new(mode, [], args[0])


def _nll_loss_backward(
    mode: SymbolicFakeMode, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> FakeTensor | None:
    if len(args) != 7 or kwargs:
        return None
    grad, x, target, weight, reduction, _ignore, total = args
    if not _nll_inputs(mode, x, target, weight, reduction):
        return None
    for t in (grad, total):
        if not _fake(mode, t) or t.dim() != 0 or t.dtype != x.dtype:
            return None
    if not _one_device(grad, x, total):
        return None
    return _new(mode, list(x.shape), x)


def _matmul_operands(mode: SymbolicFakeMode, a: Any, b: Any) -> bool:
    """2-D fakes of ``mode`` of one float dtype whose inner sizes are equal as expressions."""
    return (
        _fake(mode, a)
        and _fake(mode, b)
        and a.dtype in _FLOATS
        and b.dtype == a.dtype
        and a.dim() == 2
        and b.dim() == 2
        and _expr(a.shape[1]) == _expr(b.shape[0])
        and _one_device(a, b)
    )


def _mm(
    mode: SymbolicFakeMode, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> FakeTensor | None:
    if len(args) != 2 or kwargs or not _matmul_operands(mode, *args):
        return None
    a, b = args
    return _new(mode, [a.shape[0], b.shape[1]], a)


def _addmm(
    mode: SymbolicFakeMode, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> FakeTensor | None:
    """``addmm`` with a bias of the output's last size (a linear layer's): a contiguous
    result; ``beta`` and ``alpha`` do not change its layout."""
    if len(args) != 3 or set(kwargs) - {"beta", "alpha"}:
        return None
    bias, a, b = args
    if not _matmul_operands(mode, a, b) or not _fake(mode, bias) or bias.dtype != a.dtype:
        return None
    if not _one_device(bias, a):
        return None
    if bias.dim() != 1 or _expr(bias.shape[0]) != _expr(b.shape[1]):
        return None
    return _new(mode, [a.shape[0], b.shape[1]], a)


def _swapped(mode: SymbolicFakeMode, x: Any, order: Sequence[int]) -> FakeTensor:
    """``x``'s dimensions in ``order``: a view of its storage."""
    shape, stride = x.shape, x.stride()
    with in_kernel_invocation_manager(mode):
        meta = aten.as_strided.default(
            x, [shape[d] for d in order], [stride[d] for d in order], x.storage_offset()
        )
    return FakeTensor(mode, meta, x.device)


def _transpose(
    mode: SymbolicFakeMode, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> FakeTensor | None:
    if len(args) != 3 or kwargs or not _fake(mode, args[0]) or args[0].dim() < 2:
        return None
    x, d0, d1 = args
    n = x.dim()
    if type(d0) is not int or type(d1) is not int or not (-n <= d0 < n and -n <= d1 < n):
        return None
    order = list(range(n))
    order[d0 % n], order[d1 % n] = order[d1 % n], order[d0 % n]
    return _swapped(mode, x, order)


def _t(mode: SymbolicFakeMode, args: Sequence[Any], kwargs: Mapping[str, Any]) -> FakeTensor | None:
    if len(args) != 1 or kwargs or not _fake(mode, args[0]) or args[0].dim() != 2:
        return None
    return _swapped(mode, args[0], [1, 0])


#: op -> its rule (tried before torch's fake kernel in a :class:`SymbolicFakeMode`)
RULES: dict[Any, Rule] = {
    aten.view.default: _view,
    aten.native_layer_norm.default: _layer_norm,
    aten.native_layer_norm_backward.default: _layer_norm_backward,
    aten._log_softmax.default: _log_softmax,
    aten._log_softmax_backward_data.default: _log_softmax_backward,
    aten.nll_loss_forward.default: _nll_loss,
    aten.nll_loss_backward.default: _nll_loss_backward,
    aten.mm.default: _mm,
    aten.addmm.default: _addmm,
    aten.transpose.int: _transpose,
    aten.t.default: _t,
    aten.add.Tensor: _pointwise(2, "alpha"),
    aten.sub.Tensor: _pointwise(2, "alpha"),
    aten.mul.Tensor: _pointwise(2, None),
    aten.div.Tensor: _pointwise(2, None),
    aten.gelu.default: _pointwise(1, "approximate"),
    aten.gelu_backward.default: _pointwise(2, "approximate"),
}
