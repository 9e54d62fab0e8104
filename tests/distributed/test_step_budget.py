"""``ft.distributed.budget_blocks``: a measured step budget, in one process (blocks named,
no process group: no collective frees late, so the bound is the highest peak measured). The
2-rank FSDP2 runs are in tests/integration/test_distributed.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import functrans as ft
from functrans.distributed import CUTS, budget_blocks
from functrans.testing import measure_peak


class Block(torch.nn.Module):
    def __init__(self, d: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(F.gelu(self.fc1(self.ln(x))), self.dropout, self.training)
        return x + self.fc2(torch.tanh(h))


def stack(d: int = 32, n: int = 4, dropout: float = 0.0) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block(d, dropout) for _ in range(n)])


X = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))


def _step(model: torch.nn.Module) -> None:
    model(X).pow(2).mean().backward()


def _peaks(model: torch.nn.Module, rounds: int = 3) -> list[int]:
    out = []
    for _ in range(rounds):
        model.zero_grad(set_to_none=True)
        out.append(measure_peak(lambda: _step(model)).peak_bytes)
    return out


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    _step(model)
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def _budget(model: torch.nn.Module, limit: int) -> ft.distributed.StepBudget:
    return budget_blocks(model, lambda: _step(model), blocks=list(model), peak_bytes=limit)


def test_each_limit_holds_and_a_lower_one_never_recomputes_less():
    """A sweep of limits from above eager's peak down: every budget's later steps measure
    within its bound and the bound within the limit, gradients equal eager's, recompute never
    falls as the limit falls; above eager's peak nothing is recomputed."""
    base = stack()
    eager = max(_peaks(base))
    recomputes = []
    for limit in (eager + 4096, int(eager * 0.9), int(eager * 0.8), int(eager * 0.7)):
        model = copy.deepcopy(base)
        b = _budget(model, limit)
        assert b.peak_bytes <= limit
        assert max(_peaks(model)) <= b.peak_bytes, b.describe()
        for got, want in zip(_grads(model), _grads(base), strict=True):
            torch.testing.assert_close(got, want)
        recomputes.append(b.chosen.recompute_flops)
        assert b.margin == 0  # no process group: no collective frees late
    assert recomputes[0] == 0
    assert recomputes == sorted(recomputes), recomputes
    assert recomputes[-1] > 0


def test_a_limit_below_every_plan_names_the_lowest_and_changes_nothing():
    model = stack()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ft.InvalidPartitionError, match="the lowest step peak bound is") as e:
        _budget(model, 1024)
    assert "ask for at least that" in str(e.value)
    assert all("forward" not in block.__dict__ for block in model)  # runs as written
    assert all(p.grad is None for p in model.parameters())
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    lowest = int(str(e.value).split("bound is ")[1].split(" ")[0])
    assert _budget(copy.deepcopy(model), lowest).peak_bytes <= lowest


def test_measuring_steps_leave_gradients_buffers_and_random_state_as_they_were():
    """The steps measured run the user's step: what they change is put back (a gradient
    already accumulated, a BatchNorm's statistics, the generator dropout draws from)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16)) for _ in range(2)]
    )
    x = torch.randn(8, 16)
    model(x).sum().backward()  # a gradient the user accumulated
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    buffers = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()

    def step() -> None:
        F.dropout(model(x), 0.5).sum().backward()

    b = budget_blocks(model, step, blocks=list(model), peak_bytes=1 << 30)
    assert b.chosen.cuts == (CUTS[-1].label,) * 2  # room for everything: as written
    for p, g in zip(model.parameters(), grads, strict=True):
        assert torch.equal(p.grad, g)  # type: ignore[arg-type]
    for got, want in zip(model.buffers(), buffers, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"peak_bytes": -1}, "peak_bytes=-1"),
        ({"peak_bytes": 1 << 20, "rounds": 0}, "rounds=0"),
        ({"peak_bytes": 1 << 20, "partition": "min_cut"}, "partition='min_cut' is not accepted"),
        ({"peak_bytes": 1 << 20, "step": 3}, "step=3 is not accepted"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    model = stack(n=2)
    args = {"step": lambda: _step(model), "blocks": list(model), **kwargs}
    with pytest.raises(ft.InvalidArgumentError, match=match):
        budget_blocks(model, **args)


def test_blocks_compiled_once_are_refused():
    model = stack(n=2)
    _budget(model, 1 << 30)
    with pytest.raises(ft.InvalidArgumentError, match="already compiled"):
        _budget(model, 1 << 30)
    with pytest.raises(ft.InvalidArgumentError, match="has no FSDP unit"):
        budget_blocks(model, lambda: None, peak_bytes=1 << 30)


def test_jit_blocks_refuses_a_peak_limit_pointing_to_the_step_budget():
    """A per-block ``peak_bytes`` bounds each block's own peak, not the step's (under FSDP2
    it neither bounded nor ordered the step's peak): refused, naming budget_blocks."""
    model = stack(n=2)
    with pytest.raises(ft.InvalidArgumentError, match="budget_blocks"):
        ft.distributed.jit_blocks(
            model, blocks=list(model), partition="memory_budget", peak_bytes=1 << 20
        )
    assert all("forward" not in block.__dict__ for block in model)
