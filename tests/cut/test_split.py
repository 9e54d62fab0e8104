"""split(): the one graph-surgery function, on hand-picked saved sets."""

import pytest
import torch

import functrans as ft
from functrans.testing import measure_peak, split_and_check


def f(x, w):
    return torch.tanh(x @ w).sum()


ARGS = (torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64))


@pytest.fixture
def jg():
    return ft.joint(f)(*ARGS)


def test_saving_mm_recomputes_tanh_in_backward(jg):
    s = split_and_check(f, ARGS, jg, ["mm"])
    assert [n.name for n in s.saved] == ["primals_1", "primals_2", "mm"]
    assert [n.name for n in s.recomputed] == ["tanh"]
    assert "# recomputed" in str(s.backward)


def test_saving_a_backward_only_forward_value(jg):
    # `sub` (1 - tanh^2) never runs in an ordinary forward pass, but it is a forward value:
    # saving it makes forward compute it, and backward needs nothing else from forward.
    s = split_and_check(f, ARGS, jg, ["sub"])
    assert [n.name for n in s.saved] == ["primals_1", "primals_2", "sub"]
    assert "sub" in str(s.forward) and not s.recomputed


def test_tangent_dependent_value_cannot_be_saved(jg):
    with pytest.raises(ft.InvalidPartitionError, match=r"mul_1.*tangents_1"):
        ft.split(jg, ["mul_1"])


def test_unknown_names_are_rejected(jg):
    with pytest.raises(ft.InvalidPartitionError, match="'nope' is not a node"):
        ft.split(jg, ["nope"])


def test_nodes_from_another_graph_are_rejected(jg):
    other = ft.joint(f)(*ARGS)
    with pytest.raises(ft.InvalidPartitionError, match="not a node of this joint graph"):
        ft.split(jg, [next(other.ops())])


def test_dead_code_is_removed_from_both_graphs():
    def g(x):
        _unused = x.exp()
        return (x * 2).sum()

    jg = ft.joint(g)(torch.ones(3))
    s = ft.split(jg, [])
    text = str(s.forward) + str(s.backward)
    assert "aten.exp." not in text


def test_random_ops_are_never_silently_recomputed():
    def g(x):
        return torch.nn.functional.dropout(x, 0.5).sum()

    jg = ft.joint(g)(torch.ones(4))
    with pytest.raises(ft.InvalidPartitionError, match="random op bernoulli"):
        ft.split(jg, [])
    s = ft.split(jg, ["bernoulli"])
    _, saved = s.forward(torch.ones(4))
    mask = saved[-1]
    (grad,) = s.backward(saved, (torch.tensor(1.0),))  # consumes saved
    assert saved == []
    torch.testing.assert_close(grad, mask / 0.5)


def test_forward_graph_keeps_all_primal_placeholders():
    jg = ft.joint(lambda x, unused: x.sum())(torch.ones(2), torch.ones(3))
    s = ft.split(jg, [])
    assert [p.name for p in s.forward.placeholders()] == ["primals_1", "primals_2"]
    s.forward.verify()
    s.backward.verify()


def test_backward_recomputes_just_in_time_to_keep_peak_low():
    # two independent recomputed chains: recomputing both up front would keep both alive
    def g(x, y):
        return x.exp().sum() * 2 + y.exp().sum() * 3

    args = (torch.randn(1024), torch.randn(1024))
    p = ft.partition(ft.joint(g)(*args), "full_remat")
    lines = [line.split(":")[0].strip() for line in str(p.backward).splitlines()[1:-1]]
    # the second exp is recomputed only after the first chain is done with its exp
    assert lines.index("exp") > lines.index("mul_3"), str(p.backward)
    # the first grad, one exp and the product being computed (+ the 4-byte tangent, the 4-byte
    # output the caller holds and a 4-byte scale); x and y are the caller's, not counted
    assert p.memory.backward_peak == 3 * 4096 + 12

    def step():
        out, saved = p.forward(*args)
        return p.backward(saved, (torch.ones_like(out),))

    assert measure_peak(step).peak_bytes == p.peak_bytes  # what the allocator holds
