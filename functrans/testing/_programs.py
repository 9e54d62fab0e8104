"""Hypothesis strategy for small random straight-line PyTorch programs.

A :class:`Program` is a list of :class:`Step` s, each applying one op (a :data:`STEP_KINDS`
name) to earlier values; the value list is the inputs followed by the step results.  Programs
have no Python control flow on values, are deterministic, share one floating dtype, and are
differentiable almost everywhere with finite gradients at :meth:`Program.example_inputs`:

* every op is total (``log1p(x * x)`` rather than ``log``, ``a / (1 + b * b)`` rather than
  ``a / b``, ``exp(tanh(x))`` rather than ``exp``) and the generator tracks a bound on every
  value's magnitude, refusing ops that would push it past ``_MAX_BOUND``;
* ``amax``, ``maximum``/``minimum``, ``layer_norm``, ``relu``/``abs`` (kinks) and the comparison
  in ``where`` only see "generic" operands: values that (almost surely) have no exact ties, zeros
  or constant rows; e.g. never the output of ``relu``, ``where``, ``expand`` or a clamp, nor a
  combination of two values that share an input (``a - a`` is zero).
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st

from ._program import INPUT_BOUND, STEP_KINDS, InputSpec, Program, Step

__all__ = ["INPUT_BOUND", "STEP_KINDS", "InputSpec", "Program", "Step", "programs"]

_MAX_BOUND = 1000.0  # bound on the magnitude of every value
_MAX_NUMEL = 256
_SATURATE = 4.0  # tanh, sigmoid, gelu, softmax... of larger values may round to exact ties
_CONSTANTS = (0.5, 2.0, -1.5)


# unary op -> (result bound from operand bound, largest operand bound keeping a value generic)
_UNARY: dict[str, tuple[Callable[[float], float], float]] = {
    "neg": (lambda b: b, math.inf),
    "tanh": (lambda b: 1.0, _SATURATE),
    "sin": (lambda b: 1.0, math.inf),
    "cos": (lambda b: 1.0, math.inf),
    "exp_tanh": (lambda b: math.e, _SATURATE),
    "sigmoid": (lambda b: 1.0, _SATURATE),
    "square": (lambda b: b * b, math.inf),
    "relu": (lambda b: b, -1.0),  # many exact zeros
    "abs": (lambda b: b, math.inf),
    "gelu": (lambda b: b, _SATURATE),  # exactly 0 below about -5.5 in float32
    "silu": (lambda b: b, 50.0),
    "log1p_square": (lambda b: math.log1p(b * b), math.inf),
}
_KINKED = ("relu", "abs")
# binary op -> result bound from operand bounds
_BINARY: dict[str, Callable[[float, float], float]] = {
    "add": operator.add,
    "sub": operator.add,
    "mul": operator.mul,
    "div": lambda a, b: a,
    "maximum": max,
    "minimum": max,
}


# ---------------------------------------------------------------------------------- generation


@dataclass(frozen=True)
class _Val:
    """What the generator tracks about a value: its shape, a bound on its magnitude, whether it
    is generic (continuously distributed, almost surely free of exact ties and constant rows),
    and the inputs it depends on (combining values with shared roots can cancel or tie)."""

    shape: tuple[int, ...]
    bound: float
    generic: bool
    roots: frozenset[int]


def _bcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    """The broadcast shape of ``a`` and ``b``, or None if incompatible or too large."""
    n = max(len(a), len(b))
    out = []
    for x, y in zip((1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b, strict=True):
        if x != y and 1 not in (x, y):
            return None
        out.append(max(x, y))
    return tuple(out) if math.prod(out) <= _MAX_NUMEL else None


@functools.cache
def _reshape_targets(numel: int) -> tuple[tuple[int, ...], ...]:
    """Shapes of rank 0..3 (dims up to 8, or flat) with ``numel`` elements, lowest rank first."""
    dims = range(1, 9)
    out = [s for r in range(4) for s in itertools.product(dims, repeat=r) if math.prod(s) == numel]
    return tuple(out) if (numel,) in out else (*out, (numel,))


def _independent(a: _Val, b: _Val) -> bool:
    return a.generic and b.generic and not (a.roots & b.roots)


def _matmul_ok(a: _Val, b: _Val, transpose: bool) -> bool:
    """Whether ``a @ b`` (``a @ b.mT`` if ``transpose``) is a bounded mm or bmm."""
    if len(a.shape) != len(b.shape) or a.shape[:-2] != b.shape[:-2]:
        return False
    inner = b.shape[-1] if transpose else b.shape[-2]
    return inner == a.shape[-1] and inner * a.bound * b.bound <= _MAX_BOUND


# op -> whether a value can be its first operand (for ops other than unary and binary ones)
_ACCEPTS: dict[str, Callable[[_Val], bool]] = {
    "where": lambda v: v.generic,  # compared with a constant or an independent value
    "unsqueeze": lambda v: len(v.shape) <= 2,
    "squeeze": lambda v: 1 in v.shape,
    "transpose": lambda v: len(v.shape) >= 2,
    "permute": lambda v: len(v.shape) >= 2,
    "reshape": lambda v: True,
    "flatten": lambda v: len(v.shape) >= 2,
    "expand": lambda v: 1 in v.shape and 2 * math.prod(v.shape) <= _MAX_NUMEL,
    "narrow": lambda v: any(s > 1 for s in v.shape),
    "sum": lambda v: v.shape != () and max(v.shape) * v.bound <= _MAX_BOUND,
    "mean": lambda v: v.shape != (),
    "amax": lambda v: v.shape != () and v.generic,
    "sum_all": lambda v: math.prod(v.shape) * v.bound <= _MAX_BOUND,
    "softmax": lambda v: v.shape != (),
    "log_softmax": lambda v: v.shape != () and 2 * v.bound + max(v.shape) <= _MAX_BOUND,
    "layer_norm": lambda v: v.shape != () and v.shape[-1] >= 2 and v.generic,
    "cat": lambda v: v.shape != () and 2 * math.prod(v.shape) <= _MAX_NUMEL,
    "mm": lambda v: len(v.shape) == 2 and _matmul_ok(v, v, True),
    "bmm": lambda v: len(v.shape) == 3 and _matmul_ok(v, v, True),
}


def _eligible(kind: str, vals: Sequence[_Val], i: int) -> bool:
    """Whether a ``kind`` step can be generated with ``vals[i]`` as its first operand."""
    v = vals[i]
    if kind in _UNARY:  # no relu/abs of exact zeros, where they have a kink
        return _UNARY[kind][0](v.bound) <= _MAX_BOUND and (v.generic or kind not in _KINKED)
    if kind in ("maximum", "minimum"):
        return any(_independent(v, w) and _bcast(v.shape, w.shape) for w in vals)
    if kind in _BINARY:  # a constant operand is always possible
        return _BINARY[kind](v.bound, max(_CONSTANTS)) <= _MAX_BOUND
    return _ACCEPTS[kind](v)


def _pick_recent(draw: st.DrawFn, items: Sequence[Any]) -> Any:
    """One of ``items``, shrinking towards the last (most recently computed) one."""
    return items[len(items) - 1 - draw(st.integers(0, len(items) - 1))]


def _operand(
    draw: st.DrawFn, vals: Sequence[_Val], cands: Sequence[int]
) -> tuple[int | float, _Val]:
    """A value from ``cands`` (shrinking to the most recent) or, last, a scalar constant."""
    k = draw(st.integers(0, len(cands)))
    if k < len(cands):
        return cands[len(cands) - 1 - k], vals[cands[len(cands) - 1 - k]]
    c = draw(st.sampled_from(_CONSTANTS))
    return c, _Val((), abs(c), True, frozenset())


def _gen_step(draw: st.DrawFn, kind: str, vals: Sequence[_Val]) -> tuple[Step, _Val]:
    """Draw one ``kind`` step over ``vals``; ``kind`` must be eligible for some value."""
    i: int = _pick_recent(draw, [j for j in range(len(vals)) if _eligible(kind, vals, j)])
    v = vals[i]
    shape, bound, generic, roots = v.shape, v.bound, v.generic, v.roots
    args: tuple[int | float, ...] = (i,)
    params: tuple[int, ...] = ()
    dims = range(len(shape))
    perm: tuple[int, ...]
    if kind in _UNARY:
        bound, generic = _UNARY[kind][0](bound), generic and bound <= _UNARY[kind][1]
    elif kind in _BINARY:
        clamp = kind in ("maximum", "minimum")
        cands = [
            j
            for j, w in enumerate(vals)
            if _bcast(shape, w.shape) and _BINARY[kind](bound, w.bound) <= _MAX_BOUND
            and (kind != "sub" or j != i) and (not clamp or _independent(v, w))
        ]  # fmt: skip
        if clamp:
            b = _pick_recent(draw, cands)
            w = vals[b]
        else:
            b, w = _operand(draw, vals, cands)
        shape, bound = _bcast(shape, w.shape) or (), _BINARY[kind](bound, w.bound)
        generic, args, roots = not clamp and _independent(v, w), (i, b), roots | w.roots
    elif kind == "where":
        cands = [j for j, u in enumerate(vals) if _bcast(shape, u.shape) and _independent(v, u)]
        b, w = _operand(draw, vals, cands)
        shape = _bcast(shape, w.shape) or ()
        c, u = _operand(draw, vals, [j for j, u in enumerate(vals) if _bcast(shape, u.shape)])
        shape, bound, generic = _bcast(shape, u.shape) or (), max(bound, u.bound), False
        args, roots = (i, b, c), roots | w.roots | u.roots
    elif kind in ("unsqueeze", "squeeze", "expand"):
        d = draw(st.sampled_from([d for d in range(len(shape) + 1)
                                  if kind == "unsqueeze" or shape[d:d + 1] == (1,)]))  # fmt: skip
        params, new = (d,), () if kind == "squeeze" else (1,)
        if kind == "expand":
            sizes = [n for n in (2, 3, 4) if n * math.prod(shape) <= _MAX_NUMEL]
            params, generic, new = (), False, (draw(st.sampled_from(sizes)),)
        shape = (*shape[:d], *new, *shape[d + (kind != "unsqueeze") :])
    elif kind in ("transpose", "permute"):
        if kind == "transpose":
            params = draw(st.sampled_from(list(itertools.combinations(dims, 2))))
            perm = tuple(params[1] if d == params[0] else params[0] if d == params[1] else d
                         for d in dims)  # fmt: skip
        else:
            perm = params = tuple(draw(st.permutations(dims)))
        shape = tuple(shape[d] for d in perm)
    elif kind in ("reshape", "flatten", "sum_all"):
        numel = math.prod(shape)
        shape = draw(st.sampled_from(_reshape_targets(numel))) if kind == "reshape" else (numel,)
        shape, bound = ((), bound * numel) if kind == "sum_all" else (shape, bound)
    elif kind == "narrow":
        d = draw(st.sampled_from([d for d in dims if shape[d] > 1]))
        length = draw(st.integers(1, shape[d] - 1))
        start = draw(st.integers(0, shape[d] - length))
        shape, params = (*shape[:d], length, *shape[d + 1 :]), (d, start, length)
    elif kind in ("sum", "mean", "amax"):
        d, keep = draw(st.sampled_from(dims)), draw(st.booleans())
        bound *= shape[d] if kind == "sum" else 1
        shape, params = (*shape[:d], *((1,) if keep else ()), *shape[d + 1 :]), (d, int(keep))
    elif kind in ("softmax", "log_softmax"):
        d = draw(st.sampled_from(dims))
        generic, params = generic and shape[d] >= 2 and bound <= _SATURATE, (d,)
        bound = 1.0 if kind == "softmax" else 2 * bound + math.log(shape[d])
    elif kind == "layer_norm":  # constant along the normalized dim if it has size 1 or 2
        bound, generic = math.sqrt(shape[-1]), shape[-1] >= 3
    elif kind == "cat":
        pairs = [(j, d) for j, w in enumerate(vals) for d in dims if len(w.shape) == len(shape)
                 and all(w.shape[e] == shape[e] for e in dims if e != d)
                 and math.prod(shape) + math.prod(w.shape) <= _MAX_NUMEL]  # fmt: skip
        j = _pick_recent(draw, sorted({j for j, _ in pairs}))
        d = draw(st.sampled_from([d for jj, d in pairs if jj == j]))
        w = vals[j]
        shape = (*shape[:d], shape[d] + w.shape[d], *shape[d + 1 :])
        bound, generic = max(bound, w.bound), _independent(v, w)
        args, params, roots = (i, j), (d,), roots | w.roots
    else:  # mm, bmm; the right operand may be the transposed left one
        pairs = [(j, t) for j, w in enumerate(vals) for t in (0, 1) if _matmul_ok(v, w, bool(t))]
        j, t = _pick_recent(draw, pairs)
        w = vals[j]
        bound, generic = shape[-1] * bound * w.bound, _independent(v, w)
        shape = (*shape[:-1], w.shape[-2] if t else w.shape[-1])
        args, params, roots = (i, j), (t,), roots | w.roots
    return Step(kind, args, params, shape), _Val(shape, bound, generic, roots)


_SHAPES = st.lists(st.sampled_from((1, 2, 3, 4, 1)), max_size=3).map(tuple)  # 1s are common


@st.composite
def _next_step(draw: st.DrawFn, vals: Sequence[_Val], first: bool) -> tuple[Step, _Val] | None:
    """The next step over ``vals``, or None to end the program (never before the first step).

    Each step is one span of choices, so hypothesis can delete steps while shrinking.
    """
    if not (first or draw(st.booleans()) or draw(st.booleans()) or draw(st.booleans())):
        return None  # probability 1/8; shrinks towards fewer steps
    kinds = [k for k in STEP_KINDS if any(_eligible(k, vals, j) for j in range(len(vals)))]
    return _gen_step(draw, draw(st.sampled_from(kinds)), vals)


def programs(
    *,
    max_steps: int = 8,
    max_inputs: int = 3,
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.float64),
) -> st.SearchStrategy[Program]:
    """Strategy for random straight-line programs of 1..``max_steps`` steps over 1..``max_inputs``
    input tensors (ranks 0..3, dims 1..4) of one dtype drawn from ``dtypes``.

    Programs shrink towards fewer inputs and steps, scalar inputs, ops earlier in
    :data:`STEP_KINDS`, and chains (each operand and output shrinks towards the most recent value).
    Use it as ``@given(programs(max_steps=4))`` and run ``prog(*prog.example_inputs())``.

    A program built by hand:

    >>> import torch
    >>> from functrans.testing._programs import InputSpec, Program, Step
    >>> prog = Program(
    ...     inputs=(InputSpec((2, 3), torch.float64),),
    ...     steps=(Step("tanh", (0,), (), (2, 3)), Step("sum", (1,), (1, 0), (2,))),
    ...     outputs=(2,),
    ... )
    >>> print(prog.source())
    import torch
    import torch.nn.functional as F
    <BLANKLINE>
    <BLANKLINE>
    def program(a0):
        # a0: float64[2, 3]
        v1 = torch.tanh(a0)  # [2, 3]
        v2 = v1.sum(1, keepdim=False)  # [2]
        return (v2,)
    >>> [tuple(out.shape) for out in prog(*prog.example_inputs(seed=0))]
    [(2,)]
    """
    if max_steps < 1 or max_inputs < 1:
        raise ValueError("max_steps and max_inputs must be at least 1")
    if not dtypes or not all(d.is_floating_point for d in dtypes):
        raise ValueError(f"dtypes must be a non-empty sequence of floating dtypes, got {dtypes}")
    dtype_list = list(dtypes)

    @st.composite
    def draw_program(draw: st.DrawFn) -> Program:
        dtype = draw(st.sampled_from(dtype_list))
        shapes = draw(st.lists(_SHAPES, min_size=1, max_size=max_inputs))
        vals = [_Val(s, INPUT_BOUND, True, frozenset([k])) for k, s in enumerate(shapes)]
        steps: list[Step] = []
        while len(steps) < max_steps and (step := draw(_next_step(vals, not steps))):
            steps.append(step[0])
            vals.append(step[1])
        offsets = draw(st.lists(st.integers(0, len(vals) - 1), min_size=1, max_size=3, unique=True))
        return Program(
            inputs=tuple(InputSpec(s, dtype) for s in shapes),
            steps=tuple(steps),
            outputs=tuple(len(vals) - 1 - k for k in offsets),
        )

    return draw_program()
