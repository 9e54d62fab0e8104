"""The one save/recompute model (functrans.extend.CutProblem) and that every strategy obeys it."""

import pytest
import torch

import functrans as ft
from functrans import partitioners
from functrans._cut import problem as _cut_problem
from functrans.extend import (
    OP_RULES,
    REMAT,
    InvalidPartitionError,
    OpClass,
    OpRule,
    Policy,
    cut_problem,
    op_class,
)
from functrans.testing._check import partition_and_check

aten = torch.ops.aten


def mlp(x, w):
    return torch.tanh(x @ w).sin().sum()


def args():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(4, 4, dtype=torch.float64, generator=g),) * 2


def tagged(f, a, target, policy):
    jg = ft.joint(f)(*a)
    for n in jg.ops():
        if n.target is target:
            n.meta[REMAT] = policy
    return jg


BUILT_IN = ("default", "full_remat", "min_cut", "memory_budget", "optimal")


def every_strategy():
    # the built-ins (other tests register throwaway strategies that break rules on purpose)
    for name in BUILT_IN:
        for options in partitioners.examples(name):
            yield name, options


def test_one_value_per_forward_node_with_its_facts():
    jg = ft.joint(mlp)(*args())
    p = cut_problem(jg)
    assert [v.node for v in p] == [n for n in jg.forward_nodes() if n.op != "output"]
    by_name = {v.node.name: v for v in p}
    assert by_name["primals_1"].op_class is OpClass.INPUT
    assert not by_name["primals_1"].can_recompute
    assert by_name["mm"].op_class is OpClass.COMPUTE and by_name["mm"].in_forward
    assert by_name["mm"].can_save and by_name["mm"].can_recompute  # min_cut's ban is its own
    assert by_name["mm"].bytes == 128
    assert all(p[i].read_by_backward for i in p.drains())
    assert cut_problem(jg) is p  # built once per graph


def test_a_new_tag_rebuilds_the_problem():
    jg = ft.joint(mlp)(*args())
    before = cut_problem(jg)
    for n in jg.ops():
        if n.target is aten.tanh.default:
            n.meta[REMAT] = Policy.MUST_RECOMPUTE
    after = cut_problem(jg)
    assert after is not before
    assert not next(v for v in after if v.node.target is aten.tanh.default).can_save


def test_random_op_tagged_must_recompute_is_saved_by_every_strategy():
    def f(x, w):
        return torch.nn.functional.dropout(x @ w, 0.5).sin().sum()

    for name, options in every_strategy():
        jg = tagged(f, args(), aten.bernoulli.p, Policy.MUST_RECOMPUTE)
        (v,) = [v for v in cut_problem(jg) if v.op_class is OpClass.RANDOM]
        assert v.can_save and not v.can_recompute and v.tag_overridden
        p = ft.partition(jg, name, **options)
        assert v.node not in p.recomputed, (name, options)


def test_effectful_op_tagged_must_recompute_behaves_the_same_in_every_strategy(monkeypatch):
    # Functionalized traces hold no effectful op we could tag, so tanh plays one: the rules read
    # the class through the CutProblem, which every strategy and split's check share. Before the
    # CutProblem, `default` recomputed it (running the effect twice), `min_cut` raised "every cut
    # crosses..." and `memory_budget` reported an infeasible problem.
    real = op_class

    def classes(node):
        return OpClass.EFFECTFUL if node.target is aten.tanh.default else real(node)

    monkeypatch.setattr(_cut_problem, "op_class", classes)
    for name, options in every_strategy():
        jg = tagged(mlp, args(), aten.tanh.default, Policy.MUST_RECOMPUTE)
        v = next(v for v in cut_problem(jg) if v.node.target is aten.tanh.default)
        assert v.tag_overridden and v.can_save and not v.can_recompute
        p = ft.partition(jg, name, **options)
        assert v.node not in p.recomputed, (name, options, p.recomputed)
        assert not p.adjusted, (name, options, p.adjusted)  # the strategy itself obeyed


def test_a_contradiction_is_one_error_naming_the_op_class_and_tag(monkeypatch):
    # a future class (collectives) may be neither saved nor recomputed: backward reading one is
    # a contradiction, reported once, when the problem is built
    rules = dict(OP_RULES)
    rules[OpClass.POINTWISE] = OpRule(
        save=False, recompute=False, why_not_save="test: never", why_not_recompute="test: never"
    )
    monkeypatch.setattr(_cut_problem, "OP_RULES", rules)
    jg = tagged(mlp, args(), aten.sin.default, Policy.PREFER_SAVE)
    with pytest.raises(InvalidPartitionError, match=r"backward reads the pointwise op") as e:
        cut_problem(jg)
    assert "neither saved (test: never) nor recomputed (test: never)" in str(e.value)
    for name in ("default", "min_cut", "full_remat"):
        with pytest.raises(InvalidPartitionError, match="may be neither saved"):
            ft.partition(jg, name)


def test_must_save_is_never_recomputed_so_saved_when_backward_needs_it():
    for name, options in every_strategy():
        jg = tagged(mlp, args(), aten.tanh.default, Policy.MUST_SAVE)
        (v,) = [v for v in cut_problem(jg) if v.node.target is aten.tanh.default]
        assert v.must_save and not v.can_recompute
        p = ft.partition(jg, name, **options)
        assert "tanh" in [s.name for s in p.saved], (name, options)


def test_third_party_strategy_honours_tags_by_construction():
    # a strategy that knows nothing of remat tags: saves every forward op's value
    def save_everything(joint):
        return [n for n in joint.forward_nodes() if n.op == "call_function"]

    f = mlp
    jg = tagged(f, args(), aten.tanh.default, Policy.MUST_RECOMPUTE)
    p = ft.partition(jg, save_everything)
    assert "tanh" not in [s.name for s in p.saved]
    assert [n.name for n in p.adjusted] == ["tanh"]
    # and the property harness tells its author
    with pytest.raises(AssertionError, match="tanh"):
        partition_and_check(f, args(), jg, save_everything, {})


def test_split_checks_the_same_rules():
    jg = tagged(mlp, args(), aten.tanh.default, Policy.MUST_RECOMPUTE)
    with pytest.raises(
        InvalidPartitionError, match=r"saves the pointwise op tanh .* MUST_RECOMPUTE"
    ):
        ft.split(jg, ["tanh"])


def test_legalize_is_idempotent_on_every_strategys_choice():
    def f(x, w):
        h = torch.nn.functional.dropout(x @ w, 0.3)
        return torch.nn.functional.layer_norm(h, (4,)).relu().sum()

    jg = ft.joint(f)(*args())
    for name, options in every_strategy():
        p = ft.partition(jg, name, **options)
        assert not p.adjusted, (name, options, p.adjusted)
