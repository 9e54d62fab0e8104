"""Tests of the random-program generator ``functrans.testing._random_programs``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from functrans.testing._program import STEP_KINDS, InputSpec, Program, Step
from functrans.testing._random_programs import programs

SETTINGS = settings(max_examples=200, deadline=None)


def _all_values(prog: Program) -> Program:
    """The same program, returning every value (inputs and step results)."""
    return Program(prog.inputs, prog.steps, tuple(range(len(prog.value_shapes()))))


@SETTINGS
@given(programs())
def test_programs_run_with_predicted_shapes_and_dtypes(prog: Program) -> None:
    assert 1 <= len(prog.inputs) <= 3 and 1 <= len(prog.steps) <= 8
    assert 1 <= len(prog.outputs) <= 3
    assert all(i.dtype == prog.dtype for i in prog.inputs)
    assert prog.dtype in (torch.float32, torch.float64)
    assert all(len(i.shape) <= 3 and all(0 <= d <= 4 for d in i.shape) for i in prog.inputs)
    assert all(s.op in STEP_KINDS for s in prog.steps)
    xs = prog.example_inputs()
    values = _all_values(prog)(*xs)
    assert [tuple(v.shape) for v in values] == list(prog.value_shapes())
    assert [v.dtype for v in values] == list(prog.value_dtypes())
    for v in values:
        assert v.dtype in (prog.dtype, torch.bool, torch.int64)
        assert not v.is_floating_point() or torch.isfinite(v).all()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        outs = prog(*xs)
        assert [tuple(o.shape) for o in outs] == list(prog.output_shapes())
        # Deterministic: same inputs for the same seed, same outputs for the same inputs and RNG.
        torch.manual_seed(0)
        for a, b in zip(outs, prog(*prog.example_inputs()), strict=True):
            assert torch.equal(a, b)


@SETTINGS
@given(programs(), st.integers(0, 2**16))
def test_eager_grads_are_finite(prog: Program, seed: int) -> None:
    xs = tuple(x.requires_grad_() for x in prog.example_inputs(seed))
    gen = torch.Generator().manual_seed(seed)
    outs = prog(*xs)
    loss = sum(
        (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum()
        for o in outs
        if o.requires_grad
    )
    if not isinstance(loss, torch.Tensor):  # only comparisons and indices are not differentiable
        assert all(not o.is_floating_point() for o in outs)
        return
    grads = torch.autograd.grad(loss, xs, allow_unused=True)
    for x, g in zip(xs, grads, strict=True):
        assert g is None or (g.shape == x.shape and torch.isfinite(g).all())


@SETTINGS
@given(programs())
def test_source_executes_and_matches_call(prog: Program) -> None:
    src = prog.source()
    assert repr(prog) == src
    namespace: dict[str, Any] = {}
    exec(compile(src, "<program>", "exec"), namespace)
    xs = prog.example_inputs(seed=1)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        got = namespace["program"](*xs)
        torch.manual_seed(0)
        expected = prog(*xs)
    assert isinstance(got, tuple) and len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert a.shape == b.shape and torch.equal(a, b)


@SETTINGS
@given(programs(), st.integers(0, 2**16))
def test_no_ties_or_kinks_at_example_inputs(prog: Program, seed: int) -> None:
    """amax and argmax have a unique maximum, maximum/minimum and comparisons never see equal
    entries, relu/abs never see zeros, clamp never sees its bounds and layer_norm never sees
    constant rows."""
    values = _all_values(prog)(*prog.example_inputs(seed))
    for step in prog.steps:
        x = values[int(step.args[0])]
        other = step.args[1:2]
        y = (values[other[0]] if isinstance(other[0], int) else other[0]) if other else None
        if step.op in ("amax", "argmax") and x.shape[d := step.params[0]] > 1:
            top = torch.topk(x, 2, dim=d).values
            assert (top.narrow(d, 0, 1) > top.narrow(d, 1, 1)).all()
        elif step.op in ("maximum", "minimum", "where", "gt"):
            assert y is not None and not torch.eq(x, y).any()
        elif step.op in ("relu", "abs"):
            assert (x != 0).all()
        elif step.op == "clamp":
            assert (x.abs() != 1).all()
        elif step.op == "layer_norm":
            assert (x.amax(-1) > x.amin(-1)).all()


def test_options_are_respected() -> None:
    @settings(max_examples=50, deadline=None, database=None)
    @given(programs(max_steps=2, max_inputs=1, dtypes=(torch.float64,)))
    def check(prog: Program) -> None:
        assert len(prog.inputs) == 1 and 1 <= len(prog.steps) <= 2
        assert prog.dtype == torch.float64

    check()

    @settings(max_examples=50, deadline=None, database=None)
    @given(programs(exclude=("dropout", "neg")))
    def no_dropout(prog: Program) -> None:
        assert not prog.is_random and all(s.op not in ("dropout", "neg") for s in prog.steps)

    no_dropout()
    with pytest.raises(ValueError, match="unknown step kinds"):
        programs(exclude=("log",))
    with pytest.raises(ValueError):
        programs(max_steps=0)
    with pytest.raises(ValueError):
        programs(dtypes=(torch.int64,))


def test_every_step_kind_is_generated_and_at_least_40_aten_ops_are_covered() -> None:
    import functrans as ft

    seen: dict[str, Program] = {}

    @settings(max_examples=500, deadline=None, database=None, derandomize=True)
    @given(programs())
    def collect(prog: Program) -> None:
        for step in prog.steps:
            seen.setdefault(step.op, prog)

    collect()
    assert set(STEP_KINDS) - set(seen) == set()
    aten = set()
    for prog in {id(p): p for p in seen.values()}.values():  # one program per step kind
        graph = ft.trace(_all_values(prog))(*prog.example_inputs())
        aten |= {
            n.target.overloadpacket for n in graph.ops() if hasattr(n.target, "overloadpacket")
        }
    assert len(aten) >= 40, sorted(map(str, aten))


def test_hand_built_program() -> None:
    prog = Program(
        inputs=(InputSpec((2, 1), torch.float32), InputSpec((3,), torch.float32)),
        steps=(
            Step("add", (0, 1), (), (2, 3)),
            Step("where", (2, 0.5, 1), (), (2, 3)),
            Step("mm", (3, 3), (1,), (2, 2)),
        ),
        outputs=(4, 0),
    )
    a, b = prog.example_inputs()
    out, same = prog(a, b)
    w = torch.where(a + b > 0.5, a + b, b)
    torch.testing.assert_close(out, w @ w.T)
    assert same is a
    assert "v3 = torch.where(v2 > 0.5, v2, a1)" in prog.source()
    assert "return (v4, a0)" in prog.source()
