"""Blocks that write their buffers (batch norm's running statistics) are regions: the written
values are more outputs of the block, written back by each call. The rule: a stack compiled so
trains exactly as eager does, buffers included, under every strategy and region mode."""

from __future__ import annotations

import copy
import json
import os
import pathlib
import subprocess
import sys
from typing import Any

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


def test_train_eval_train_keeps_eager_s_statistics() -> None:
    """Switching the mode between calls: a region traced in training writes the statistics,
    one in eval reads them (a key of its own), and the statistics stay eager's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[ConvBlock(3, 0.1, True) for _ in range(3)])
    eager = copy.deepcopy(model)
    jitted = ft.jit(model)
    x = torch.randn(2, 3, 5, 5)
    for training in (True, False, True):
        model.train(training)
        eager.train(training)
        torch.testing.assert_close(_train(jitted, x, 1), _train(eager, x, 1))
        _same(model, eager)


BN_PROGRAM = """
import json, torch, functrans as ft
from tests.trace.test_region_writes import ConvBlock
torch.manual_seed(0)
model = torch.nn.Sequential(*[ConvBlock(3, 0.1, True) for _ in range(3)])
x = torch.randn(2, 3, 5, 5)
jitted = ft.jit(model)
jitted(x).square().mean().backward()
print("RESULT " + json.dumps({
    "hits": jitted.cache_info().disk_hits,
    "mean": model[2].bn.running_mean.tolist(),
    "count": int(model[2].bn.num_batches_tracked),
    "grad": model[0].conv.weight.grad.sum().item(),
}))
"""


def test_a_stored_batch_norm_step_writes_its_statistics_in_a_fresh_process(
    tmp_path: pathlib.Path,
) -> None:
    """The step is stored on disk with its regions; a second process reads it back and its
    calls still write every block's statistics, as the first process's did."""
    env = {
        **os.environ,
        "FUNCTRANS_CACHE": "1",
        "FUNCTRANS_CACHE_DIR": str(tmp_path),
        "FUNCTRANS_NATIVE": "0",
        "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[2]),
    }

    def run() -> dict[str, Any]:
        done = subprocess.run(
            [sys.executable, "-c", BN_PROGRAM],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
        return dict(json.loads(line[len("RESULT ") :]))

    first, second = run(), run()
    assert (first["hits"], second["hits"]) == (0, 1)
    assert first["count"] == second["count"] == 1
    assert first["mean"] == second["mean"] and first["grad"] == second["grad"]
