"""Generation rules of the step kinds that are not plain unary or binary pointwise ops:
comparisons and masks, indexing, scans, extra reductions and views, stack and addmm.

Each kind has an eligibility predicate over (all values, index of the first operand) and a
generator ``(draw, vals, i) -> (Step, Val)``; :mod:`._random_programs` dispatches to them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from hypothesis import strategies as st

from ._program import Step
from ._values import (
    MAX_BOUND,
    MAX_NUMEL,
    SATURATE,
    Val,
    bcast,
    independent,
    matmul_ok,
    matmul_shape,
    operand,
    pick_recent,
)

__all__ = ["ELIGIBLE", "GENERATE"]

Gen = Callable[[st.DrawFn, Sequence[Val], int], tuple[Step, Val]]


def _dims(v: Val, least: int = 1) -> list[int]:
    """Dims of ``v`` with at least ``least`` elements."""
    return [d for d, n in enumerate(v.shape) if n >= least]


def _index_sizes(v: Val, most: int) -> list[tuple[int, int]]:
    """(dim, index length) pairs for an index of at most ``most`` elements along a dim."""
    return [
        (d, k) for d in _dims(v) for k in (1, 2, 3) if k * math.prod(v.shape) // v.shape[d] <= most
    ]


def _masks(vals: Sequence[Val], v: Val) -> list[int]:
    return [
        j for j, m in enumerate(vals) if m.kind == "bool" and bcast(m.shape, v.shape) == v.shape
    ]


def _same_shape(vals: Sequence[Val], v: Val) -> list[int]:
    return [j for j, w in enumerate(vals) if w.is_float and w.shape == v.shape]


def _biases(vals: Sequence[Val], shape: tuple[int, ...], bound: float) -> list[int]:
    return [
        j
        for j, b in enumerate(vals)
        if b.is_float and bcast(b.shape, shape) == shape and bound + b.bound <= MAX_BOUND
    ]


def _addmm_pairs(vals: Sequence[Val], v: Val) -> list[tuple[int, int, int]]:
    """(right operand, transpose flag, bias) triples for ``addmm(bias, v, w)``."""
    if len(v.shape) != 2:
        return []
    out = []
    for j, w in enumerate(vals):
        for t in (0, 1):
            if matmul_ok(v, w, bool(t)):
                bound = v.shape[-1] * v.bound * w.bound
                out += [(j, t, b) for b in _biases(vals, matmul_shape(v, w, bool(t)), bound)]
    return out


ELIGIBLE: dict[str, Callable[[Sequence[Val], int], bool]] = {
    "gt": lambda vals, i: vals[i].generic,
    "masked_fill": lambda vals, i: bool(_masks(vals, vals[i])),
    "select": lambda vals, i: bool(_dims(vals[i])),
    "slice_step": lambda vals, i: bool(_dims(vals[i], 2)),
    "flip": lambda vals, i: vals[i].shape != (),
    "pad": lambda vals, i: vals[i].shape != () and 2 * math.prod(vals[i].shape) + 8 <= MAX_NUMEL,
    "var": lambda vals, i: (
        not vals[i].empty and vals[i].shape != () and vals[i].bound ** 2 <= MAX_BOUND
    ),
    "logsumexp": lambda vals, i: bool(_dims(vals[i])) and vals[i].bound + 6 <= MAX_BOUND,
    "argmax": lambda vals, i: bool(_dims(vals[i])) and vals[i].generic,
    "cumsum": lambda vals, i: (
        vals[i].shape != () and max(vals[i].shape) * vals[i].bound <= MAX_BOUND
    ),
    "gather": lambda vals, i: bool(_index_sizes(vals[i], 64)),
    "index_select": lambda vals, i: bool(_index_sizes(vals[i], MAX_NUMEL)),
    "stack": lambda vals, i: 2 * math.prod(vals[i].shape) <= MAX_NUMEL,
    "addmm": lambda vals, i: bool(_addmm_pairs(vals, vals[i])),
}


def _keepdim(draw: st.DrawFn, v: Val, d: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A keepdim flag; returns (reduced shape, params (d, keepdim))."""
    keep = draw(st.booleans())
    return (*v.shape[:d], *((1,) if keep else ()), *v.shape[d + 1 :]), (d, int(keep))


def _gt(draw: st.DrawFn, vals: Sequence[Val], i: int) -> tuple[Step, Val]:
    v = vals[i]
    cands = [j for j, w in enumerate(vals) if bcast(v.shape, w.shape) and independent(v, w)]
    b, w = operand(draw, vals, cands)
    shape = bcast(v.shape, w.shape) or ()
    return Step("gt", (i, b), (), shape), Val(shape, 0.0, False, v.roots | w.roots, "bool")


def _masked_fill(draw: st.DrawFn, vals: Sequence[Val], i: int) -> tuple[Step, Val]:
    v = vals[i]
    j = pick_recent(draw, _masks(vals, v))
    val = Val(v.shape, max(v.bound, 0.5), False, v.roots | vals[j].roots)
    return Step("masked_fill", (i, j), (), v.shape), val


def _view(draw: st.DrawFn, vals: Sequence[Val], i: int, kind: str) -> tuple[Step, Val]:
    """select, slice_step, flip and pad: they keep the bound and (but pad) genericity."""
    v = vals[i]
    s, generic = list(v.shape), v.generic
    params: tuple[int, ...]
    if kind == "select":
        d = draw(st.sampled_from(_dims(v)))
        params = (d, draw(st.integers(0, s[d] - 1)))
        del s[d]
    elif kind == "slice_step":
        d = draw(st.sampled_from(_dims(v, 2)))
        params = (d, draw(st.integers(0, 1)))
        s[d] = (s[d] - params[1] + 1) // 2
    elif kind == "flip":
        params = (draw(st.sampled_from(range(len(s)))),)
    else:  # pad the last dim with zeros
        params = (draw(st.integers(0, 2)), draw(st.integers(0, 2)))
        s[-1] += sum(params)
        generic = generic and sum(params) == 0
    return Step(kind, (i,), params, tuple(s)), Val(tuple(s), v.bound, generic, v.roots)


def _reduce(draw: st.DrawFn, vals: Sequence[Val], i: int, kind: str) -> tuple[Step, Val]:
    """var, logsumexp, argmax (over a non-empty dim) and cumsum."""
    v = vals[i]
    if kind == "cumsum":
        d = draw(st.sampled_from(range(len(v.shape))))
        val = Val(v.shape, v.bound * v.shape[d], v.generic, v.roots)
        return Step(kind, (i,), (d,), v.shape), val
    d = draw(st.sampled_from(_dims(v)))
    shape, params = _keepdim(draw, v, d)
    if kind == "var":  # var of one element is exactly 0
        val = Val(shape, v.bound**2, v.generic and v.shape[d] >= 2, v.roots)
    elif kind == "logsumexp":
        generic = v.generic and v.bound <= SATURATE
        val = Val(shape, v.bound + math.log(v.shape[d]), generic, v.roots)
    else:
        val = Val(shape, 0.0, False, v.roots, "int")
    return Step(kind, (i,), params, shape), val


def _index(draw: st.DrawFn, vals: Sequence[Val], i: int, kind: str) -> tuple[Step, Val]:
    """gather and index_select with constant indices (baked into ``params``)."""
    v = vals[i]
    d, k = draw(st.sampled_from(_index_sizes(v, 64 if kind == "gather" else MAX_NUMEL)))
    shape = (*v.shape[:d], k, *v.shape[d + 1 :])
    count = math.prod(shape) if kind == "gather" else k
    entries = draw(st.lists(st.integers(0, v.shape[d] - 1), min_size=count, max_size=count))
    generic = v.generic and kind == "index_select" and len(set(entries)) == k
    return Step(kind, (i,), (d, *entries), shape), Val(shape, v.bound, generic, v.roots)


def _stack(draw: st.DrawFn, vals: Sequence[Val], i: int) -> tuple[Step, Val]:
    v = vals[i]
    j = pick_recent(draw, _same_shape(vals, v))
    w = vals[j]
    d = draw(st.integers(0, len(v.shape)))
    shape = (*v.shape[:d], 2, *v.shape[d:])
    val = Val(shape, max(v.bound, w.bound), independent(v, w), v.roots | w.roots)
    return Step("stack", (i, j), (d,), shape), val


def _addmm(draw: st.DrawFn, vals: Sequence[Val], i: int) -> tuple[Step, Val]:
    v = vals[i]
    j, t, b = pick_recent(draw, _addmm_pairs(vals, v))
    w, bias = vals[j], vals[b]
    shape = matmul_shape(v, w, bool(t))
    generic = independent(v, w) and v.shape[-1] > 0 and not ((v.roots | w.roots) & bias.roots)
    bound = v.shape[-1] * v.bound * w.bound + bias.bound
    val = Val(shape, bound, generic, v.roots | w.roots | bias.roots)
    return Step("addmm", (i, j, b), (t,), shape), val


def _kind(gen: Callable[[st.DrawFn, Sequence[Val], int, str], tuple[Step, Val]], kind: str) -> Gen:
    return lambda draw, vals, i: gen(draw, vals, i, kind)


GENERATE: dict[str, Gen] = {
    "gt": _gt,
    "masked_fill": _masked_fill,
    **{k: _kind(_view, k) for k in ("select", "slice_step", "flip", "pad")},
    **{k: _kind(_reduce, k) for k in ("var", "logsumexp", "argmax", "cumsum")},
    **{k: _kind(_index, k) for k in ("gather", "index_select")},
    "stack": _stack,
    "addmm": _addmm,
}
