"""Complex tensors are differentiated as eager PyTorch differentiates them.

torch's convention: the ``.grad`` of a complex leaf is the conjugate Wirtinger derivative of
the real loss, what ``loss.backward()`` leaves. Every case runs eager and functrans under one
seed and compares the gradients (and, for outputs, ``requires_grad``) end to end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import functrans as ft

STRATEGIES = ["default", "min_cut", "full_remat"]


class SpectralLayer(nn.Module):
    """An FFT spectral filter (a complex weight per frequency) followed by a real Linear."""

    def __init__(self, n: int = 8) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, dtype=torch.cfloat))
        self.lin = nn.Linear(n, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        filtered = torch.fft.ifft(torch.fft.fft(x) * self.w).real
        return torch.tanh(self.lin(filtered))


def _grads(m: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in m.named_parameters()}


def _assert_same_grads(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert got[name] is not None, f"{name} got no gradient"
        torch.testing.assert_close(got[name], w, msg=lambda m, n=name: f"{n}: {m}")


def _leaves(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in ts]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_spectral_layer_weight_learns_under_jit(strategy: str) -> None:
    # the failure this guards: the complex spectral weight got no .grad while the Linear trained
    torch.manual_seed(0)
    model, x = SpectralLayer(), torch.randn(4, 8)
    model(x).square().sum().backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    ft.jit(model, partition=strategy)(x).square().sum().backward()
    got = _grads(model)
    _assert_same_grads(got, want)
    assert got["w"] is not None and got["w"].dtype == torch.cfloat


def test_spectral_layer_trains_like_eager_over_steps() -> None:
    torch.manual_seed(0)
    eager, x = SpectralLayer(), torch.randn(4, 8)
    compiled_model = SpectralLayer()
    compiled_model.load_state_dict(eager.state_dict())
    compiled = ft.jit(compiled_model)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (eager, compiled_model)]
    for _ in range(3):
        for run, opt in zip((eager, compiled), opts, strict=True):
            opt.zero_grad()
            run(x).square().sum().backward()
            opt.step()
    for (name, a), b in zip(eager.named_parameters(), compiled_model.parameters(), strict=True):
        torch.testing.assert_close(b, a, msg=lambda m, n=name: f"{n}: {m}")


def _check_function(
    f: Callable[..., Any],
    args: list[torch.Tensor],
    loss: Callable[[Any], torch.Tensor],
    strategy: str,
    backend: str = "aten",
) -> None:
    """``f`` under ``ft.jit`` against eager: outputs, their ``requires_grad``, input grads."""
    eager_args, jit_args = _leaves(*args), _leaves(*args)
    want = f(*eager_args)
    got = ft.jit(f, partition=strategy, backend=backend)(*jit_args)
    want_t = want if isinstance(want, tuple) else (want,)
    got_t = got if isinstance(got, tuple) else (got,)
    for g, w in zip(got_t, want_t, strict=True):
        assert (g.dtype, g.requires_grad) == (w.dtype, w.requires_grad)
        torch.testing.assert_close(g, w)
    loss(want).backward()
    loss(got).backward()
    for a, b in zip(jit_args, eager_args, strict=True):
        assert (a.grad is None) == (b.grad is None)
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_complex_inputs_of_a_function(strategy: str) -> None:
    torch.manual_seed(0)
    z = torch.randn(5, dtype=torch.cfloat, requires_grad=True)
    w = torch.randn(5, dtype=torch.cfloat, requires_grad=True)
    x = torch.randn(5, requires_grad=True)
    _check_function(
        lambda z, w, x: (torch.sin(z) * w.conj() * x).abs().square().sum(),
        [z, w, x],
        lambda o: o,
        strategy,
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_complex_output_requires_grad_and_backward(strategy: str) -> None:
    # a complex output came back with requires_grad=False and backward raised a raw error
    torch.manual_seed(0)
    z = torch.randn(5, dtype=torch.cdouble, requires_grad=True)
    w = torch.randn(5, dtype=torch.cdouble, requires_grad=True)
    _check_function(lambda z, w: torch.exp(z) * w, [z, w], lambda o: o.abs().sum(), strategy)
    _check_function(
        lambda z, w: torch.exp(z) * w,
        [z, w],
        lambda o: torch.view_as_real(o).square().sum(),
        strategy,
    )


@pytest.mark.parametrize("strategy", ["default", "min_cut"])
def test_real_input_complex_output(strategy: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    _check_function(lambda x: torch.fft.rfft(x), [x], lambda o: o.abs().sum(), strategy)
    _check_function(
        lambda x: torch.polar(x.abs() + 1, x), [x], lambda o: (o * o).real.sum(), strategy
    )


@pytest.mark.parametrize("strategy", ["default", "min_cut"])
def test_complex_and_real_outputs_together(strategy: str) -> None:
    torch.manual_seed(0)
    z = torch.randn(5, dtype=torch.cfloat, requires_grad=True)
    x = torch.randn(5, requires_grad=True)
    _check_function(
        lambda z, x: (z * x, (z * x).real.sum(), z.detach() * 2),
        [z, x],
        lambda o: o[0].abs().sum() + o[1],
        strategy,
    )


@pytest.mark.parametrize("backend", ["aten", "triton"])
def test_conjugate_cotangent(backend: str) -> None:
    # backward of .conj() hands the compiled backward a tangent with the conjugate bit set;
    # triton lowers no complex op and runs those in ATen, which reads the bit
    if backend == "triton":
        pytest.importorskip("triton")
    torch.manual_seed(0)
    z = torch.randn(5, dtype=torch.cfloat, requires_grad=True)
    k = torch.randn(5, dtype=torch.cfloat)
    _check_function(
        lambda z: torch.exp(z) * 2, [z], lambda o: (o.conj() * k).sum().real, "min_cut", backend
    )


def test_complex_matmul_in_double() -> None:
    torch.manual_seed(0)
    a = torch.randn(3, 4, dtype=torch.cdouble, requires_grad=True)
    b = torch.randn(4, 2, dtype=torch.cdouble, requires_grad=True)
    _check_function(lambda a, b: a @ b, [a, b], lambda o: o.abs().sum(), "min_cut")


def test_complex_input_that_needs_no_grad() -> None:
    # eager: a complex input without requires_grad stays out of the gradient
    torch.manual_seed(0)
    z = torch.randn(5, dtype=torch.cfloat)
    x = torch.randn(5, requires_grad=True)
    _check_function(lambda z, x: z * x, [z, x], lambda o: o.abs().sum(), "min_cut")


def _loss(z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (torch.sin(z) * x).abs().square().sum()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_grad_of_a_complex_input_matches_torch_func(strategy: str) -> None:
    torch.manual_seed(0)
    z, x = torch.randn(4, dtype=torch.cfloat), torch.randn(4)
    want = torch.func.grad(_loss, argnums=(0, 1))(z, x)
    got = ft.grad(_loss, argnums=(0, 1), partition=strategy)(z, x)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w)
    value, gz = ft.value_and_grad(_loss, partition=strategy)(z, x)
    torch.testing.assert_close(value, _loss(z, x))
    torch.testing.assert_close(gz, want[0])


def test_grad_of_a_complex_input_composes() -> None:
    torch.manual_seed(0)
    z, x = torch.randn(4, dtype=torch.cfloat), torch.randn(4)
    want = torch.func.grad(_loss)(z, x)
    torch.testing.assert_close(ft.jit(ft.grad(_loss))(z, x), want)
    torch.testing.assert_close(ft.grad(ft.jit(_loss))(z, x), want)
    torch.testing.assert_close(torch.func.grad(ft.jit(_loss))(z, x), want)
    zs, xs = torch.randn(3, 4, dtype=torch.cfloat), torch.randn(3, 4)
    per_example = torch.func.vmap(torch.func.grad(_loss))(zs, xs)
    torch.testing.assert_close(ft.vmap(ft.grad(_loss))(zs, xs), per_example)
    torch.testing.assert_close(ft.jit(ft.vmap(ft.grad(_loss)))(zs, xs), per_example)


@pytest.mark.parametrize("strategy", ["default", "min_cut"])
def test_vjp_of_a_complex_function_matches_torch_func(strategy: str) -> None:
    torch.manual_seed(0)
    z = torch.randn(4, dtype=torch.cfloat)
    cot = torch.randn(4, dtype=torch.cfloat)

    def f(z: torch.Tensor) -> torch.Tensor:
        return torch.exp(z) * z

    out, vjp_fn = ft.vjp(f, z, partition=strategy)
    want_out, want_vjp = torch.func.vjp(f, z)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(vjp_fn(cot)[0], want_vjp(cot)[0])


def test_grad_of_a_complex_loss_is_refused_by_name() -> None:
    # torch.func.grad and loss.backward() refuse a complex scalar loss too
    z = torch.randn(3, dtype=torch.cfloat)
    with pytest.raises(ft.FunctransError, match="complex64: a complex loss has no single"):
        ft.grad(lambda z: (z * z).sum())(z)


def test_custom_jvp_with_a_complex_output_under_backward() -> None:
    # the transposed jvp rule skipped complex outputs, and torch.func.vjp raised a raw error
    @ft.custom_jvp
    def cexp(z: torch.Tensor) -> torch.Tensor:
        return torch.exp(z)

    @cexp.defjvp
    def cexp_jvp(primals: Any, tangents: Any) -> Any:
        (z,), (t,) = primals, tangents
        y = torch.exp(z)
        return y, y * t

    torch.manual_seed(0)
    z = torch.randn(3, dtype=torch.cfloat, requires_grad=True)
    _check_function(lambda z: cexp(z), [z], lambda o: o.abs().sum(), "min_cut")
    eager = z.detach().clone().requires_grad_()
    torch.exp(eager).abs().sum().backward()
    ruled = z.detach().clone().requires_grad_()
    cexp(ruled).abs().sum().backward()
    torch.testing.assert_close(ruled.grad, eager.grad)
