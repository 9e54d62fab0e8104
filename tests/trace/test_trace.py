"""trace(): pytrees, static leaves, functionalization, errors that name the op/argument."""

import dataclasses
from typing import NamedTuple

import optree
import pytest
import torch

import functrans as ft


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


@optree.dataclasses.dataclass(namespace="functrans")
class Params:
    w: torch.Tensor
    scale: float


def ops(graph):
    return [str(n.target) for n in graph.ops()]


def test_pytree_inputs_and_outputs_roundtrip():
    def f(pair, d, params, n, nothing=None):
        y = (pair.a * params.w + d["k"][0]) * params.scale * n
        return {"y": y, "parts": [pair.b.sum(), None], "n": n}

    args = (
        Pair(torch.randn(3), torch.randn(3)),
        {"k": [torch.randn(3)]},
        Params(torch.randn(3), 2.0),
        4,
    )
    g = ft.trace(f)(*args)
    g.verify()
    out = g(*args)
    expected = f(*args)
    torch.testing.assert_close(out["y"], expected["y"])
    torch.testing.assert_close(out["parts"][0], expected["parts"][0])
    assert out["parts"][1] is None and out["n"] == 4
    assert [p.name for p in g.placeholders()] == ["pair_a", "pair_b", "d_k_0", "params_w"]


def test_kwargs_are_traced_too():
    g = ft.trace(lambda x, *, bias: x + bias)(torch.ones(2), bias=torch.ones(2))
    assert [p.name for p in g.placeholders()] == ["x", "bias"]
    torch.testing.assert_close(g(torch.ones(2), bias=torch.full((2,), 2.0)), torch.full((2,), 3.0))


def test_static_value_is_baked_in_and_checked():
    g = ft.trace(lambda x, k: x * k)(torch.ones(2), 3)
    assert "3" in str(g)
    with pytest.raises(ft.TraceError, match=r"static argument .*was 3 .* is 4"):
        g(torch.ones(2), 4)


def test_shape_and_structure_changes_are_rejected():
    g = ft.trace(lambda x: x * 2)(torch.ones(2))
    with pytest.raises(ft.FunctransError, match=r"input x was traced as torch.float32 \[2\]"):
        g(torch.ones(3))
    with pytest.raises(ft.TraceError, match="structure changed"):
        g([torch.ones(2)])


def test_static_argnums_bakes_a_tensor_as_constant():
    g = ft.trace(lambda x, k: x * k.sum(), static_argnums=(1,))(torch.ones(2), torch.ones(2))
    assert [p.name for p in g.placeholders()] == ["x"]
    torch.testing.assert_close(g(torch.ones(2), torch.ones(2)), torch.full((2,), 2.0))
    with pytest.raises(ft.TraceError, match="static argument"):
        g(torch.ones(2), torch.zeros(2))


def test_core_decompositions_by_default_and_opt_out():
    f = lambda x: torch.nn.functional.silu(x)  # noqa: E731
    assert "aten.silu.default" not in ops(ft.trace(f)(torch.ones(2)))
    assert ops(ft.trace(f, decompositions=None)(torch.ones(2))) == ["aten.silu.default"]


def test_views_of_forward_mode_zero_tangents_stay_on_the_inputs_device():
    # the outer tangent of 2 * one is a ZeroTensor; torch's own kernels for the views of one
    # ran ahead of the fake tensors, and the reshape came out of the trace on 'meta'
    f = lambda x: (2 * x).reshape(-1)  # noqa: E731
    one = torch.tensor(1.0, dtype=torch.float64)
    d2 = lambda x: ft.jvp(lambda y: ft.jvp(f, (y,), (one,))[1], (x,), (one,))[1]  # noqa: E731
    graph = ft.trace(d2)(one)
    vals = [n.meta.get("val") for n in graph.graph_module.graph.nodes]
    assert {v.device.type for v in vals if isinstance(v, torch.Tensor)} == {"cpu"}
    assert ft.eval_shape(d2, one).device == torch.device("cpu")
    x = torch.tensor(3.0, dtype=torch.float64)
    expected = torch.func.jvp(lambda y: torch.func.jvp(f, (y,), (one,))[1], (x,), (one,))[1]
    torch.testing.assert_close(graph(x), expected)  # zeros, on the CPU


def test_inplace_on_intermediates_is_functionalized():
    def f(x):
        y = x * 2
        y.add_(1)
        y[0] = 5.0
        return y

    g = ft.trace(f)(torch.ones(3))
    assert not any(n.target._schema.is_mutable for n in g.ops() if hasattr(n.target, "_schema"))
    torch.testing.assert_close(g(torch.ones(3)), torch.tensor([5.0, 3.0, 3.0]))


def test_input_mutation_names_op_and_argument():
    def f(x, params):
        params["w"].mul_(2)
        return x

    with pytest.raises(ft.TraceError, match=r"`aten.mul_.Tensor` mutates input params\['w'\]"):
        ft.trace(f)(torch.ones(2), {"w": torch.ones(2)})
    with pytest.raises(ft.TraceError, match=r"mutates input params\['w'\] .*test_trace.py"):
        ft.joint(f)(torch.ones(2), {"w": torch.ones(2)})


def test_mutation_through_a_view_of_an_input_is_caught():
    def f(x):
        x[0] = 1.0
        return x * 2

    with pytest.raises(ft.TraceError, match=r"`aten.copy_.default` mutates input x.*x\[0\] = 1.0"):
        ft.trace(f)(torch.ones(2))


def test_data_dependent_branch_names_the_line():
    def f(x):
        if x.sum() > 0:
            return x
        return -x

    with pytest.raises(ft.TraceError) as info:
        ft.trace(f)(torch.ones(2))
    msg = str(info.value)
    assert "if x.sum() > 0:" in msg and "test_trace.py" in msg
    assert "torch.where" in msg and "static_argnums" in msg


def test_data_dependent_shape_is_a_trace_error():
    with pytest.raises(ft.TraceError, match="nonzero"):
        ft.trace(lambda x: x.nonzero())(torch.ones(2))


def test_source_lines_are_recorded():
    def f(x):
        return x.sin()

    g = ft.trace(f)(torch.ones(2))
    (sin,) = g.ops()
    assert sin.meta["functrans.source"].endswith("return x.sin()")


def test_printing_is_stable_and_uses_argument_names():
    g = ft.trace(lambda inp, w: (inp @ w).relu())(torch.ones(2, 3), torch.ones(3, 4))
    assert str(g) == (
        'def forward(inp: "f32[2, 3]", w: "f32[3, 4]"):\n'
        '    mm: "f32[2, 4]" = aten.mm.default(inp, w)\n'
        '    relu: "f32[2, 4]" = aten.relu.default(mm)\n'
        "    return (relu,)"
    )
    assert isinstance(g.graph_module, torch.fx.GraphModule)


def test_plain_dataclass_without_registration_is_a_static_leaf():
    @dataclasses.dataclass(frozen=True)
    class Cfg:
        k: int

    g = ft.trace(lambda x, cfg: x * cfg.k)(torch.ones(2), Cfg(3))
    torch.testing.assert_close(g(torch.ones(2), Cfg(3)), torch.full((2,), 3.0))


def test_common_subexpressions_are_merged_but_random_ops_are_not():
    def f(x):
        a, b = x.sin(), x.sin()
        d1, d2 = torch.nn.functional.dropout(x, 0.5), torch.nn.functional.dropout(x, 0.5)
        return a + b + d1 + d2

    g = ft.trace(f)(torch.ones(4))
    targets = [str(n.target) for n in g.ops()]
    assert targets.count("aten.sin.default") == 1
    assert targets.count("aten.bernoulli.p") == 2


def test_seeding_inside_a_traced_function_is_an_error_not_a_silent_change():
    """Found by the OpInfo sweep: torch.manual_seed inside f was silently dropped."""

    def f(x):
        torch.manual_seed(42)
        return torch.nn.functional.dropout(x, 0.5)

    with pytest.raises(ft.TraceError, match="changed the global random number generator"):
        ft.joint(f)(torch.ones(4))


def test_non_contiguous_tangents_and_inputs_are_handed_over_in_traced_layout():
    """Found by the OpInfo sweep: unfold's backward views its tangent assuming a layout."""
    from functrans.testing import check_partition

    x = torch.randn(5, 5, 5, 5, dtype=torch.float64)
    for strategy in ("default", "min_cut", "full_remat"):
        check_partition(lambda x: x.unfold(0, 3, 1), (x,), strategy)
    g = ft.trace(lambda x: x.view(-1) * 2)(torch.ones(3, 4))
    torch.testing.assert_close(g(torch.ones(4, 3).t()), torch.full((12,), 2.0))


def test_batch_norm_running_stats_update_is_visible_not_hidden():
    """native_batch_norm updates its running stats in place without saying so in its schema:
    graphs must not mutate a caller's buffers behind its back (nor again on recomputation)."""

    def f(x, mean, var):
        return torch.nn.functional.batch_norm(x, mean, var, training=True).sum()

    with pytest.raises(ft.TraceError, match="mutates input mean"):
        ft.joint(f, argnums=0)(torch.randn(4, 3), torch.zeros(3), torch.ones(3))

    def g(x, mean, var):  # updating copies is fine, and the update is a pure graph op
        mean, var = mean.clone(), var.clone()
        y = torch.nn.functional.batch_norm(x, mean, var, training=True)
        return y.sum(), mean, var

    x, mean, var = torch.randn(4, 3), torch.zeros(3), torch.ones(3)
    graph = ft.trace(g)(x, mean, var)
    assert not any(n.target._schema.is_mutable for n in graph.ops() if hasattr(n.target, "_schema"))
    _, new_mean, _ = graph(x, mean, var)
    torch.testing.assert_close(new_mean, 0.1 * x.mean(0))
    assert torch.equal(mean, torch.zeros(3))
