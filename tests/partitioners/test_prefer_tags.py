"""PREFER_* tags mean the same in every strategy as in eager selective checkpointing.

torch documents a policy that saves matmuls (MUST_SAVE) and prefers recomputing the rest
(PREFER_RECOMPUTE). Eager remat recomputes the rest; so must ``default`` (what ``ft.grad`` and
``ft.vjp`` use), as torch's own default partition does. Before, ``default`` read PREFER_RECOMPUTE
as "save if backward reads it" and kept twice eager's bytes.
"""

import torch

import functrans as ft
from benchmarks.remat import measure_bytes
from functrans.extend import Policy
from functrans.testing import check_partition

aten = torch.ops.aten


def save_mm_prefer_recompute_rest(op, *args, **kwargs):
    return Policy.MUST_SAVE if op is aten.mm.default else Policy.PREFER_RECOMPUTE


def block(x, w):
    h = x @ w
    z = torch.cat([h.sin(), h.cos()], dim=1)
    return z * z  # backward reads z, the cat


def loss(params, x):
    (w,) = params
    return ft.remat(block, policy=save_mm_prefer_recompute_rest)(x, w).sum()


def args():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(16, 16, dtype=torch.float64, generator=g)], torch.randn(
        8, 16, dtype=torch.float64, generator=g
    )


def test_default_recomputes_what_the_policy_prefers_to_recompute_like_eager():
    params, x = args()
    w = [params[0].clone().requires_grad_()]
    eager = measure_bytes(loss, w, x)["live_bytes"]
    for strategy in ("default", "min_cut"):
        p = check_partition(loss, (params, x), strategy)
        assert p.activation_bytes == eager, (strategy, p.report())
        assert [s.op for s in p.saved if not s.is_input] == ["aten.mm.default"], p.report()
        assert "cat" in [n.name for n in p.recomputed], (strategy, p.report())


def test_prefer_save_is_saved_by_default_and_recomputed_by_full_remat():
    def prefer_save_tanh(op, *args, **kwargs):
        return Policy.PREFER_SAVE if op is aten.tanh.default else Policy.PREFER_RECOMPUTE

    def f(x, w):
        return ft.remat(lambda x, w: (x @ w).tanh().sin(), policy=prefer_save_tanh)(x, w).sum()

    params, x = args()
    default = check_partition(f, (x, params[0]), "default")
    assert "tanh" in [s.name for s in default.saved], default.report()
    full = check_partition(f, (x, params[0]), "full_remat")
    assert "tanh" in [n.name for n in full.recomputed], full.report()
