"""``ft.scan`` (issue 51): JAX's scan, eagerly a loop, under ``ft.jit`` one region reused."""

from __future__ import annotations

import pytest
import torch

import functrans as ft


def _block(h: torch.Tensor, p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    h = h + torch.tanh(h @ p["w"] + p["b"])
    return h, h.mean()


def _params(n: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "w": (0.3 * torch.randn(n, 8, 8, dtype=torch.float64)).requires_grad_(),
        "b": torch.randn(n, 8, dtype=torch.float64, requires_grad=True),
    }


def _loop(params: dict[str, torch.Tensor], x: torch.Tensor, reverse: bool = False):  # type: ignore[no-untyped-def]
    n = params["w"].shape[0]
    ys = []
    for i in reversed(range(n)) if reverse else range(n):
        x, y = _block(x, {k: v[i] for k, v in params.items()})
        ys.append(y)
    return x, torch.stack(ys[::-1] if reverse else ys)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("jitted", [False, True])
def test_scan_is_the_loop_with_gradients(reverse: bool, jitted: bool) -> None:
    params, x = _params(5), torch.randn(3, 8, dtype=torch.float64)

    def scanned(params, x):  # type: ignore[no-untyped-def]
        return ft.scan(_block, x, params, reverse=reverse)

    def loss(fn):  # type: ignore[no-untyped-def]
        h, ys = fn(params, x)
        total = h.square().sum() + ys.sum()
        grads = torch.autograd.grad(total, list(params.values()))
        return h, ys, grads

    want = loss(lambda p, x: _loop(p, x, reverse))
    got = loss(ft.jit(scanned) if jitted else scanned)
    torch.testing.assert_close(got, want)


def test_a_deep_scan_traces_its_body_once_or_twice() -> None:
    params, x = _params(12), torch.randn(3, 8, dtype=torch.float64)
    step = ft.jit(lambda p, x: ft.scan(_block, x, p)[0].sum())
    step(params, x).backward()
    assert step.cache_info().regions_reused >= 10  # 12 steps: the first carry needs no grad


def test_scan_without_xs_takes_a_length() -> None:
    carry, ys = ft.scan(lambda c, _: (c * 2, c), torch.ones(2), length=3)
    torch.testing.assert_close(carry, torch.full((2,), 8.0))
    torch.testing.assert_close(ys, torch.tensor([[1.0, 1.0], [2.0, 2.0], [4.0, 4.0]]))


@pytest.mark.parametrize(
    ("xs", "length", "match"),
    [
        ({"a": torch.ones(3, 2), "b": torch.ones(4)}, None, "leading sizes \\[3, 4\\]"),
        (None, None, "pass length="),
        (torch.ones(3), 4, "length=4 but xs's leading size is 3"),
        ([1.0, 2.0], None, "every leaf of xs must be a tensor"),
    ],
)
def test_bad_scans_are_named(xs: object, length: int | None, match: str) -> None:
    with pytest.raises(ft.InvalidArgumentError, match=match):
        ft.scan(lambda c, x: (c, None), torch.zeros(1), xs, length)


def test_a_body_that_returns_no_pair_is_named() -> None:
    with pytest.raises(ft.InvalidArgumentError, match="must return a pair"):
        ft.scan(lambda c, x: c, torch.zeros(1), torch.ones(2, 1))
