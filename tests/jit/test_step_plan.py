"""Peak goals planned on the step as it runs (functrans._jit.step_plan).

The rules: ``min_peak``'s measured peak is at most every local named strategy's; a
``memory_budget(peak_bytes=N)`` is met (measured <= N) whenever one of them measures <= N, and
recomputes no more than ``full_remat`` there; the reported peak is the measured one; the
measured peak never rises as the limit falls; gradients are eager's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import functrans as ft
from functrans._jit.outline import OUTLINED
from functrans._jit.step_plan import CHOICES, largest_passing
from functrans.testing import measure_peak


class Block(nn.Module):
    """A pre-norm attention + MLP block (no dropout: every cut may recompute it)."""

    def __init__(self, d: int, mlp: int = 4) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, mlp * d), nn.Linear(mlp * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, -1)
        a = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1)
        x = x + self.o(a @ v)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Stack(nn.Module):
    def __init__(self, n: int, d: int, mlp: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, mlp) for _ in range(n))
        self.head = nn.Linear(d, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x).square().mean()


def _model(n: int = 5, d: int = 32, mlp: int = 4, seed: int = 0) -> tuple[Callable[..., Any], Any]:
    torch.manual_seed(seed)
    m = Stack(n, d, mlp)
    params = {k: v.detach().requires_grad_() for k, v in m.named_parameters()}

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(m, p, (x,))  # type: ignore[no-any-return]

    return loss, (params, torch.randn(4, 24, d))


def _grads(f: Callable[..., Any], args: Any) -> list[torch.Tensor]:
    params, x = args
    for t in params.values():
        t.grad = None
    f(params, x).backward()
    return [t.grad.clone() for t in params.values()]


def _peak(f: Callable[..., Any], args: Any) -> int:
    params, x = args
    for t in params.values():
        t.grad = None
    return measure_peak(lambda: f(params, x).backward()).peak_bytes


def _run(loss: Callable[..., Any], args: Any, strategy: str, **options: Any) -> tuple[int, Any]:
    """(measured peak, partition) of one jitted step, its gradients checked against eager's."""
    step = ft.jit(loss, partition=strategy, **options)
    for a, b in zip(_grads(step, args), _grads(loss, args), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    return _peak(step, args), step.partitions()[0]


@pytest.fixture(scope="module")
def named() -> dict[str, tuple[int, Any]]:
    loss, args = _model()
    return {s: _run(loss, args, s) for s in ("default", "min_cut", "full_remat")}


def test_min_peak_is_at_most_every_named_strategy(named: dict[str, tuple[int, Any]]) -> None:
    loss, args = _model()
    peak, p = _run(loss, args, "min_peak")
    assert peak <= min(m for m, _ in named.values())
    assert p.peak_bytes == peak  # reported is measured
    assert p.strategy == "min_peak"


def test_a_limit_a_named_strategy_meets_is_met_with_less_recompute(
    named: dict[str, tuple[int, Any]],
) -> None:
    loss, args = _model()
    full_peak, full = named["full_remat"]
    peak, p = _run(loss, args, "memory_budget", peak_bytes=full_peak)
    assert peak <= full_peak
    assert p.peak_bytes == peak
    assert p.recompute_flops < full.recompute_flops


def test_recompute_inside_blocks_is_counted(named: dict[str, tuple[int, Any]]) -> None:
    """A region that saves only its inputs recomputes its forward in its backward: the step's
    recompute FLOPs count it (they were the step's own ops only)."""
    _, default = named["default"]
    _, full = named["full_remat"]
    block_flops = sum(o.forward_flops for o in full.joint.attached(OUTLINED))
    assert full.recompute_flops >= 0.5 * block_flops * 5  # five blocks
    assert default.recompute_flops < full.recompute_flops / 100


def test_the_measured_peak_never_rises_as_the_limit_falls(
    named: dict[str, tuple[int, Any]],
) -> None:
    loss, args = _model()
    low, high = named["full_remat"][0], named["default"][0]
    peaks = []
    for frac in (1.0, 0.75, 0.5, 0.25, 0.0):
        limit = int(low + frac * (high - low))
        peak, _ = _run(loss, args, "memory_budget", peak_bytes=limit)
        assert peak <= limit
        peaks.append(peak)
    assert peaks == sorted(peaks, reverse=True)


def test_a_limit_below_every_plan_names_the_block_by_block_floor() -> None:
    loss, args = _model(n=3)
    step = ft.jit(loss, partition="memory_budget", peak_bytes=1024)
    with pytest.raises(ft.InvalidPartitionError, match=r"Planned block by block .* lowest step"):
        _grads(step, args)


@settings(max_examples=4, deadline=None)
@given(
    n=st.integers(2, 5),
    d=st.sampled_from([16, 32]),
    mlp=st.sampled_from([1, 4]),
    frac=st.floats(0.0, 1.0),
)
def test_any_limit_between_the_floor_and_default_is_met(
    n: int, d: int, mlp: int, frac: float
) -> None:
    """Generated stacks: a limit between ``min_peak``'s measured peak and ``default``'s is
    met, as reported, with eager's gradients."""
    loss, args = _model(n, d, mlp)
    low, _ = _run(loss, args, "min_peak")
    high, _ = _run(loss, args, "default")
    limit = int(low + frac * (high - low))
    peak, p = _run(loss, args, "memory_budget", peak_bytes=limit)
    assert peak <= limit
    assert p.peak_bytes == peak


def test_the_choices_run_from_least_to_most_saved() -> None:
    assert CHOICES[0].strategy == "full_remat" and CHOICES[-1].strategy == "default"
    assert largest_passing(9, lambda m: m < 4) == 3


def test_grad_plans_its_blocks_as_jit_does(named: dict[str, tuple[int, Any]]) -> None:
    """``ft.grad(..., peak_bytes=N)`` plans the same block-by-block step: a limit jit's
    ``full_remat`` meets is met by the gradient call, with eager's gradients."""
    loss, (params, x) = _model()
    limit = named["full_remat"][0]
    g = ft.grad(loss, partition="memory_budget", peak_bytes=limit)
    plain = {k: v.detach() for k, v in params.items()}  # JAX-style: parameters as values
    got = g(plain, x)
    for a, b in zip(got.values(), _grads(loss, (params, x)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert measure_peak(lambda: (g(plain, x), None)[1]).peak_bytes <= limit
