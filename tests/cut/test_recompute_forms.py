"""A recomputed op re-run in its cheaper form (:mod:`functrans._cut.recompute_forms`). The rule:
the form changes what the backward reads, never a value: a split with forms computes eager's
gradients and buffers bit for bit, and a training batch norm re-run in backward reads no
running statistics (so the forward hands none over)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.fx as fx
from hypothesis import given, settings
from hypothesis import strategies as st

import functrans as ft
from functrans._core.graph import PATH, ROLE, Role
from functrans._cut.recompute_forms import _FORMS, RecomputeForm, recompute_form_of

aten = torch.ops.aten


class Net(torch.nn.Module):
    def __init__(self, c: int, dims: int, momentum: float | None, affine: bool) -> None:
        super().__init__()
        norm = {1: torch.nn.BatchNorm1d, 2: torch.nn.BatchNorm2d}[dims]
        self.a = norm(c, momentum=momentum, affine=affine)
        self.b = norm(c, momentum=momentum, affine=affine)
        self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (1, -1) + (1,) * (x.dim() - 2)
        h = torch.relu(self.a(x)) * self.w.view(shape)
        return (torch.tanh(self.b(h)) + h).square().mean()


@pytest.mark.parametrize("mode", ["unrolled", "compiled"])
@pytest.mark.parametrize("strategy", ["full_remat", "min_cut"])
def test_a_recomputed_batch_norm_reads_no_running_statistics(strategy: str, mode: str) -> None:
    """Unrolled, the step's own backward; as regions, the blocks' (a stack of two; the step
    re-running a whole block's forward under ``full_remat`` re-runs its updates with it)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(Block(4), Block(4))
    step = ft.jit(net, partition=strategy, regions=mode)
    step(torch.randn(3, 4, 5, 5)).square().mean().backward()
    (p,) = step.partitions()
    outlined = [o.partition.backward.fx_graph for o in _outlined(p.forward.fx_graph)]
    backwards = outlined if mode == "compiled" else [p.backward.fx_graph]
    assert len(outlined) == (2 if mode == "compiled" else 0)
    norms = [n for g in backwards for n in g.nodes if "batch_norm_legit" in str(n.target)]
    assert norms and all(n.target is aten._native_batch_norm_legit.no_stats for n in norms)
    # the running statistics are neither recomputed from nor handed over
    for g in backwards:
        for n in g.nodes:
            if n.op == "placeholder" and n.meta.get(ROLE) is Role.SAVED:
                assert "running" not in str(n.meta.get(PATH)), n.format_node()


class Block(torch.nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.bn = torch.nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.bn(x)) * 2


def _outlined(g: fx.Graph) -> list[Any]:
    from functrans._jit import outline

    return [
        outline._OUTLINED[n.args[0]]
        for n in g.nodes
        if n.target is torch.ops.functrans.outlined_fwd.default
    ]


def _step(model: torch.nn.Module, x: torch.Tensor) -> tuple[Any, ...]:
    loss = model(x)
    loss.backward()
    return loss.detach(), [q.grad for q in model.parameters()], [b.clone() for b in model.buffers()]


@settings(max_examples=12, deadline=None)
@given(
    c=st.integers(1, 5),
    dims=st.sampled_from([1, 2]),
    momentum=st.sampled_from([0.1, 0.7, 1.0]),
    affine=st.booleans(),
    channels_last=st.booleans(),
    strategy=st.sampled_from(["full_remat", "min_cut", "default"]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_steps_with_recomputed_batch_norm_equal_eager_bit_for_bit(
    c: int,
    dims: int,
    momentum: float | None,
    affine: bool,
    channels_last: bool,
    strategy: str,
    dtype: torch.dtype,
) -> None:
    torch.manual_seed(c)
    eager = Net(c, dims, momentum, affine).to(dtype)
    jitted = copy.deepcopy(eager)
    shape = (3, c, 4, 5) if dims == 2 else (3, c, 6)
    x = torch.randn(shape, dtype=dtype)
    if channels_last and dims == 2:
        x = x.to(memory_format=torch.channels_last)
    step = ft.jit(jitted, partition=strategy)
    for _ in range(2):
        want, got = _step(eager, x), _step(step, x)
        assert torch.equal(want[0], got[0])
        for a, b in zip(want[1], got[1], strict=True):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
        for a, b in zip(want[2], got[2], strict=True):
            assert torch.equal(a, b)


def test_a_form_is_not_used_where_the_backward_reads_a_result_it_does_not_give() -> None:
    """``aminmax`` given a one-result form: re-run for its min only, the backward's node is
    the form's; where the backward reads the max too, the op is re-run as written."""
    op = aten.aminmax.default
    assert recompute_form_of(op) is None
    _FORMS[op] = RecomputeForm(op, lambda n: tuple(n.args), 1)
    try:
        for reads_max, results in ((False, 1), (True, 2)):

            def f(x: torch.Tensor, reads_max: bool = reads_max) -> torch.Tensor:
                lo, hi = torch.aminmax(x)
                return (x.sin() * lo).sum() + ((x.cos() * hi).sum() if reads_max else 0)

            jg = ft.joint(f, decompositions="minimal")(torch.randn(5))
            p = ft.partition(jg, "full_remat")
            (node,) = [n for n in p.backward.fx_graph.nodes if n.target is op]
            assert len(node.meta["val"]) == results
            x = torch.randn(5)
            xr = x.clone().requires_grad_()
            (want,) = torch.autograd.grad(f(xr), xr)
            _, saved = p.forward(x)
            (got,) = p.backward(saved, (torch.tensor(1.0),))
            assert torch.equal(got, want)
    finally:
        del _FORMS[op]
