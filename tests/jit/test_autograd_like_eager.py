"""Autograd through a compiled step as eager's: second derivatives, unused inputs, gradients
taken inside, and inputs written in place (issue 49).

Each regression case was wrong on 5d11780 (a first-order answer, zeros where eager gives
None, a raw error, or a refusal); the properties run random programs (``functrans.testing``)
differentiated twice, and random programs that update their inputs in place, against eager.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import functional_call

import functrans as ft
from functrans.testing import programs


def _close(a: object, b: object) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# -- second derivatives ------------------------------------------------------------------------


def _f(x: torch.Tensor) -> torch.Tensor:
    return (x.sin() * x.cos()).sum() + (x**3).sum()


@pytest.mark.parametrize(
    "second",
    [
        lambda g, x: torch.autograd.functional.hvp(g, x, torch.ones_like(x))[1],
        lambda g, x: torch.autograd.functional.vhp(g, x, torch.ones_like(x))[1],
        lambda g, x: torch.autograd.functional.hessian(g, x),
        lambda g, x: torch.autograd.functional.jacobian(
            lambda y: torch.autograd.functional.jacobian(g, y, create_graph=True), x
        ),
    ],
    ids=["hvp", "vhp", "hessian", "jacobian_of_jacobian"],
)
def test_second_derivatives_of_a_jitted_function_are_eagers(second) -> None:
    # 5d11780: all zeros (the compiled backward's gradients were detached)
    x = torch.randn(4, dtype=torch.float64)
    _close(second(ft.jit(_f), x), second(_f, x))


def test_a_third_derivative_through_a_jitted_function() -> None:
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)

    def third(g):
        (a,) = torch.autograd.grad(g(x), x, create_graph=True)
        (b,) = torch.autograd.grad(a.sum(), x, create_graph=True)
        return torch.autograd.grad(b.sum(), x)[0]

    _close(third(ft.jit(_f)), third(_f))


def _critic() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def _gradient_penalty(critic, x: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_(True)
    out = critic(x).sum()
    (g,) = torch.autograd.grad(out, x, create_graph=True)
    return out + 10 * (g.norm(dim=1) - 1).pow(2).mean()


@pytest.mark.parametrize("where", ["critic jitted", "penalty jitted"])
def test_a_wgan_gp_penalty_trains_the_critic_as_eager(where: str) -> None:
    # 5d11780: jitted critic, the penalty dropped (first-order grads); jitted penalty: KeyError
    critic, twin = _critic(), _critic()
    x = torch.randn(5, 3)
    if where == "critic jitted":
        _gradient_penalty(ft.jit(critic), x).backward()
    else:
        ft.jit(lambda x: _gradient_penalty(critic, x))(x).backward()
    _gradient_penalty(twin, x).backward()
    for a, b in zip(critic.parameters(), twin.parameters(), strict=True):
        _close(a.grad, b.grad)


def test_maml_through_repeated_blocks_keeps_its_second_order_term() -> None:
    # 5d11780: 0.33 off torch.func (within 5e-4 of first-order MAML): a repeated block's
    # region backward had no derivative; a gradient differentiated again traces blocks inline
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh()
    )
    params = {k: v.detach() for k, v in net.named_parameters()}
    x, y = torch.randn(4, 3), torch.randn(4, 8)

    def inner(p, x, y):
        return ((functional_call(net, p, (x,)) - y) ** 2).mean()

    def meta(grad):
        def loss(p, x, y):
            g = grad(inner)(p, x, y)
            return inner({k: p[k] - 0.1 * g[k] for k in p}, x, y)

        return loss

    want = torch.func.grad(meta(torch.func.grad))(params, x, y)
    for got in (ft.grad(meta(ft.grad))(params, x, y), ft.jit(ft.grad(meta(ft.grad)))(params, x, y)):
        for k in want:
            _close(got[k], want[k])


def test_random_numbers_in_a_step_differentiated_twice_are_refused_by_name() -> None:
    g = ft.jit(lambda y: torch.nn.functional.dropout(y, 0.5).sum() * (y**2).sum())
    y = torch.randn(4, requires_grad=True)
    with pytest.raises(ft.UnsupportedOpError, match=r"create_graph=True.*random numbers"):
        torch.autograd.grad(g(y), y, create_graph=True)


# -- gradients taken inside, and structure -------------------------------------------------------


def test_torch_autograd_grad_inside_jit() -> None:
    # torch.func's test_inner_grad: 5d11780 raised a raw error
    def f(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        (gx,) = torch.autograd.grad(y.sum(), x)
        return gx

    x = torch.randn(3, requires_grad=True)
    got, want = ft.jit(f)(x), f(x)
    _close(got, want)
    assert got.requires_grad is want.requires_grad is False


def test_allow_unused_gives_none_exactly_where_eager_does() -> None:
    # 5d11780: zeros for w2 (the fix of a round ago covered .backward() only)
    def f(w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (w1 * 2).sum(), (w2 * 3).sum()

    w1, w2 = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    o0, _ = ft.jit(f)(w1, w2)
    g1, g2 = torch.autograd.grad(o0, (w1, w2), allow_unused=True)
    _close(g1, torch.full((3,), 2.0))
    assert g2 is None


@settings(max_examples=max(30, settings().max_examples // 4))  # ~0.3 s an example
@given(
    deps=st.lists(st.sets(st.integers(0, 2), max_size=3), min_size=1, max_size=3),
    asked=st.sets(st.integers(0, 2), min_size=1, max_size=3),
)
def test_property_allow_unused_none_where_eager_for_every_subset(deps, asked) -> None:
    """Outputs that each depend on a subset of three inputs; the gradient of some of them:
    None exactly for the inputs eager finds unreachable."""
    asked = sorted(i for i in asked if i < len(deps))
    if not asked:
        return

    def f(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ins = (a, b, c)
        return tuple(sum((ins[i] * (i + 1)).sum() for i in d) + a.detach().sum() for d in deps)

    ins = [torch.randn(2, requires_grad=True) for _ in range(3)]
    outs, eager = ft.jit(f)(*ins), f(*ins)
    for o in eager:
        if not o.requires_grad:
            return  # an output depending on no input: eager cannot differentiate it either
    got = torch.autograd.grad([outs[i] for i in asked], ins, allow_unused=True)
    want = torch.autograd.grad([eager[i] for i in asked], ins, allow_unused=True)
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        if w is not None:
            _close(g, w)


@settings(max_examples=max(40, settings().max_examples // 5))  # ~0.4 s an example
@given(prog=programs(max_steps=5, max_inputs=2, dtypes=(torch.float64,), exclude=("dropout",)))
def test_property_random_programs_differentiated_twice_equal_eager(prog) -> None:
    """``create_graph=True`` through the jitted program, then a second gradient (a
    Hessian-vector product): eager's, or a named error."""
    ins = [x.requires_grad_() for x in prog.example_inputs()]

    def loss(*xs: torch.Tensor) -> torch.Tensor:
        outs = prog(*xs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        floats = [o.sum() for o in outs if o.is_floating_point()]
        return torch.stack(floats).sum() if floats else xs[0].sum() * 0

    def hvp(f):
        out = f(*ins)
        if not out.requires_grad:
            return None
        grads = torch.autograd.grad(out, ins, create_graph=True, allow_unused=True)
        total = sum((g * g).sum() for g in grads if g is not None and g.requires_grad)
        if not isinstance(total, torch.Tensor):
            return None
        return torch.autograd.grad(total, ins, allow_unused=True)

    want = hvp(loss)
    got = hvp(ft.jit(loss))
    if want is None:
        return
    for g, w in zip(got, want, strict=True):
        if w is None:
            assert g is None or not g.abs().max() > 0
        else:
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


# -- inputs written in place -------------------------------------------------------------------


@pytest.mark.parametrize(
    "write",
    [
        lambda x, y: x.add_(1),
        lambda x, y: x.copy_(y),
        lambda x, y: x[0].mul_(3),
        lambda x, y: x.clamp_(min=0),
    ],
    ids=["add_", "copy_", "view mul_", "clamp_"],
)
def test_an_input_written_in_place_is_written_back(write) -> None:
    # 5d11780: TraceError; AOTAutograd writes such inputs back after the graph
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        write(x, y)
        return (x * y).sum()

    jitted = ft.jit(f)
    for _ in range(2):  # the compile, then a cache hit
        x, y = torch.randn(3), torch.randn(3)
        xe = x.clone()
        _close(jitted(x, y), f(xe, y))
        _close(x, xe)
    assert jitted.cache_info().misses == 1


def test_a_written_input_computed_from_a_parameter_gets_its_gradient() -> None:
    w = torch.randn(3, requires_grad=True)

    def f(x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return x.sum()

    grads = []
    for g in (ft.jit(f), f):
        w.grad = None
        x = w * 1.0  # not a leaf: eager records the in-place update
        (g(x) + x.pow(2).sum()).backward()
        grads.append(w.grad.clone())
    _close(*grads)


def test_a_leaf_that_requires_grad_written_in_place_is_refused_as_eager() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return x.sum()

    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        f(torch.ones(2, requires_grad=True))
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        ft.jit(f)(torch.ones(2, requires_grad=True))


def _bn_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.ReLU())


@pytest.mark.parametrize("form", ["module argument", "functional_call", "closure"])
def test_batch_norm_statistics_follow_eager(form: str) -> None:
    # 5d11780: refused (it updates a buffer it captures); a module passed as an argument too
    model, twin = _bn_model(), _bn_model()

    def step(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        if form == "functional_call":
            return functional_call(m, dict(m.named_parameters()), (x,)).pow(2).sum()
        return m(x).pow(2).sum()

    jitted = ft.jit(step) if form != "closure" else ft.jit(lambda m, x: step(model, x))
    for _ in range(3):
        x = torch.randn(8, 4)
        got = jitted(model, x)
        want = step(twin, x)
        _close(got, want)
        got.backward()
        want.backward()
    for a, b in zip(model.state_dict().values(), twin.state_dict().values(), strict=True):
        _close(a, b)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        _close(a.grad, b.grad)


def test_a_module_passed_as_an_argument_is_guarded_like_one_closed_over() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Dropout(0.5))
    f = ft.jit(lambda m, x: m(x).sum())
    x = torch.randn(2, 3)
    model.eval()
    _close(f(model, x), model(x).sum())
    model[1].p = 0.0  # read by the trace: a change compiles anew
    model.train()
    _close(f(model, x), model(x).sum())
    other = copy.deepcopy(model)
    _close(f(other, x), other(x).sum())


@settings(max_examples=max(40, settings().max_examples // 5))  # ~0.3 s an example
@given(
    prog=programs(max_steps=4, max_inputs=2, dtypes=(torch.float64,), exclude=("dropout",)),
    op=st.sampled_from(["add_", "mul_", "copy_", "zero_", "clamp_"]),
    which=st.integers(0, 1),
)
def test_property_random_programs_writing_their_inputs_equal_eager(prog, op, which) -> None:
    """A random program whose input is updated in place first (and read after): outputs, and
    the inputs left behind, as eager's; twice, so the cache hit writes back too."""

    def f(*xs: torch.Tensor) -> object:
        x = xs[which % len(xs)]
        if op == "copy_":
            x.copy_(x.flip(-1) if x.dim() else x * 2)
        elif op == "zero_":
            x.zero_()
        elif op == "clamp_":
            x.clamp_(min=-0.5)
        else:
            getattr(x, op)(0.5)
        return prog(*xs)

    jitted = ft.jit(f)
    for _ in range(2):
        ins = prog.example_inputs()
        twins = [x.clone() for x in ins]
        got, want = jitted(*ins), f(*twins)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, equal_nan=True)
        for a, b in zip(ins, twins, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("nested", [True, False])
def test_transformer_encoder_fast_path_is_matched(nested: bool) -> None:
    """Eval-mode ``nn.TransformerEncoder`` under no_grad with a padding mask: eager runs it on
    nested tensors (zeros at padded positions); jit runs such calls as written, saying so, and
    compiles an encoder built with ``enable_nested_tensor=False`` (eager's padded path)."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, batch_first=True)
    enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested).eval()
    x = torch.randn(2, 5, 16)
    mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])

    def f(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return enc(x, src_key_padding_mask=m)  # type: ignore[no-any-return]

    jitted = ft.jit(f)
    with torch.no_grad():
        want = f(x, mask)
        if nested:
            with pytest.warns(UserWarning, match="enable_nested_tensor=False"):
                got = jitted(x, mask)
        else:
            got = jitted(x, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (jitted.cache_info().misses == 0) is nested


def test_update_bn_on_a_jitted_model_runs_as_eager() -> None:
    """``torch.optim.swa_utils.update_bn`` sets ``momentum=None`` (a cumulative average that
    divides by the batch counter as a Python number): the jitted model runs those calls as
    written, naming the cause, and the statistics are eager's (issue 52: it blamed the
    user's forward)."""
    torch.manual_seed(0)

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))

    loader = [torch.randn(16, 4) for _ in range(3)]
    want, mine = make(), make()
    torch.optim.swa_utils.update_bn(loader, want)
    with pytest.warns(UserWarning, match="momentum=None"):
        torch.optim.swa_utils.update_bn(loader, ft.jit(mine))
    torch.testing.assert_close(mine[1].running_mean, want[1].running_mean)
    torch.testing.assert_close(mine[1].running_var, want[1].running_var)


def test_a_pure_transform_over_a_training_batch_norm_names_its_update() -> None:
    """A loss closing over a train-mode BatchNorm under ``ft.joint`` (a graph, which cannot
    write the module): the refusal names the norm's own running-statistics update and the
    ways out, not the user's code to rewrite."""
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8)).train()
    with pytest.raises(
        ft.FunctransError, match=r"BatchNorm in training mode updates its run.*ft\.jit"
    ):
        ft.joint(lambda x: m(x).square().mean())(torch.randn(16, 4))


def test_grad_of_a_loss_closing_over_a_training_batch_norm_is_eagers() -> None:
    """``ft.grad`` of a loss closing over a train-mode BatchNorm: the gradient and the running
    statistics are eager's (the model's tensors are the call's inputs, its buffers written
    back, as ``ft.jit`` does), and the parameters' ``.grad`` are untouched, as
    ``torch.autograd.grad`` leaves them. It was refused while its first trace baked the
    parameters in."""
    torch.manual_seed(0)
    mine = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8)).train()
    want = copy.deepcopy(mine)
    grad = ft.grad(lambda x: mine(x).square().mean())
    for step in range(2):
        x = torch.randn(16, 4)
        xr = x.clone().requires_grad_()
        (expected,) = torch.autograd.grad(want(xr).square().mean(), xr)
        assert torch.equal(grad(x), expected), step
        for (name, a), (_, b) in zip(mine.named_buffers(), want.named_buffers(), strict=True):
            assert torch.equal(a, b), name
    assert all(p.grad is None for p in mine.parameters())
