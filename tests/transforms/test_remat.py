"""remat: JAX's semantics in traced graphs, torch-checkpoint semantics in eager, one policy."""

import pytest
import torch
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks

import functrans as ft
from functrans import policies
from functrans.extend import REMAT, Policy

aten = torch.ops.aten


def saved_names(f, *args, strategy="default"):
    p = ft.partition(ft.joint(f)(*args), strategy)
    return sorted(s.name for s in p.saved)


def mlp(x, w1, w2):
    return torch.tanh(torch.relu(x @ w1) @ w2).sum()


def mlp_args(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(4, 4, generator=g, dtype=dtype) for _ in range(3))


def test_policy_none_saves_only_the_inputs():
    f = ft.remat(lambda x: torch.sin(torch.sin(x)).sum())
    assert saved_names(f, torch.ones(4)) == ["primals_1"]


def test_dots_saveable_saves_exactly_the_matmul_outputs():
    f = ft.remat(mlp, policy=policies.dots_saveable)
    for strategy in ("default", "full_remat", "min_cut"):
        p = ft.partition(ft.joint(f)(*mlp_args()), strategy)
        assert sorted(s.name for s in p.saved if not s.is_input) == ["mm", "mm_1"], strategy


def test_name_based_policies_save_exactly_the_named_values():
    def f(x, w):
        h = ft.checkpoint_name(torch.relu(x @ w), "h")
        g = ft.checkpoint_name(torch.sin(h), "g")
        return torch.cos(g).sum()

    args = mlp_args()[:2]
    only_h = ft.remat(f, policy=policies.save_only_these_names("h"))
    assert saved_names(only_h, *args) == ["checkpoint_name", "primals_1", "primals_2"]
    but_h = ft.remat(f, policy=policies.save_any_names_but_these("h"))
    assert saved_names(but_h, *args) == ["checkpoint_name_1", "primals_1", "primals_2"]


@pytest.mark.parametrize(
    "policy",
    [
        None,
        policies.everything_saveable,
        policies.nothing_saveable,
        policies.dots_saveable,
        policies.dots_with_no_batch_dims_saveable,
        [aten.relu.default],
        policies.save_from_both_policies(policies.dots_saveable, [aten.relu.default]),
    ],
)
@pytest.mark.parametrize("strategy", ["default", "full_remat", "min_cut"])
def test_gradients_equal_eager_in_both_modes(policy, strategy):
    args = mlp_args()
    want = torch.func.grad(mlp, argnums=(0, 1, 2))(*args)
    f = ft.remat(mlp, policy=policy)
    torch.testing.assert_close(ft.grad(f, argnums=(0, 1, 2), partition=strategy)(*args), want)
    leaves = [a.clone().requires_grad_() for a in args]
    f(*leaves).backward()
    torch.testing.assert_close(tuple(a.grad for a in leaves), want)


def test_same_policy_same_decisions_in_eager_and_traced_mode():
    seen = []

    def recording(op, *args, **kwargs):
        decision = policies.dots_saveable(op, *args, **kwargs)
        seen.append((str(op), decision))
        return decision

    f = ft.remat(mlp, policy=recording)
    jg = ft.joint(f)(*mlp_args())
    traced = {
        (str(n.target), n.meta[REMAT] is Policy.MUST_SAVE)
        for n in jg.forward_nodes()
        if REMAT in n.meta
    }
    seen.clear()
    leaves = [a.clone().requires_grad_() for a in mlp_args()]
    f(*leaves)  # eager forward: the policy runs once per op
    assert {s for s in seen if s[1]} == {s for s in traced if s[1]} == {("aten.mm.default", True)}
    # the same ops were decided, up to core-ATen decomposition (sum -> sum.dim_IntList)
    assert {s[0] for s in seen} - {"aten.sum.default"} == {s[0] for s in traced} - {
        "aten.sum.dim_IntList"
    }


def test_eager_remat_saves_fewer_bytes():
    def saved_bytes(fn):
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        leaves = [a.clone().requires_grad_() for a in mlp_args(torch.float32)]
        with saved_tensors_hooks(pack, lambda t: t):
            fn(*leaves).backward()
        return total[0]

    plain = saved_bytes(mlp)
    remat_dots = saved_bytes(ft.remat(mlp, policy=policies.dots_saveable))
    assert remat_dots < plain


def test_dropout_inside_remat_matches_no_remat_with_the_same_seed():
    def f(x, w):
        return (F.dropout(x @ w, 0.5) * x).sum()

    x, w = (torch.randn(8, 8) for _ in range(2))

    def grads(fn):
        torch.manual_seed(7)
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        fn(xs, ws).backward()
        return xs.grad, ws.grad

    torch.testing.assert_close(grads(ft.remat(f)), grads(f))


def test_bad_policy_answer_names_the_op_and_value():
    f = ft.remat(mlp, policy=lambda op, *a, **k: "yes")
    with pytest.raises(ft.FunctransError, match=r"returned 'yes' for op aten.mm.default"):
        ft.joint(f)(*mlp_args())
    with pytest.raises(ft.FunctransError, match=r"returned 'yes' for op aten.mm.default"):
        f(*[a.clone().requires_grad_() for a in mlp_args()]).backward()


def test_torch_checkpoint_policy_values_are_accepted():
    from torch.utils.checkpoint import CheckpointPolicy

    f = ft.remat(
        mlp,
        policy=lambda op, *a, **k: (
            CheckpointPolicy.MUST_SAVE
            if op is aten.mm.default
            else CheckpointPolicy.PREFER_RECOMPUTE
        ),
    )
    p = ft.partition(ft.joint(f)(*mlp_args()), "min_cut")
    assert {"mm", "mm_1"} <= {s.name for s in p.saved}


def test_nested_remat_keeps_inner_decisions():
    def inner_fn(x, w):
        return torch.relu(x @ w)

    inner = ft.remat(inner_fn, policy=policies.everything_saveable)

    def outer_fn(x, w1, w2):
        return torch.tanh(inner(x, w1) @ w2).sum()

    f = ft.remat(outer_fn, policy=policies.nothing_saveable)
    jg = ft.joint(f)(*mlp_args())
    tags = {n.name: n.meta[REMAT] for n in jg.forward_nodes() if REMAT in n.meta}
    assert tags["mm"] is Policy.MUST_SAVE  # inside the inner region: the inner policy
    # the inner region's output belongs to the outer region, whose policy decides it
    assert tags["relu"] is tags["mm_1"] is Policy.MUST_RECOMPUTE
    # (torch.func.grad cannot differentiate through torch's checkpoint: reference without it)
    want = torch.func.grad(mlp, argnums=(0, 1, 2))(*mlp_args())
    torch.testing.assert_close(ft.grad(f, argnums=(0, 1, 2))(*mlp_args()), want)


def test_kwargs_pytree_outputs_and_vjp():
    def plain(x, *, params):
        h = x @ params["w"]
        return {"h": h, "loss": h.tanh().sum()}

    f = ft.remat(policy=policies.dots_saveable)(plain)
    x, w = mlp_args()[:2]
    out, vjp_fn = ft.vjp(lambda x, w: f(x, params={"w": w}), x, w)
    _, want_vjp = torch.func.vjp(lambda x, w: plain(x, params={"w": w}), x, w)
    cot = {"h": torch.ones_like(out["h"]), "loss": torch.tensor(1.0, dtype=x.dtype)}
    torch.testing.assert_close(vjp_fn(cot), want_vjp(cot))


def test_remat_module_in_a_training_loop():
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    ref.load_state_dict(block.state_dict())
    model = ft.remat(block, policy=policies.dots_saveable)
    assert len(list(model.parameters())) == 4
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    x = torch.randn(4, 8)
    for _ in range(3):
        for m, opt in zip((model, ref), opts, strict=True):
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_saved_residuals_lines():
    def f(x, w):
        return ft.checkpoint_name(torch.tanh(x @ w), "a").sin().sum()

    lines = [
        str(r)
        for r in ft.saved_residuals(
            ft.remat(f, policy=policies.save_only_these_names("a")), *mlp_args()[:2]
        )
    ]
    assert any(line.startswith("f64[4, 4] 128 B named 'a'") for line in lines), lines
    assert any("0 B from the argument 'x'" in line for line in lines), lines
    module = torch.nn.Linear(4, 4)
    lines = [str(r) for r in ft.saved_residuals(module, torch.ones(2, 4))]
    assert any("from the argument 'inputs[0]'" in line for line in lines), lines


def test_tags_survive_functionalization_of_inplace_ops():
    def f(x, w):
        h = x @ w
        h.mul_(2)  # an in-place op makes tracing retrace through functionalization
        return h.tanh().sum()

    jg = ft.joint(ft.remat(f, policy=policies.dots_saveable))(*mlp_args()[:2])
    tags = {n.name: n.meta.get(REMAT) for n in jg.forward_nodes()}
    assert tags["mm"] is Policy.MUST_SAVE and tags["mul"] is Policy.MUST_RECOMPUTE


def test_eager_second_backward_needs_retain_graph_and_then_works():
    f = ft.remat(mlp, policy=policies.dots_saveable)
    leaves = [a.clone().requires_grad_() for a in mlp_args()]
    loss = f(*leaves)
    loss.backward(retain_graph=True)
    first = [a.grad.clone() for a in leaves]
    loss.backward()  # recomputes again from the kept cache: gradients accumulate exactly
    for a, g in zip(leaves, first, strict=True):
        torch.testing.assert_close(a.grad, 2 * g)
    loss = f(*leaves)
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


def residual_stack(depth):
    def block(x, w):
        return x + torch.tanh(x @ w)

    def stack(x, *ws, policy=None):
        for w in ws:
            x = ft.remat(block, policy=policy)(x, w) if policy != "off" else block(x, w)
        return x.sum()

    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(8, 8, generator=g, dtype=torch.float64) / 4 for _ in range(depth)]
    return stack, (torch.randn(4, 8, generator=g, dtype=torch.float64), *ws)


def test_per_layer_remat_saves_each_block_input_like_eager_checkpointing():
    """Found by the remat benchmark: tagging a region's outputs MUST_RECOMPUTE chained the
    blocks into one region (everything recomputed from the first input), and the default
    strategy walked every path of the residual stack (exponential)."""
    stack, args = residual_stack(40)
    p = ft.partition(ft.joint(stack)(*args), "default")
    block_inputs = [s for s in p.saved if not s.is_input]
    assert len(block_inputs) == 39 and all(s.op == "aten.add.Tensor" for s in block_inputs)
    want = torch.func.grad(lambda *a: stack(*a, policy="off"), argnums=tuple(range(41)))(*args)
    got = ft.grad(stack, argnums=tuple(range(41)))(*args)
    torch.testing.assert_close(got, want)


def test_everything_saveable_with_multi_output_ops_under_min_cut():
    """Found by the remat benchmark: MUST_SAVE on native_layer_norm (a tuple) had no finite cut."""

    def f(x, w):
        return F.layer_norm(torch.relu(x @ w), (4,)).pow(2).sum()

    g = ft.remat(f, policy=policies.everything_saveable)
    args = mlp_args()[:2]
    p = ft.partition(ft.joint(g)(*args), "min_cut")
    assert any(s.op == "operator.getitem" or "getitem" in s.name for s in p.saved), p.report()
    want = torch.func.grad(f, argnums=(0, 1))(*args)
    torch.testing.assert_close(ft.grad(g, argnums=(0, 1), partition="min_cut")(*args), want)


def test_name_policies_in_eager_mode_see_the_named_values():
    seen = []

    def policy(op, *args, **kwargs):
        decision = policies.save_only_these_names("h")(op, *args, **kwargs)
        seen.append((str(op), decision))
        return decision

    def f(x, w):
        return torch.cos(ft.checkpoint_name(torch.relu(x @ w), "h")).sum()

    leaves = [a.clone().requires_grad_() for a in mlp_args()[:2]]
    ft.remat(f, policy=policy)(*leaves).backward()
    assert ("functrans.checkpoint_name.default", True) in seen

    def plain(x, w):  # (torch.func cannot differentiate the name op: reference without it)
        return torch.cos(torch.relu(x @ w)).sum()

    want = torch.func.grad(plain, argnums=(0, 1))(*mlp_args()[:2])
    torch.testing.assert_close(tuple(a.grad for a in leaves), want)
