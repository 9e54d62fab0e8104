"""The environment is read once, when a transform is built (:mod:`functrans._trace.options`).

The rule: a ``FUNCTRANS_*`` switch changed after ``ft.jit(f)`` (or ``ft.joint(f)``) changes
nothing of its later calls, retraces included: what each call traces is what the switch said
when the transform was built, or what ``regions=`` said. The property generates the mode at
build time and the changes between calls (each call a new shape, so each one traces) and
compares every call with a jit built with that mode named.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import functrans as ft
from functrans._core.switches import overridden
from functrans._jit import outline
from functrans._trace import regions as _regions
from functrans._trace.options import REGION_MODES

OUTLINED = (outline.FORWARD, outline.FORWARD_RANDOM, outline.BACKWARD)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.tanh(self.fc(x)))


class Stack(nn.Module):
    def __init__(self, n: int = 3, d: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(d) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x.square().mean()


def _outlined_calls(step: Any) -> int:
    p = step.partitions()[-1]
    graphs = (p.forward.fx_graph, p.backward.fx_graph)
    return sum(n.target in OUTLINED for g in graphs for n in g.nodes)


def _call(step: Any, model: nn.Module, rows: int) -> tuple[Any, ...]:
    """One training call on a new shape (so it traces): loss, gradients, regions reused by its
    trace and the outlined block calls of its step."""
    model.zero_grad(set_to_none=True)
    reused = _regions.stats.reused
    loss = step(torch.randn(rows, 8, generator=torch.Generator().manual_seed(rows)))
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    return loss.detach(), grads, _regions.stats.reused - reused, _outlined_calls(step)


@settings(max_examples=6, deadline=None)
@given(
    built=st.sampled_from(REGION_MODES),
    changes=st.lists(st.sampled_from([*REGION_MODES, None]), min_size=1, max_size=3),
)
def test_a_switch_changed_after_jit_changes_none_of_its_calls(
    built: str, changes: list[str | None]
) -> None:
    torch.manual_seed(0)
    model = Stack()
    with overridden(FUNCTRANS_REGIONS=built):
        step = ft.jit(model, dynamic=False)
    named = ft.jit(model, dynamic=False, regions=built)  # the reference: the mode named
    for rows, change in enumerate(changes, start=2):
        with overridden(FUNCTRANS_REGIONS=change):
            got = _call(step, model, rows)
            want = _call(named, model, rows)
        assert torch.equal(got[0], want[0])
        assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))
        assert got[2:] == want[2:]
        assert (got[2] > 0) == (built != "off")  # the mode built with is the one that traced
        assert (got[3] > 0) == (built == "compiled")


def test_regions_named_beats_the_environment_and_is_checked_when_jit_is_called() -> None:
    torch.manual_seed(0)
    model = Stack()
    with overridden(FUNCTRANS_REGIONS="0"):
        step = ft.jit(model, regions="compiled")
    assert _call(step, model, 2)[3] > 0
    with pytest.raises(ft.InvalidArgumentError, match="regions='sometimes' is not accepted"):
        ft.jit(model, regions="sometimes")  # type: ignore[arg-type]  # the wrong value tested
    with pytest.raises(ft.InvalidArgumentError, match="regions='sometimes'"):
        ft.jit(regions="sometimes")  # type: ignore[arg-type]  # the decorator form checks too
    with (
        overridden(FUNCTRANS_REGIONS="compile"),
        pytest.raises(ft.InvalidArgumentError, match="FUNCTRANS_REGIONS='compile'"),
    ):
        ft.jit(model)  # a bad switch is named when the transform is built, not at a call


def test_joint_reads_the_switch_when_it_is_built() -> None:
    torch.manual_seed(0)
    model = Stack()
    params = {k: v.detach().requires_grad_() for k, v in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, p, (x,))

    x = torch.randn(2, 8)
    with overridden(FUNCTRANS_REGIONS="0"):
        inline = ft.joint(loss, argnums=0)
    with overridden(FUNCTRANS_REGIONS="unrolled"):
        reused = _regions.stats.reused
        inline(params, x)
        assert _regions.stats.reused == reused  # built with regions off: every block inline
        pasted = ft.joint(loss, argnums=0)
    reused = _regions.stats.reused
    pasted(params, x)
    # the first block's input needs no grad (a region of its own); the last two share one
    assert _regions.stats.reused - reused == 1
