"""Property: any composition of up to three of {grad, vjp, jvp, vmap, jit, remat, jacrev} over a
random program gives what torch.func's composition of the same function gives, whatever
partition strategy each reverse-mode level uses. Shrunk failures live in
tests/transforms/test_compose.py as named cases."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import assume, given, note
from hypothesis import strategies as st
from torch import func as tf

import functrans as ft
from functrans.testing import programs, tolerances
from functrans.testing._program import InputSpec, Program, Step

STRATEGIES = ("default", "min_cut", "full_remat", "memory_budget")
PROGRAMS = programs(max_steps=5, max_inputs=2, dtypes=(torch.float64,), exclude=("dropout",))

Fn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Level:
    """One transform of a composition; ``strategy`` only matters for grad and vjp."""

    transform: str
    strategy: str = "default"

    def __repr__(self) -> str:
        reverse = self.transform in ("grad", "vjp")
        return f"{self.transform}[{self.strategy}]" if reverse else self.transform

    def apply(self, fn: Fn, ours: bool) -> Fn:
        return _TRANSFORMS[self.transform](fn, ours, self.strategy)


def _options(strategy: str) -> dict[str, Any]:
    return {"budget": 0.5} if strategy == "memory_budget" else {}


def _grad(fn: Fn, ours: bool, strategy: str) -> Fn:
    scalar = lambda *a: (fn(*a) * _weights(fn(*a))).sum()  # noqa: E731
    if ours:
        return ft.grad(scalar, partition=strategy, **_options(strategy))
    return tf.grad(scalar)


def _vjp(fn: Fn, ours: bool, strategy: str) -> Fn:
    def run(*a: torch.Tensor) -> torch.Tensor:
        if ours:
            out, vjp_fn = ft.vjp(fn, *a, partition=strategy, **_options(strategy))
        else:
            out, vjp_fn = tf.vjp(fn, *a)
        return vjp_fn(_weights(out))[0]

    return run


def _jvp(fn: Fn, ours: bool, strategy: str) -> Fn:
    def run(*a: torch.Tensor) -> torch.Tensor:
        tangents = tuple(_weights(x) for x in a)
        return (ft.jvp if ours else tf.jvp)(fn, a, tangents)[1]

    return run


def _vmap(fn: Fn, ours: bool, strategy: str) -> Fn:
    def run(x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        batch = torch.stack([x, x * 0.5 + 0.25])
        dims = (0,) + (None,) * len(rest)
        return (ft.vmap if ours else tf.vmap)(fn, in_dims=dims)(batch, *rest)

    return run


def _jit(fn: Fn, ours: bool, strategy: str) -> Fn:
    return ft.jit(fn) if ours else fn


def _remat(fn: Fn, ours: bool, strategy: str) -> Fn:
    return ft.remat(fn) if ours else fn


def _jacrev(fn: Fn, ours: bool, strategy: str) -> Fn:
    return (ft.jacrev if ours else tf.jacrev)(fn)


_TRANSFORMS = {
    "grad": _grad,
    "vjp": _vjp,
    "jvp": _jvp,
    "vmap": _vmap,
    "jit": _jit,
    "remat": _remat,
    "jacrev": _jacrev,
}


def _weights(t: torch.Tensor) -> torch.Tensor:
    """Fixed, non-uniform weights shaped like ``t`` (so sums do not hide wrong entries)."""
    n = t.numel()
    return (torch.arange(n, dtype=t.dtype) % 5 + 1).reshape(t.shape).detach() / 3


levels = st.builds(Level, st.sampled_from(sorted(_TRANSFORMS)), st.sampled_from(STRATEGIES))


def _base(prog: Any) -> Fn:
    def fn(*xs: torch.Tensor) -> torch.Tensor:
        outs = [o for o in prog(*xs) if o.is_floating_point()]
        return torch.cat([o.reshape(-1) for o in outs])

    return fn


@given(prog=PROGRAMS, stack=st.lists(levels, min_size=1, max_size=3))
def test_property_compositions_match_torch_func(prog, stack):
    assume(any(prog.value_dtypes()[i].is_floating_point for i in prog.outputs))
    assume(sum(level.transform == "jacrev" for level in stack) <= 1)  # sizes stay small
    note(f"composition (outermost first): {stack}")
    ours, theirs = _base(prog), _base(prog)
    for level in reversed(stack):
        ours, theirs = level.apply(ours, True), level.apply(theirs, False)
    args = prog.example_inputs()
    try:
        expected = theirs(*args)
    except Exception as e:  # torch.func cannot run it either (a missing batching rule...)
        note(f"torch.func refused: {type(e).__name__}: {e}")
        assume(False)
    rtol, atol = tolerances(prog.dtype)
    torch.testing.assert_close(ours(*args), expected, rtol=rtol, atol=atol)


# Shrunk by make fuzz (nightly, 1000 examples): grad of jvp of jvp of abs on a float64 scalar.
# The outer jvp's tangent of abs's derivative is a ZeroTensor, whose view (the reshape in _base)
# came out of grad's trace on the 'meta' device: a TraceError at the weighting mul, until such
# views reached the fake tensor mode (functrans/_core/zero_tensors.py).
NESTED_JVP_OF_ABS = Program(
    inputs=(InputSpec((), torch.float64),),
    steps=(
        Step("neg", (0,), (), ()),
        Step("neg", (1,), (), ()),
        Step("neg", (2,), (), ()),
        Step("abs", (3,), (), ()),
        Step("neg", (4,), (), ()),
    ),
    outputs=(4,),
)


def test_grad_of_two_jvps_of_abs_matches_torch_func() -> None:
    stack = [Level("grad", "default"), Level("jvp", "default"), Level("jvp", "default")]
    ours, theirs = _base(NESTED_JVP_OF_ABS), _base(NESTED_JVP_OF_ABS)
    for level in reversed(stack):
        ours, theirs = level.apply(ours, True), level.apply(theirs, False)
    args = NESTED_JVP_OF_ABS.example_inputs()
    torch.testing.assert_close(ours(*args), theirs(*args))
