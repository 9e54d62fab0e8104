"""functrans inside torch.compile / torch.export, and torch.compile-d code inside functrans:
each result against eager under one seed."""

from __future__ import annotations

import copy

import pytest
import torch

import functrans as ft
from functrans import policies


def _f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w).sum()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, 4, generator=g), torch.randn(4, 5, generator=g)


def _value_and_grad(fn: object, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    w = w.clone().requires_grad_()
    out = fn(x, w)  # type: ignore[operator]
    out.backward()
    assert w.grad is not None
    return out.detach(), w.grad


class _Net(torch.nn.Module):
    def __init__(self, remat: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        blk = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        self.blk = ft.remat(blk, policy=policies.nothing_saveable) if remat else blk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blk(torch.relu(self.lin(x))).sum()


def _module_grads(m: torch.nn.Module, call: object, x: torch.Tensor) -> list[torch.Tensor]:
    out = call(x)  # type: ignore[operator]
    out.backward()
    return [out.detach(), *(p.grad for p in m.parameters() if p.grad is not None)]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_over_jit_matches_eager(backend: str) -> None:
    x, w = _inputs()
    want = _value_and_grad(_f, x, w)
    jf = ft.jit(_f)
    got = _value_and_grad(torch.compile(jf, backend=backend), x, w)
    torch.testing.assert_close(got, want)
    assert jf.cache_info().misses == 1  # the jitted entry ran: functrans compiled it


def test_compile_over_jit_module_matches_eager() -> None:
    x, _ = _inputs()
    eager, jitted = _Net(remat=False), _Net(remat=False)
    want = _module_grads(eager, eager, x)
    jm = ft.jit(jitted)
    got = _module_grads(jitted, torch.compile(jm, backend="aot_eager"), x)
    torch.testing.assert_close(got, want)
    assert jm.cache_info().misses == 1


# Inductor on this model passes too; its cold C++ compile (16 s on 2 loaded cores) is kept
# out of the suite
@pytest.mark.parametrize("backend", ["aot_eager"])
def test_compile_of_model_with_remat_matches_eager(backend: str) -> None:
    x, _ = _inputs()
    eager, rematted = _Net(remat=False), _Net(remat=True)
    want = _module_grads(eager, eager, x)
    got = _module_grads(rematted, torch.compile(rematted, backend=backend), x)
    torch.testing.assert_close(got, want)


class _SquareSum(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.square().sum()


def _blocks(policy: object) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Three MLP blocks and a scalar loss; the copy's blocks under ``ft.remat(policy)``."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(
        *[
            torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
            for _ in range(3)
        ],
        _SquareSum(),
    )
    rematted = copy.deepcopy(plain)
    for i in range(3):
        rematted[i] = ft.remat(rematted[i], policy=policy)
    return plain, rematted


@pytest.mark.parametrize("policy", [None, "dots_saveable", "offload_dot_with_no_batch_dims"])
def test_compile_of_remat_blocks_is_one_graph(policy: str | None) -> None:
    """Issue 52: torch.compile of a model holding ft.remat blocks broke the graph at each
    block (4 graphs) and ran the blocks uncompiled. A remat region is torch's checkpoint where
    Dynamo traces it, the policy's decisions torch's selective checkpointing."""
    chosen = None if policy is None else getattr(policies, policy)
    if policy == "offload_dot_with_no_batch_dims":
        chosen = chosen()
    plain, rematted = _blocks(chosen)
    x = torch.randn(4, 16)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(rematted)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    want = _module_grads(plain, plain, x)
    got = _module_grads(rematted, torch.compile(rematted, backend="aot_eager"), x)
    torch.testing.assert_close(got, want)


def test_a_remat_policy_decides_under_torch_compile() -> None:
    asked = []

    def policy(op: object, *args: object, **kwargs: object) -> bool:
        asked.append(op)
        return op is torch.ops.aten.addmm.default

    plain, rematted = _blocks(policy)
    x = torch.randn(4, 16)
    torch._dynamo.reset()
    got = _module_grads(rematted, torch.compile(rematted, backend="aot_eager"), x)
    torch.testing.assert_close(got, _module_grads(plain, plain, x))
    assert torch.ops.aten.addmm.default in asked  # torch's selective checkpointing asked it


def test_jit_and_grad_over_compiled_function_match_eager() -> None:
    x, w = _inputs()
    want = _value_and_grad(_f, x, w)
    compiled = torch.compile(_f, backend="aot_eager")
    torch.testing.assert_close(_value_and_grad(ft.jit(compiled), x, w), want)
    torch.testing.assert_close(ft.grad(compiled, argnums=1)(x, w), want[1])
    inner = torch.compile(lambda x, w: torch.tanh(x @ w), backend="aot_eager")
    calls = ft.jit(lambda x, w: inner(x, w).sum())
    torch.testing.assert_close(_value_and_grad(calls, x, w), want)


@pytest.mark.parametrize("strict", [False, True])
def test_export_of_remat_is_refused_by_name(strict: bool) -> None:
    x, _ = _inputs()
    model = _Net(remat=True)
    # non-strict export runs our code: our error. Strict export runs Dynamo, whose raises and
    # graph breaks lead with its own headline: there our explanation is the first line a user
    # reads (an AssertionError's message), not Dynamo's "Remove the graph_break() call"
    expected: type[Exception] = AssertionError if strict else ft.FunctransError
    with pytest.raises(expected) as info:
        torch.export.export(model, (x,), strict=strict)
    first = str(info.value).splitlines()[0]
    assert first.startswith("remat(Sequential) under torch.export: "), first
    assert "policy" in first and "graph_break" not in str(info.value)


def test_export_of_plain_model_still_works() -> None:
    x, _ = _inputs()
    model = _Net(remat=False)
    ep = torch.export.export(model, (x,), strict=False)
    torch.testing.assert_close(ep.module()(x), model(x))
