"""Blocks that write their buffers (batch norm's running statistics) are regions: the written
values are more outputs of the block, written back by each call. The rule: a stack compiled so
trains exactly as eager does, buffers included, under every strategy and region mode."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functrans as ft
from functrans._core.switches import overridden
from functrans._trace import regions


class ConvBlock(torch.nn.Module):
    def __init__(self, c: int, momentum: float | None, affine: bool) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(c, c, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(c, momentum=momentum, affine=affine)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.bn(self.conv(x)))


class Counting(torch.nn.Module):
    """Writes a buffer through a view: not made functional, so traced inline."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(c, c)
        self.register_buffer("seen", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen[0:1].add_(1)
        return torch.tanh(self.fc(x)) + x


def _train(model: torch.nn.Module, x: torch.Tensor, steps: int) -> list[torch.Tensor]:
    losses = []
    for _ in range(steps):
        loss = model(x).square().mean()
        loss.backward()
        losses.append(loss.detach())
    return losses


def _same(jitted: torch.nn.Module, eager: torch.nn.Module) -> None:
    for (name, a), (_, b) in zip(jitted.named_buffers(), eager.named_buffers(), strict=True):
        assert torch.equal(a, b), name
    for (name, a), (_, b) in zip(jitted.named_parameters(), eager.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_batch_norm_stack_is_one_region_and_trains_as_eager() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[ConvBlock(4, 0.1, True) for _ in range(4)])
    eager = copy.deepcopy(model)
    x = torch.randn(2, 4, 6, 6)
    before = regions.stats.reused
    got = _train(ft.jit(model), x, 3)
    assert regions.stats.reused - before == 2  # blocks 3 and 4 reuse block 2's region
    assert torch.equal(torch.stack(got), torch.stack(_train(eager, x, 3)))
    _same(model, eager)
    assert int(model[0].bn.num_batches_tracked) == 3


def test_a_buffer_written_through_a_view_is_traced_inline() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Counting(4) for _ in range(3)])
    eager = copy.deepcopy(model)
    x = torch.randn(2, 4)
    torch.testing.assert_close(_train(ft.jit(model), x, 2), _train(eager, x, 2))
    _same(model, eager)
    assert model[2].seen.tolist() == [2.0, 0.0]


@settings(max_examples=10, deadline=None)
@given(
    depth=st.integers(2, 4),
    momentum=st.sampled_from([0.1, 0.5, None]),
    affine=st.booleans(),
    strategy=st.sampled_from(["default", "min_cut", "full_remat"]),
    mode=st.sampled_from(["compiled", "unrolled"]),
)
def test_property_batch_norm_stacks_train_as_eager(
    depth: int, momentum: float | None, affine: bool, strategy: str, mode: str
) -> None:
    torch.manual_seed(depth)
    model = torch.nn.Sequential(*[ConvBlock(3, momentum, affine) for _ in range(depth)])
    eager = copy.deepcopy(model)
    x = torch.randn(2, 3, 5, 5)
    with overridden(FUNCTRANS_REGIONS=mode):
        jitted = ft.jit(model, partition=strategy)
        if momentum is None:  # a cumulative average reads the counter: runs as written
            with pytest.warns(UserWarning, match="momentum=None"):
                got = _train(jitted, x, 2)
        else:
            got = _train(jitted, x, 2)
    torch.testing.assert_close(got, _train(eager, x, 2), rtol=1e-5, atol=1e-6)
    _same(model, eager)
