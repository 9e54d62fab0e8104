"""Liveness simulation on hand-computed graphs."""

import torch

import functrans as ft
from functrans._memory import simulate

KB = 1024  # every f32[256] tensor below is 1 KiB


def profile(f, strategy, *args):
    p = ft.partition(ft.joint(f)(*args), strategy)
    return simulate(p.forward.fx_graph, p.backward.fx_graph)


def test_chain_frees_values_after_last_use():
    # forward: x (input, 1K) -> a=sin (1K) -> b=cos(a) (1K, a freed) -> loss (4 B)
    # nothing needs a tangent-free save except x, so full_remat keeps just x across the cut.
    def f(x):
        return x.sin().cos().sum()

    m = profile(f, "full_remat", torch.ones(256))
    assert m.forward_peak == 3 * KB  # x, sin, cos live together when cos runs
    assert m.boundary_bytes == KB + 4  # x and the loss
    # backward: sin (recomputed), sin_1, neg, mul = expand(t) * neg, cos_1, mul_1 = mul * cos_1;
    # the tangent is freed after `mul`, and at `mul_1` x, mul, cos_1 and mul_1 are live.
    assert m.backward_peak == 4 * KB


def test_saved_values_live_until_their_last_backward_use():
    def f(x):
        return x.exp().sum()

    default = profile(f, "default", torch.ones(256))
    # exp is saved: live across the cut (x + exp + loss), then exp * expand(tangent)
    assert default.boundary_bytes == 2 * KB + 4
    assert default.backward_peak == 3 * KB + 4  # x, exp, tangent, the product


def test_views_share_storage_with_their_base():
    def f(x):
        return x.t().contiguous().sum()

    g = ft.trace(f)(torch.ones(16, 16))
    p = ft.partition(ft.joint(f)(torch.ones(16, 16)), "default")
    m = simulate(p.forward.fx_graph, p.backward.fx_graph)
    # forward: x (1K) + permute (a view: 0) + the contiguous copy (1K) + loss (4 B)
    assert m.forward_peak == 2 * KB + 4
    assert "permute" in str(g)


def test_multi_output_ops_allocate_each_output():
    def f(x):
        return torch.nn.functional.layer_norm(x, (256,)).sum()

    m = profile(f, "default", torch.ones(4, 256))
    # native_layer_norm allocates out (4K) and mean/rstd (16 B each); all three are live at once
    assert m.forward_peak >= 4 * KB * 2 + 32
