"""joint(): roles and phases by data flow, argnums, unused and non-float inputs, has_aux."""

import pytest
import torch

import functrans as ft
from functrans.testing import assert_close, eager_vjp


def roles(jg):
    return [(p.name, p.meta["functrans.role"]) for p in jg.placeholders()]


def test_roles_and_phases_follow_data_flow():
    jg = ft.joint(lambda x, w: torch.tanh(x @ w).sum())(torch.ones(2, 2), torch.ones(2, 2))
    assert roles(jg) == [
        ("primals_1", ft.Role.PRIMAL),
        ("primals_2", ft.Role.PRIMAL),
        ("tangents_1", ft.Role.TANGENT),
    ]
    phases = {n.name: n.meta["functrans.phase"] for n in jg.fx_graph.nodes if n.op != "output"}
    assert phases["mm"] is ft.Phase.FORWARD and phases["tanh"] is ft.Phase.FORWARD
    # 1 - tanh^2 needs no tangent: by data flow it is a forward value (it could be saved)
    assert phases["sub"] is ft.Phase.FORWARD
    assert phases["mul_1"] is ft.Phase.BACKWARD and phases["mm_1"] is ft.Phase.BACKWARD
    jg.verify()


def test_verify_rejects_a_wrong_phase():
    jg = ft.joint(lambda x: x.sin().sum())(torch.ones(2))
    next(jg.ops()).meta["functrans.phase"] = ft.Phase.BACKWARD
    with pytest.raises(ft.GraphError, match="phase"):
        jg.verify()


def test_argnums_selects_differentiated_args():
    f = lambda x, y: (x * y).sum()  # noqa: E731
    x, y = torch.randn(3), torch.randn(3)
    jg = ft.joint(f, argnums=1)(x, y)
    _, grads = jg((x, y), (torch.tensor(1.0),))
    torch.testing.assert_close(grads, x)
    _, grads = ft.joint(f, argnums=(1, 0))(x, y)((x, y), (torch.tensor(1.0),))
    torch.testing.assert_close(grads, (x, y))
    with pytest.raises(ft.TraceError, match="argnums=5"):
        ft.joint(f, argnums=5)(x, y)


def test_unused_and_non_float_inputs():
    def f(x, unused, idx, n):
        return x[idx].sum() * n

    args = (torch.randn(4), torch.randn(2), torch.tensor([0, 2]), 3.0)
    jg = ft.joint(f)(*args)
    _, grads = jg(args, (torch.tensor(1.0),))
    assert grads[2] is None and grads[3] is None
    torch.testing.assert_close(grads[1], torch.zeros(2))
    torch.testing.assert_close(grads[0], torch.tensor([3.0, 0.0, 3.0, 0.0]))


def test_one_tangent_per_float_output_leaf():
    def f(x):
        return {"a": x.sin(), "i": x.argmax(), "b": [x.cos().sum()]}

    x = torch.randn(3)
    jg = ft.joint(f)(x)
    assert [t.meta["functrans.path"] for t in jg.tangents()] == [
        "tangent of output['a']",
        "tangent of output['b'][0]",
    ]
    tangents = (torch.randn(3), torch.tensor(2.0))
    outs, grads = jg((x,), tangents)
    e_outs, e_grads = eager_vjp(f, (x,), tangents)
    assert_close(outs, e_outs, "outs")
    assert_close(grads, e_grads, "grads")


def test_has_aux_output_gets_no_tangent():
    def f(x):
        return (x * x).sum(), {"stat": x.mean()}

    jg = ft.joint(f, has_aux=True)(torch.ones(2))
    assert len(jg.tangents()) == 1
    with pytest.raises(ft.TraceError, match="has_aux=True"):
        ft.joint(lambda x: x, has_aux=True)(torch.ones(2))


def test_output_that_is_an_input():
    x = torch.randn(2)
    outs, grads = ft.joint(lambda x: x)(x)((x,), (torch.ones(2) * 5,))
    torch.testing.assert_close(outs, x)
    torch.testing.assert_close(grads[0], torch.full((2,), 5.0))


def test_joint_graph_is_callable_with_its_pytree_convention():
    jg = ft.joint(lambda x: (x * x).sum())(torch.ones(3))
    assert repr(jg).startswith("<JointGraph with 2 inputs")
    with pytest.raises(ft.TraceError, match="structure"):
        jg((torch.ones(3),), ())


def test_joint_runs_the_function_once() -> None:
    # the tangents become inputs of the trace when the outputs are known, so f is not run a
    # second time beforehand to learn their shapes
    calls: list[int] = []

    def f(x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        calls.append(1)
        return x.sin().sum(), {"aux": x.cos()}

    jg = ft.joint(f, has_aux=True)(torch.ones(3))
    assert len(calls) == 1
    assert [p.name for p in jg.placeholders()] == ["primals_1", "tangents_1"]
    outs, grads = jg((torch.zeros(3),), (torch.tensor(1.0),))
    torch.testing.assert_close(outs[0], torch.tensor(0.0))
    torch.testing.assert_close(grads[0], torch.ones(3))


def _described(jg):
    """Per node: its name, target and each value's layout, ``requires_grad`` and storage
    (by the first node whose value lies on it)."""
    first: dict[int, int] = {}
    rows = []
    for i, n in enumerate(jg.fx_graph.nodes):
        vals = n.meta.get("val")
        row = [n.name, str(n.target)]
        for v in vals if isinstance(vals, (list, tuple)) else [vals]:
            if isinstance(v, torch.Tensor):
                owner = first.setdefault(v.untyped_storage()._cdata, i)
                row.append((tuple(v.shape), v.stride(), v.dtype, v.requires_grad, owner))
        rows.append(row)
    return rows


def test_inputs_recorded_directly_as_make_fx_records_them(monkeypatch):
    # a joint trace's inputs are written into the graph as placeholders by the traced
    # function itself (not by make_fx, which snapshots and describes each); the graph and
    # every value's layout, requires_grad and storage are the ones make_fx's inputs give
    import functrans._trace.trace as trace_module

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    params = {k: v.detach().requires_grad_() for k, v in net.named_parameters()}
    x = torch.randn(3, 4)

    def f(ps, x):
        return torch.func.functional_call(net, ps, (x,)).square().sum()

    used = []
    known = trace_module.known_inputs
    monkeypatch.setattr(
        trace_module, "known_inputs", lambda inputs: used.append(known(inputs)) or used[-1]
    )
    direct = ft.joint(f, argnums=(0, 1))(params, x)
    assert used == [True]
    monkeypatch.setattr(trace_module, "known_inputs", lambda inputs: False)
    through_make_fx = ft.joint(f, argnums=(0, 1))(params, x)
    assert str(direct) == str(through_make_fx)
    assert _described(direct) == _described(through_make_fx)
    one = (torch.tensor(1.0),)
    assert_close(direct((params, x), one), eager_vjp(f, (params, x), one), "joint vs eager")


def test_fake_devices_are_answered_as_the_tracing_modes_answer_them(monkeypatch):
    # a trace answers fake tensors' device queries ahead of make_fx's modes (autograd asks
    # dozens per op); with every query passed down instead, the joint graph is the same
    import functrans._trace.trace_run as trace_run

    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    def f(x):
        for b in blocks:
            x = torch.tanh(b(x)) + torch.ones(4, device=x.device)
        return x.to(x.device).sum()

    x = torch.randn(2, 4, requires_grad=True)
    answered = ft.joint(f)(x)
    monkeypatch.setattr(
        trace_run._FakeDevices,
        "__torch_dispatch__",
        lambda self, func, types, args=(), kwargs=None: func(*args, **(kwargs or {})),
    )
    passed_down = ft.joint(f)(x)
    assert str(answered) == str(passed_down)
    assert _described(answered) == _described(passed_down)


def test_a_users_own_fake_tensors_keep_their_requires_grad():
    # the trace turns requires_grad off on the fakes it recorded as inputs: those are the
    # trace's own fakes, never a user's (here: fake tensors a user made to estimate memory)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.randn(3, 4)
        w = torch.randn(4, 2).requires_grad_()
        b = torch.randn(2).requires_grad_()
    jg = ft.joint(lambda w, b, x: torch.tanh(x @ w + b).sum(), argnums=(0, 1))(w, b, x)
    assert [n.name for n in jg.placeholders()][:3] == ["primals_1", "primals_2", "primals_3"]
    assert (w.requires_grad, b.requires_grad, x.requires_grad) == (True, True, False)
