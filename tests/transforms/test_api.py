"""vjp / grad / value_and_grad agree with torch.func for every strategy."""

import pytest
import torch

import functrans as ft

STRATEGIES = ["default", "full_remat"]


def loss(params, x):
    h = torch.nn.functional.gelu(x @ params["w1"] + params["b1"])
    return torch.nn.functional.layer_norm(h @ params["w2"], (4,)).pow(2).mean()


def make():
    g = torch.Generator().manual_seed(0)
    params = {
        "w1": torch.randn(3, 5, generator=g, dtype=torch.float64),
        "b1": torch.randn(5, generator=g, dtype=torch.float64),
        "w2": torch.randn(5, 4, generator=g, dtype=torch.float64),
    }
    return params, torch.randn(2, 3, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_grad_matches_torch_func(strategy):
    params, x = make()
    got = ft.grad(loss, partition=strategy)(params, x)
    want = torch.func.grad(loss)(params, x)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_value_and_grad_with_aux_and_argnums(strategy):
    params, x = make()

    def f(params, x):
        value = loss(params, x)
        return value, {"x_mean": x.mean()}

    (value, aux), grads = ft.value_and_grad(f, argnums=(0, 1), has_aux=True, partition=strategy)(
        params, x
    )
    want_grads, want_aux = torch.func.grad(f, argnums=(0, 1), has_aux=True)(params, x)
    torch.testing.assert_close(value, loss(params, x))
    torch.testing.assert_close(aux, want_aux)
    torch.testing.assert_close(grads, want_grads)
    got_grads, got_aux = ft.grad(f, argnums=(0, 1), has_aux=True, partition=strategy)(params, x)
    torch.testing.assert_close(got_grads, want_grads)
    torch.testing.assert_close(got_aux, want_aux)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_vjp_matches_torch_func(strategy):
    params, x = make()
    f = lambda p, x: {"h": x @ p["w1"], "s": (x @ p["w1"]).tanh().sum()}  # noqa: E731
    out, vjp_fn = ft.vjp(f, params, x, partition=strategy)
    want_out, want_vjp = torch.func.vjp(f, params, x)
    cot = {"h": torch.randn(2, 5, dtype=torch.float64), "s": torch.tensor(2.0, dtype=torch.float64)}
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(vjp_fn(cot), want_vjp(cot))
    with pytest.raises(ft.FunctransError, match="structure of the outputs"):
        vjp_fn([cot["h"]])


def test_grad_of_non_scalar_output_is_a_clear_error():
    with pytest.raises(ft.FunctransError, match=r"scalar float tensor.*shape \[3\]"):
        ft.grad(lambda x: x * 2)(torch.ones(3))


def test_partition_options_are_forwarded():
    seen = {}

    def strategy(joint, *, note):
        seen["note"] = note
        return []

    ft.grad(lambda x: x.exp().sum(), partition=strategy, note="hi")(torch.ones(2))
    assert seen == {"note": "hi"}


@pytest.mark.parametrize("strategy", [*STRATEGIES, "min_cut"])
def test_regression_sdpa_gradients_are_right(strategy):
    """torch's core decomposition of CPU flash attention is wrong under autograd (it feeds the
    attention matrix to the backward op as its logsumexp): gradients were off by ~1e3."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 16, generator=g, dtype=torch.float64) for _ in range(3))

    def f(q, k, v):
        return (
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).pow(2).sum()
        )

    got = ft.grad(f, argnums=(0, 1, 2), partition=strategy)(q, k, v)
    torch.testing.assert_close(got, torch.func.grad(f, argnums=(0, 1, 2))(q, k, v))
