"""Peer cases for custom rules and vjp, in our own words."""

import pytest
import torch
from torch import func as tf

import functrans as ft


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def nestable():
    def f(x):
        return x**2

    @ft.custom_vjp
    def g(x):
        return f(x)

    g.defvjp(lambda x: ft.vjp(f, x), lambda f_vjp, y_bar: f_vjp(y_bar))
    return g


# ported from JAX tests/api_test.py CustomVJPTest.test_nestable_vjp
def test_nestable_vjp_first_and_second_order():
    g = nestable()
    _, g_vjp = ft.vjp(g, torch.tensor(1.0))
    close(g_vjp(torch.tensor(1.0))[0], torch.tensor(2.0))
    x = torch.tensor(3.0)
    close(ft.grad(g)(x), torch.tensor(6.0))
    close(ft.jit(ft.grad(g))(x), torch.tensor(6.0))
    for second in (ft.grad(ft.grad(g)), tf.grad(tf.grad(g)), ft.jit(ft.grad(ft.grad(g)))):
        close(second(x), torch.tensor(2.0))  # was 0: the residual function hid x
    z = ft.jit(lambda x, c: ft.vjp(g, x)[1](c))
    close(z(torch.tensor(1.0), torch.tensor(3.0))[0], torch.tensor(6.0))


# ported from the same test: jit returning the vjp function (JAX returns a pytree)
def test_jit_returning_a_vjp_function_is_named():
    z = ft.jit(lambda x: ft.vjp(nestable(), x)[1])
    with pytest.raises(ft.TraceError, match="returns the function"):
        z(torch.tensor(1.0))


def log1pexp():
    @ft.custom_jvp
    def f(x):
        return torch.log1p(torch.exp(x))

    @f.defjvp
    def _(primals, tangents):
        return f(primals[0]), tangents[0] * torch.sigmoid(primals[0])

    return f


# ported from JAX tests/api_test.py CustomJVPTest.test_vmap (jvp of vmap)
def test_jvp_of_vmap_of_custom_jvp():
    x, t = torch.randn(4, 3), torch.randn(4, 3)
    close(ft.jvp(ft.vmap(log1pexp()), (x,), (t,))[1], t * torch.sigmoid(x))


def test_custom_jvp_closing_over_a_differentiated_tensor_is_named():
    def h(y):
        @ft.custom_jvp
        def sc(x):
            return x * y

        @sc.defjvp
        def _(p, tt):
            return sc(p[0]), tt[0] * y

        return sc(torch.ones(3))

    x = torch.randn(4, 3)
    close(ft.vmap(h)(x), x)  # batching alone is fine
    with pytest.raises(ft.UnsupportedOpError, match="closes over tensor 'y'"):
        ft.jvp(ft.vmap(h), (x,), (x,))


def test_eval_shape_of_jvp_of_custom_jvp():
    t = torch.ones(2, 3)
    out = ft.eval_shape(lambda x: ft.jvp(log1pexp(), (x,), (t,)), torch.ones(2, 3))
    assert [o.shape for o in out] == [(2, 3), (2, 3)]


# ported from torch.func.vjp's has_aux (test/functorch/test_eager_transforms.py)
@pytest.mark.parametrize("where", ["eager", "torch.func", "jit"])
def test_vjp_has_aux(where):
    x = torch.randn(3)

    def f(x):
        return x.sin(), {"c": x.cos()}

    if where == "eager":
        out, vjp_fn, aux = ft.vjp(f, x, has_aux=True)
        g = vjp_fn(torch.ones(3))[0]
    elif where == "torch.func":  # ft.vjp under a torch.func transform

        def inner(x):
            out, vjp_fn, aux = ft.vjp(f, x, has_aux=True)
            return vjp_fn(torch.ones(3))[0].sum(), (out, aux)

        g, (out, aux) = tf.grad(inner, has_aux=True)(x)
        g = -g  # d/dx sum(cos x) = -sin x
        close(g, x.sin())
    else:
        out, g, aux = ft.jit(
            lambda x: (lambda r: (r[0], r[1](torch.ones(3))[0], r[2]))(ft.vjp(f, x, has_aux=True))
        )(x)
    close(out, x.sin())
    close(aux["c"], x.cos())
    if where != "torch.func":
        close(g, x.cos())


# ported from JAX tests/api_test.py CustomVJPTest.test_nondiff_arg
def test_custom_vjp_nondiff_argnums_and_keywords():
    def app(f, x):
        return f(x)

    app = ft.custom_vjp(app, nondiff_argnums=(0,))
    app.defvjp(lambda f, x: (app(f, x), torch.cos(x)), lambda f, cos_x, g: (cos_x * g,))
    x = torch.randn(3)
    close(ft.grad(lambda x: app(torch.sin, x).sum())(x), x.cos())
    close(ft.grad(lambda x: app(torch.sin, x=x).sum())(x), x.cos())  # keywords bound


# ported from JAX tests/api_test.py CustomJVPTest.test_nondiff_arg
def test_custom_jvp_nondiff_argnums():
    def app(f, x):
        return f(x)

    app = ft.custom_jvp(app, nondiff_argnums=(0,))

    @app.defjvp
    def _(f, primals, tangents):
        (x,), (t,) = primals, tangents
        return app(f, x), torch.cos(x) * t * 2  # twice the true derivative: the rule runs

    x = torch.randn(3)
    close(ft.jvp(lambda x: app(torch.sin, x), (x,), (torch.ones(3),))[1], 2 * x.cos())
    close(ft.grad(lambda x: app(torch.sin, x=x).sum())(x), 2 * x.cos())


def test_bad_nondiff_argnums_and_keywords_are_named():
    with pytest.raises(ft.InvalidArgumentError, match="nondiff_argnums"):
        ft.custom_vjp(lambda x: x, nondiff_argnums="0")

    @ft.custom_vjp
    def kw_only(x, *, y):
        return x * y

    with pytest.raises(ft.InvalidArgumentError, match="could not be bound to positions"):
        kw_only(torch.ones(2), y=2.0)
