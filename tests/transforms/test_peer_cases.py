"""Peer cases from JAX's test suite that functrans got wrong (issue 49), in our own words:
a ``custom_vjp`` whose ``fwd`` returns a primal output of another type than the function's,
a ``custom_jvp`` closing over a value the outer transform differentiates (refused by ``jvp``,
once let through by ``grad``), and JAX's catch-all remat policy ``lambda *_, **__: True``."""

import math

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st
from torch import func as tf

import functrans as ft
from functrans.policies import InvalidPolicyError, convention


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


# -- custom_vjp: fwd's primal output must have the function's type -----------------------------


def wrong_shape(calls_f=False, counter=None):
    """``f(x) = x``; fwd returns a (3,) vector for a scalar: a silent ``[0, 0, 0]`` before."""

    @ft.custom_vjp
    def f(x):
        if counter is not None:
            counter.append(1)
        return x

    def f_fwd(x):
        if calls_f:
            f(x)
        return torch.zeros(3, dtype=x.dtype), None

    f.defvjp(f_fwd, lambda _, g: (2 * g.sum(),))
    return f


SHAPE = r"custom_vjp f: fwd f_fwd's primal output differs from f's at output: shape \(3,\) where "
SHAPE += r"f returns shape \(\)"

WHERES = {
    "eager": lambda f, x: f(x.requires_grad_()),
    "grad": lambda f, x: ft.grad(lambda x: f(x).sum())(x),
    "vjp": lambda f, x: ft.vjp(f, x),
    "value_and_grad": lambda f, x: ft.value_and_grad(lambda x: f(x).sum())(x),
    "jit": lambda f, x: ft.jit(f)(x.requires_grad_()),
    "jit_grad": lambda f, x: ft.jit(ft.grad(lambda x: f(x).sum()))(x),
    "tf.grad": lambda f, x: tf.grad(lambda x: f(x).sum())(x),
    "tf.vmap": lambda f, x: tf.vmap(f)(x.expand(2)),
}


# ported from JAX tests/api_test.py CustomVJPTest (fwd's primal output type checked)
@pytest.mark.parametrize("calls_f", [False, True], ids=["fwd_alone", "fwd_calls_f"])
@pytest.mark.parametrize("where", list(WHERES))
def test_fwd_primal_output_of_the_wrong_shape_is_named(where, calls_f):
    with pytest.raises(ft.InvalidArgumentError, match=SHAPE):
        WHERES[where](wrong_shape(calls_f), torch.tensor(1.0))


def test_without_a_gradient_the_function_runs_as_written():
    # nothing differentiates: fwd does not run, the function's own output comes back (as in JAX)
    close(wrong_shape()(torch.tensor(1.0)), torch.tensor(1.0))
    with torch.no_grad():
        close(wrong_shape()(torch.tensor(1.0, requires_grad=True)), torch.tensor(1.0))


# ported from JAX CustomVJPTest.test_fwd_rule_primal_out_type_doesnt_match_primal_error_message
def test_fwd_primal_output_of_the_wrong_structure_is_named():
    @ft.custom_vjp
    def f(x):
        return x

    f.defvjp(lambda x: ((x, x), None), lambda _, g: (g,))
    with pytest.raises(ft.InvalidArgumentError, match=r"has structure PyTreeSpec\(\(\*, \*\)"):
        ft.grad(lambda x: f(x)[0])(torch.tensor(1.0))


def test_fwd_primal_output_of_the_wrong_dtype_is_named_with_its_path():
    @ft.custom_vjp
    def f(x):
        return {"y": x, "n": 2}

    f.defvjp(lambda x: ({"y": x.double(), "n": 2}, None), lambda _, g: (g["y"],))
    match = r"at output\['y'\]: dtype torch.float64 where f returns dtype torch.float32"
    with pytest.raises(ft.InvalidArgumentError, match=match):
        ft.vjp(f, torch.ones(2))


def test_fwd_calling_f_is_checked_without_running_f_again():
    runs = []
    f = wrong_shape(calls_f=True, counter=runs)
    with pytest.raises(ft.InvalidArgumentError, match=SHAPE):
        f(torch.tensor(1.0, requires_grad=True))
    assert len(runs) == 1  # the call inside fwd: its output is the reference


def test_fwd_alone_is_checked_once_per_input_type():
    runs = []

    @ft.custom_vjp
    def f(x):
        runs.append(1)
        return x.sin()

    f.defvjp(lambda x: (x.sin(), x.cos()), lambda cos, g: (cos * g,))
    for _ in range(3):
        x = torch.randn(4, requires_grad=True)
        f(x).sum().backward()
        close(x.grad, x.cos())
    assert len(runs) == 1  # one abstract run (fake tensors) for the (4,) float32 input
    f(torch.randn(5, requires_grad=True))
    assert len(runs) == 2


def test_right_fwd_rules_still_pass():
    # nondiff_argnums, keywords and static outputs: the check compares what it should
    def app(fn, x, scale=2.0):
        return fn(x) * scale, "tag"

    app = ft.custom_vjp(app, nondiff_argnums=(0,))
    app.defvjp(
        lambda fn, x, scale: (app(fn, x, scale), (x, scale)),
        lambda fn, res, g: (torch.cos(res[0]) * res[1] * g[0], None),
    )
    x = torch.randn(3)
    close(ft.grad(lambda x: app(torch.sin, x=x)[0].sum())(x), 2 * x.cos())
    close(tf.grad(lambda x: app(torch.sin, x)[0].sum())(x), 2 * x.cos())
    close(ft.jit(ft.grad(lambda x: app(torch.sin, x)[0].sum()))(x), 2 * x.cos())


def test_a_function_that_reads_values_is_left_unchecked():
    # fwd does not call f and f cannot run on fake tensors (.item()): nothing to compare with
    @ft.custom_vjp
    def f(x):
        return x * x.sum().item()

    f.defvjp(lambda x: (x * x.sum().item(), x), lambda x, g: (g * x.sum().item(),))
    x = torch.ones(2, requires_grad=True)
    close(f(x), torch.full((2,), 2.0))


def test_a_function_storing_a_tensor_is_named_when_fwd_does_not_call_it():
    store = {}

    @ft.custom_vjp
    def f(x):
        store["y"] = x * 3
        return x

    f.defvjp(lambda x: (x, None), lambda _, g: (g,))
    with pytest.raises(ft.TraceError, match=r"Have fwd call f itself"):
        f(torch.ones(2, requires_grad=True))

    f.defvjp(lambda x: (f(x), None), lambda _, g: (g,))  # fwd calls f: f runs as written
    f(torch.ones(2, requires_grad=True))
    close(store["y"], torch.full((2,), 3.0))


# property: any wrong primal output fwd returns is a named error, never a result


def _outputs(kind, x):
    if kind == "leaf":
        return x * 2
    if kind == "pair":
        return (x * 2, x + 1)
    return {"a": x * 2, "b": x + 1}


def _leaf_paths(kind):
    return {"leaf": [()], "pair": [(0,), (1,)], "dict": [("a",), ("b",)]}[kind]


def _replace(tree, path, fn):
    if not path:
        return fn(tree)
    head, rest = path[0], path[1:]
    if isinstance(tree, tuple):
        return tuple(_replace(t, rest, fn) if i == head else t for i, t in enumerate(tree))
    return {k: _replace(v, rest, fn) if k == head else v for k, v in tree.items()}


MUTATIONS = {
    "longer": lambda t: torch.zeros(*t.shape, 2, dtype=t.dtype),
    "scalar_or_wider": lambda t: t.sum() if t.dim() else t.expand(2).contiguous(),
    "bigger": lambda t: torch.zeros(tuple(d + 1 for d in t.shape) or (1,), dtype=t.dtype),
    "float64": lambda t: t.double(),
    "float16": lambda t: t.half(),
    "int64": lambda t: t.long(),
    "bool": lambda t: t > 0,
    "none": lambda t: None,
    "int": lambda t: 1,
    "wrapped": lambda t: (t,),
}


@st.composite
def wrong_rules(draw):
    kind = draw(st.sampled_from(["leaf", "pair", "dict"]))
    shape = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    path = draw(st.sampled_from(_leaf_paths(kind)))
    mutation = draw(st.sampled_from([*sorted(MUTATIONS), "drop", "extra"]))
    calls_f = draw(st.booleans())
    where = draw(st.sampled_from(["eager", "vjp", "tf.vjp"]))
    return kind, shape, path, mutation, calls_f, where


def _mutate(out, kind, path, mutation):
    if mutation == "drop":
        return out[:1] if kind == "pair" else {"a": out["a"]} if kind == "dict" else (out,)
    if mutation == "extra":
        return (*out, out[0]) if kind == "pair" else {**out, "c": 1} if kind == "dict" else [out]
    return _replace(out, path, MUTATIONS[mutation])


@given(wrong_rules())
def test_property_a_wrong_fwd_primal_output_is_always_named(case):
    kind, shape, path, mutation, calls_f, where = case
    note(f"f returns {kind} of shape {shape}; fwd's {mutation} at {path}; {where}")

    @ft.custom_vjp
    def f(x):
        return _outputs(kind, x)

    def f_fwd(x):
        out = f(x) if calls_f else _outputs(kind, x)
        return _mutate(out, kind, path, mutation), None

    f.defvjp(f_fwd, lambda _, g: (torch.zeros(shape),))
    x = torch.randn(shape)
    with pytest.raises(ft.InvalidArgumentError, match=r"custom_vjp f: fwd f_fwd's primal output"):
        if where == "eager":
            f(x.requires_grad_())
        elif where == "vjp":
            ft.vjp(f, x)
        else:
            tf.vjp(f, x)


# -- custom_jvp / custom_vjp closing over a differentiated value: refused alike ----------------


def closing_jvp(x):
    # JAX's CustomJVPTest.test_closed_over_tracers_error_message, in our words
    @ft.custom_jvp
    def g(y):
        return x + y

    @g.defjvp
    def _(primals, tangents):
        return g(x), 2 * primals[0]

    return g(torch.tensor(1.0))


def closing_vjp(x):
    @ft.custom_vjp
    def g(y):
        return x * y

    g.defvjp(lambda y: (g(y), y), lambda y, ct: (x * ct,))
    return g(torch.tensor(1.0))


REFUSERS = {
    "jvp": lambda f, x: ft.jvp(f, (x,), (torch.tensor(1.0),)),
    "grad": lambda f, x: ft.grad(f)(x),
    "vjp": lambda f, x: ft.vjp(f, x)[1](torch.tensor(1.0)),
    "value_and_grad": lambda f, x: ft.value_and_grad(f)(x),
    "jacrev": lambda f, x: ft.jacrev(f)(x),
    "jit_grad": lambda f, x: ft.jit(ft.grad(f))(x),
    "tf.grad": lambda f, x: tf.grad(f)(x),
    "eager": lambda f, x: f(x.requires_grad_()),
}


@pytest.mark.parametrize("transform", list(REFUSERS))
def test_custom_jvp_closing_over_a_differentiated_value_is_refused_alike(transform):
    with pytest.raises(ft.UnsupportedOpError) as jvp_error:
        REFUSERS["jvp"](closing_jvp, torch.tensor(3.0))
    with pytest.raises(ft.UnsupportedOpError, match="g closes over tensor 'x'") as error:
        REFUSERS[transform](closing_jvp, torch.tensor(3.0))
    assert str(jvp_error.value) in str(error.value)  # one message (a nest may name its stack)


@pytest.mark.parametrize("transform", ["grad", "vjp", "tf.grad", "eager"])
def test_custom_vjp_closing_over_a_differentiated_value_is_refused(transform):
    with pytest.raises(ft.UnsupportedOpError, match="closes over tensor 'x'"):
        REFUSERS[transform](closing_vjp, torch.tensor(3.0))


def test_a_closed_over_value_nothing_differentiates_is_fine():
    close(
        ft.grad(lambda y, x: closing_jvp(x) * y)(torch.tensor(2.0), torch.tensor(3.0)),
        torch.tensor(4.0),
    )
    with torch.no_grad():
        close(closing_jvp(torch.tensor(3.0, requires_grad=True)), torch.tensor(4.0))
    close(closing_vjp(torch.tensor(3.0)), torch.tensor(3.0))


# -- JAX's catch-all remat policy ------------------------------------------------------------


# ported from JAX tests/api_test.py RematTest.test_remat_basic (its policy variants)
@pytest.mark.parametrize("saves", [True, False])
def test_remat_basic_with_a_catch_all_policy(saves):
    policy = lambda *_, **__: saves  # noqa: E731
    assert convention(policy) == "jax"
    g = ft.remat(lambda x: (torch.sin(torch.sin(x)), 3.0), policy=policy)

    def f(x):
        y, _ = g(x)
        return y

    x = torch.tensor(2.0, dtype=torch.float64)
    expected = math.sin(math.sin(2.0))
    derivative = math.cos(math.sin(2.0)) * math.cos(2.0)
    close(f(x).item(), expected)
    out, f_lin = ft.linearize(f, x)
    close(out.item(), expected)
    close(f_lin(torch.tensor(3.0, dtype=torch.float64)).item(), 3.0 * derivative)
    out, f_vjp = ft.vjp(f, x)
    close(f_vjp(torch.tensor(1.0, dtype=torch.float64))[0].item(), derivative)
    close(ft.jit(ft.grad(f))(x).item(), derivative)
    xe = x.clone().requires_grad_()
    f(xe).backward()  # eager: torch's selective checkpointing asks the same policy
    close(xe.grad.item(), derivative)


def test_a_policy_naming_neither_ctx_nor_op_stays_ambiguous():
    assert convention(lambda *args: True) == "jax"
    with pytest.raises(InvalidPolicyError, match=r"takes \(a, b, \*rest\)"):
        convention(lambda a, b, *rest: True)
    with pytest.raises(InvalidPolicyError, match=r"takes \(\*\*kwargs\)"):
        convention(lambda **kwargs: True)
