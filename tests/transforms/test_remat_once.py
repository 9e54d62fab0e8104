"""Eager remat runs its region's body exactly once per call, and once more per recomputation in
backward (as ``torch.utils.checkpoint`` does), whatever the body calls: nothing is retried, so
Python side effects, module state and every random generator advance as in eager."""

import pytest
import torch
import torch.func as tf
from torch.testing import assert_close

import functrans as ft
from functrans import policies

POLICIES = {
    "nothing": None,
    "dots": policies.dots_saveable,
    "everything": policies.everything_saveable,
}


def _x(*values):
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def _grads(fn, *args):
    """fn's output and the gradients of its sum with respect to ``args``."""
    out = fn(*args)
    return out, torch.autograd.grad(out.sum(), args)


# each body reaches torch.func's reverse mode through functrans (the calls that used to fail
# under remat's saved-tensor hooks, after part of the body had run, and be run again)
BODIES = {
    "jacrev": lambda x: ft.jacrev(lambda y: -y * y.sin())(x.cos()).sum(0) * x,
    "hessian": lambda x: ft.hessian(lambda y: (y**3).sum())(x.sin()).sum(0) * x,
    "vmap_of_grad": lambda x: (
        ft.vmap(ft.grad(lambda y: (y.sin() * y).sum()))(x.cos()[:, None])[:, 0] * x
    ),
}


@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("policy", POLICIES)
def test_body_runs_once_in_forward_and_once_per_recomputation(body, policy):
    calls = []

    def f(x):
        calls.append("ran")  # a Python side effect inside the region
        return BODIES[body](x)

    x = _x(0.7, -0.3, 1.1)
    want_out, want_grads = _grads(f, x)
    calls.clear()
    out = ft.remat(f, policy=POLICIES[policy])(x)
    assert len(calls) == 1  # forward: the body ran once (it used to run up to twice)
    (got,) = torch.autograd.grad(out.sum(), x)
    assert len(calls) == 2  # backward: one recomputation
    assert_close(out, want_out)
    assert_close(got, want_grads[0])


def test_module_state_advances_once_in_forward():
    """A BatchNorm in training counts its batches: the region's forward counts one."""
    bn = torch.nn.BatchNorm1d(3).double()

    def f(x):
        h = bn(x)
        return ft.jacrev(lambda y: (y * y).sum(-1))(h).sum(0) * h

    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    ft.remat(f, policy=policies.dots_saveable)(x)
    assert bn.num_batches_tracked.item() == 1


@pytest.mark.parametrize("policy", POLICIES)
def test_default_generator_draws_as_eager(policy):
    """The region draws from the default CPU generator before and after a functrans jacrev:
    outputs, gradients and the generator's state afterwards are eager's."""

    def f(x):
        r = torch.rand_like(x)
        j = ft.jacrev(lambda y: y.sin() * r)(x).sum(0)
        return j * x * torch.rand_like(x)

    x = _x(0.7, -0.3, 1.1)
    torch.manual_seed(0)
    want_out, want_grads = _grads(f, x)
    want_state = torch.get_rng_state()
    torch.manual_seed(0)
    out, grads = _grads(ft.remat(f, policy=POLICIES[policy]), x)
    assert torch.equal(torch.get_rng_state(), want_state)
    assert_close(out, want_out)
    assert_close(grads[0], want_grads[0])


@pytest.mark.parametrize("with_jacrev", [False, True], ids=["plain", "jacrev"])
@pytest.mark.parametrize("policy", POLICIES)
def test_own_generator_draws_as_eager(policy, with_jacrev):
    """A generator passed to a random op: checkpoint restores only the default generators, so
    the recomputation drew other numbers from it (a wrong gradient) and advanced it again;
    and with a jacrev in the body, the retried forward drew twice (a wrong output)."""

    def f(x, g):
        r = torch.rand(x.shape, generator=g, dtype=x.dtype)
        h = ft.jacrev(lambda y: y.sin())(x).sum(0) if with_jacrev else x.sin()
        return h * r * x

    def run(fn):
        x, g = _x(0.7, -0.3, 1.1), torch.Generator().manual_seed(7)
        out = fn(x, g)
        (grad,) = torch.autograd.grad(out.sum(), x)
        return out, grad, g.get_state()

    want_out, want_grad, want_state = run(f)
    out, grad, state = run(ft.remat(f, policy=POLICIES[policy]))
    assert_close(out, want_out)
    assert_close(grad, want_grad)
    assert torch.equal(state, want_state)  # drawn from once, as in eager


def test_jacrev_region_gradients_match_torch_func():
    """The case that used to be retried (``remat(jacrev(f))``), now checkpointed: outputs and
    second-order gradients equal torch.func's."""
    x = _x(0.7, -0.3)
    fn = lambda y: -y * y.tanh()  # noqa: E731
    out = ft.remat(ft.jacrev(fn))(x)
    want = tf.jacrev(fn)(x)
    assert_close(out, want)
    (got,) = torch.autograd.grad(out.sum(), x)
    assert_close(got, tf.grad(lambda y: tf.jacrev(fn)(y).sum())(x.detach()))


def test_direct_torch_func_call_in_region_is_refused_without_rerunning():
    """torch.func.grad called directly refuses remat's saved-tensor hooks; the body is not run
    again as written: a named error says what to call instead."""
    calls = []

    def region(x):
        calls.append("ran")
        return tf.grad(lambda y: (y * y).sum())(x.sin())

    with pytest.raises(ft.UnsupportedOpError, match=r"remat\(region\).*ft\.jacrev"):
        ft.remat(region)(_x(0.5, 0.2))
    assert calls == ["ran"]


def test_jacrev_under_callers_saved_tensor_hooks():
    """ft.jacrev sets any caller's saved-tensor hooks aside while it runs (torch.func's own
    refuses to start under them), as a trace does; values are those without hooks."""
    x = _x(0.7, -0.3)
    with torch.autograd.graph.save_on_cpu():
        out = ft.jacrev(lambda y: y.sin() * y)(x)
    assert_close(out, tf.jacrev(lambda y: y.sin() * y)(x))
