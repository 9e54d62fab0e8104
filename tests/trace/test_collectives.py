"""Collectives in traced graphs, without a process group (functional collectives trace on fake
tensors): never recomputed, merged or dropped unless tagged; reshard_after_forward re-gathers
the weight and everything rebuilt from it alone. The 2-rank runs are in test_distributed.py."""

import pytest
import torch

import functrans as ft
from functrans import policies
from functrans.extend import OpClass, cut_problem, is_collective, op_class

c10d = torch.ops._c10d_functional
STRATEGIES = [
    ("default", {}),
    ("min_cut", {}),
    ("full_remat", {}),
    ("memory_budget", {"budget": 0.0}),
    ("memory_budget", {"budget": 0.5}),
]


def gathered(x, w):
    g = c10d.wait_tensor(c10d.all_gather_into_tensor(w, 2, "0"))
    return torch.tanh(x @ g.t()).sum()


def gathered_on_dim1(x, w):  # a weight sharded on dim 1: gather, chunk, concatenate
    g = c10d.wait_tensor(c10d.all_gather_into_tensor(w, 2, "0"))
    return torch.tanh(x @ torch.cat(torch.chunk(g, 2, 0), 1)).sum()


@pytest.mark.parametrize(("strategy", "options"), STRATEGIES)
def test_collectives_are_never_recomputed_untagged(strategy, options):
    jg = ft.joint(gathered, argnums=(0, 1))(torch.randn(4, 8), torch.randn(4, 8))
    assert {op_class(n) for n in jg.ops() if is_collective(n)} == {OpClass.COLLECTIVE}
    p = ft.partition(jg, strategy, **options)
    assert not [n for n in p.recomputed if is_collective(n)]
    assert not cut_problem(jg)[next(n for n in jg.ops() if is_collective(n))].can_recompute


@pytest.mark.parametrize(("strategy", "options"), STRATEGIES)
@pytest.mark.parametrize(("fn", "shard"), [(gathered, (4, 8)), (gathered_on_dim1, (8, 4))])
def test_reshard_after_forward_saves_no_gathered_weight(fn, shard, strategy, options):
    """The full weight is 8x8 (its gathered buffer 8x8 or 16x4): none of it is saved."""
    resharded = ft.remat(fn, policy=policies.reshard_after_forward)
    jg = ft.joint(resharded, argnums=(0, 1))(torch.randn(4, 8), torch.randn(shard))
    p = ft.partition(jg, strategy, **options)
    weight_sized = [s.name for s in p.saved if not s.is_input and s.shape in ((8, 8), (16, 4))]
    assert weight_sized == [], p.report()
    assert any("all_gather" in str(n.target) for n in p.recomputed)


def test_passes_never_merge_or_drop_collectives():
    def twice(w):
        a = c10d.wait_tensor(c10d.all_reduce(w, "sum", "0"))
        b = c10d.wait_tensor(c10d.all_reduce(w, "sum", "0"))  # the same message, sent twice
        c10d.wait_tensor(c10d.all_reduce(w * 2, "sum", "0"))  # unused: still sent
        return a + b

    g = ft.trace(twice)(torch.ones(3))
    assert sum(1 for n in g.ops() if "all_reduce" in str(n.target)) == 3
