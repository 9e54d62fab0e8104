"""Hypothesis strategy for small random straight-line PyTorch programs.

A :class:`Program` is a list of :class:`Step` s, each applying one op to earlier values (the
value list is the inputs followed by the step results).  Programs have no Python control flow on
values, are deterministic, share one floating dtype, and are differentiable almost everywhere
with finite gradients at the inputs :meth:`Program.example_inputs` produces: every op is total
(``log1p(x * x)`` instead of ``log``, ``a / (1 + b * b)`` instead of ``a / b``), the generator
tracks a bound on every value's magnitude, and ``amax``/``maximum``/``minimum``/``layer_norm``
are only applied where exact ties or constant rows are (almost surely) impossible.
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
import torch.nn.functional as F
from hypothesis import strategies as st

__all__ = ["STEP_KINDS", "InputSpec", "Program", "Step", "programs"]

INPUT_BOUND = 2.0  # example inputs are uniform in [-INPUT_BOUND, INPUT_BOUND)
_MAX_BOUND = 1000.0  # no value may exceed this magnitude bound
_MAX_NUMEL = 256
_SATURATE = 4.0  # tanh/sigmoid of larger values may round to exact ties in float32
_CONSTANTS = (0.5, 2.0, -1.5)


@dataclass(frozen=True)
class InputSpec:
    """Shape and dtype of one program input."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Step:
    """One op: ``op`` (a :data:`STEP_KINDS` name) applied to ``args``.

    ``args`` are value indices (``int``) or Python ``float`` constants; ``params`` are the op's
    integer parameters (dims, sizes, flags); ``shape`` is the result's shape.
    """

    op: str
    args: tuple[int | float, ...]
    params: tuple[int, ...]
    shape: tuple[int, ...]


def _ident(b: float) -> float:
    return b


def _sat(b: float) -> bool:
    return b <= _SATURATE


def _always(b: float) -> bool:
    return True


def _never(b: float) -> bool:
    return False


# name -> (function, source template, result bound from operand bound, keeps operand generic)
_UNARY: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str, Callable[[float], float],
                        Callable[[float], bool]]] = {
    "neg": (torch.neg, "-{0}", _ident, _always),
    "tanh": (torch.tanh, "torch.tanh({0})", lambda b: 1.0, _sat),
    "sin": (torch.sin, "torch.sin({0})", lambda b: 1.0, _always),
    "cos": (torch.cos, "torch.cos({0})", lambda b: 1.0, _always),
    "exp_tanh": (lambda x: torch.exp(torch.tanh(x)), "torch.exp(torch.tanh({0}))",
                 lambda b: math.e, _sat),
    "sigmoid": (torch.sigmoid, "torch.sigmoid({0})", lambda b: 1.0, _sat),
    "square": (lambda x: x * x, "{0} * {0}", lambda b: b * b, _always),
    "relu": (torch.relu, "torch.relu({0})", _ident, _never),
    "abs": (torch.abs, "torch.abs({0})", _ident, _always),
    "gelu": (F.gelu, "F.gelu({0})", _ident, _always),
    "silu": (F.silu, "F.silu({0})", _ident, _always),
    "log1p_square": (lambda x: torch.log1p(x * x), "torch.log1p({0} * {0})",
                     lambda b: math.log1p(b * b), _always),
}  # fmt: skip

# name -> (function, source template, result bound from operand bounds)
_BINARY: dict[str, tuple[Callable[[torch.Tensor, Any], torch.Tensor], str,
                         Callable[[float, float], float]]] = {
    "add": (operator.add, "{0} + {1}", operator.add),
    "sub": (operator.sub, "{0} - {1}", operator.add),
    "mul": (operator.mul, "{0} * {1}", operator.mul),
    "div": (lambda a, b: a / (1 + b * b), "{0} / (1 + {1} * {1})", lambda a, b: a),
    "maximum": (torch.maximum, "torch.maximum({0}, {1})", max),
    "minimum": (torch.minimum, "torch.minimum({0}, {1})", max),
}  # fmt: skip

_VIEWS = ("unsqueeze", "squeeze", "transpose", "permute", "reshape", "flatten", "expand", "narrow")
_REDUCTIONS = ("sum", "mean", "amax", "sum_all")
_OTHERS = ("softmax", "log_softmax", "layer_norm", "cat", "mm", "bmm")
STEP_KINDS: tuple[str, ...] = (*_UNARY, *_BINARY, "where", *_VIEWS, *_REDUCTIONS, *_OTHERS)
"""Every ``Step.op``, simplest first (the order hypothesis shrinks towards)."""


@dataclass(frozen=True, repr=False)
class Program:
    """A straight-line program: ``inputs``, then ``steps``, returning the values ``outputs``."""

    inputs: tuple[InputSpec, ...]
    steps: tuple[Step, ...]
    outputs: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype shared by every value of the program."""
        return self.inputs[0].dtype

    def value_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Shapes of all values: the inputs, then each step's result."""
        return tuple(i.shape for i in self.inputs) + tuple(s.shape for s in self.steps)

    def output_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Predicted shapes of the returned tensors."""
        shapes = self.value_shapes()
        return tuple(shapes[i] for i in self.outputs)

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(tensors) != len(self.inputs):
            raise TypeError(f"program takes {len(self.inputs)} inputs, got {len(tensors)}")
        values = list(tensors)
        for step in self.steps:
            values.append(_apply(step, values))
        return tuple(values[i] for i in self.outputs)

    def example_inputs(self, seed: int = 0) -> tuple[torch.Tensor, ...]:
        """Deterministic inputs, uniform in ``[-INPUT_BOUND, INPUT_BOUND)``."""
        gen = torch.Generator().manual_seed(seed)
        return tuple(
            (torch.rand(i.shape, generator=gen, dtype=i.dtype) * 2 - 1) * INPUT_BOUND
            for i in self.inputs
        )

    def source(self) -> str:
        """Self-contained Python source defining an equivalent ``program`` function."""
        names = [f"a{i}" for i in range(len(self.inputs))]
        lines = ["import torch", "import torch.nn.functional as F", "", ""]
        lines.append(f"def program({', '.join(names)}):")
        for name, spec in zip(names, self.inputs):
            lines.append(
                f"    # {name}: {str(spec.dtype).removeprefix('torch.')}{list(spec.shape)}"
            )
        for step in self.steps:
            names.append(f"v{len(names)}")
            lines.append(f"    {names[-1]} = {_expr(step, names)}  # {list(step.shape)}")
        outs = ", ".join(names[i] for i in self.outputs)
        lines.append(f"    return ({outs}{',' if len(self.outputs) == 1 else ''})")
        return "\n".join(lines) + "\n"

    def __repr__(self) -> str:
        return self.source()


def _apply(step: Step, values: list[torch.Tensor]) -> torch.Tensor:
    """Run one step eagerly on the values computed so far."""
    ops: list[Any] = [values[a] if isinstance(a, int) else a for a in step.args]
    x, p = ops[0], step.params
    if step.op in _UNARY:
        return _UNARY[step.op][0](x)
    if step.op in _BINARY:
        return _BINARY[step.op][0](x, ops[1])
    match step.op:
        case "where":
            return torch.where(x > ops[1], x, ops[2])
        case "unsqueeze":
            return torch.unsqueeze(x, p[0])
        case "squeeze":
            return torch.squeeze(x, p[0])
        case "transpose":
            return torch.transpose(x, p[0], p[1])
        case "permute":
            return torch.permute(x, p)
        case "reshape":
            return torch.reshape(x, step.shape)
        case "flatten":
            return torch.flatten(x)
        case "expand":
            return x.expand(step.shape)  # type: ignore[no-any-return]
        case "narrow":
            return torch.narrow(x, p[0], p[1], p[2])
        case "sum":
            return torch.sum(x, p[0], keepdim=bool(p[1]))
        case "mean":
            return torch.mean(x, p[0], keepdim=bool(p[1]))
        case "amax":
            return torch.amax(x, p[0], keepdim=bool(p[1]))
        case "sum_all":
            return torch.sum(x)
        case "softmax":
            return torch.softmax(x, p[0])
        case "log_softmax":
            return torch.log_softmax(x, p[0])
        case "layer_norm":
            return F.layer_norm(x, (x.shape[-1],))
        case "cat":
            return torch.cat([x, ops[1]], p[0])
        case "mm":
            return torch.mm(x, ops[1].mT if p[0] else ops[1])
        case "bmm":
            return torch.bmm(x, ops[1].mT if p[0] else ops[1])
    raise ValueError(f"unknown op {step.op!r}")


def _expr(step: Step, names: Sequence[str]) -> str:
    """Source expression of one step; ``names`` maps value indices to variable names."""
    ops = [names[a] if isinstance(a, int) else f"({a!r})" if a < 0 else repr(a) for a in step.args]
    x, p = ops[0], ", ".join(map(str, step.params))
    if step.op in _UNARY:
        return _UNARY[step.op][1].format(x)
    if step.op in _BINARY:
        return _BINARY[step.op][1].format(x, ops[1])
    match step.op:
        case "where":
            return f"torch.where({x} > {ops[1]}, {x}, {ops[2]})"
        case "reshape" | "expand":
            return f"{x}.{step.op}({step.shape})"
        case "flatten" | "sum_all":
            return f"{x}.{step.op.removesuffix('_all')}()"
        case "sum" | "mean" | "amax":
            return f"{x}.{step.op}({step.params[0]}, keepdim={bool(step.params[1])})"
        case "softmax" | "log_softmax":
            return f"torch.{step.op}({x}, {p})"
        case "layer_norm":
            return f"F.layer_norm({x}, {x}.shape[-1:])"
        case "cat":
            return f"torch.cat([{x}, {ops[1]}], {p})"
        case "mm" | "bmm":
            return f"torch.{step.op}({x}, {ops[1]}{'.mT' if step.params[0] else ''})"
    return f"{x}.{step.op}({p})"  # unsqueeze, squeeze, transpose, permute, narrow


# ----------------------------------------------------------------------------- generation


@dataclass(frozen=True)
class _Val:
    """What the generator tracks about a value.

    ``generic``: the entries have (almost surely) no exact ties, are not constant along any dim
    and come from a continuous distribution; ``roots``: the inputs the value depends on.
    """

    shape: tuple[int, ...]
    bound: float
    generic: bool
    roots: frozenset[int]


def _bcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    n = max(len(a), len(b))
    out = []
    for x, y in zip((1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b):
        if x != y and 1 not in (x, y):
            return None
        out.append(max(x, y))
    return tuple(out) if math.prod(out) <= _MAX_NUMEL else None


@functools.cache
def _reshape_targets(numel: int) -> tuple[tuple[int, ...], ...]:
    shapes = [
        s
        for r in range(4)
        for s in itertools.product(range(1, 9), repeat=r)
        if math.prod(s) == numel
    ]
    return tuple(shapes) if (numel,) in shapes else (*shapes, (numel,))


def _independent(a: _Val, b: _Val) -> bool:
    return a.generic and b.generic and not (a.roots & b.roots)


def _matmul_ok(a: _Val, b: _Val, transpose: bool) -> bool:
    """Whether ``a @ b`` (or ``a @ b^T``) is well-shaped (mm or bmm) and stays bounded."""
    if len(a.shape) != len(b.shape) or a.shape[:-2] != b.shape[:-2]:
        return False
    k = a.shape[-1]
    inner = b.shape[-1] if transpose else b.shape[-2]
    return inner == k and k * a.bound * b.bound <= _MAX_BOUND


def _eligible(kind: str, vals: Sequence[_Val], i: int) -> bool:
    """Whether ``kind`` can be generated with ``vals[i]`` as its first operand."""
    v = vals[i]
    rank, bound = len(v.shape), v.bound
    if kind in _UNARY:
        return _UNARY[kind][2](bound) <= _MAX_BOUND
    if kind in ("maximum", "minimum"):
        return any(_independent(v, w) and _bcast(v.shape, w.shape) for w in vals)
    if kind in _BINARY:
        return _BINARY[kind][2](bound, max(_CONSTANTS)) <= _MAX_BOUND
    match kind:
        case "where" | "reshape":
            return True
        case "unsqueeze":
            return rank <= 2
        case "squeeze":
            return 1 in v.shape
        case "expand":
            return 1 in v.shape and 2 * math.prod(v.shape) <= _MAX_NUMEL
        case "transpose" | "permute" | "flatten":
            return rank >= 2
        case "narrow":
            return any(s > 1 for s in v.shape)
        case "sum":
            return rank >= 1 and max(v.shape) * bound <= _MAX_BOUND
        case "mean" | "softmax":
            return rank >= 1
        case "amax":
            return rank >= 1 and v.generic
        case "sum_all":
            return math.prod(v.shape) * bound <= _MAX_BOUND
        case "log_softmax":
            return rank >= 1 and 2 * bound + math.log(max(v.shape)) <= _MAX_BOUND
        case "layer_norm":
            return rank >= 1 and v.shape[-1] >= 2 and v.generic
        case "cat":
            return rank >= 1 and 2 * math.prod(v.shape) <= _MAX_NUMEL
        case "mm":
            return rank == 2 and _matmul_ok(v, v, True)
        case "bmm":
            return rank == 3 and _matmul_ok(v, v, True)
    raise ValueError(f"unknown op {kind!r}")


def _pick_recent(draw: st.DrawFn, items: Sequence[Any]) -> Any:
    """Choose one of ``items``, shrinking towards the last (most recently computed) one."""
    return items[len(items) - 1 - draw(st.integers(0, len(items) - 1))]


def _operand_or_const(draw: st.DrawFn, cands: Sequence[int]) -> int | float:
    """A value index from ``cands`` (most recent first) or, as a last resort, a constant."""
    k = draw(st.integers(0, len(cands)))
    return cands[len(cands) - 1 - k] if k < len(cands) else draw(st.sampled_from(_CONSTANTS))


def _gen_step(draw: st.DrawFn, kind: str, vals: Sequence[_Val]) -> tuple[Step, _Val]:
    """Generate one ``kind`` step over ``vals``; ``kind`` must be eligible for some value."""
    i: int = _pick_recent(draw, [j for j in range(len(vals)) if _eligible(kind, vals, j)])
    v = vals[i]
    shape, bound, generic, roots = v.shape, v.bound, v.generic, v.roots
    args: tuple[int | float, ...] = (i,)
    params: tuple[int, ...] = ()
    dims = range(len(shape))
    if kind in _UNARY:
        bound, generic = _UNARY[kind][2](bound), generic and _UNARY[kind][3](bound)
    elif kind in _BINARY:
        bound_fn = _BINARY[kind][2]
        cands = [
            j
            for j, w in enumerate(vals)
            if _bcast(shape, w.shape) and bound_fn(bound, w.bound) <= _MAX_BOUND
            and (kind != "sub" or j != i)
            and (kind not in ("maximum", "minimum") or _independent(v, w))
        ]  # fmt: skip
        b = draw(st.sampled_from(cands)) if kind in ("maximum", "minimum") else None
        b = _operand_or_const(draw, cands) if b is None else b
        w = vals[b] if isinstance(b, int) else _Val((), abs(b), True, frozenset())
        shape, bound = _bcast(shape, w.shape) or (), bound_fn(bound, w.bound)
        generic, roots = kind not in ("maximum", "minimum") and _independent(v, w), roots | w.roots
        args = (i, b)
    elif kind == "where":
        b = _operand_or_const(
            draw, [j for j, w in enumerate(vals) if j != i and _bcast(shape, w.shape)]
        )
        if isinstance(b, int):
            shape = _bcast(shape, vals[b].shape) or ()
        c = _operand_or_const(draw, [j for j, w in enumerate(vals) if _bcast(shape, w.shape)])
        if isinstance(c, int):
            shape, bound = _bcast(shape, vals[c].shape) or (), max(bound, vals[c].bound)
        else:
            bound = max(bound, abs(c))
        roots = roots.union(*(vals[j].roots for j in (b, c) if isinstance(j, int)))
        args, generic = (i, b, c), False
    elif kind in ("unsqueeze", "squeeze", "expand"):
        d = draw(st.sampled_from([d for d in range(len(shape) + 1) if kind == "unsqueeze"
                                  or shape[d:d + 1] == (1,)]))  # fmt: skip
        if kind == "unsqueeze":
            shape, params = (*shape[:d], 1, *shape[d:]), (d,)
        elif kind == "squeeze":
            shape, params = shape[:d] + shape[d + 1 :], (d,)
        else:
            n = math.prod(shape)
            size = draw(st.sampled_from([s for s in (2, 3, 4) if n * s <= _MAX_NUMEL]))
            shape, generic = (*shape[:d], size, *shape[d + 1 :]), False
    elif kind == "transpose":
        params = draw(st.sampled_from(list(itertools.combinations(dims, 2))))
        perm = list(dims)
        perm[params[0]], perm[params[1]] = perm[params[1]], perm[params[0]]
        shape = tuple(shape[d] for d in perm)
    elif kind == "permute":
        params = tuple(draw(st.permutations(dims)))
        shape = tuple(shape[d] for d in params)
    elif kind == "reshape":
        shape = draw(st.sampled_from(_reshape_targets(math.prod(shape))))
    elif kind == "flatten":
        shape = (math.prod(shape),)
    elif kind == "narrow":
        d = draw(st.sampled_from([d for d in dims if shape[d] > 1]))
        length = draw(st.integers(1, shape[d] - 1))
        start = draw(st.integers(0, shape[d] - length))
        shape, params = (*shape[:d], length, *shape[d + 1 :]), (d, start, length)
    elif kind in ("sum", "mean", "amax"):
        d, keep = draw(st.sampled_from(dims)), draw(st.booleans())
        bound *= shape[d] if kind == "sum" else 1
        shape = (*shape[:d], 1, *shape[d + 1 :]) if keep else shape[:d] + shape[d + 1 :]
        params = (d, int(keep))
    elif kind == "sum_all":
        shape, bound = (), bound * math.prod(shape)
    elif kind in ("softmax", "log_softmax"):
        d = draw(st.sampled_from(dims))
        generic = generic and shape[d] >= 2
        bound = 1.0 if kind == "softmax" else 2 * bound + math.log(shape[d])
        params = (d,)
    elif kind == "layer_norm":
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
    else:  # mm, bmm
        j, t = _pick_recent(
            draw, [(j, t) for j, w in enumerate(vals) for t in (0, 1) if _matmul_ok(v, w, bool(t))]
        )
        w = vals[j]
        shape = (*shape[:-1], w.shape[-2] if t else w.shape[-1])
        bound, generic = shape[-1] * bound * w.bound, _independent(v, w)
        args, params, roots = (i, j), (t,), roots | w.roots
    return Step(kind, args, params, shape), _Val(shape, bound, generic, roots)


_DIM_SIZES = (1, 2, 3, 4, 1)  # size-1 dims are common, for broadcasting edge cases


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
        n_inputs = draw(st.integers(1, max_inputs))
        shapes = [
            tuple(draw(st.sampled_from(_DIM_SIZES)) for _ in range(draw(st.integers(0, 3))))
            for _ in range(n_inputs)
        ]
        n_steps = draw(st.integers(1, max_steps))
        n_values = n_inputs + n_steps
        offsets = draw(st.lists(st.integers(0, n_values - 1), min_size=1, max_size=3, unique=True))
        vals = [_Val(s, INPUT_BOUND, True, frozenset([k])) for k, s in enumerate(shapes)]
        steps = []
        for _ in range(n_steps):
            kinds = [k for k in STEP_KINDS if any(_eligible(k, vals, j) for j in range(len(vals)))]
            step, val = _gen_step(draw, draw(st.sampled_from(kinds)), vals)
            steps.append(step)
            vals.append(val)
        return Program(
            inputs=tuple(InputSpec(s, dtype) for s in shapes),
            steps=tuple(steps),
            outputs=tuple(n_values - 1 - k for k in offsets),
        )

    return draw_program()
