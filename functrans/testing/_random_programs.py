"""Random programs: the hypothesis strategy that draws small straight-line PyTorch programs
(the :class:`Program` data type, its op table and printing live in :mod:`._program`).

A :class:`Program` is a list of :class:`Step` s, each applying one op (a :data:`STEP_KINDS`
name) to earlier values; the value list is the inputs followed by the step results.  Programs
have no Python control flow on values, share one floating dtype (comparisons give bool values
and ``argmax`` int64 values: non-differentiable outputs), draw random numbers only in
``dropout`` (compare such programs under the same seed) and are differentiable almost
everywhere with finite gradients at :meth:`Program.example_inputs`:

* every op is total (``log1p(x * x)`` rather than ``log``, ``a / (1 + b * b)`` rather than
  ``a / b``, ``exp(tanh(x))`` rather than ``exp``, no ``mean``/``amax``/``var`` over an empty
  dim) and the generator tracks a bound on every value's magnitude, refusing ops that would
  push it past ``MAX_BOUND``;
* ``amax``, ``argmax``, ``maximum``/``minimum``, ``layer_norm``, ``relu``/``abs``/``clamp``
  (kinks) and comparisons (``gt``, ``where``) only see "generic" operands: values that (almost
  surely) have no exact ties, zeros or constant rows; e.g. never the output of ``relu``,
  ``where``, ``expand``, ``dropout``, ``pad`` or a clamp, a sum over an empty dim, nor a
  combination of two values that share an input (``a - a`` is zero).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import torch
from hypothesis import strategies as st

from ._program import INPUT_BOUND, RANDOM_OPS, STEP_KINDS, InputSpec, Program, Step
from ._steps import ELIGIBLE, GENERATE
from ._values import (
    BINARY,
    CONSTANTS,
    KINKED,
    MAX_BOUND,
    MAX_NUMEL,
    SATURATE,
    UNARY,
    Val,
    bcast,
    independent,
    matmul_ok,
    operand,
    pick_recent,
    reshape_targets,
)

__all__ = ["programs"]


# op -> whether a value can be its first operand (for the kinds of this module)
_ACCEPTS: dict[str, Callable[[Val], bool]] = {
    "where": lambda v: v.generic,  # compared with a constant or an independent value
    "unsqueeze": lambda v: len(v.shape) <= 2,
    "squeeze": lambda v: 1 in v.shape,
    "transpose": lambda v: len(v.shape) >= 2,
    "permute": lambda v: len(v.shape) >= 2,
    "reshape": lambda v: True,
    "flatten": lambda v: len(v.shape) >= 2,
    "expand": lambda v: 1 in v.shape and 2 * math.prod(v.shape) <= MAX_NUMEL,
    "narrow": lambda v: any(s > 1 for s in v.shape),
    "sum": lambda v: v.shape != () and max(v.shape) * v.bound <= MAX_BOUND,
    "mean": lambda v: any(s > 0 for s in v.shape),  # the mean of nothing is nan
    "amax": lambda v: any(s > 0 for s in v.shape) and v.generic,
    "sum_all": lambda v: math.prod(v.shape) * v.bound <= MAX_BOUND,
    "softmax": lambda v: v.shape != (),
    "log_softmax": lambda v: v.shape != () and 2 * v.bound + max(v.shape) <= MAX_BOUND,
    "layer_norm": lambda v: v.shape != () and v.shape[-1] >= 2 and v.generic,
    "cat": lambda v: v.shape != () and 2 * math.prod(v.shape) <= MAX_NUMEL,
    "mm": lambda v: len(v.shape) == 2 and matmul_ok(v, v, True),
    "bmm": lambda v: len(v.shape) == 3 and matmul_ok(v, v, True),
}


def _eligible(kind: str, vals: Sequence[Val], i: int) -> bool:
    """Whether a ``kind`` step can be generated with ``vals[i]`` as its first operand."""
    v = vals[i]
    if not v.is_float:  # bool and int values are only ever outputs or masks
        return False
    if kind in UNARY:  # no relu/abs of exact zeros, where they have a kink
        return UNARY[kind].bound(v.bound) <= MAX_BOUND and (v.generic or kind not in KINKED)
    if kind in ("maximum", "minimum"):
        return any(independent(v, w) and bcast(v.shape, w.shape) for w in vals)
    if kind in BINARY:  # a constant operand is always possible
        return BINARY[kind](v.bound, max(CONSTANTS)) <= MAX_BOUND
    if kind in ELIGIBLE:
        return ELIGIBLE[kind](vals, i)
    return _ACCEPTS[kind](v)


def _gen_step(draw: st.DrawFn, kind: str, vals: Sequence[Val]) -> tuple[Step, Val]:
    """Draw one ``kind`` step over ``vals``; ``kind`` must be eligible for some value."""
    i: int = pick_recent(draw, [j for j in range(len(vals)) if _eligible(kind, vals, j)])
    if kind in GENERATE:
        return GENERATE[kind](draw, vals, i)
    v = vals[i]
    shape, bound, generic, roots = v.shape, v.bound, v.generic, v.roots
    args: tuple[int | float, ...] = (i,)
    params: tuple[int, ...] = ()
    dims = range(len(shape))
    perm: tuple[int, ...]
    if kind in UNARY:
        rule = UNARY[kind]
        bound, generic = rule.bound(bound), generic and bound <= rule.generic_below
    elif kind in BINARY:
        clamp = kind in ("maximum", "minimum")
        cands = [
            j
            for j, w in enumerate(vals)
            if w.is_float and bcast(shape, w.shape) and BINARY[kind](bound, w.bound) <= MAX_BOUND
            and (kind != "sub" or j != i) and (not clamp or independent(v, w))
        ]  # fmt: skip
        if clamp:
            b = pick_recent(draw, cands)
            w = vals[b]
        else:
            b, w = operand(draw, vals, cands)
        shape, bound = bcast(shape, w.shape) or (), BINARY[kind](bound, w.bound)
        generic, args, roots = not clamp and independent(v, w), (i, b), roots | w.roots
    elif kind == "where":
        cands = [j for j, u in enumerate(vals) if bcast(shape, u.shape) and independent(v, u)]
        b, w = operand(draw, vals, cands)
        shape = bcast(shape, w.shape) or ()
        floats = [j for j, u in enumerate(vals) if u.is_float and bcast(shape, u.shape)]
        c, u = operand(draw, vals, floats)
        shape, bound, generic = bcast(shape, u.shape) or (), max(bound, u.bound), False
        args, roots = (i, b, c), roots | w.roots | u.roots
    elif kind in ("unsqueeze", "squeeze", "expand"):
        d = draw(st.sampled_from([d for d in range(len(shape) + 1)
                                  if kind == "unsqueeze" or shape[d:d + 1] == (1,)]))  # fmt: skip
        params, new = (d,), () if kind == "squeeze" else (1,)
        if kind == "expand":
            sizes = [n for n in (2, 3, 4) if n * math.prod(shape) <= MAX_NUMEL]
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
        shape = draw(st.sampled_from(reshape_targets(numel))) if kind == "reshape" else (numel,)
        shape, bound = ((), bound * numel) if kind == "sum_all" else (shape, bound)
        generic = generic and (kind != "sum_all" or numel > 0)  # the sum of nothing is 0
    elif kind == "narrow":
        d = draw(st.sampled_from([d for d in dims if shape[d] > 1]))
        length = draw(st.integers(1, shape[d] - 1))
        start = draw(st.integers(0, shape[d] - length))
        shape, params = (*shape[:d], length, *shape[d + 1 :]), (d, start, length)
    elif kind in ("sum", "mean", "amax"):
        d = draw(st.sampled_from([d for d in dims if kind == "sum" or shape[d] > 0]))
        keep = draw(st.booleans())
        bound *= shape[d] if kind == "sum" else 1
        generic = generic and shape[d] > 0
        shape, params = (*shape[:d], *((1,) if keep else ()), *shape[d + 1 :]), (d, int(keep))
    elif kind in ("softmax", "log_softmax"):
        d = draw(st.sampled_from(dims))
        generic, params = generic and shape[d] >= 2 and bound <= SATURATE, (d,)
        bound = 1.0 if kind == "softmax" else 2 * bound + math.log(max(shape[d], 1))
    elif kind == "layer_norm":  # constant along the normalized dim if it has size 1 or 2
        bound, generic = math.sqrt(shape[-1]), shape[-1] >= 3
    elif kind == "cat":
        pairs = [(j, d) for j, w in enumerate(vals) for d in dims if len(w.shape) == len(shape)
                 and w.is_float and all(w.shape[e] == shape[e] for e in dims if e != d)
                 and math.prod(shape) + math.prod(w.shape) <= MAX_NUMEL]  # fmt: skip
        j = pick_recent(draw, sorted({j for j, _ in pairs}))
        d = draw(st.sampled_from([d for jj, d in pairs if jj == j]))
        w = vals[j]
        shape = (*shape[:d], shape[d] + w.shape[d], *shape[d + 1 :])
        bound, generic = max(bound, w.bound), independent(v, w)
        args, params, roots = (i, j), (d,), roots | w.roots
    else:  # mm, bmm; the right operand may be the transposed left one
        pairs = [(j, t) for j, w in enumerate(vals) for t in (0, 1) if matmul_ok(v, w, bool(t))]
        j, t = pick_recent(draw, pairs)
        w = vals[j]
        bound, generic = shape[-1] * bound * w.bound, independent(v, w) and shape[-1] > 0
        shape = (*shape[:-1], w.shape[-2] if t else w.shape[-1])
        args, params, roots = (i, j), (t,), roots | w.roots
    return Step(kind, args, params, shape), Val(shape, bound, generic, roots)


# 1s are common; zero-size dims are rarer, and last in the shrink order
_SHAPES = st.lists(st.sampled_from((1, 2, 3, 4, 1, 2, 3, 0)), max_size=3).map(tuple)


@st.composite
def _next_step(
    draw: st.DrawFn, vals: Sequence[Val], first: bool, allowed: Sequence[str] = STEP_KINDS
) -> tuple[Step, Val] | None:
    """The next step over ``vals``, or None to end the program (never before the first step).

    Each step is one span of choices, so hypothesis can delete steps while shrinking.
    """
    if not (first or draw(st.booleans()) or draw(st.booleans()) or draw(st.booleans())):
        return None  # probability 1/8; shrinks towards fewer steps
    kinds = [k for k in allowed if any(_eligible(k, vals, j) for j in range(len(vals)))]
    if not kinds:
        return None
    if "masked_fill" in kinds and draw(st.booleans()) and draw(st.booleans()):
        return _gen_step(draw, "masked_fill", vals)  # else a comparison is rarely consumed
    return _gen_step(draw, draw(st.sampled_from(kinds)), vals)


def programs(
    *,
    max_steps: int = 8,
    max_inputs: int = 3,
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.float64),
    exclude: Sequence[str] = (),
    batch: bool = False,
) -> st.SearchStrategy[Program]:
    """Strategy for random straight-line programs of 1..``max_steps`` steps over 1..``max_inputs``
    input tensors (ranks 0..3, dims 0..4: size-1 dims are common, zero-size ones rarer) of one
    floating dtype drawn from ``dtypes`` (e.g. add ``torch.bfloat16``; :func:`tolerances` widens
    with it).

    ``exclude`` leaves out step kinds (e.g. ``("dropout",)`` for a backend whose random numbers
    differ from eager PyTorch's); a program may then have no step if no allowed kind fits.

    Programs shrink towards fewer inputs and steps, scalar inputs, ops earlier in
    :data:`STEP_KINDS`, and chains (each operand and output shrinks towards the most recent value).
    Use it as ``@given(programs(max_steps=4))`` and run ``prog(*prog.example_inputs())``.

    ``batch=True`` is the dynamic-batch mode: every input gets a leading batch dimension (of
    2 to 4) the program maps over with ``torch.func.vmap``, random steps left out; trace it
    with ``dynamic=prog.dynamic_dims()`` and run it at other batch sizes with
    ``prog.example_inputs(batch=n)`` (:func:`~functrans.testing.check_dynamic_partition`).

    A program built by hand:

    >>> import torch
    >>> from functrans.testing._program import InputSpec, Program, Step
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
    unknown = set(exclude) - set(STEP_KINDS)
    if unknown:
        raise ValueError(f"unknown step kinds {sorted(unknown)}; the kinds are {STEP_KINDS}")
    allowed = tuple(k for k in STEP_KINDS if k not in exclude and not (batch and k in RANDOM_OPS))

    @st.composite
    def draw_program(draw: st.DrawFn) -> Program:
        dtype = draw(st.sampled_from(dtype_list))
        shapes = draw(st.lists(_SHAPES, min_size=1, max_size=max_inputs))
        vals = [Val(s, INPUT_BOUND, True, frozenset([k])) for k, s in enumerate(shapes)]
        steps: list[Step] = []
        while len(steps) < max_steps and (drawn := draw(_next_step(vals, not steps, allowed))):
            step, val = drawn
            steps.append(step)
            vals.append(val)
        offsets = draw(st.lists(st.integers(0, len(vals) - 1), min_size=1, max_size=3, unique=True))
        return Program(
            inputs=tuple(InputSpec(s, dtype) for s in shapes),
            steps=tuple(steps),
            outputs=tuple(len(vals) - 1 - k for k in offsets),
            batch=draw(st.integers(2, 4)) if batch else 0,
        )

    return draw_program()
