"""jit is never silently wrong: every piece of state a trace reads is guarded, lifted or refused.

Each test crosses a boundary a training script crosses (train/eval, autocast, torch.func, a
replaced closure tensor, global flags, threads) and compares with eager PyTorch.
"""

import logging
import sys
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import functrans as ft


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---------------------------------------------------------------- module training flags


def _dropout_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5), nn.Linear(6, 3))


@pytest.mark.parametrize("first", ["train", "eval"])
def test_train_eval_switch_follows_eager(first):
    net, ref = _dropout_net(), _dropout_net()
    model = ft.jit(net)
    x = torch.randn(8, 6)
    modes = ["train", "eval", "train"] if first == "train" else ["eval", "train", "eval"]
    for mode in modes:
        for m in (net, ref):
            m.train(mode == "train")
        torch.manual_seed(1)
        out = model(x)
        torch.manual_seed(1)
        _close(out, ref(x))
    assert model.cache_info().misses == 2  # one entry per mode, reused when switching back


def test_training_applies_dropout_after_an_eval_first_compile():
    net = _dropout_net().eval()
    model = ft.jit(net)
    x = torch.randn(64, 6)
    with torch.no_grad():
        model(x)
    net.train()
    a, b = model(x), model(x)
    assert not torch.equal(a, b)  # dropout draws anew: it is applied


def test_jitted_eval_and_model_eval_are_one_switch():
    net = _dropout_net()
    model = ft.jit(net)
    model.eval()
    assert not net.training and not net[1].training and not model.training
    net.train()
    assert model.training


def test_batchnorm_eval_after_train_uses_running_stats_and_stops_updating():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    ref = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    ref.load_state_dict(net.state_dict())
    model = ft.jit(net)
    x = torch.randn(6, 3)
    model(x).sum().backward()
    ref(x).sum().backward()
    net.eval(), ref.eval()
    stats = net[1].running_mean.clone()
    y = torch.randn(6, 3)
    torch.testing.assert_close(model(y), ref(y))  # eval batch norm is decomposed: 1 ulp
    _close(net[1].running_mean, stats)


def test_a_submodule_in_eval_mode_inside_a_training_model():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Dropout(0.5), nn.Linear(4, 4), nn.Dropout(0.5))
    model = ft.jit(net)
    x = torch.randn(32, 4)
    model(x)
    net[0].eval()  # a frozen encoder in eval, the rest training
    torch.manual_seed(3)
    out = model(x)
    torch.manual_seed(3)
    _close(out, net(x))
    assert model.cache_info().misses == 2


def test_a_replaced_submodule_recompiles():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.GELU())
    model = ft.jit(net)
    x = torch.randn(2, 4)
    model(x)
    net[1] = nn.ReLU()  # no parameters: the arguments look the same
    _close(model(x), net(x))


def test_a_function_closing_over_a_module_guards_its_training_flag():
    torch.manual_seed(0)
    drop = nn.Dropout(0.5)
    f = ft.jit(lambda x: drop(x) * 2)
    x = torch.randn(16)
    f(x)
    drop.eval()
    _close(f(x), x * 2)


# ---------------------------------------------------------------- autocast


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))


@pytest.mark.parametrize("order", [(False, True, False), (True, False, True)])
def test_autocast_on_and_off_give_eager_values_forward_and_backward(order):
    net, ref = _mlp(), _mlp()
    model = ft.jit(net)
    x = torch.randn(5, 8)
    for enabled in order:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            out, expected = model(x), ref(x)
        assert out.dtype == expected.dtype
        _close(out, expected)
        out.float().square().mean().backward()
        expected.float().square().mean().backward()
        for a, b in zip(net.parameters(), ref.parameters(), strict=True):
            _close(a.grad, b.grad)
        net.zero_grad(), ref.zero_grad()
    assert model.cache_info().misses == 2


def test_autocast_dtype_is_part_of_the_key():
    f = ft.jit(lambda x, w: x @ w)
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    for dtype in (torch.bfloat16, torch.float16, torch.bfloat16):
        with torch.autocast("cpu", dtype=dtype):
            assert f(x, w).dtype == dtype
    assert f.cache_info().misses == 2


def test_backward_under_autocast_runs_the_compiled_backward_as_traced():
    net, ref = _mlp(), _mlp()
    model = ft.jit(net)
    x = torch.randn(5, 8)
    out = model(x)  # float32 graph
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out.sum().backward()  # used to fail: "expected scalar type Float but found BFloat16"
    ref(x).sum().backward()
    for a, b in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


# ---------------------------------------------------------------- torch.func over jit


def _f(x):
    return torch.sin(x) * x.sum()


@pytest.mark.parametrize(
    "transform",
    [
        lambda f, x: torch.func.vmap(f)(x),
        lambda f, x: torch.func.jvp(f, (x,), (torch.ones_like(x),)),
        lambda f, x: torch.func.grad(lambda x: f(x).sum())(x),
        lambda f, x: torch.func.vjp(f, x)[1](torch.ones_like(x)),
        lambda f, x: torch.func.jacrev(f)(x),
        lambda f, x: torch.func.jacfwd(f)(x),
    ],
    ids=["vmap", "jvp", "grad", "vjp", "jacrev", "jacfwd"],
)
def test_torch_func_over_jit_gives_eager_values(transform):
    x = torch.randn(3, 4, dtype=torch.float64)
    jitted = ft.jit(_f)
    jitted(x)  # a cached entry exists: it must not be used under the transform
    got, expected = transform(jitted, x), transform(_f, x)
    for g, e in zip(
        torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected), strict=True
    ):
        assert type(g) is torch.Tensor
        _close(g, e)


def _loss(x):
    return (torch.sin(x) * x).sum()


@pytest.mark.parametrize(
    "transform",
    [
        lambda g: torch.func.grad(lambda x: g(x).sum()),
        lambda g: torch.func.vmap(g),
        lambda g: torch.func.jacrev(g),
        lambda g: lambda x: torch.func.vjp(g, x)[1](torch.ones_like(x)),
    ],
    ids=["grad", "vmap", "jacrev", "vjp"],
)
@pytest.mark.parametrize("ours", ["grad", "value_and_grad", "vjp"])
def test_torch_func_over_functrans_derivatives(transform, ours):
    inner = {
        "grad": ft.grad(_loss),
        "value_and_grad": lambda x: ft.value_and_grad(_loss)(x)[1],
        "vjp": lambda x: ft.vjp(_loss, x)[1](torch.tensor(1.0, dtype=x.dtype))[0],
    }[ours]
    x = torch.randn(2, 3, dtype=torch.float64)
    got = transform(inner)(x)
    expected = transform(torch.func.grad(_loss))(x)
    for g, e in zip(
        torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected), strict=True
    ):
        assert type(g) is torch.Tensor
        torch.testing.assert_close(g, e)


def test_vmap_over_a_jitted_module():
    net = _mlp()
    model = ft.jit(net)
    x = torch.randn(3, 5, 8)
    _close(torch.func.vmap(model)(x), torch.func.vmap(net)(x))


# ---------------------------------------------------------------- captured tensors


def test_a_replaced_closure_tensor_is_seen():
    w = torch.randn(4)
    f = ft.jit(lambda x: (x * w).sum())
    x = torch.randn(4)
    _close(f(x), (x * w).sum())
    w = torch.randn(4)  # rebinding the closure cell is the point
    _close(f(x), (x * w).sum())
    assert f.cache_info().misses == 1  # a new value, same metadata: no recompile


def test_a_closure_parameter_gets_eager_gradients_and_follows_optimizer_steps():
    torch.manual_seed(0)
    lin, ref = nn.Linear(4, 3), nn.Linear(4, 3)
    ref.load_state_dict(lin.state_dict())
    step = ft.jit(lambda x: lin(x).tanh().sum())
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (lin, ref))
    for _ in range(3):
        x = torch.randn(5, 4, requires_grad=True)
        step(x).backward()
        ref(x.detach()).tanh().sum().backward()
        for a, b in zip(lin.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    for a, b in zip(lin.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_a_replaced_parameter_of_a_closure_module_is_seen():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    f = ft.jit(lambda x: lin(x))
    x = torch.randn(2, 4)
    f(x)
    lin.weight = nn.Parameter(torch.zeros(4, 4))
    _close(f(x), lin(x))


def test_global_and_attribute_tensors_are_lifted():
    class Holder:
        def __init__(self):
            self.scale = torch.full((3,), 2.0)

    holder = Holder()
    f = ft.jit(lambda x: x * holder.scale + GLOBAL_SHIFT)
    x = torch.ones(3)
    f(x)
    holder.scale = torch.full((3,), 5.0)
    globals()["GLOBAL_SHIFT"] = torch.full((3,), 7.0)
    _close(f(x), x * 5 + 7)
    globals()["GLOBAL_SHIFT"] = torch.zeros(3)


GLOBAL_SHIFT = torch.zeros(3)


SHIFT = torch.zeros(2)


class Shifted(nn.Module):
    def forward(self, x):
        return x + SHIFT  # a module-level tensor read by a user module's forward


def test_a_global_read_by_a_modules_forward_is_lifted():
    # the path goes through the module's class (found by an HF model's act_fn)
    net = Shifted()
    f = ft.jit(lambda x: net(x))
    f(torch.ones(2))
    globals()["SHIFT"] = torch.full((2,), 3.0)
    try:
        _close(f(torch.ones(2)), torch.full((2,), 4.0))
    finally:
        globals()["SHIFT"] = torch.zeros(2)


def test_a_closure_tensor_updated_in_place_outside_is_seen():
    w = torch.ones(3)
    f = ft.jit(lambda x: x + w)
    f(torch.zeros(3))
    w.mul_(4)
    _close(f(torch.zeros(3)), torch.full((3,), 4.0))


def test_mutating_a_captured_tensor_inside_writes_it_back_as_eager():
    # refused until issue 49: jit now writes a captured tensor the function updates in place
    # back after each call, as AOTAutograd does, and keeps the call compiled
    buf = torch.zeros(3)

    def f(x):
        buf.add_(x)
        return x * 2

    jitted = ft.jit(f)
    for _ in range(3):
        torch.testing.assert_close(jitted(torch.ones(3)), torch.full((3,), 2.0))
    torch.testing.assert_close(buf, torch.full((3,), 3.0))
    assert jitted.cache_info().hits >= 1


def test_a_tensor_in_a_tuple_that_requires_grad_is_refused():
    params = (torch.randn(3, requires_grad=True),)
    with pytest.raises(ft.TraceError, match=r"params\[0\].*requires grad"):
        ft.jit(lambda x: x * params[0])(torch.ones(3))


def test_a_closure_over_tied_weights_trains_like_eager_and_survives_untying():
    # found by tests/integration/test_real_use.py: the tie made the second path a constant
    torch.manual_seed(0)
    emb, head = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
    head.weight = emb.weight
    f = ft.jit(lambda i: head(emb(i)).logsumexp(-1).sum())
    i = torch.tensor([1, 2, 5])
    f(i).backward()
    got = emb.weight.grad.clone()
    emb.weight.grad = None
    head(emb(i)).logsumexp(-1).sum().backward()
    torch.testing.assert_close(got, emb.weight.grad)
    head.weight = nn.Parameter(torch.zeros(8, 4))  # untied: two tensors now
    _close(f(i), head(emb(i)).logsumexp(-1).sum())


def test_fresh_constants_are_not_captures():
    f = ft.jit(lambda x: x * torch.tensor([1.0, 2.0]))
    _close(f(torch.ones(2)), torch.tensor([1.0, 2.0]))


# ---------------------------------------------------------------- global state


def test_default_dtype_is_guarded():
    f = ft.jit(lambda x: x + torch.ones(2))
    x = torch.zeros(2, dtype=torch.float16)
    assert f(x).dtype == torch.float32
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert f(x).dtype == torch.float64
    finally:
        torch.set_default_dtype(old)
    assert f(x).dtype == torch.float32 and f.cache_info().misses == 2


def test_inference_mode_and_deterministic_flag_are_guarded():
    f = ft.jit(lambda x: x.sin())
    x = torch.randn(3)
    f(x)
    with torch.inference_mode():
        out = f(x)
    assert out.is_inference()
    torch.use_deterministic_algorithms(True)
    try:
        f(x)
    finally:
        torch.use_deterministic_algorithms(False)
    assert f.cache_info().misses == 3


# ---------------------------------------------------------------- RNG check


def test_threads_drawing_random_numbers_do_not_trip_the_rng_check():
    errors = []
    barrier = threading.Barrier(4)

    def work(i):
        try:
            f = ft.jit(lambda x: F.dropout(x * i, 0.5))
            barrier.wait()
            for _ in range(2):
                torch.randn(100)
                f(torch.randn(16))
        except Exception as e:  # pragma: no cover - the failure we test for
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors


def test_reseeding_inside_a_traced_function_is_refused_in_every_thread():
    def f(x):
        torch.manual_seed(0)
        return F.dropout(x, 0.5)

    errors = []

    def work():
        try:
            ft.jit(f)(torch.ones(4))
        except ft.TraceError as e:
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join(timeout=120)
    assert errors and "torch.manual_seed" in str(errors[0])
    torch.manual_seed(0)  # outside a trace the wrapper is the original


def test_reseeding_inside_fork_rng_is_allowed_only_without_random_ops():
    # torch's OpInfo samples wrap ops this way (wrapper_set_seed): the seed matters only to
    # random ops, whose graph would ignore it
    def deterministic(x):
        with torch.random.fork_rng():
            torch.manual_seed(42)
            return x * 2

    def random(x):
        with torch.random.fork_rng():
            torch.manual_seed(42)
            return F.dropout(x, 0.5)

    state = torch.random.get_rng_state()
    _close(ft.jit(deterministic)(torch.ones(2)), torch.full((2,), 2.0))
    with pytest.raises(ft.TraceError, match=r"reseeds .*torch\.manual_seed.* draws random"):
        ft.jit(random)(torch.ones(4))
    assert torch.equal(state, torch.random.get_rng_state())


def test_fork_rng_without_reseeding_is_allowed():
    def f(x):
        with torch.random.fork_rng():
            return x * 2

    _close(ft.jit(f)(torch.ones(2)), torch.full((2,), 2.0))


# Found by a user-style review: Python values a trace read from a module or from the function's
# globals were baked in without a guard, so changing them gave stale results.

SCALE = 1.0


def _scaled(x):
    return x * SCALE


def test_changing_a_module_attribute_compiles_anew():
    class Tempered(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.temperature = 1.0
            self.drop = torch.nn.Dropout(0.0)

        def forward(self, x):
            return self.drop(self.lin(x) / self.temperature)

    m = Tempered()
    jm = ft.jit(m)
    x = torch.ones(3, 2)
    torch.testing.assert_close(jm(x), m(x))
    m.temperature = 2.0
    torch.testing.assert_close(jm(x), m(x))
    m.temperature, m.drop.p = 1.0, 0.9
    torch.manual_seed(0)
    got = jm(x)
    torch.manual_seed(0)
    torch.testing.assert_close(got, m(x))
    assert jm.cache_info().misses == 3


def test_changing_a_global_the_function_reads_compiles_anew(monkeypatch):
    jf = ft.jit(_scaled)
    x = torch.ones(2)
    torch.testing.assert_close(jf(x), x)
    monkeypatch.setattr(sys.modules[__name__], "SCALE", 3.0)
    torch.testing.assert_close(jf(x), 3 * x)
    assert jf.cache_info().misses == 2


_LOG = logging.getLogger("functrans.tests.guards")


def _logs_then_computes(x: torch.Tensor) -> torch.Tensor:
    if _LOG.isEnabledFor(logging.DEBUG):
        _LOG.debug("called with %s", tuple(x.shape))
    _LOG.info("computing")
    return torch.sin(x) * 2


def test_the_logging_tree_is_not_state_a_compiled_entry_depends_on():
    """A module-level logger the traced code logs through is read, but the logging tree is
    not state the values depend on: loggers made, levels and handlers changed between calls
    (every library does, torchtune's attention logs each call) recompile nothing."""
    f = ft.jit(_logs_then_computes)
    x = torch.randn(3)
    torch.testing.assert_close(f(x), _logs_then_computes(x))
    for i in range(3):
        logging.getLogger(f"functrans.tests.guards.new{i}")  # the manager's table grows
        _LOG.setLevel(logging.DEBUG if i % 2 else logging.WARNING)
        _LOG.addHandler(logging.NullHandler())
        torch.testing.assert_close(f(x), _logs_then_computes(x))
    info = f.cache_info()
    assert (info.misses, info.hits) == (1, 3)
