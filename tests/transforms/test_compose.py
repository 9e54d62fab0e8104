"""Composition: jvp, linearize, vmap, jacrev, jacfwd, hessian, stop_gradient, eval_shape, and
every nesting of them with grad/jit/remat, compared with torch.func's composition of the same
function. Several cases are ported, in our own words, from JAX's tests/api_test.py (nesting,
stop_gradient, eval_shape) and PyTorch's test/functorch/test_eager_transforms.py (per-example
gradients, Hessian-vector products); each names its origin."""

import pytest
import torch
from torch import func as tf

import functrans as ft
from functrans.testing._check import partition_and_check

STRATEGIES = ["default", "min_cut", "full_remat"]


def assert_close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)


def f(x):
    return (x.sin() * x).sum()


def loss(w, x):  # one example: x [3] -> scalar
    return torch.tanh(x @ w).pow(2).sum()


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(3, 2, generator=g),
        torch.randn(5, 3, generator=g),
        torch.randn(3, generator=g),
    )


# --- each transform alone, against torch.func ---------------------------------------------


def test_jvp_matches_torch_func(data):
    _, _, x = data
    t = torch.ones(3)
    assert_close(ft.jvp(torch.sin, (x,), (t,)), tf.jvp(torch.sin, (x,), (t,)))
    out, tangent, aux = ft.jvp(lambda x: (x.exp(), x.sum()), (x,), (t,), has_aux=True)
    assert_close((out, tangent, aux), (x.exp(), x.exp() * t, x.sum()))


def test_jvp_refuses_non_tuple_primals():
    with pytest.raises(ft.InvalidArgumentError, match="primals must be a tuple"):
        ft.jvp(torch.sin, torch.ones(2), (torch.ones(2),))


def test_linearize_evaluates_forward_once_and_matches_jvp(data):
    _, _, x = data
    out, jvp_fn = ft.linearize(lambda x: x.sin() * x, x)
    assert_close(out, x.sin() * x)
    for t in (torch.ones(3), torch.arange(3.0)):
        assert_close(jvp_fn(t), tf.jvp(lambda x: x.sin() * x, (x,), (t,))[1])


def test_vmap_in_dims_out_dims_and_pytrees():
    a, b = torch.randn(4, 3), torch.randn(3)
    assert_close(ft.vmap(torch.dot, in_dims=(0, None))(a, b), a @ b)
    out = ft.vmap(lambda d: {"s": d["x"] + d["y"]}, in_dims=({"x": 0, "y": 1},), out_dims=1)(
        {"x": torch.ones(4, 3), "y": torch.ones(3, 4)}
    )
    assert out["s"].shape == (3, 4)


def test_vmap_validates_its_options():
    with pytest.raises(ft.InvalidArgumentError, match="randomness='sometimes'"):
        ft.vmap(torch.sin, randomness="sometimes")
    with pytest.raises(ft.InvalidArgumentError, match="chunk_size=0"):
        ft.vmap(torch.sin, chunk_size=0)


def test_vmap_randomness_follows_torch_func():
    xs = torch.zeros(4, 1000)
    with pytest.raises(Exception, match="randomness"):
        ft.vmap(lambda x: torch.nn.functional.dropout(x + 1, 0.5))(xs)
    same = ft.vmap(lambda x: x + torch.rand(1000), randomness="same")(xs)
    different = ft.vmap(lambda x: x + torch.rand(1000), randomness="different")(xs)
    assert torch.equal(same[0], same[1]) and not torch.equal(different[0], different[1])


@pytest.mark.parametrize("name", ["jacrev", "jacfwd"])
def test_jacobians_match_torch_func(name, data):
    w, _, x = data
    g = lambda w, x: torch.tanh(x @ w)  # noqa: E731
    ours, theirs = getattr(ft, name), getattr(tf, name)
    assert_close(ours(g, argnums=(0, 1))(w, x), theirs(g, argnums=(0, 1))(w, x))


def test_hessian_matches_torch_func(data):
    _, _, x = data
    assert_close(ft.hessian(f)(x), tf.hessian(f)(x))


# JAX tests/api_test.py, stop_gradient: no gradient through the stopped value, at any level
def test_stop_gradient_on_pytrees_and_nested_grad():
    x = torch.tensor(3.0)
    assert_close(ft.grad(lambda x: x * ft.stop_gradient(x))(x), x)
    tree = ft.stop_gradient({"a": x.requires_grad_(), "n": 2})
    assert not tree["a"].requires_grad and tree["n"] == 2
    # the stopped value is constant at every level (as in JAX and torch.func): the inner
    # gradient is stop_gradient(x)**2, which has no gradient at the outer level either
    inner = lambda y: y * ft.stop_gradient(y) ** 2  # noqa: E731
    g2 = ft.grad(lambda x: ft.grad(inner)(x))(x.detach())
    assert_close(g2, tf.grad(lambda x: tf.grad(lambda y: y * y.detach() ** 2)(x))(x.detach()))
    assert_close(g2, torch.tensor(0.0))


# JAX tests/api_test.py, eval_shape: shapes and dtypes without compute, pytrees in and out
def test_eval_shape_computes_nothing():
    calls = []

    def fn(x, cfg):
        calls.append(type(x).__name__)
        return {"y": (x @ x.T).to(torch.float16), "n": cfg["n"]}

    spec = ft.eval_shape(fn, ft.ShapeDtypeStruct((1000, 30), torch.float32), {"n": 3})
    assert spec == {"y": ft.ShapeDtypeStruct((1000, 1000), torch.float16), "n": 3}
    assert calls == ["FakeTensor"]
    assert ft.eval_shape(torch.sin, torch.ones(2, 5)).shape == (2, 5)


def test_eval_shape_inside_a_trace_records_nothing():
    def g(x):
        shape = ft.eval_shape(lambda y: y.repeat(2, 1), x).shape
        return x.new_zeros(shape) + 1

    graph = ft.trace(g)(torch.ones(2, 3))
    assert_close(graph(torch.ones(2, 3)), torch.ones(4, 3))
    assert "repeat" not in str(graph)


# --- nesting -------------------------------------------------------------------------------


def _three_grads(grad):
    return grad(lambda x: grad(lambda y: grad(f)(y).sum())(x).sum())


NESTINGS = {
    "grad(grad(grad))": (lambda x: _three_grads(ft.grad)(x), lambda x: _three_grads(tf.grad)(x)),
    "jit(grad)": (lambda x: ft.jit(ft.grad(f))(x), lambda x: tf.grad(f)(x)),
    "grad(jit)": (lambda x: ft.grad(ft.jit(f))(x), lambda x: tf.grad(f)(x)),
    "jit(grad(jit))": (lambda x: ft.jit(ft.grad(ft.jit(f)))(x), lambda x: tf.grad(f)(x)),
    "jvp(grad) (hvp)": (
        lambda x: ft.jvp(ft.grad(f), (x,), (torch.ones(3),))[1],
        lambda x: tf.jvp(tf.grad(f), (x,), (torch.ones(3),))[1],
    ),
    "jit(jvp(grad))": (
        lambda x: ft.jit(lambda x: ft.jvp(ft.grad(f), (x,), (x.cos(),))[1])(x),
        lambda x: tf.jvp(tf.grad(f), (x,), (x.cos(),))[1],
    ),
    "vmap(jit)": (
        lambda x: ft.vmap(ft.jit(torch.sin))(x.expand(4, 3)),
        lambda x: x.sin().expand(4, 3),
    ),
    "grad(vmap)": (
        lambda x: ft.grad(lambda x: ft.vmap(f)(x.expand(4, 3)).sum())(x),
        lambda x: tf.grad(lambda x: tf.vmap(f)(x.expand(4, 3)).sum())(x),
    ),
    "grad(jvp)": (
        lambda x: ft.grad(lambda x: ft.jvp(f, (x,), (x.exp(),))[1])(x),
        lambda x: tf.grad(lambda x: tf.jvp(f, (x,), (x.exp(),))[1])(x),
    ),
    "jacrev(grad)": (lambda x: ft.jacrev(ft.grad(f))(x), lambda x: tf.jacrev(tf.grad(f))(x)),
    "jacfwd(jit(grad))": (
        lambda x: ft.jacfwd(ft.jit(ft.grad(f)))(x),
        lambda x: tf.jacfwd(tf.grad(f))(x),
    ),
    "hessian(remat)": (lambda x: ft.hessian(ft.remat(f))(x), lambda x: tf.hessian(f)(x)),
    "jvp(remat)": (
        lambda x: ft.jvp(ft.remat(f), (x,), (torch.ones(3),))[1],
        lambda x: tf.jvp(f, (x,), (torch.ones(3),))[1],
    ),
    "grad(grad(remat))": (
        lambda x: ft.grad(lambda x: ft.grad(ft.remat(f))(x).sum())(x),
        lambda x: tf.grad(lambda x: tf.grad(f)(x).sum())(x),
    ),
    "torch.func.vmap(ft.grad)": (
        lambda x: tf.vmap(ft.grad(f))(x.expand(4, 3)),
        lambda x: tf.vmap(tf.grad(f))(x.expand(4, 3)),
    ),
    "torch.func.grad(ft.jit)": (lambda x: tf.grad(ft.jit(f))(x), lambda x: tf.grad(f)(x)),
    "torch.func.grad(ft.grad)": (
        lambda x: tf.grad(lambda x: ft.grad(f)(x).sum())(x),
        lambda x: tf.grad(lambda x: tf.grad(f)(x).sum())(x),
    ),
    "torch.func.grad(ft.remat)": (lambda x: tf.grad(ft.remat(f))(x), lambda x: tf.grad(f)(x)),
}


@pytest.mark.parametrize("name", list(NESTINGS))
def test_nesting_matches_torch_func(name, data):
    ours, theirs = NESTINGS[name]
    x = data[2]
    assert_close(ours(x), theirs(x))


# Functions whose second derivative is known to be zero: forward mode makes it a ZeroTensor,
# whose views torch computes ahead of the fake tensors of a trace; they came out on the 'meta'
# device (shrunk from test_compose_properties.py's grad(jvp(jvp(abs)))).
ZERO_SECOND_DERIVATIVE = {
    "abs": torch.abs,
    "relu": torch.relu,
    "sign": torch.sign,
    "where": lambda x: torch.where(x > 0, x, -2 * x),
    "2x": lambda x: 2 * x,
}


def _compositions(jvp, grad, vjp, jit):
    def jvp_of(g):
        return lambda x: jvp(g, (x,), (torch.full_like(x, 0.5),))[1]

    def weights(t):  # made on the CPU, not on t's device: as the property test's
        return torch.full(t.shape, 3.0, dtype=t.dtype)

    def grad_of(g):
        return grad(lambda x: (g(x) * weights(g(x))).sum())

    def vjp_of(g):
        def run(x):
            out, vjp_fn = vjp(g, x)
            return vjp_fn(weights(out))[0]

        return run

    return {
        "jvp(jvp)": lambda g: jvp_of(jvp_of(g)),
        "jit(jvp(jvp))": lambda g: jit(jvp_of(jvp_of(g))),
        "grad(jvp)": lambda g: grad_of(jvp_of(g)),
        "grad(jvp(jvp))": lambda g: grad_of(jvp_of(jvp_of(g))),
        "vjp(jvp)": lambda g: vjp_of(jvp_of(g)),
        "vjp(jvp(jvp))": lambda g: vjp_of(jvp_of(jvp_of(g))),
    }


OURS = _compositions(ft.jvp, ft.grad, ft.vjp, ft.jit)
THEIRS = _compositions(tf.jvp, tf.grad, tf.vjp, lambda g: g)


@pytest.mark.parametrize("composition", list(OURS))
@pytest.mark.parametrize("name", list(ZERO_SECOND_DERIVATIVE))
def test_nested_jvps_of_a_zero_derivative_then_a_view_match_torch_func(name, composition):
    g = lambda x: ZERO_SECOND_DERIVATIVE[name](x).reshape(-1)  # noqa: E731
    x = torch.tensor(-1.3, dtype=torch.float64)
    ours, theirs = OURS[composition](g)(x), THEIRS[composition](g)(x)
    assert ours.device == theirs.device
    torch.testing.assert_close(ours, theirs)


# PyTorch test/functorch/test_eager_transforms.py, per-sample gradients: vmap(grad(loss))
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("wrap", ["eager", "jit", "remat", "jit+remat"])
def test_per_example_gradients(strategy, wrap, data):
    w, xs, _ = data
    body = ft.remat(loss) if "remat" in wrap else loss
    per_example = ft.vmap(ft.grad(body, partition=strategy), in_dims=(None, 0))
    if "jit" in wrap:
        per_example = ft.jit(per_example)
    expected = tf.vmap(tf.grad(loss), in_dims=(None, 0))(w, xs)
    assert_close(per_example(w, xs), expected)


def test_per_example_value_and_grad_with_aux_and_argnums(data):
    w, xs, _ = data

    def with_aux(w, x):
        y = torch.tanh(x @ w)
        return y.pow(2).sum(), y.mean()

    ours = ft.vmap(ft.value_and_grad(with_aux, argnums=(0, 1), has_aux=True), in_dims=(None, 0))
    theirs = tf.vmap(tf.grad_and_value(with_aux, argnums=(0, 1), has_aux=True), in_dims=(None, 0))
    ((value, aux), grads) = ours(w, xs)
    t_grads, (t_value, t_aux) = theirs(w, xs)
    assert_close((value, aux, grads), (t_value, t_aux, t_grads))


def test_per_example_plan_is_one_joint_graph_cut_by_the_strategy(data, monkeypatch):
    """Eager vmap(grad) runs grad's partition on the batched loss: min_cut saves no more."""
    from functrans._transforms import grad as _api

    seen = []
    real = _api._partition
    monkeypatch.setattr(
        _api, "_partition", lambda jg, s, o: seen.append(real(jg, s, o)) or seen[-1]
    )
    w, xs, _ = data
    for strategy in ("default", "min_cut"):
        ft.vmap(ft.grad(loss, partition=strategy), in_dims=(None, 0))(w, xs)
    default, min_cut = seen
    assert default.strategy == "default" and min_cut.strategy == "min_cut"
    assert min_cut.activation_bytes <= default.activation_bytes


def test_per_example_non_scalar_loss_is_named(data):
    w, xs, _ = data
    with pytest.raises(ft.FunctransError, match="scalar float tensor per example"):
        ft.vmap(ft.grad(lambda w, x: x @ w), in_dims=(None, 0))(w, xs)


# --- graphs of composed transforms ----------------------------------------------------------


def test_trace_joint_and_jit_of_composed_transforms_are_aten_graphs(data):
    w, xs, x = data
    per_example = ft.vmap(ft.grad(loss), in_dims=(None, 0))
    graph = ft.trace(per_example)(w, xs)
    assert all(
        str(n.target).startswith("aten.")
        for n in graph.graph_module.graph.nodes
        if n.op == "call_function"
    )
    assert_close(graph(w, xs), tf.vmap(tf.grad(loss), in_dims=(None, 0))(w, xs))
    hvp = lambda x, v: ft.jvp(ft.grad(f), (x,), (v,))[1]  # noqa: E731
    h = lambda x, v: hvp(x, v).pow(2).sum()  # noqa: E731
    jg = ft.joint(h)(x, torch.ones(3))
    for strategy in STRATEGIES:
        partition_and_check(h, (x, torch.ones(3)), jg, strategy, {})


def test_joint_of_grad_is_double_backward_and_min_cut_saves_no_more(data):
    """``ft.joint(ft.grad(f))`` is the joint graph of a gradient function; min_cut's cut of it is
    valid and saves no more bytes than default."""
    w, _, x = data
    g = lambda w, x: ft.grad(loss)(w, x).pow(2).sum()  # noqa: E731
    jg = ft.joint(g)(w, x)
    parts = {s: partition_and_check(g, (w, x), jg, s, {}) for s in STRATEGIES}
    assert parts["min_cut"].activation_bytes <= parts["default"].activation_bytes
    expected = tf.grad(lambda w, x: tf.grad(loss)(w, x).pow(2).sum(), argnums=(0, 1))(w, x)
    assert_close(ft.grad(g, argnums=(0, 1), partition="min_cut")(w, x), expected)


def test_jit_of_vmap_grad_compiles_with_triton_backend(data):
    pytest.importorskip("triton")
    w, xs, _ = data
    per_example = ft.jit(ft.vmap(ft.grad(loss), in_dims=(None, 0)), backend="triton")
    assert_close(per_example(w, xs), tf.vmap(tf.grad(loss), in_dims=(None, 0))(w, xs))


# --- errors name the transform stack ---------------------------------------------------------


def test_error_inside_nested_transforms_names_the_stack_and_line():
    def bad_loss(x):
        return (x @ torch.ones(5)).sum()  # x has 3 features

    with pytest.raises(ft.TransformError) as info:
        ft.jit(ft.vmap(ft.grad(bad_loss)))(torch.ones(4, 3))
    message = str(info.value)
    assert message.startswith("inside jit(vmap(grad(bad_loss))): RuntimeError (`aten.mv.default`")
    assert "test_compose.py" in message and "x @ torch.ones(5)" in message
    assert isinstance(info.value, RuntimeError)  # still what torch raised, for except clauses
    assert isinstance(info.value.__cause__, RuntimeError)


def test_functrans_error_inside_nested_transforms_keeps_its_type():
    with pytest.raises(ft.InvalidArgumentError, match=r"^inside vmap\(grad\(<lambda>\)\): grad"):
        ft.vmap(ft.grad(lambda n: n * 2.0))(torch.arange(3))


def test_user_exception_keeps_its_type_and_gains_the_stack():
    def picky(x):
        raise ValueError("bad config")

    with pytest.raises(ValueError, match="bad config") as info:
        ft.grad(ft.jit(picky))(torch.ones(2))
    assert isinstance(info.value, ft.FunctransError)
    assert str(info.value).startswith("inside grad(jit(picky))")


def test_single_transform_errors_are_unchanged():
    def picky(x):
        raise ValueError("bad config")

    with pytest.raises(ValueError) as info:
        ft.grad(picky)(torch.ones(2))
    assert not isinstance(info.value, ft.FunctransError)


# --- as a researcher would use it ------------------------------------------------------------


def test_dp_sgd_training_loop_equals_torch_func():
    """Per-example clipped gradients (DP-SGD without noise) for a small MLP, 5 steps with SGD:
    ``ft.jit(ft.vmap(ft.grad(loss)))`` against ``torch.func.vmap(torch.func.grad(loss))``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    data = [(torch.randn(12, 8), torch.randint(0, 4, (12,))) for _ in range(5)]

    def per_example_loss(p, x, y):
        logits = tf.functional_call(model, p, (x[None],))
        return torch.nn.functional.cross_entropy(logits, y[None])

    def clipped_mean(grads, clip=1.0):
        norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()]).norm(dim=0)
        scale = (clip / (norms + 1e-6)).clamp(max=1.0)
        return {k: (g * scale.view(-1, *[1] * (g.dim() - 1))).mean(0) for k, g in grads.items()}

    def train(per_example_grads):
        p = {k: v.clone() for k, v in params.items()}
        for x, y in data:
            g = clipped_mean(per_example_grads(p, x, y))
            p = {k: p[k] - 0.5 * g[k] for k in p}
        return p

    ours = train(
        ft.jit(ft.vmap(ft.grad(per_example_loss, partition="min_cut"), in_dims=(None, 0, 0)))
    )
    theirs = train(tf.vmap(tf.grad(per_example_loss), in_dims=(None, 0, 0)))
    assert_close(ours, theirs)


def test_newton_step_with_hvp_conjugate_gradient():
    """Hessian-free optimisation: conjugate gradient on Hessian-vector products
    (``jvp(grad(f))``) solves H d = -g; equal to torch.func's and to a dense solve."""
    torch.manual_seed(0)
    a = torch.randn(6, 6, dtype=torch.float64)
    h_true = a @ a.T + 6 * torch.eye(6, dtype=torch.float64)
    obj = lambda x: 0.5 * x @ h_true @ x + (x**4).sum() * 0.01  # noqa: E731
    x = torch.randn(6, dtype=torch.float64)

    def cg(hvp, b, iters=30):
        d, r = torch.zeros_like(b), b.clone()
        p = r.clone()
        for _ in range(iters):
            hp = hvp(p)
            alpha = (r @ r) / (p @ hp)
            d, r_new = d + alpha * p, r - alpha * hp
            if r_new.norm() < 1e-12:
                break
            p, r = r_new + (r_new @ r_new) / (r @ r) * p, r_new
        return d

    g = ft.grad(obj)(x)
    ours = cg(ft.jit(lambda v: ft.jvp(ft.grad(obj), (x,), (v,))[1]), -g)
    theirs = cg(lambda v: tf.jvp(tf.grad(obj), (x,), (v,))[1], -g)
    dense = torch.linalg.solve(tf.hessian(obj)(x), -g)
    assert_close(ours, theirs)
    assert_close(ours, dense)


def test_eager_remat_around_grad_keeps_its_hooks_out_of_the_trace():
    """Shrunk from test_compose_properties ([remat, grad] over atan): the joint trace inside an
    eager remat ran its own autograd through remat's saved-tensor hooks and got 1.0 for
    d/dx atan(x)/3 at x=1.88."""
    x = torch.tensor([1.8802], dtype=torch.float64)
    scalar = lambda x: (torch.atan(x) * (torch.atan(x) * 0 + 1).detach() / 3).sum()  # noqa: E731
    assert_close(ft.remat(ft.grad(scalar))(x), tf.grad(scalar)(x))


def test_vmap_plans_only_a_grad_itself_not_a_wrapper_of_one():
    """Shrunk from test_compose_properties ([vmap, jacrev, grad] over neg): jacrev's wrapper
    copied grad's attributes, so vmap planned per-example gradients of the wrong function."""
    s = lambda x: (-x / 3).sum()  # noqa: E731
    xs = torch.full((2,), 0.7, dtype=torch.float64)
    assert_close(ft.vmap(ft.jacrev(ft.grad(s)))(xs), tf.vmap(tf.jacrev(tf.grad(s)))(xs))


def test_grad_of_torch_func_inside_eager_remat():
    """Shrunk from test_compose_properties ([grad, jacrev] over neg): the trace set the
    caller's saved-tensor hooks aside by pushing its own, which torch.func.grad refuses."""
    x = torch.tensor(0.7, dtype=torch.float64)
    fn = lambda x: ft.jacrev(lambda y: -y)(x) * x  # noqa: E731
    assert_close(ft.grad(fn)(x), tf.grad(lambda x: tf.jacrev(lambda y: -y)(x) * x)(x))
    assert_close(ft.remat(ft.grad(fn))(x), tf.grad(lambda x: tf.jacrev(lambda y: -y)(x) * x)(x))


def test_eager_remat_around_torch_func_jacrev():
    """Shrunk from test_compose_properties ([remat, jacrev] over neg): torch.func's jacrev
    refuses the saved-tensor hooks of eager remat; the region runs as written."""
    x = torch.tensor(0.7, dtype=torch.float64)
    assert_close(ft.remat(ft.jacrev(lambda y: -y * y))(x), tf.jacrev(lambda y: -y * y)(x))


def test_vmap_of_jit_compiles_the_batched_function(monkeypatch):
    """``ft.vmap(ft.jit(f))`` is one compiled graph of the batched function (as
    ``jax.vmap(jax.jit(f))``), compiled once and reused; values equal torch.func's."""
    from functrans._jit.entry_compiler import EntryCompiler

    compiles = []
    real = EntryCompiler.compile
    monkeypatch.setattr(
        EntryCompiler, "compile", lambda self, *a: compiles.append(self) or real(self, *a)
    )
    batched = ft.vmap(ft.jit(lambda x, w: torch.tanh(x @ w)), in_dims=(0, None))
    x, w = torch.randn(4, 5, 3), torch.randn(3, 2)
    for _ in range(3):
        assert_close(batched(x, w), tf.vmap(lambda x, w: torch.tanh(x @ w), (0, None))(x, w))
    assert len(compiles) == 1


def test_vmap_of_jit_with_captured_tensors_lifts_them():
    """The batched jit of ``vmap(jit(f))`` lifts what ``f`` captures (its internal retry is not
    an error of the user's), and a replaced capture is seen."""
    holder = {"w": torch.randn(3, 2)}
    batched = ft.vmap(ft.jit(lambda x: torch.tanh(x @ holder["w"])))
    x = torch.randn(4, 5, 3)
    assert_close(batched(x), torch.tanh(x @ holder["w"]))
    holder["w"] = torch.randn(3, 2)
    assert_close(batched(x), torch.tanh(x @ holder["w"]))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_jit_of_grad_is_cut_by_grads_own_strategy(strategy):
    """``ft.jit(ft.grad(f, partition=s))`` compiles f's joint graph cut by ``s`` (its forward,
    then its backward: what ``s`` did not save is recomputed in the one compiled graph), not an
    inlined gradient; captured tensors are still lifted and re-read."""

    def loss(w, x):
        h = torch.tanh(x @ w)
        return (h.sin() * h).pow(2).sum()

    w, x = torch.randn(8, 8), torch.randn(4, 8)
    jitted = ft.jit(ft.grad(loss, partition=strategy))
    assert_close(jitted(w, x), tf.grad(loss)(w, x))
    (p,) = jitted.partitions()
    assert p.strategy == strategy
    assert (p.recomputed == ()) == (strategy == "default")  # min_cut recomputes tanh, sin
    holder = {"w": w}
    vg = ft.jit(ft.value_and_grad(lambda x: loss(holder["w"], x), partition=strategy))
    for scale in (1.0, 2.0):
        holder["w"] = w * scale
        value, g = vg(x)
        assert_close((value, g), (loss(w * scale, x), tf.grad(loss, argnums=1)(w * scale, x)))
    assert vg.cache_info().misses == 1


# --- found in review ---------------------------------------------------------------------------


def test_grads_under_inference_mode_are_not_zeros(data):
    w, xs, _ = data
    with torch.inference_mode():
        ours = ft.vmap(ft.grad(loss), in_dims=(None, 0))(w, xs)
        single = ft.grad(loss)(w, xs[0])
        jitted = ft.jit(ft.grad(loss))(w, xs[0])
    assert_close(ours, tf.vmap(tf.grad(loss), in_dims=(None, 0))(w, xs))
    assert_close((single, jitted), (tf.grad(loss)(w, xs[0]),) * 2)


def test_per_example_grads_stay_differentiable_in_shared_params(data):
    """A gradient penalty on per-example gradients needs them connected to the parameters."""
    w, xs, _ = data
    w = w.clone().requires_grad_()
    per_example = ft.vmap(ft.grad(loss), in_dims=(None, 0))(w, xs)
    assert per_example.requires_grad
    (penalty,) = torch.autograd.grad(per_example.pow(2).sum(), w)
    expected = tf.grad(lambda w: tf.vmap(tf.grad(loss), in_dims=(None, 0))(w, xs).pow(2).sum())(w)
    assert_close(penalty, expected)


def test_per_example_plan_edge_cases(data):
    w, xs, _ = data
    params = {"w": w, "scale": 2.0}  # a non-tensor leaf in the shared argument
    got = ft.vmap(ft.grad(lambda p, x: loss(p["w"], x) * p["scale"]), in_dims=(None, 0))(params, xs)
    assert got["scale"] is None
    assert_close(got["w"], 2 * tf.vmap(tf.grad(loss), in_dims=(None, 0))(w, xs))
    shaped = ft.vmap(ft.grad(lambda w, x: loss(w, x).reshape(1)), in_dims=(None, 0))(w, xs)
    assert_close(shaped, tf.vmap(tf.grad(loss), in_dims=(None, 0))(w, xs))  # one element each
    with pytest.raises(ValueError, match="in_dim=0"):  # a 0-d input cannot be batched
        ft.vmap(ft.grad(torch.sin))(torch.tensor(1.0))


def test_eval_shape_under_transforms_and_without_side_effects():
    c = torch.randn(3, 5)
    f = lambda x: x * ft.eval_shape(lambda y: y @ c, x).shape[-1]  # noqa: E731
    assert_close(ft.vmap(f)(torch.ones(2, 3)), torch.full((2, 3), 5.0))
    assert_close(ft.jvp(f, (torch.ones(2, 3),), (torch.ones(2, 3),))[1], torch.full((2, 3), 5.0))
    bn = torch.nn.BatchNorm1d(3)
    assert ft.eval_shape(bn, ft.ShapeDtypeStruct((4, 3), torch.float32)).shape == (4, 3)
    assert bn.num_batches_tracked.item() == 0 and bn.running_mean.abs().sum() == 0


def test_user_exceptions_inside_nested_transforms_keep_what_handlers_need():
    class CodedError(Exception):
        def __init__(self, code, msg):
            super().__init__(code, msg)
            self.code = code

    def coded(x):
        raise CodedError(7, "bad input")

    with pytest.raises(CodedError) as info:
        ft.jit(ft.vmap(coded))(torch.ones(2, 3))
    assert info.value.code == 7 and info.value.args == (7, "bad input")
    assert "inside jit(vmap(coded))" in info.value.__notes__[0]
    with pytest.raises(StopIteration):  # not turned into "generator raised StopIteration"
        ft.jit(ft.vmap(lambda x: next(iter([]))))(torch.ones(2, 3))
    with pytest.raises(KeyError) as key:
        ft.jit(ft.vmap(lambda x: {}["k"]))(torch.ones(2, 3))
    assert key.value.args == ("k",)  # the key, as handlers read it


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_jit_of_vmap_grad_is_the_per_example_joint_cut_by_the_strategy(strategy, data):
    """``ft.jit(ft.vmap(ft.grad(loss, partition=s)))`` compiles the per-example joint graph
    eager vmap(grad) plans, cut by ``s``; captured tensors are lifted and re-read."""
    w, xs, _ = data
    holder = {"w": w}
    jitted = ft.jit(ft.vmap(ft.grad(lambda x: loss(holder["w"], x), partition=strategy)))
    for scale in (1.0, 3.0):
        holder["w"] = w * scale
        expected = tf.vmap(tf.grad(loss, argnums=1), in_dims=(None, 0))(w * scale, xs)
        assert_close(jitted(xs), expected)
    (p,) = jitted.partitions()
    assert p.strategy == strategy and jitted.cache_info().misses == 1
    assert (p.recomputed == ()) == (strategy == "default")


def test_jit_of_grad_follows_module_mode_and_rng_like_eager():
    """The planned jit(grad) path across model.train()/eval() with dropout: gradients equal
    torch.func's under one seed in both modes, and switching back reuses the first entry."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.3), torch.nn.Tanh())
    x = torch.randn(4, 8)

    def loss(x):
        return model(x).pow(2).sum()

    jitted = ft.jit(ft.grad(loss, partition="min_cut"))
    for mode in ("train", "eval", "train"):
        getattr(model, mode)()
        torch.manual_seed(7)
        ours = jitted(x)
        torch.manual_seed(7)
        assert_close(ours, tf.grad(loss)(x))
    assert jitted.cache_info().misses == 2


def test_vmap_of_jit_follows_module_mode():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    batched = ft.vmap(ft.jit(lambda x: model(x)), randomness="different")
    xs = torch.ones(3, 2, 4)
    model.eval()
    assert_close(batched(xs), model(xs))
    model.train()
    assert (batched(xs) == 0).any()  # dropout is on again
    model.eval()
    assert_close(batched(xs), model(xs))
