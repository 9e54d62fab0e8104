"""Reductions inside a kernel: a row reduced, given how to compute the row's values.

A kernel with reductions runs one program per ``XBLOCK`` rows. When a row fits in one block the
kernel is *persistent*: the row's values are computed once and each reduction is one
``tl.sum``/``tl.max`` over the block. Otherwise each reduction loops over the row in ``RBLOCK``
chunks with an accumulator, recomputing the row values it needs from memory in every loop
(row-independent values are emitted once, before the loop). ``var``/``var_mean`` take two
passes (mean, then squared deviations), which is exact where one-pass formulas cancel.

These are plain functions of an :class:`~.emitter.Emitter`; what the reduced operand is, and
what a loop over it needs first, the caller (:mod:`.render`) passes as functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from .emitter import Emitter
from .lowering import REDUCTIONS, as_dtype, compute_dtype, compute_triton_dtype, literal
from .traced import first_output

__all__ = ["reduction"]

_BLOCK = "[XBLOCK, RBLOCK]"


@dataclass(frozen=True)
class _Combine:
    """How a row folds into one value: the value masked-off elements hold (``fill``), the
    block-wide reduction, and one accumulation step (a format of ``{a}`` and ``{v}``)."""

    fill: str
    reduce: str
    step: str


_SUM = _Combine("0", "tl.sum", "{a} + {v}")
_EXTREMES = {
    "max": _Combine('float("-inf")', "tl.max", "tl.maximum({a}, {v})"),
    "min": _Combine('float("inf")', "tl.min", "tl.minimum({a}, {v})"),
}


def _correction(n: fx.Node) -> float:
    corr: Any = n.kwargs.get("correction", 1)
    return 1.0 if corr is None else float(corr)


def reduction(
    em: Emitter, n: fx.Node, row: Callable[[], str], prepare: Callable[[], None]
) -> list[str]:
    """Emit reduction ``n`` at the top level; returns its outputs' names (``var_mean`` has
    two). ``row()`` emits the reduced operand in the current scope and returns its name;
    ``prepare()`` emits, before a loop, what the operand needs that does not vary along a row.
    """
    combine = REDUCTIONS[n.target].combine
    dtype = first_output(n).dtype
    acc_t = compute_triton_dtype(dtype)
    if not em.geo.reduce:  # reduces only size-1 dims: each output is its one input element
        v = row()
        var = em.assign(f"({v} - {v}) / {literal(float(1 - _correction(n)))}")
        return {"var_mean": [var, v], "var": [var]}.get(combine, [v])
    if combine in _EXTREMES:
        return [_reduce_row(em, row, prepare, _EXTREMES[combine], acc_t)]
    rnumel = em.geo.rnumel
    total = _reduce_row(em, row, prepare, _SUM, acc_t)
    if combine in ("sum", "mean"):
        parts = [total if combine == "sum" else em.assign(f"{total} / {rnumel}")]
    else:  # var_mean / var: two passes, mean then squared deviations
        mean = em.assign(f"{total} / {rnumel}")

        def deviation(v: str) -> str:
            return f"({v} - {mean}) * ({v} - {mean})"

        m2 = _reduce_row(em, row, prepare, _SUM, acc_t, deviation)
        var = em.assign(f"{m2} / {literal(float(rnumel - _correction(n)))}")
        parts = [var, mean] if combine == "var_mean" else [var]
    if compute_dtype(dtype) != dtype:  # rounded like eager's result
        parts = [em.assign(as_dtype(p, dtype)) for p in parts]
    return parts


def _reduce_row(
    em: Emitter,
    row: Callable[[], str],
    prepare: Callable[[], None],
    op: _Combine,
    acc_t: str,
    f: Callable[[str], str] = lambda v: v,
) -> str:
    """``op`` over the row of ``f(row())``: one block-wide reduction when the kernel is
    persistent, else a loop accumulating ``RBLOCK`` chunks."""
    if em.geo.persistent:
        v = f(row())
        masked = em.assign(f"tl.where(rmask, tl.broadcast_to({v}, {_BLOCK}), {op.fill})")
        return em.assign(f"{op.reduce}({masked}, 1)[:, None]")
    prepare()
    acc = em.assign(f"tl.full({_BLOCK}, {op.fill}, {acc_t})")
    em.open_loop()
    v = f(row())
    step = op.step.format(a=acc, v=f"tl.broadcast_to({v}, {_BLOCK})")
    em.emit(f"{acc} = tl.where(rmask, {step}, {acc})")
    em.close_loop()
    return em.assign(f"{op.reduce}({acc}, 1)[:, None]")
