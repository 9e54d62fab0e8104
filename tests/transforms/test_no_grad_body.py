"""A function body under ``torch.no_grad()``: ``jit`` and ``grad`` do what eager does.

Eager autograd leaves an output made under ``no_grad`` (or detached) with
``requires_grad=False``, saves nothing for it, and ``backward()`` on it raises; ``torch.func.grad``
through such a body gives zeros. The joint graph traces the body with autograd on, so ``jit``
used to hand back such outputs as differentiable, saving the inputs for a backward that eager
never has.
"""

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

import functrans as ft


def all_no_grad(x, w):
    with torch.no_grad():
        return (x @ w).sin() * 2


def detached(x, w):
    return (x @ w).detach().cos()


def mixed(x, w):  # one output differentiable, one not
    y = torch.tanh(x @ w)
    with torch.no_grad():
        z = y.exp()
    return y, z


def partly(x, w):  # a no_grad value used by differentiable code
    with torch.no_grad():
        scale = (x @ w).abs().amax()
    return (x @ w) / scale


def args():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, generator=g, dtype=torch.float64)
    w = torch.randn(4, 2, generator=g, dtype=torch.float64)
    return x.requires_grad_(), w.requires_grad_()


def run_counting_saves(f, *a):
    """The outputs of ``f(*a)`` and how many tensors autograd saved while computing them."""
    saved = []
    with saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = f(*a)
    return out, len(saved)


def leaves(out):
    return list(out) if isinstance(out, tuple) else [out]


@pytest.mark.parametrize("f", [all_no_grad, detached, mixed, partly], ids=lambda f: f.__name__)
def test_jit_outputs_require_grad_as_in_eager(f):
    jitted = ft.jit(f)
    want = leaves(f(*args()))
    for _ in range(2):  # compiled, then from the cache through the guards
        got = leaves(jitted(*args()))
        assert [t.requires_grad for t in got] == [t.requires_grad for t in want]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w.detach())


@pytest.mark.parametrize("f", [all_no_grad, detached], ids=lambda f: f.__name__)
def test_jit_of_a_no_grad_body_saves_nothing_and_backward_raises_like_eager(f):
    jitted = ft.jit(f)
    jitted(*args())  # compile (tracing runs autograd on fake tensors)
    for _ in range(2):
        out, saved = run_counting_saves(jitted, *args())
        assert saved == 0 and out.grad_fn is None
        with pytest.raises(RuntimeError, match="does not require grad"):
            out.sum().backward()
    with pytest.raises(RuntimeError, match="does not require grad"):
        f(*args()).sum().backward()


@pytest.mark.parametrize("f", [mixed, partly], ids=lambda f: f.__name__)
def test_jit_gradients_through_partly_no_grad_bodies_equal_eager(f):
    def loss(fn, x, w):
        return sum(t.sum() for t in leaves(fn(x, w)) if t.requires_grad)

    x, w = args()
    loss(f, x, w).backward()
    jx, jw = args()
    loss(ft.jit(f), jx, jw).backward()
    torch.testing.assert_close((jx.grad, jw.grad), (x.grad, w.grad))


@pytest.mark.parametrize("f", [all_no_grad, detached, partly], ids=lambda f: f.__name__)
def test_grad_through_a_no_grad_body_equals_torch_func(f):
    x, w = (a.detach() for a in args())

    def loss(x, w):
        return f(x, w).sum()

    want = torch.func.grad(loss, argnums=(0, 1))(x, w)
    torch.testing.assert_close(ft.grad(loss, argnums=(0, 1))(x, w), want)


def test_joint_graph_records_which_outputs_are_differentiable():
    jg = ft.joint(mixed)(*(a.detach() for a in args()))
    assert jg.differentiable == (True, False)


def test_jit_module_with_a_frozen_forward():
    class Frozen(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2, dtype=torch.float64)

        def forward(self, x):
            with torch.no_grad():
                return self.lin(x).relu()

    torch.manual_seed(0)
    m = Frozen()
    x = args()[0]
    want = m(x)
    jitted = ft.jit(m)
    jitted(x)  # compile
    got, saved = run_counting_saves(jitted, x)
    assert not got.requires_grad and saved == 0
    torch.testing.assert_close(got, want)


def test_enable_grad_body_called_under_no_grad():  # more in test_trace_state.py
    def f(x):
        with torch.enable_grad():
            return x.sin()

    x = args()[0]
    with torch.no_grad():
        want, got = f(x), ft.jit(f)(x)
    assert got.requires_grad == want.requires_grad
