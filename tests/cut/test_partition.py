"""partition(): registry, records, totals, custom strategies."""

import pytest
import torch

import functrans as ft
from functrans import partitioners
from functrans.extend import cut_problem


def f(x, w):
    return torch.relu(x @ w).sum()


@pytest.fixture
def jg():
    return ft.joint(f)(torch.randn(4, 8), torch.randn(8, 8))


def test_unknown_strategy_lists_registered_names(jg):
    with pytest.raises(ft.UnknownNameError, match="'mincut'; registered: 'checkpoint', 'default'"):
        ft.partition(jg, "mincut")


def test_saved_records_describe_each_value(jg):
    p = ft.partition(jg, "default")
    by_name = {s.name: s for s in p.saved}
    assert set(by_name) == {"primals_1", "primals_2", "relu"}
    relu = by_name["relu"]
    assert (relu.op, relu.shape, relu.dtype, relu.nbytes) == (
        "aten.relu.default",
        (4, 8),
        torch.float32,
        128,
    )
    assert not relu.is_input and relu.source.endswith("return torch.relu(x @ w).sum()")
    assert by_name["primals_1"].is_input and by_name["primals_1"].activation_bytes == 0
    assert p.activation_bytes == 128 and p.saved_bytes == 128 + 4 * 8 * 4 + 8 * 8 * 4


def test_views_of_inputs_cost_no_activation_bytes():
    # (a transposed input would not do: its backward transposes it back to the input itself)
    jg = ft.joint(lambda x, w: (x.reshape(3, 4) @ w).sum(), argnums=1)(
        torch.ones(4, 3), torch.ones(4, 2)
    )
    p = ft.partition(jg, lambda j: [n for n in j.ops() if n.name == "view"])
    assert [(s.name, s.is_input) for s in p.saved] == [("view", True)]
    assert p.activation_bytes == 0 and p.saved_bytes == 4 * 3 * 4


def test_callable_strategy_with_options(jg):
    def save_named(joint, *, names):
        return names

    p = ft.partition(jg, save_named, names=["mm"])
    assert p.strategy == "save_named" and "mm" in [s.name for s in p.saved]
    assert [n.name for n in p.recomputed] == ["relu"]


def test_registered_strategy_is_usable_by_name(jg):
    def save_matmuls(joint):
        mms = [n for n in joint.forward_nodes() if n.target is torch.ops.aten.mm.default]
        return cut_problem(joint).legalize(mms)  # plus random outputs: it obeys the rules

    # stays registered: the property suites (test_properties, test_fuzz_regressions) then check
    # it on random programs too, dropout included
    partitioners.register("test_save_mm", save_matmuls, replace=True)
    assert [n.name for n in ft.partition(jg, "test_save_mm").recomputed] == ["relu"]
    with pytest.raises(ValueError, match="already registered"):
        partitioners.register("test_save_mm", lambda joint: [])


def test_report_mentions_totals(jg):
    text = ft.partition(jg, "full_remat").report()
    assert "activation bytes: 0" in text and "recomputed in backward: mm, relu" in text
    assert str(ft.partition(jg, "full_remat")) == text
