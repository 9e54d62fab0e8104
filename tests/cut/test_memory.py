"""Liveness simulation on hand-computed graphs, each checked against the allocator too.

The figures are bytes above the inputs (the caller holds ``x``): what a profile of the step
measures (:func:`functrans.testing.measure_peak`).
"""

import torch

import functrans as ft
from functrans._cut.memory import simulate
from functrans.testing import measure_peak

KB = 1024  # every f32[256] tensor below is 1 KiB


def partition(f, strategy, *args):
    return ft.partition(ft.joint(f)(*args), strategy)


def profile(f, strategy, *args):
    p = partition(f, strategy, *args)
    return simulate(p.forward.fx_graph, p.backward.fx_graph, p.joint.num_outputs)


def measured(p, *args):
    """The allocator's peak of running ``p`` forward then backward, driven directly."""

    def step():
        outs, saved = p.forward(*args)
        tangents = tuple(torch.ones_like(o) for o in (outs if isinstance(outs, tuple) else (outs,)))
        return outs, p.backward(saved, tangents)  # saved is consumed: freed as backward goes

    return measure_peak(step).peak_bytes


def test_chain_frees_values_after_last_use():
    # forward: a=sin(x) (1K) -> b=cos(a) (1K, a freed after) -> loss (4 B); full_remat saves x
    # only (the caller's), so between the passes just the loss is live.
    def f(x):
        return x.sin().cos().sum()

    m = profile(f, "full_remat", torch.ones(256))
    assert m.forward_peak == 2 * KB  # sin and cos live together when cos runs
    assert m.boundary_bytes == 4  # the loss
    # backward: sin (recomputed), sin_1, neg, mul = expand(t) * neg, cos_1, mul_1 = mul * cos_1;
    # at mul_1 mul, cos_1 and mul_1 are live, with the tangent and the loss (4 B each)
    assert m.backward_peak == 3 * KB + 8
    p = partition(f, "full_remat", torch.ones(256))
    assert measured(p, torch.ones(256)) == p.peak_bytes == 3 * KB + 8


def test_saved_values_live_until_their_last_backward_use():
    def f(x):
        return x.exp().sum()

    default = profile(f, "default", torch.ones(256))
    # exp is saved: live across the cut (exp + loss), then exp * expand(tangent)
    assert default.boundary_bytes == KB + 4
    assert default.backward_peak == 2 * KB + 8  # exp, the product, the tangent, the loss
    p = partition(f, "default", torch.ones(256))
    assert measured(p, torch.ones(256)) == p.peak_bytes


def test_views_share_storage_with_their_base():
    def f(x):
        return x.t().contiguous().sum()

    g = ft.trace(f)(torch.ones(16, 16))
    m = profile(f, "default", torch.ones(16, 16))
    # forward: permute (a view of x: 0) + the contiguous copy (1K) + loss (4 B)
    assert m.forward_peak == KB + 4
    assert "permute" in str(g)


def test_multi_output_ops_allocate_each_output():
    def f(x):
        return torch.nn.functional.layer_norm(x, (256,)).sum()

    m = profile(f, "default", torch.ones(4, 256))
    # native_layer_norm allocates out (4K) and mean/rstd (16 B each); all three are live at once
    assert m.forward_peak == 4 * KB + 32 + 4
    p = partition(f, "default", torch.ones(4, 256))
    assert abs(measured(p, torch.ones(4, 256)) - p.peak_bytes) <= 0.02 * p.peak_bytes
