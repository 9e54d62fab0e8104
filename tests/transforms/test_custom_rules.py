"""custom_vjp and custom_jvp: eager, traced, partitioned, jitted, nested, under torch.func.
Several cases follow JAX's tests/api_test.py CustomVJPTest/CustomJVPTest (clip_gradient,
log1pexp, higher order, forward mode of a custom_vjp refused), in our own words."""

import pytest
import torch
from torch import func as tf

import functrans as ft
from functrans.extend import Policy, policy_of
from functrans.testing._check import partition_and_check


def assert_close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)


def make_layer(policy=Policy.MUST_SAVE):
    @ft.custom_vjp
    def layer(x, w):
        return torch.tanh(x @ w)

    def fwd(x, w):
        y = torch.tanh(x @ w)
        return y, {"x": x, "w": w, "y": y}

    def bwd(res, g):
        gy = g * (1 - res["y"] ** 2)
        return gy @ res["w"].T, res["x"].T @ gy

    layer.defvjp(fwd, bwd)
    layer.residual_policy = policy
    return layer


def plain(x, w):
    return torch.tanh(x @ w)


def loss_of(layer):
    return lambda x, w: layer(x, w).pow(2).sum()


@pytest.fixture
def xw():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 3, generator=g), torch.randn(3, 5, generator=g)


RUNS = {
    "eager": lambda L, x, w: ft.grad(L, argnums=(0, 1))(x, w),
    "jit": lambda L, x, w: ft.jit(ft.grad(L, argnums=(0, 1)))(x, w),
    "torch.func.grad": lambda L, x, w: tf.grad(L, argnums=(0, 1))(x, w),
    "vmap(grad)": lambda L, x, w: ft.vmap(ft.grad(L, argnums=(0, 1)), in_dims=(0, None))(
        x[:, None], w
    ),
    "jit(vmap(grad))": lambda L, x, w: ft.jit(
        ft.vmap(ft.grad(L, argnums=(0, 1)), in_dims=(0, None))
    )(x[:, None], w),
    "grad(remat)": lambda L, x, w: ft.grad(ft.remat(L), argnums=(0, 1))(x, w),
}


@pytest.mark.parametrize("run", list(RUNS))
def test_custom_vjp_gradients_equal_the_plain_function(run, xw):
    x, w = xw
    assert_close(RUNS[run](loss_of(make_layer()), x, w), RUNS[run](loss_of(plain), x, w))


def test_custom_vjp_bwd_is_what_runs():
    @ft.custom_vjp
    def clip_gradient(x):
        return x

    clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (g.clamp(-1.0, 1.0),))
    g = ft.grad(lambda x: (clip_gradient(x) * 10).sum())(torch.ones(3))
    assert_close(g, torch.ones(3))
    jg = ft.jit(ft.grad(lambda x: (clip_gradient(x) * 10).sum()))(torch.ones(3))
    assert_close(jg, torch.ones(3))


@pytest.mark.parametrize("strategy", ["default", "min_cut", "full_remat"])
def test_residuals_are_exactly_what_is_saved_for_the_rule(strategy, xw):
    x, w = xw
    L = loss_of(make_layer())
    jg = ft.joint(L)(x, w)
    tagged = [n for n in jg.ops() if policy_of(n) is Policy.MUST_SAVE]
    assert [str(n.target) for n in tagged] == ["aten.tanh.default"]  # the residual y
    p = partition_and_check(L, (x, w), jg, strategy, {})
    assert not set(p.recomputed) & set(tagged)
    assert {s.node for s in p.saved} >= set(tagged)


def test_residual_policy_must_recompute_lets_strategies_recompute(xw):
    x, w = xw
    L = loss_of(make_layer(Policy.MUST_RECOMPUTE))
    jg = ft.joint(L)(x, w)
    p = partition_and_check(L, (x, w), jg, "default", {})
    assert "aten.tanh.default" in {str(n.target) for n in p.recomputed}


def test_custom_vjp_second_order(xw):
    @ft.custom_vjp
    def cube(x):
        return x**3

    cube.defvjp(lambda x: (x**3, x), lambda x, g: (3 * x**2 * g,))
    x = xw[0]
    ours = ft.grad(lambda x: ft.grad(lambda y: cube(y).sum())(x).sum())(x)
    assert_close(ours, 6 * x)
    assert_close(tf.grad(lambda x: tf.grad(lambda y: cube(y).sum())(x).sum())(x), 6 * x)


def test_custom_vjp_refuses_forward_mode():
    @ft.custom_vjp
    def sq(x):
        return x * x

    sq.defvjp(lambda x: (x * x, x), lambda x, g: (2 * x * g,))
    with pytest.raises(ft.UnsupportedOpError, match="custom_vjp sq has a reverse-mode rule only"):
        ft.jvp(sq, (torch.ones(2),), (torch.ones(2),))


def test_custom_vjp_errors_name_the_rule():
    @ft.custom_vjp
    def f(x, y):
        return x * y

    with pytest.raises(ft.FunctransError, match=r"call f\.defvjp"):
        ft.grad(lambda x: f(x, x).sum())(torch.ones(2))
    f.defvjp(lambda x, y: (x * y, (x, y)), lambda res, g: (g * res[1],))  # one grad: 2 args
    with pytest.raises(ft.InvalidArgumentError, match="one gradient per positional argument"):
        ft.grad(lambda x: f(x, x).sum())(torch.ones(2))
    with pytest.raises(ft.InvalidArgumentError, match="residual_policy"):
        ft.custom_vjp(lambda x: x, residual_policy="save")


def test_custom_vjp_pytree_arguments_and_none_gradients():
    @ft.custom_vjp
    def scale(params, x):
        return params["a"] * x + params["b"]

    scale.defvjp(
        lambda p, x: (scale(p, x), (p, x)),
        lambda res, g: ({"a": (g * res[1]).sum(), "b": g.sum()}, None),
    )
    p = {"a": torch.tensor(2.0), "b": torch.tensor(1.0)}
    grads = ft.grad(lambda p, x: scale(p, x).sum())(p, torch.arange(3.0))
    assert_close(grads, {"a": torch.tensor(3.0), "b": torch.tensor(3.0)})


def log1pexp_rule():
    @ft.custom_jvp
    def log1pexp(x):
        return torch.log1p(torch.exp(x))

    @log1pexp.defjvp
    def _(primals, tangents):
        (x,), (t,) = primals, tangents
        return log1pexp(x), t * torch.sigmoid(x)

    return log1pexp


CUSTOM_JVP_RUNS = {
    "jvp": lambda g, x: ft.jvp(g, (x,), (x.cos(),))[1],
    "grad": lambda g, x: ft.grad(lambda x: g(x).pow(2).sum())(x),
    "jit(grad)": lambda g, x: ft.jit(ft.grad(lambda x: g(x).pow(2).sum()))(x),
    "grad(grad)": lambda g, x: ft.grad(lambda x: ft.grad(lambda y: g(y).sum())(x).sum())(x),
    "jvp(grad) (hvp)": lambda g, x: ft.jvp(ft.grad(lambda x: g(x).pow(2).sum()), (x,), (x,))[1],
    "jacfwd": lambda g, x: ft.jacfwd(g)(x),
    "jacrev": lambda g, x: ft.jacrev(g)(x),
    "vmap": lambda g, x: ft.vmap(g)(x[:, None]),
    "jit(jvp)": lambda g, x: ft.jit(lambda x: ft.jvp(g, (x,), (x.cos(),))[1])(x),
}


@pytest.mark.parametrize("run", list(CUSTOM_JVP_RUNS))
def test_custom_jvp_matches_the_plain_function(run):
    x = torch.linspace(-3, 3, 5)
    ours = CUSTOM_JVP_RUNS[run](log1pexp_rule(), x)
    assert_close(ours, CUSTOM_JVP_RUNS[run](torch.nn.functional.softplus, x))


def test_custom_jvp_rule_is_what_runs_where_plain_autograd_overflows():
    g = ft.grad(lambda x: log1pexp_rule()(x).sum())(torch.tensor([100.0]))
    assert_close(g, torch.tensor([1.0]))
    plain = ft.grad(lambda x: torch.log1p(torch.exp(x)).sum())(torch.tensor([100.0]))
    assert torch.isnan(plain).all()


def test_custom_jvp_without_rule_is_named():
    with pytest.raises(ft.FunctransError, match="no rule; call defjvp"):
        ft.custom_jvp(torch.sin)(torch.ones(2))


# worked once the argument mask stopped travelling as a (pytree) operand of the Function
def test_custom_jvp_forward_over_forward():
    x = torch.linspace(-1, 1, 3)
    ours = ft.hessian(lambda x: log1pexp_rule()(x).pow(2).sum())(x)
    assert_close(ours, tf.hessian(lambda x: torch.nn.functional.softplus(x).pow(2).sum())(x))


def test_custom_jvp_rule_error_under_hessian_names_the_transform_stack():
    @ft.custom_jvp
    def bad(x):
        return x * 2

    @bad.defjvp
    def _(primals, tangents):
        return bad(primals[0]), tangents[0] @ torch.ones(5)  # a shape error in the rule

    with pytest.raises(ft.TransformError, match=r"inside hessian\(custom_jvp\(bad\)\)"):
        ft.hessian(lambda x: bad(x).pow(2).sum())(torch.linspace(-1, 1, 3))


# found in review: integer and boolean arguments and outputs of custom rules
def test_custom_jvp_with_a_boolean_argument_differentiates_the_float_one():
    @ft.custom_jvp
    def masked_exp(x, m):
        return torch.where(m, x.exp(), x)

    @masked_exp.defjvp
    def _(primals, tangents):
        x, m = primals
        return masked_exp(x, m), torch.where(m, x.exp() * tangents[0], tangents[0])

    m, x = torch.tensor([True, False, True]), torch.randn(3)
    expected = torch.where(m, x.exp(), torch.ones(3))
    assert_close(ft.grad(lambda x: masked_exp(x, m).sum())(x), expected)
    assert_close(tf.grad(lambda x: masked_exp(x, m).sum())(x), expected)
    assert_close(ft.jvp(lambda x: masked_exp(x, m), (x,), (torch.ones(3),))[1], expected)


def test_custom_jvp_with_an_integer_output():
    @ft.custom_jvp
    def double_and_argmax(x):
        return x * 2, x.argmax()

    @double_and_argmax.defjvp
    def _(primals, tangents):
        return double_and_argmax(primals[0]), (tangents[0] * 2, None)

    x = torch.randn(3)
    assert_close(
        ft.jvp(lambda x: double_and_argmax(x)[0], (x,), (torch.ones(3),))[1], torch.full((3,), 2.0)
    )
    assert_close(ft.grad(lambda x: double_and_argmax(x)[0].sum())(x), torch.full((3,), 2.0))


def test_custom_vjp_double_backward_with_a_boolean_argument():
    m, x = torch.tensor([True, False, True]), torch.randn(3)

    @ft.custom_vjp
    def masked_exp(x, m):
        return torch.where(m, x.exp(), x)

    masked_exp.defvjp(
        lambda x, m: (masked_exp(x, m), (x.exp(),)),
        lambda res, g: (torch.where(m, res[0] * g, g), None),
    )
    second = ft.grad(lambda x: ft.grad(lambda x: masked_exp(x, m).sum())(x).sum())(x)
    assert_close(second, torch.where(m, x.exp(), torch.zeros(3)))
