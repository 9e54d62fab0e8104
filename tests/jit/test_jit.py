"""jit: autograd integration, caching, inference path, threads, strategies and backends."""

import threading

import pytest
import torch

import functrans as ft
from functrans import policies


def mlp(params, x):
    h = torch.nn.functional.gelu(x @ params["w1"] + params["b1"])
    return {"loss": (h @ params["w2"]).pow(2).mean(), "argmax": h.argmax(-1)}


def make(requires_grad=True):
    g = torch.Generator().manual_seed(0)
    params = {
        "w1": torch.randn(3, 5, generator=g, dtype=torch.float64),
        "b1": torch.randn(5, generator=g, dtype=torch.float64),
        "w2": torch.randn(5, 4, generator=g, dtype=torch.float64),
    }
    params = {k: v.requires_grad_(requires_grad) for k, v in params.items()}
    return params, torch.randn(2, 3, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("strategy", ["default", "min_cut", "full_remat"])
def test_backward_matches_eager_and_grads_flow_only_where_required(strategy):
    f = ft.jit(mlp, partition=strategy)
    params, x = make()
    out = f(params, x)
    out["loss"].backward()
    ref_params, _ = make()
    ref = mlp(ref_params, x)
    ref["loss"].backward()
    torch.testing.assert_close(out["loss"], ref["loss"])
    assert torch.equal(out["argmax"], ref["argmax"]) and not out["argmax"].requires_grad
    for k in params:
        torch.testing.assert_close(params[k].grad, ref_params[k].grad)
    assert x.grad is None


def test_cache_hits_misses_and_retrace_on_new_shapes():
    f = ft.jit(mlp)
    params, x = make()
    f(params, x)
    f(params, x)
    assert (f.cache_info().hits, f.cache_info().misses) == (1, 1)
    f(params, torch.randn(7, 3, dtype=torch.float64))
    with torch.no_grad():
        f(params, x)
    info = f.cache_info()
    assert (info.misses, info.entries) == (3, 3) and info.trace_s > 0 and info.partition_s > 0


def test_inference_path_saves_nothing():
    f = ft.jit(mlp)
    params, x = make(requires_grad=False)
    out = f(params, x)
    assert not out["loss"].requires_grad
    torch.testing.assert_close(out["loss"], mlp(params, x)["loss"])


def test_partition_options_and_configured_strategies():
    params, x = make()
    f = ft.jit(mlp, partition="memory_budget", budget=0.0)
    f(params, x)["loss"].backward()
    ref_params, _ = make()
    mlp(ref_params, x)["loss"].backward()
    torch.testing.assert_close(params["w1"].grad, ref_params["w1"].grad)


def test_threads_get_correct_results():
    f = ft.jit(lambda x, k: (x * k).sin().sum())
    xs = [torch.randn(16, dtype=torch.float64) for _ in range(8)]
    results = [None] * 8

    def work(i):
        results[i] = f(xs[i], 3)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for x, r in zip(xs, results, strict=True):
        torch.testing.assert_close(r, (x * 3).sin().sum())
    assert f.cache_info().entries == 1


def test_remat_inside_jit():
    params, x = make()
    block = ft.remat(lambda p, x: mlp(p, x)["loss"], policy=policies.dots_saveable)
    f = ft.jit(block, partition="default")
    f(params, x).backward()
    ref_params, _ = make()
    mlp(ref_params, x)["loss"].backward()
    for k in params:
        torch.testing.assert_close(params[k].grad, ref_params[k].grad)
    entry = f._cache.slots()[0].entry
    assert sorted(s.op for s in entry.partition.saved if not s.is_input) == [
        "aten.mm.default",
        "aten.mm.default",
    ]


def test_output_that_is_an_input_and_unknown_backend():
    f = ft.jit(lambda x: (x, x * 2))
    x = torch.randn(3, requires_grad=True)
    a, b = f(x)
    (a.sum() + b.sum()).backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 3.0))
    with pytest.raises(ft.UnknownNameError, match="'aten'"):
        ft.jit(lambda x: x, backend="nope")(torch.ones(1))


def test_jit_module_trains_like_eager_with_an_optimizer():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    ref.load_state_dict(net.state_dict())
    model = ft.jit(net)
    assert len(list(model.parameters())) == 4  # the module's own parameters, not copies
    opts = [torch.optim.Adam(m.parameters(), lr=0.05) for m in (model, ref)]
    x = torch.randn(5, 4)
    for _ in range(3):
        for m, opt in zip((model, ref), opts, strict=True):
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()
    for a, b in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    assert model.cache_info().entries == 1  # updated parameters are inputs: no retrace


def test_jit_module_updates_batchnorm_running_stats_like_eager():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.ReLU())
    ref = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.ReLU())
    ref.load_state_dict(net.state_dict())
    model = ft.jit(net)
    for _ in range(3):
        x = torch.randn(6, 3)
        model(x).sum().backward()
        ref(x).sum().backward()
    for (name, a), b in zip(net.state_dict().items(), ref.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
    for a, b in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)
    net.eval()
    ref.eval()
    with torch.no_grad():
        x = torch.randn(6, 3)
        torch.testing.assert_close(model(x), ref(x))


def test_differentiating_a_compiled_backward_again_gives_eagers_term() -> None:
    # found by a user-style review: under create_graph=True (a WGAN-GP penalty) the compiled
    # backward's gradients came out detached, and the penalty added no gradient, silently;
    # then it raised; now the backward is differentiable (apply.Twice), as eager's is
    x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 4, dtype=torch.float64)

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w).pow(2).sum()

    loss = ft.jit(f)(x, w)
    (gx,) = torch.autograd.grad(loss, x, create_graph=True)
    torch.testing.assert_close(gx, torch.autograd.grad(f(x, w), x)[0])  # first order: right
    (loss + (gx**2).sum()).backward()
    twice = x.grad
    x.grad = None
    eager = f(x, w)
    (g,) = torch.autograd.grad(eager, x, create_graph=True)
    (eager + (g**2).sum()).backward()
    torch.testing.assert_close(twice, x.grad)

    # what the message suggests: the inner gradient inside the jitted function
    def penalized(x: torch.Tensor) -> torch.Tensor:
        return f(x, w) + (ft.grad(f)(x, w) ** 2).sum()

    x.grad = None
    ft.jit(penalized)(x).backward()
    got = x.grad
    x.grad = None
    loss = f(x, w)
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    (loss + (g**2).sum()).backward()
    torch.testing.assert_close(got, x.grad)
