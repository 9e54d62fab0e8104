"""torch.distributed on 2 real gloo processes (short collective timeouts: a hang fails within
seconds): functional collectives in partitioned graphs, FSDP2 and tensor parallelism."""

import sys

import pytest
import torch.distributed as dist
from _dist import run_on_ranks

pytestmark = pytest.mark.skipif(
    not dist.is_available() or sys.platform == "win32", reason="needs torch.distributed (gloo)"
)


def test_sharded_weights_every_strategy_same_collectives_on_every_rank():
    """Every strategy (and budget) equals eager on both ranks, and both ranks issue the same
    collectives although their local batches differ (64 and 512: a bytes-driven choice would
    differ); collectives are never recomputed unless reshard_after_forward tags them, and then
    no gathered weight is saved."""
    import dist_workers

    ranks = run_on_ranks(dist_workers.sharded_mlp_every_strategy, [64, 512])
    r0, r1 = ranks
    for name in r0:
        assert r0[name]["forward"] == r1[name]["forward"], name
        assert r0[name]["backward"] == r1[name]["backward"], name
        gathers_in_backward = [c for c in r0[name]["backward"] if "all_gather" in c]
        if name.endswith("+reshard"):
            # w2 at least (backward reads it); w1 too where the strategy recomputes x @ w1
            assert 1 <= len(gathers_in_backward) <= 2, name
            assert r0[name]["saved_gathered"] == [] == r1[name]["saved_gathered"], name
        else:
            assert gathers_in_backward == [], name  # never recomputed by bytes
    resharded = r0["min_cut+reshard"]["activation_bytes"]
    assert resharded < r0["min_cut"]["activation_bytes"]


def test_fsdp2_training_with_jit_blocks_equals_eager():
    import dist_workers

    for rank in run_on_ranks(dist_workers.fsdp2_training):
        eager = rank["losses"]["eager"]
        for name, losses in rank["losses"].items():
            assert losses == pytest.approx(eager, rel=1e-5), name
        assert "jit_blocks" in rank["refused"]


def test_fsdp2_step_budget_bounds_each_ranks_step_peak():
    """ft.distributed.budget_blocks on 2 gloo ranks: limits that differ between ranks are
    refused on both (a search per rank would hang); a limit below every plan is refused
    naming the lowest bound; at that bound and at no limit, every later step's measured peak
    on each rank is within the bound; gradients (so losses) equal eager FSDP2's."""
    import dist_workers

    for rank in run_on_ranks(dist_workers.fsdp2_step_budget, timeout=180.0):
        assert "ask for at least that" in rank["refused"]
        assert "pass the same limit on every rank" in rank["mismatch"]
        for name in ("roomy", "lowest"):
            got = rank[name]
            assert max(got["measured"]) <= got["bound"], (name, got)
            assert got["margin"] > 0  # a unit's unsharded bytes: gloo frees late
        assert set(rank["roomy"]["cuts"]) == {"default"}
        assert rank["lowest"]["bound"] < rank["roomy"]["bound"]
        for name, losses in rank["losses"].items():
            assert losses == pytest.approx(rank["losses"]["eager"], rel=1e-5), name


def test_dtensor_arguments_trace_jit_grad():
    import dist_workers

    ranks = run_on_ranks(dist_workers.dtensor_arguments)
    assert ranks[0]["collectives"] == ranks[1]["collectives"]
    assert any("all_gather" in c for c in ranks[0]["collectives"]), ranks[0]


def test_tensor_parallel_blocks_equal_eager():
    import dist_workers

    for compiled in run_on_ranks(dist_workers.tensor_parallel_blocks):
        # one entry for inference, one for training: both compiled, none run as written
        assert compiled == {"mlp": 2, "attention": 2}
