"""What research code does after the first call, compared with eager under one seed.

Gradients have eager's structure (a parameter no output depends on keeps ``.grad is None``,
so AdamW leaves it alone); torch-convention selective-checkpoint policies
(``policy_fn(ctx, op, *args, **kwargs)``: torch, torchtitan, torchtune) mean what they mean
there; an ambiguous policy is refused by name.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

import functrans as ft
from functrans.extend import REMAT, Policy
from functrans.policies import InvalidPolicyError, convention

aten = torch.ops.aten


class WithUnused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(4, 4)
        self.unused = torch.nn.Linear(4, 4)  # a frozen branch, a head not trained this phase

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x).square().mean()


def _train(model: torch.nn.Module, run, steps: int = 3) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        run(torch.randn(8, 4, generator=torch.Generator().manual_seed(i))).backward()
        opt.step()


def test_a_parameter_no_output_reads_keeps_grad_none_and_adamw_skips_it():
    torch.manual_seed(0)
    eager, jitted = WithUnused(), WithUnused()
    jitted.load_state_dict(eager.state_dict())
    before = jitted.unused.weight.detach().clone()
    _train(eager, eager)
    _train(jitted, ft.jit(jitted))
    assert jitted.unused.weight.grad is None and eager.unused.weight.grad is None
    assert torch.equal(jitted.unused.weight, before)  # weight decay never touched it
    torch.testing.assert_close(jitted.used.weight, eager.used.weight)


def test_an_input_whose_outputs_are_all_detached_gets_no_grad():
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    out_a, out_b = ft.jit(lambda a, b: (a.detach(), b * 2))(a, b)
    assert not out_a.requires_grad
    out_b.sum().backward()
    assert a.grad is None
    torch.testing.assert_close(b.grad, torch.full((3,), 2.0))


def test_a_gradient_that_is_zero_by_arithmetic_stays_a_tensor():
    x = torch.randn(3, requires_grad=True)
    ft.jit(lambda x: (x * 0).sum())(x).backward()
    assert x.grad is not None and torch.equal(x.grad, torch.zeros(3))


# -- policies in torch's convention ----------------------------------------------------------


def _dots_torch(ctx, op, *args, **kwargs):
    return (
        CheckpointPolicy.MUST_SAVE if op is aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE
    )


def _tags(fn, policy, *args):
    jg = ft.joint(ft.remat(fn, policy=policy))(*args)
    return {n.name: n.meta.get(REMAT) for n in jg.ops() if REMAT in n.meta}


def test_torch_convention_policies_save_what_they_say():
    def f(x, w):
        return torch.tanh(x @ w).sum()

    tags = _tags(f, _dots_torch, torch.randn(4, 4), torch.randn(4, 4))
    assert tags["mm"] is Policy.MUST_SAVE
    assert tags["tanh"] is Policy.PREFER_RECOMPUTE
    assert convention(_dots_torch) == "torch"


def _torchtitan_like_policy(meta: dict[str, int]):
    """Ported in our own words from torchtitan's selective activation checkpointing "op"
    mode: save the outputs of compute-intensive ops, except every second matmul, counted
    separately in forward and in recomputation."""
    save = {aten.mm.default, aten._scaled_dot_product_efficient_attention.default}

    def _custom_policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        key = f"{mode}_mm_count"
        if func is aten.mm.default:
            meta[key] += 1
        keep = func in save and not (func is aten.mm.default and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return _custom_policy


def test_a_torchtitan_policy_runs_unchanged():
    def f(x, w1, w2):
        return (torch.relu(x @ w1) @ w2).sum()

    meta = {"forward_mm_count": 0, "recompute_mm_count": 0}
    args = (torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4))
    tags = _tags(f, _torchtitan_like_policy(meta), *args)
    assert (tags["mm"], tags["mm_1"]) == (Policy.MUST_SAVE, Policy.PREFER_RECOMPUTE)
    # eager: the same policy object through ft.remat gives eager's gradients
    xs = [a.clone().requires_grad_() for a in args]
    meta.update(forward_mm_count=0, recompute_mm_count=0)
    ft.remat(f, policy=_torchtitan_like_policy(meta))(*xs).backward()
    ref = [a.clone().requires_grad_() for a in args]
    f(*ref).backward()
    for got, exp in zip(xs, ref, strict=True):
        torch.testing.assert_close(got.grad, exp.grad)


def test_a_torchtune_policy_runs_unchanged():
    """Ported in our own words from torchtune's selective checkpointing: a partial of a
    policy function over the ops to save."""

    def policy_fn(ctx, op, *args, ops_to_save=(), **kwargs):
        return (
            CheckpointPolicy.MUST_SAVE if op in ops_to_save else CheckpointPolicy.PREFER_RECOMPUTE
        )

    policy = functools.partial(policy_fn, ops_to_save={aten.mm.default})
    tags = _tags(lambda x, w: torch.tanh(x @ w).sum(), policy, torch.randn(4, 4), torch.randn(4, 4))
    assert tags["mm"] is Policy.MUST_SAVE


def test_an_ambiguous_policy_is_refused_by_name():
    def mystery(a, b, *rest):
        return True

    with pytest.raises(InvalidPolicyError, match=r"mystery takes \(a, b, \*rest\).*ctx.*op"):
        ft.remat(lambda x: x.sin().sum(), policy=mystery)(torch.randn(3))


# -- an inner gradient under torch.no_grad() --------------------------------------------------
# ported in our own words from torch.func's test_no_grad_nested_simple / _complicated: a
# gradient taken under no_grad inside the differentiated function is a constant to the outer


def test_inner_grad_under_no_grad_is_a_constant_to_the_outer_grad():
    def h(x):
        with torch.no_grad():
            shift = ft.grad(lambda y: 0.25 * y**4)(x)
        return x**3 - shift

    def h_torch(x):
        with torch.no_grad():
            shift = torch.func.grad(lambda y: 0.25 * y**4)(x)
        return x**3 - shift

    x = torch.tensor(1.5)
    want = torch.func.grad(h_torch)(x)
    torch.testing.assert_close(want, torch.tensor(6.75))
    torch.testing.assert_close(ft.grad(h)(x), want)
    torch.testing.assert_close(ft.jit(ft.grad(h))(x), want)


def test_inner_grad_under_no_grad_with_two_inputs_and_outside_use():
    def h(x, y, grad):
        with torch.no_grad():
            c = grad(lambda x: (x * y.sin()).sum())(x * 2)  # = sin(y), a constant
        return (x * c).sum() + (x * y).sum()

    x, y = torch.randn(3), torch.randn(3)
    want = torch.func.grad(h, argnums=(0, 1))(x, y, torch.func.grad)
    got = ft.grad(h, argnums=(0, 1))(x, y, ft.grad)
    torch.testing.assert_close(got, want)


# -- module hooks are state a trace reads ----------------------------------------------------


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))


def test_a_hook_registered_after_the_first_call_applies():
    model = _mlp()
    jitted = ft.jit(model)
    x = torch.randn(3, 4)
    jitted(x)  # compiled without hooks
    handle = model[0].register_forward_hook(lambda mod, args, out: torch.zeros_like(out))
    with pytest.warns(UserWarning, match="Linear has forward hooks.*run as written"):
        patched = jitted(x)
    torch.testing.assert_close(patched, model(x))  # activation patching, as eager
    handle.remove()
    torch.testing.assert_close(jitted(x), model(x))
    assert jitted.cache_info().misses == 1  # the entry compiled before serves again


def test_a_hook_with_side_effects_runs_on_every_call():
    model = _mlp()
    seen: list[torch.Tensor] = []
    model[1].register_forward_hook(lambda mod, args, out: seen.append(out.detach()))
    jitted = ft.jit(model)
    with pytest.warns(UserWarning, match="ReLU has forward hooks"):
        for _ in range(3):
            jitted(torch.randn(2, 4)).sum().backward()
    assert len(seen) == 3  # a probe caching activations sees every call


def test_backward_and_global_hooks_run_too():
    model = _mlp()
    grads: list[torch.Tensor] = []
    model[2].register_full_backward_hook(lambda mod, gin, gout: grads.append(gout[0]))
    jitted = ft.jit(model)
    with pytest.warns(UserWarning, match="backward hooks"):
        jitted(torch.randn(2, 4)).sum().backward()
    assert len(grads) == 1
    calls: list[int] = []
    plain = _mlp()
    j2 = ft.jit(plain)
    j2(torch.randn(2, 4))
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda mod, args, out: calls.append(1)
    )
    try:
        with pytest.warns(UserWarning, match="global module forward hooks"):
            j2(torch.randn(2, 4))
    finally:
        handle.remove()
    assert calls  # the global hook ran on the modules, as in eager
