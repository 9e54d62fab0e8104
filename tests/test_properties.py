"""Property tests: every registered strategy, and random saved sets, preserve outputs and
gradients of random programs (compared with eager autograd, dtype-aware tolerances)."""

import torch
from hypothesis import given
from hypothesis import strategies as st

import functrans as ft
from functrans import partitioners
from functrans.testing import check_partition, programs, saved_sets, split_and_check

PROGRAMS = programs(dtypes=(torch.float64, torch.float32))


@given(PROGRAMS)
def test_property_every_registered_strategy_preserves_gradients(prog):
    args = prog.example_inputs()
    for name in partitioners.names():
        for options in partitioners.examples(name):
            check_partition(prog, args, name, **options)


@given(PROGRAMS, st.data())
def test_property_random_saved_sets_preserve_gradients(prog, data):
    args = prog.example_inputs()
    jg = ft.joint(prog)(*args)
    jg.verify()
    split_and_check(prog, args, jg, data.draw(saved_sets(jg), label="saved"))


@given(PROGRAMS)
def test_property_full_remat_saves_only_primal_inputs(prog):
    p = ft.partition(ft.joint(prog)(*prog.example_inputs()), "full_remat")
    assert all(s.op == "input" for s in p.saved), p.report()
    assert p.activation_bytes == 0


@given(PROGRAMS)
def test_property_default_recomputes_nothing(prog):
    p = ft.partition(ft.joint(prog)(*prog.example_inputs()), "default")
    assert p.recomputed == () and p.recompute_flops == 0, p.report()


def test_checker_catches_a_wrong_gradient():
    import pytest

    def f(x):
        return x.sin().sum()

    args = (torch.randn(3, dtype=torch.float64),)
    jg = ft.joint(f)(*args)
    s = ft.split(jg, [])
    cos = next(n for n in s.backward.ops() if n.target is torch.ops.aten.cos.default)
    cos.target = torch.ops.aten.sin.default  # sabotage backward: d sin = sin (wrong)
    s.backward.graph_module.recompile()
    from functrans.testing import check_split

    with pytest.raises(AssertionError, match=r"grad\[0\] differs from eager"):
        check_split(f, args, jg, s, "sabotaged")


@given(PROGRAMS)
def test_property_min_cut_saves_no_more_than_default_and_respects_bans(prog):
    from functrans.partitioners.min_cut import MinCutOptions, banned

    jg = ft.joint(prog)(*prog.example_inputs())
    mc = ft.partition(jg, "min_cut")
    assert mc.activation_bytes <= ft.partition(jg, "default").activation_bytes, mc.report()
    by_name = {n.name: n for n in jg.fx_graph.nodes}
    broken = [name for name in mc.recomputed if banned(by_name[name], MinCutOptions())]
    assert not broken, f"min_cut recomputed banned ops {broken}\n{mc.report()}"


def test_regression_layer_norm_over_two_elements_float32():
    """Shrunk by hypothesis: decomposed layer_norm backward over 2 elements differs from eager
    by 1.25e-5 in float32 (an ill-conditioned op, not a wrong gradient); float64 agrees tightly.
    """
    from functrans.testing._programs import InputSpec, Program, Step

    for dtype in (torch.float32, torch.float64):
        prog = Program(  # exactly the shrunk case (unused inputs keep the example values)
            inputs=(InputSpec((), dtype), InputSpec((1,), dtype), InputSpec((2,), dtype)),
            steps=(Step("tanh", (2,), (), (2,)), Step("layer_norm", (3,), (), (2,))),
            outputs=(4,),
        )
        for name in partitioners.names():
            for options in partitioners.examples(name):
                check_partition(prog, prog.example_inputs(), name, **options)
