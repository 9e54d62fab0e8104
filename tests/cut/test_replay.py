"""Random ops the backward draws again from a saved generator state (functrans._cut.replay).

On 6e73d63 a dropout mask was always saved: a random op was never recomputed, so a dropout
model's floor sat a mask per block above per-block checkpointing's (issue 50: the 10-block
dropout GPT's ``memory_budget(peak_bytes=P)`` was infeasible). Now the generator state before
each draw is what a strategy may save instead, and the replay draws the same numbers.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functrans as ft
from functrans._cut.replay import SAVES_STATE, WITH_STATE, replayable


def _mlp(w1: torch.Tensor, w2: torch.Tensor, p: float = 0.3):  # type: ignore[no-untyped-def]
    def f(x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.dropout(torch.tanh(x @ w1), p)
        return torch.nn.functional.dropout(torch.tanh(h @ w2), p).square().sum()

    return f


def _run(fn, x, w):  # type: ignore[no-untyped-def]
    torch.manual_seed(1)
    loss = fn(x)
    loss.backward()
    after = torch.rand(3)  # where the generator was left
    grads = [t.grad.clone() for t in w]
    for t in w:
        t.grad = None
    return loss.detach(), grads, after


@pytest.mark.parametrize(
    ("strategy", "options"),
    [("default", {}), ("min_cut", {}), ("full_remat", {}), ("memory_budget", {"budget": 0.0})],
)
def test_a_replayed_dropout_step_is_eagers_bit_for_bit(strategy: str, options: dict) -> None:
    torch.manual_seed(0)
    w = [torch.randn(256, 256, requires_grad=True) for _ in range(2)]
    f, x = _mlp(*w), torch.randn(64, 256)
    want = _run(f, x, w)
    jitted = ft.jit(f, partition=strategy, **options)
    for _ in range(2):
        got = _run(jitted, x, w)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_full_remat_saves_generator_states_not_masks() -> None:
    torch.manual_seed(0)
    w = [torch.randn(256, 256, requires_grad=True) for _ in range(2)]
    jg = ft.joint(_mlp(*w))(torch.randn(64, 256))
    p = ft.partition(jg, "full_remat")
    assert not any(s.shape == (64, 256) and not s.is_input for s in p.saved)  # 6e73d63: masks
    assert sum(n.target is WITH_STATE for n in p.backward.fx_graph.nodes) == 2
    forward = {n.target for n in p.forward.fx_graph.nodes}
    assert SAVES_STATE in forward and WITH_STATE not in forward  # one draw each, in forward


def test_a_saved_mask_is_the_forwards_own_draw() -> None:
    """``default`` saves the masks: the forward draws each once, with the plain op."""
    torch.manual_seed(0)
    w = [torch.randn(8, 8, requires_grad=True) for _ in range(2)]
    jg = ft.joint(_mlp(*w))(torch.randn(4, 8))
    p = ft.partition(jg, "default")
    targets = {n.target for n in p.forward.fx_graph.nodes}
    assert SAVES_STATE not in targets and WITH_STATE not in targets


def test_replayable_leaves_a_graph_without_random_ops_alone() -> None:
    jg = ft.joint(lambda x: x.sin().sum())(torch.ones(3))
    assert replayable(jg) is jg


def test_a_users_generator_is_not_replayed() -> None:
    g = torch.Generator().manual_seed(0)

    def f(x: torch.Tensor) -> torch.Tensor:
        return (x * torch.bernoulli(torch.full_like(x, 0.5), generator=g)).tanh().sum()

    x = torch.randn(16, requires_grad=True)
    g.manual_seed(3)
    (want,) = torch.autograd.grad(f(x), x)
    g.manual_seed(3)
    (got,) = torch.autograd.grad(ft.jit(f, partition="full_remat")(x), x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@settings(max_examples=max(20, settings().max_examples // 5), deadline=None)
@given(
    p=st.sampled_from([0.1, 0.5]),
    strategy=st.sampled_from(["min_cut", "full_remat", "default"]),
    budget=st.sampled_from([0.0, 0.5, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_property_replayed_steps_match_eager(
    p: float, strategy: str, budget: float, seed: int
) -> None:
    """Dropout at random rates under every strategy and under memory budgets: losses,
    gradients and the generator left behind are eager's, bit for bit."""
    torch.manual_seed(seed)
    w = [torch.randn(32, 32, requires_grad=True) for _ in range(2)]
    f, x = _mlp(*w, p=p), torch.randn(8, 32)
    want = _run(f, x, w)
    if strategy == "default":
        jitted = ft.jit(f, partition="memory_budget", budget=budget)
    else:
        jitted = ft.jit(f, partition=strategy)
    torch.testing.assert_close(_run(jitted, x, w), want, rtol=0, atol=0)


@pytest.mark.parametrize("strategy", ["default", "min_cut", "full_remat"])
def test_replayed_blocks_report_the_measured_peak(strategy: str) -> None:
    """Dropout blocks compiled once (regions): the report is the measured peak. (The first
    cut of this read the block's residuals against the uncopied graph: every input of a block
    counted as a result of its call, 12% over.)"""
    from functrans.testing import measure_peak

    torch.manual_seed(0)
    blocks = torch.nn.Sequential(
        *[
            torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Tanh(), torch.nn.Dropout(0.2))
            for _ in range(4)
        ]
    )
    x = torch.randn(64, 128)
    jitted = ft.jit(lambda x: blocks(x).square().sum(), partition=strategy)

    def step() -> None:
        jitted(x).backward()

    step()
    (p,) = jitted.partitions()
    measured = measure_peak(step).peak_bytes
    assert abs(measured - p.peak_bytes) <= 0.01 * measured, (measured, p.peak_bytes)


@pytest.mark.parametrize("strategy", ["full_remat", "min_cut"])
def test_grad_through_dropout_blocks_compiled_once_is_eagers(strategy: str) -> None:
    """Shrunk from benchmarks.peak_memory's ft.grad row on the dropout GPT: every block's
    generator state had one real tensor as its traced value, so a trace of the step (ft.grad
    stitches forward and backward into one) took each block's state for the last block's, and
    every block but the last replayed another's mask."""
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5)) for _ in range(3)]
    )
    params = {k: v.detach() for k, v in blocks.named_parameters()}
    x = torch.randn(4, 16)

    def f(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(blocks, p, (x,)).square().sum()

    torch.manual_seed(0)
    want = torch.func.grad(f)(params, x)
    torch.manual_seed(0)
    got = ft.grad(f, partition=strategy)(params, x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
