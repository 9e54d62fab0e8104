"""Eager ``remat``: saved outputs mutated after the op that made them, and bad policies.

The mutation cases follow the idea of PyTorch's ``TestSelectiveActivationCheckpoint``
mutation tests (an op's output is saved by the policy, then changed in place by a later op of
the region); where torch raises "has been mutated", functrans recomputes the op and returns the
right gradient.
"""

import re

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

import functrans as ft
from functrans import policies
from functrans.policies import InvalidPolicyError, Policy

aten = torch.ops.aten


def save_sin(op, *args, **kwargs):
    return Policy.MUST_SAVE if op is aten.sin.default else Policy.PREFER_RECOMPUTE


def mul_(x):
    return x.sin().mul_(2).cos().exp()


def add_(x):
    s = x.sin()
    s.add_(x)
    return (s * s).sum()


def index_put_(x):
    s = x.sin()
    s.index_put_((torch.tensor([0, 2]),), x[:2] * 3, accumulate=True)
    return s.cos()


def copy_(x):
    s = x.sin()
    s.copy_(s.flip(0) + x)
    return s.tanh() * x


def view_of_saved(x):
    s = x.sin()
    s.view(2, 3)[1].mul_(x[:3])
    return s.cos()


def saved_is_view(x):  # the saved output is a view whose base is mutated afterwards
    s = x.sin()
    v = s.view(2, 3)
    s.add_(1)
    return v.exp()


def mutation_then_reuse(x):  # mutated through one name, read through the other
    s = x.sin()
    t = s * 2
    s.mul_(t)
    return s.cos() + t


CASES = [mul_, add_, index_put_, copy_, view_of_saved, saved_is_view, mutation_then_reuse]


def x64():
    torch.manual_seed(0)
    return torch.randn(6, dtype=torch.float64)


def eager_grad(f, x):
    leaf = x.clone().requires_grad_()
    f(leaf).sum().backward()
    return leaf.grad


@pytest.mark.parametrize("f", CASES, ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    "policy",
    [save_sin, policies.everything_saveable, [aten.sin.default]],
    ids=["save_sin", "everything", "list"],
)
def test_saved_output_mutated_later_gives_the_eager_gradient(f, policy):
    x = x64()
    want = eager_grad(f, x)
    got = eager_grad(ft.remat(f, policy=policy), x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("f", CASES, ids=lambda f: f.__name__)
def test_traced_mode_agrees(f):
    x = x64()
    want = eager_grad(f, x)
    got = ft.grad(lambda x: ft.remat(f, policy=save_sin)(x).sum())(x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_one_output_of_a_multi_output_op_mutated():
    def f(x):
        values, indices = x.reshape(2, 3).max(dim=1)
        values.add_(indices + 1)
        return (values * values).sum() * x

    x = x64()
    for policy in ([aten.max.dim], policies.everything_saveable):
        got = eager_grad(ft.remat(f, policy=policy), x)
        torch.testing.assert_close(got, eager_grad(f, x), rtol=0, atol=1e-12)


def test_output_mutated_after_the_region_is_recomputed_for_its_backward():
    """The code after the region writes to a saved output that the region's own backward
    reads: checked when backward replays the region, not only at the end of forward."""

    def region(x):
        s = x.sin()
        return s, s * s

    def f(x):
        s, p = ft.remat(region, policy=save_sin)(x)
        s.mul_(3)
        return p + s

    def reference(x):  # the same values without the write (eager autograd refuses it)
        s, p = region(x)
        return p + s * 3

    torch.testing.assert_close(eager_grad(f, x64()), eager_grad(reference, x64()), rtol=0, atol=0)


def test_mutated_outputs_are_recomputed_unmutated_ones_served():
    """The version counter decides: the mutated ``sin`` output is recomputed in backward, the
    untouched ``tanh`` output is served from the cache (no extra memory, no extra compute)."""
    ran = []

    def policy(op, *args, **kwargs):
        ran.append(op)
        return op in (aten.sin.default, aten.tanh.default)

    def f(x):
        s = x.sin()
        c = s.tanh()
        s.mul_(2)
        return (s * c).exp()

    leaf = x64().requires_grad_()
    out = ft.remat(f, policy=policy)(leaf).sum()
    ran.clear()
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ran.append(func)
            return func(*args, **(kwargs or {}))

    with Count():
        out.backward()
    assert aten.sin.default in ran and aten.tanh.default not in ran
    torch.testing.assert_close(leaf.grad, eager_grad(f, x64()), rtol=0, atol=1e-12)


def test_second_backward_with_retain_graph_after_mutation():
    leaf = x64().requires_grad_()
    out = ft.remat(mul_, policy=save_sin)(leaf).sum()
    out.backward(retain_graph=True)
    first = leaf.grad.clone()
    out.backward()
    torch.testing.assert_close(leaf.grad, 2 * first, rtol=0, atol=1e-12)
    torch.testing.assert_close(first, eager_grad(mul_, x64()), rtol=0, atol=1e-12)


# --- item 2: bad policies are refused when remat is called --------------------------------


@pytest.mark.parametrize(
    ("policy", "match"),
    [
        ([2], r"element 0 of the policy list is 2 \(int\)"),
        ([aten.mm.default, "mm"], r"element 1 of the policy list is 'mm' \(str\)"),
        ((aten.mm, None), r"element 1 of the policy tuple is None"),
        ({3.5}, r"element 0 of the policy set is 3.5 \(float\)"),
        ("dots_saveable", r"policy='dots_saveable'.*functrans.policies.dots_saveable"),
        ({aten.mm.default: True}, r"a dict"),
        (3, r"policy=3 \(int\)"),
    ],
)
def test_bad_policy_is_refused_when_remat_is_called(policy, match):
    for make in (
        lambda: ft.remat(torch.sin, policy=policy),
        lambda: ft.remat(policy=policy),
        lambda: ft.remat(torch.nn.Linear(2, 2), policy=policy),
    ):
        with pytest.raises(InvalidPolicyError, match=match) as info:
            make()
        message = str(info.value)
        assert "OpOverload" in message or "callable" in message, message


@pytest.mark.parametrize(
    "policy",
    [
        None,
        [],
        [aten.mm.default, aten.sin],
        (aten.mm,),
        {aten.mm.default},
        frozenset({aten.mm}),
        Policy.MUST_SAVE,
        CheckpointPolicy.PREFER_RECOMPUTE,
        policies.dots_saveable,
        policies.save_only_these_names("h"),
        policies.save_any_names_but_these("h"),
        policies.save_ops(aten.mm.default),
        policies.save_from_both_policies(policies.dots_saveable, [aten.sin.default]),
    ],
)
def test_every_policy_form_is_accepted(policy):
    x = x64().reshape(2, 3)
    w = x64().reshape(3, 2)

    def f(x, w):
        return torch.sin(x @ w).sum()

    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    ft.remat(f, policy=policy)(*leaves).backward()
    want = torch.func.grad(f, argnums=(0, 1))(x, w)
    torch.testing.assert_close(tuple(a.grad for a in leaves), want)


def test_bad_element_in_a_combined_policy_is_refused_when_combining():
    with pytest.raises(InvalidPolicyError, match=r"element 0 of the policy list is 'sin'"):
        policies.save_from_both_policies(policies.dots_saveable, ["sin"])


@pytest.mark.parametrize("value", [None, "save", 1, Policy])
def test_bad_policy_answer_names_op_and_value_in_both_modes(value):
    f = ft.remat(lambda x: x.sin().sum(), policy=lambda op, *a, **k: value)
    match = f"returned {re.escape(repr(value))} for op aten\\.sin\\.default"
    leaf = x64().requires_grad_()
    with pytest.raises(InvalidPolicyError, match=match):
        f(leaf).backward()
    with pytest.raises(InvalidPolicyError, match=match):
        ft.grad(f)(x64())


def test_policy_returning_none_hints_at_a_missing_return():
    def forgot(op, *args, **kwargs):
        op is aten.sin.default  # noqa: B015  # the bug under test: no return

    with pytest.raises(InvalidPolicyError, match="return"):
        ft.remat(torch.sin, policy=forgot)(x64().requires_grad_())
