"""Shrunk counterexamples the property suite found, kept as regression tests."""

import torch

import functrans as ft
from functrans import partitioners
from functrans.testing import check_policy_tags
from functrans.testing._check import partition_and_check
from functrans.testing._program import InputSpec, Program, Step
from functrans.testing._suite import register_partitioner_tests  # noqa: F401  (the suite)


def _check_all_strategies(prog, policy=None):
    """Every registered strategy and option set, plain and under a remat ``policy``."""
    args = prog.example_inputs()
    f = prog if policy is None else ft.remat(prog, policy=policy)
    jg = ft.joint(f)(*args)
    for name in partitioners.names():
        for options in partitioners.examples(name):
            p = partition_and_check(f, args, jg, name, options, eager=prog)
            check_policy_tags(p)


def test_regression_dropout_tagged_must_recompute_is_saved_not_infeasible():
    """nightly: under a policy that recomputes everything (``nothing_saveable``), the random op
    is tagged MUST_RECOMPUTE too; min_cut (and memory_budget's bounds) gave its save edge an
    infinite cost and raised "every cut crosses a value that may be neither saved nor
    recomputed". Random ops are never recomputed, so they are saved whatever their tag."""
    prog = Program(
        inputs=(InputSpec((1, 1), torch.float64),),
        steps=(Step("dropout", (0,), (), (1, 1)), Step("neg", (1,), (), (1, 1))),
        outputs=(2, 1),
    )
    _check_all_strategies(prog, ft.policies.nothing_saveable)


def test_regression_min_cut_does_not_save_a_free_view_tagged_must_recompute():
    """fuzz (bfloat16): min_cut added every view of an input that backward reads to the saved
    set (free either way), even one a remat policy tagged MUST_RECOMPUTE."""
    prog = Program(
        inputs=(InputSpec((), torch.float32), InputSpec((1, 1), torch.float32)),
        steps=(Step("mm", (1, 1), (1,), (1, 1)),),
        outputs=(2,),
    )
    _check_all_strategies(prog, ft.policies.nothing_saveable)


def test_regression_dropout_of_a_transposed_value_is_compared_under_the_same_seed():
    """doctest (harness): the traced graph of ``F.dropout(x.transpose(0, 1))`` draws its mask in
    another element order than eager (``bernoulli.p`` of an ``empty_permuted`` input), so the
    same seed gave different masks; programs now drop out a contiguous copy."""
    prog = Program(
        inputs=(InputSpec((), torch.float64), InputSpec((2, 2), torch.float64)),
        steps=(Step("transpose", (1,), (0, 1), (2, 2)), Step("dropout", (2,), (), (2, 2))),
        outputs=(3,),
    )
    assert ".contiguous(), 0.5)" in prog.source()
    _check_all_strategies(prog)
    _check_all_strategies(prog, ft.policies.everything_saveable)


def test_regression_budget_below_full_remat_is_not_infeasible_when_a_cut_beats_it():
    """nightly (``optimal``, budget 0.3): with every op tagged MUST_SAVE, full_remat saves layer
    norm's ``rstd`` (104 B) while min_cut saves the smaller ``rstd / N`` backward reads (96 B);
    the budget, placed between them, fell below full_remat's figure and raised "below the
    smallest achievable". The smallest is now the lesser cut, and the ILP (which finds 64 B
    here) is asked before a budget below it is refused."""
    prog = Program(
        inputs=(InputSpec((3,), torch.float64),),
        steps=(
            Step("stack", (0, 0), (0,), (2, 3)),
            Step("narrow", (1,), (0, 0, 1), (1, 3)),
            Step("layer_norm", (2,), (), (1, 3)),
            Step("layer_norm", (3,), (), (1, 3)),
        ),
        outputs=(4, 3),
    )
    tagged = ft.remat(prog, policy=lambda op, *args, **kwargs: ft.policies.Policy.MUST_SAVE)
    args = prog.example_inputs()
    jg = ft.joint(tagged)(*args)
    for name in ("optimal", "memory_budget"):  # the built-ins a budget reaches
        for options in partitioners.examples(name):
            check_policy_tags(partition_and_check(tagged, args, jg, name, options, eager=prog))
    low = ft.partition(jg, "optimal", budget=0.0).activation_bytes
    assert low < ft.partition(jg, "full_remat").activation_bytes
