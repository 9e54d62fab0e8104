"""What the program generator tracks about each value, and the small rules built on it."""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from hypothesis import strategies as st

MAX_BOUND = 1000.0  # bound on the magnitude of every value
MAX_NUMEL = 256
SATURATE = 4.0  # tanh, sigmoid, gelu, softmax... of larger values may round to exact ties
CONSTANTS = (0.5, 2.0, -1.5)


class Unary(NamedTuple):
    """What a unary op does to the tracked facts about its operand."""

    bound: Callable[[float], float]  # the result's magnitude bound from the operand's
    generic_below: float  # the largest operand bound that keeps the result generic


# unary op -> (bound, generic_below): see Unary
_UNARY: dict[str, tuple[Callable[[float], float], float]] = {
    "neg": (lambda b: b, math.inf),
    "tanh": (lambda b: 1.0, SATURATE),
    "sin": (lambda b: 1.0, math.inf),
    "cos": (lambda b: 1.0, math.inf),
    "atan": (lambda b: min(b, math.pi / 2), SATURATE),
    "erf": (lambda b: 1.0, 2.0),  # erf(4) rounds to 1 in float32
    "exp_tanh": (lambda b: math.e, SATURATE),
    "sigmoid": (lambda b: 1.0, SATURATE),
    "square": (lambda b: b * b, math.inf),
    "cube": (lambda b: b * b * b, math.inf),
    "relu": (lambda b: b, -1.0),  # many exact zeros
    "abs": (lambda b: b, math.inf),
    "clamp": (lambda b: min(b, 1.0), 1.0),  # ties at +-1 once it clamps
    "gelu": (lambda b: b, SATURATE),  # exactly 0 below about -5.5 in float32
    "silu": (lambda b: b, 50.0),
    "log1p_square": (lambda b: math.log1p(b * b), math.inf),
    "sqrt_1p_square": (lambda b: math.sqrt(1 + b * b), math.inf),
    "dropout": (lambda b: 2 * b, -1.0),  # zeros where the mask drops
    "clone": (lambda b: b, math.inf),
}
UNARY = {op: Unary(*row) for op, row in _UNARY.items()}
KINKED = ("relu", "abs", "clamp")  # kinks or ties: their operands must be generic
# binary op -> result bound from operand bounds
BINARY: dict[str, Callable[[float, float], float]] = {
    "add": operator.add,
    "sub": operator.add,
    "mul": operator.mul,
    "div": lambda a, b: a,
    "maximum": max,
    "minimum": max,
}


@dataclass(frozen=True)
class Val:
    """What the generator tracks about a value: its shape, a bound on its magnitude, whether it
    is generic (continuously distributed, almost surely free of exact ties and constant rows),
    the inputs it depends on (combining values with shared roots can cancel or tie) and its
    kind: ``"float"`` (differentiable), ``"bool"`` (a comparison) or ``"int"`` (an index)."""

    shape: tuple[int, ...]
    bound: float
    generic: bool
    roots: frozenset[int]
    kind: str = "float"

    @property
    def is_float(self) -> bool:
        return self.kind == "float"

    @property
    def empty(self) -> bool:
        return 0 in self.shape


def bcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    """The broadcast shape of ``a`` and ``b``, or None if incompatible or too large."""
    n = max(len(a), len(b))
    out = []
    for x, y in zip((1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b, strict=True):
        if x != y and 1 not in (x, y):
            return None
        out.append(x if y == 1 else y)
    return tuple(out) if math.prod(out) <= MAX_NUMEL else None


@functools.cache
def reshape_targets(numel: int) -> tuple[tuple[int, ...], ...]:
    """Shapes of rank 0..3 (dims up to 8, or flat) with ``numel`` elements, lowest rank first."""
    dims = range(1, 9)
    out = [s for r in range(4) for s in itertools.product(dims, repeat=r) if math.prod(s) == numel]
    return tuple(out) if (numel,) in out else (*out, (numel,))


def independent(a: Val, b: Val) -> bool:
    return a.generic and b.generic and not (a.roots & b.roots)


def matmul_ok(a: Val, b: Val, transpose: bool) -> bool:
    """Whether ``a @ b`` (``a @ b.mT`` if ``transpose``) is a bounded mm or bmm."""
    if not (a.is_float and b.is_float) or len(a.shape) != len(b.shape):
        return False
    if a.shape[:-2] != b.shape[:-2]:
        return False
    inner = b.shape[-1] if transpose else b.shape[-2]
    return inner == a.shape[-1] and inner * a.bound * b.bound <= MAX_BOUND


def matmul_shape(a: Val, b: Val, transpose: bool) -> tuple[int, ...]:
    return (*a.shape[:-1], b.shape[-2] if transpose else b.shape[-1])


def pick_recent(draw: st.DrawFn, items: Sequence[Any]) -> Any:
    """One of ``items``, shrinking towards the last (most recently computed) one."""
    return items[len(items) - 1 - draw(st.integers(0, len(items) - 1))]


def operand(draw: st.DrawFn, vals: Sequence[Val], cands: Sequence[int]) -> tuple[int | float, Val]:
    """A value from ``cands`` (shrinking to the most recent) or, last, a scalar constant."""
    k = draw(st.integers(0, len(cands)))
    if k < len(cands):
        return cands[len(cands) - 1 - k], vals[cands[len(cands) - 1 - k]]
    c = draw(st.sampled_from(CONSTANTS))
    return c, Val((), abs(c), True, frozenset())
