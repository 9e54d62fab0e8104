"""functrans' reverse mode nested inside its own transforms: an inner
``grad``/``vjp`` under an outer trace differentiates in place and the outer trace records it.
Before, each of these raised torch's raw "fake mode ... doesn't match mode" assertion."""

import pytest
import torch

import functrans as ft
from functrans.testing import check_partition


def f(x):
    return (x.sin() ** 2 * x).sum()


def tf_grad(x):
    return torch.func.grad(f)(x)


X = torch.randn(5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("strategy", ["default", "min_cut", "full_remat"])
def test_grad_of_grad_is_torch_funcs(strategy):
    got = ft.grad(lambda y: ft.grad(f)(y).sum(), partition=strategy)(X)
    torch.testing.assert_close(got, torch.func.grad(lambda y: tf_grad(y).sum())(X))


def test_grad_three_deep():
    got = ft.grad(lambda y: ft.grad(lambda z: ft.grad(f)(z).sum())(y).sum())(X)
    want = torch.func.grad(lambda y: torch.func.grad(lambda z: tf_grad(z).sum())(y).sum())(X)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("strategy", ["default", "min_cut"])
def test_jit_of_grad_and_value_and_grad(strategy):
    torch.testing.assert_close(ft.jit(ft.grad(f), partition=strategy)(X), tf_grad(X))
    value, grads = ft.jit(ft.value_and_grad(f), partition=strategy)(X)
    torch.testing.assert_close(value, f(X))
    torch.testing.assert_close(grads, tf_grad(X))


def test_backward_through_jit_of_grad_is_double_backward():
    x = X.clone().requires_grad_()
    ft.jit(ft.grad(f))(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.func.grad(lambda y: tf_grad(y).sum())(X))


def test_joint_of_grad_partitions_with_every_strategy():
    jg = ft.joint(ft.grad(f))(X)
    default = ft.partition(jg, "default")
    assert ft.partition(jg, "min_cut").activation_bytes <= default.activation_bytes
    for strategy in ("default", "min_cut", "full_remat"):
        check_partition(ft.grad(f), (X,), strategy)


def test_vjp_inside_jit():
    def g(x):
        out, vjp_fn = ft.vjp(torch.sin, x)
        (gx,) = vjp_fn(torch.ones_like(out))
        return out * gx

    torch.testing.assert_close(ft.jit(g)(X), X.sin() * X.cos())


def test_grad_with_respect_to_a_pytree_inside_grad():
    def loss(p, x):
        return (p["w"] * x).sin().sum() + p["b"].sum()

    def outer(p):
        return sum(g.pow(2).sum() for g in ft.grad(loss)(p, X).values())

    p = {"w": X.clone(), "b": X[:2].clone()}
    want = torch.func.grad(
        lambda p: sum(g.pow(2).sum() for g in torch.func.grad(loss)(p, X).values())
    )(p)
    got = ft.grad(outer)(p)
    torch.testing.assert_close(got, want)


def test_nested_grad_of_a_non_scalar_output_is_the_same_error():
    # the in-place path must refuse what the traced path refuses, not sum the output silently
    with pytest.raises(ft.FunctransError, match="scalar float tensor"):
        ft.grad(lambda y: ft.grad(torch.sin)(y).sum())(X)
    with pytest.raises(ft.FunctransError, match="scalar float tensor"):
        ft.jit(ft.grad(torch.sin))(X)


def test_jax_style_training_loop_jit_of_value_and_grad_matches_eager():
    # what a researcher coming from JAX writes: params as a dict of plain tensors, one jitted
    # value_and_grad step, SGD by hand, some steps under bf16 autocast, an eval call between
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(8, 4, generator=g), "b": torch.zeros(4)}
    data = [(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)) for _ in range(6)]

    def loss(p, x, y):
        return ((torch.tanh(x @ p["w"] + p["b"]) - y) ** 2).mean()

    step = ft.jit(ft.value_and_grad(loss), partition="min_cut")
    evaluate = ft.jit(loss)
    ours = {k: v.clone() for k, v in params.items()}
    ref = {k: v.clone() for k, v in params.items()}
    for i, (x, y) in enumerate(data):
        amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=i % 2 == 1)
        with amp:
            value, grads = step(ours, x, y)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=i % 2 == 1):
            want_value, want_grads = torch.func.grad_and_value(loss)(ref, x, y)[::-1]
        torch.testing.assert_close(value, want_value)
        torch.testing.assert_close(grads, want_grads)
        ours = {k: v - 0.1 * grads[k] for k, v in ours.items()}
        ref = {k: v - 0.1 * want_grads[k] for k, v in ref.items()}
        torch.testing.assert_close(evaluate(ours, x, y), loss(ref, x, y))


def test_jit_of_grad_sees_the_module_mode_and_its_updated_weights():
    # the module is reached only through ft.grad's wrapper closure: jit's guards and captures
    # must still see model.train()/eval() and an in-place weight update
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    x = torch.randn(8, 4)

    def loss(w):
        return (model(x) * w).sum()

    step = ft.jit(ft.grad(loss))
    w = torch.randn(4)
    model.eval()
    evaluated = step(w)
    torch.testing.assert_close(evaluated, torch.func.grad(loss)(w))
    model.train()
    torch.manual_seed(1)
    trained = step(w)
    torch.manual_seed(1)
    torch.testing.assert_close(trained, torch.func.grad(loss)(w))
    assert not torch.equal(trained, evaluated)
    with torch.no_grad():
        model[0].weight.mul_(2)
    model.eval()
    torch.testing.assert_close(step(w), torch.func.grad(loss)(w))
