"""Offload, the third decision: the graph ops, the rules, the exact solver and its promises,
a poison test of the wiring, and offload under jit in a training loop."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from expecttest import assert_expected_inline
from hypothesis import example, given, settings
from hypothesis import strategies as st

import functrans as ft
from functrans import FunctransError, InvalidPartitionError, Offload
from functrans.extend import (
    OFFLOAD_OPS,
    Cut,
    PinnedHost,
    cut_problem,
    use_transfer,
    why_not_offload,
)
from functrans.partitioners._ilp import solve_ilp
from functrans.partitioners.memory_budget import MemoryBudget, offload_terms
from functrans.testing import check_partition, programs
from functrans.testing._check import check_split, compare
from functrans.testing._program import InputSpec, Program, Step

INF = Offload(bandwidth=math.inf)


def mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = F.dropout(torch.tanh(x @ w1), 0.3)
    return (torch.relu(h @ w2) ** 2).sum()


def mlp_args() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(16, 32, generator=g),
        torch.randn(32, 64, generator=g, requires_grad=True),
        torch.randn(64, 32, generator=g, requires_grad=True),
    )


def offload_everything(jg: ft.JointGraph) -> Cut:
    """A strategy that asks to offload every forward value (the rules pick what may go)."""
    return Cut(saved=(), offloaded=tuple(n for n in jg.forward_nodes() if n.op != "placeholder"))


# ---------------------------------------------------------------------------------------------
# the graphs


def test_golden_offloaded_graphs() -> None:
    # exp goes out after its last forward use (mm); it comes back ahead of the last op that
    # computes before its first backward use (mul_1: the copy runs meanwhile), and is waited
    # for right before that use
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x.exp() @ w).tanh().sum()

    jg = ft.joint(f)(torch.ones(2, 3), torch.ones(3, 4))
    p = ft.partition(jg, lambda jg: Cut(saved=("tanh",), offloaded=("exp",)))
    assert_expected_inline(
        str(p.forward),
        """\
def forward(primals_1: "f32[2, 3]", primals_2: "f32[3, 4]"):
    exp: "f32[2, 3]" = aten.exp.default(primals_1)
    mm: "f32[2, 4]" = aten.mm.default(exp, primals_2)
    to_host_default: "f32[2, 3]" = functrans.to_host.default(exp)
    tanh: "f32[2, 4]" = aten.tanh.default(mm)
    sum_1: "f32[]" = aten.sum.dim_IntList(tanh, [])
    return (sum_1, primals_2, to_host_default, tanh)""",
    )
    assert_expected_inline(
        str(p.backward),
        """\
def forward(primals_2: "f32[3, 4]", to_host_default: "f32[2, 3]", tanh: "f32[2, 4]", tangents_1: "f32[]"):
    expand: "f32[2, 4]" = aten.expand.default(tangents_1, [2, 4])
    mul: "f32[2, 4]" = aten.mul.Tensor(tanh, tanh)
    sub: "f32[2, 4]" = aten.sub.Tensor(1, mul)
    to_device_default: "f32[2, 3]" = functrans.to_device.default(to_host_default, device('cpu'))
    mul_1: "f32[2, 4]" = aten.mul.Tensor(expand, sub)
    wait_copy_default: "f32[2, 3]" = functrans.wait_copy.default(to_device_default)
    permute: "f32[3, 2]" = aten.permute.default(wait_copy_default, [1, 0])
    mm_1: "f32[3, 4]" = aten.mm.default(permute, mul_1)
    permute_1: "f32[4, 3]" = aten.permute.default(primals_2, [1, 0])
    mm_2: "f32[2, 3]" = aten.mm.default(mul_1, permute_1)
    mul_2: "f32[2, 3]" = aten.mul.Tensor(mm_2, wait_copy_default)
    return (mul_2, mm_1)""",
    )
    p.forward.verify()
    p.backward.verify()


def test_offloaded_bytes_leave_the_device() -> None:
    jg = ft.joint(lambda x: x.exp().sin().sum())(torch.ones(256))
    kept = ft.partition(jg, "default")
    moved = ft.partition(jg, lambda jg: Cut(offloaded=("exp",)))
    assert [s.name for s in moved.offloaded] == ["exp"]
    assert moved.activation_bytes == kept.activation_bytes - 1024
    assert moved.offloaded_bytes == 1024 and moved.transfer_bytes == 2048
    assert moved.host_peak_bytes == 1024 and kept.host_peak_bytes == 0
    assert moved.memory.boundary_bytes == kept.memory.boundary_bytes - 1024
    assert "exp (1024 bytes; 2048 bytes copied; host peak 1024)" in moved.report()
    steps = moved.memory.timeline
    assert [s.phase for s in steps].count("forward") == len(list(moved.forward.ops()))
    assert max(s.host_bytes for s in steps) == 1024


def test_the_rules_follow_torch() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x.exp()
        mean, rstd = torch.ops.aten.native_layer_norm(y, [4], None, None, 1e-5)[1:]
        return y.t().sin().sum() + mean.sum() * rstd.sum() + y.t().contiguous().cos().sum(), y

    jg = ft.joint(f)(torch.randn(3, 4))
    why = {n.name: why_not_offload(n, frozenset(jg.forward_outputs())) for n in jg.forward_nodes()}
    assert why["primals_1"] == "it is an input"
    assert why["exp"] == "it is an output of the function"
    assert why["permute"] == "it is a view"
    assert why["getitem_1"] == "it is one output of a multi-output op"
    p = ft.partition(jg, offload_everything)
    problem = cut_problem(jg)
    assert p.offloaded and all(problem[v.node].can_offload for v in p.offloaded)
    assert not {v.name for v in p.offloaded} & {"exp", "permute", "getitem_1", "getitem_2"}


def test_a_value_an_output_views_stays() -> None:
    # found by a review: returning a view of the value kept its buffer on the device anyway
    def f(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x @ w
        return h.t(), h.sin().sum()

    jg = ft.joint(f)(torch.randn(2, 3), torch.randn(3, 2))
    (mm,) = [n for n in jg.forward_nodes() if n.target is torch.ops.aten.mm.default]
    assert cut_problem(jg)[mm].why_not_offload == "an output of the function is a view of it"
    assert mm not in {v.node for v in ft.partition(jg, offload_everything).offloaded}


def test_a_value_whose_storage_a_saved_view_shares_stays() -> None:
    jg = ft.joint(lambda x: (x.exp() * x.exp().t()).sum())(torch.ones(4, 4))
    p = ft.partition(jg, lambda jg: Cut(saved=("permute",), offloaded=("exp",)))
    assert p.offloaded == ()  # the saved transpose keeps exp's buffer on the device anyway


@settings(max_examples=max(40, settings().max_examples // 4))  # ~0.5 s an example
@given(programs(max_steps=6), st.integers(0, 2**31 - 1))
def test_property_nothing_forbidden_is_offloaded_and_gradients_hold(prog, seed) -> None:  # type: ignore[no-untyped-def]
    args = prog.example_inputs(seed=seed % 1000)
    jg = ft.joint(prog)(*args)
    p = ft.partition(jg, offload_everything)
    check_split(prog, args, jg, p, "offload everything")
    refused = {n for n in p.adjusted}  # asked for and kept on the device: the rules said so
    assert not refused & {v.node for v in p.offloaded}
    outputs = frozenset(p.joint.forward_outputs())
    for v in p.offloaded:
        assert why_not_offload(v.node, outputs) == "", v.name
        assert v.node not in outputs and v.node.meta["val"].is_contiguous()
    check_placement(p)


def check_placement(p: ft.Partition) -> None:
    """Each offloaded value goes out once, after its last forward use, and comes back once:
    issued before its wait, waited for right before its first backward use."""
    to_host, to_device, wait = OFFLOAD_OPS
    fwd = list(p.forward.fx_graph.nodes)
    outs = [n for n in fwd if n.target is to_host]
    assert len(outs) == len(p.offloaded)
    for out in outs:
        (value,) = out.args
        users = [u for u in value.users if u is not out and u.op != "output"]
        assert all(fwd.index(u) < fwd.index(out) for u in users), f"{value} used after its copy"
    bwd = list(p.backward.fx_graph.nodes)
    backs = [n for n in bwd if n.target is to_device]
    assert len(backs) == len(p.offloaded)
    for back in backs:
        (ready,) = back.users
        assert ready.target is wait and bwd.index(back) < bwd.index(ready)
        first = min(ready.users, key=bwd.index)
        between = bwd[bwd.index(ready) + 1 : bwd.index(first)]
        assert all(n.target in OFFLOAD_OPS for n in between), "the wait is not right before use"


# ---------------------------------------------------------------------------------------------
# the poison test: what stays behind after forward is garbage, gradients still hold


class Poison(PinnedHost):
    """Copies values out, and fills the originals with NaN once forward is over."""

    def __init__(self) -> None:
        super().__init__()
        self.originals: list[torch.Tensor] = []
        self.out = self.back = 0

    def to_host(self, x: torch.Tensor) -> torch.Tensor:
        self.out += 1
        self.originals.append(x)
        return x.clone()

    def to_device(self, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        self.back += 1
        return x.clone()

    def poison(self) -> None:
        with torch.no_grad():
            for t in self.originals:
                t.fill_(float("nan"))


@pytest.mark.parametrize(
    "strategy, options",
    [
        (offload_everything, {}),
        ("memory_budget", {"budget": 0.0, "offload": INF}),
        ("memory_budget", {"max_bytes": 0, "offload": INF}),
    ],
)
def test_poisoned_originals_do_not_reach_the_gradients(strategy, options) -> None:  # type: ignore[no-untyped-def]
    args = mlp_args()
    jg = ft.joint(mlp)(*args)
    p = ft.partition(jg, strategy, **options)
    assert p.offloaded
    transfer = Poison()

    def run(a, tangents):  # type: ignore[no-untyped-def]
        with use_transfer(transfer):
            outs, saved = p.forward(*a)
            transfer.poison()
            return outs, p.backward(saved, tangents)

    compare(mlp, args, jg, run, f"offloaded {[v.name for v in p.offloaded]}")
    check_placement(p)
    # each offloaded value went out once after forward and came back once in backward
    assert transfer.out == transfer.back == len(p.offloaded)


# ---------------------------------------------------------------------------------------------
# the solver


def test_offload_makes_budgets_below_full_remat_feasible() -> None:
    jg = ft.joint(mlp)(*mlp_args())
    with pytest.raises(InvalidPartitionError, match="below the smallest achievable"):
        ft.partition(jg, "memory_budget", max_bytes=0)
    p = ft.partition(jg, "memory_budget", max_bytes=0, offload=INF)
    assert p.activation_bytes == 0 and p.recompute_flops == 0
    assert "bernoulli" in {v.op.split(".")[1] for v in p.offloaded} or any(
        v.node.meta["val"].dtype == torch.float32 for v in p.offloaded
    )
    # found by review: the message blamed the device when the host limit was what bound
    with pytest.raises(InvalidPartitionError, match="needs more host memory than host_bytes=8"):
        ft.partition(jg, "memory_budget", max_bytes=0, offload=Offload(bandwidth=1e9, host_bytes=8))


def test_offload_options_are_checked() -> None:
    jg = ft.joint(mlp)(*mlp_args())
    with pytest.raises(FunctransError, match=r"offload=.*needs solver='ilp'"):
        ft.partition(jg, "memory_budget", budget=0.5, solver="greedy", offload=INF)
    with pytest.raises(FunctransError, match=r"offload=3 .* must be an Offload"):
        ft.partition(jg, "memory_budget", budget=0.5, offload=3)
    assert Offload(host_bytes=16e9).host_bytes == 16 * 10**9  # found by review: refused
    for bad in ({"bandwidth": -1.0}, {"host_bytes": 1.5}, {"overlap": 2.0}, {"compute_rate": 0}):
        with pytest.raises(FunctransError, match=f"Offload: {next(iter(bad))}="):
            Offload(**bad)  # type: ignore[arg-type]


def _cost(jg: ft.JointGraph, max_bytes: int, offload: Offload | None) -> float:
    """The ILP's optimal cost (recompute FLOPs plus exposed copy time in FLOPs)."""
    problem = cut_problem(jg)
    costs = problem.costs()
    terms = None
    if offload is not None and offload.enabled:
        terms = offload_terms(jg, problem, costs, offload, "flops")
    result = solve_ilp(problem, costs, max_bytes, 20.0, terms)
    return math.inf if result is None else result.cost


def test_bandwidth_zero_is_todays_memory_budget_on_the_mlp() -> None:
    jg = ft.joint(mlp)(*mlp_args())
    for budget in (0.0, 0.3, 1.0):
        plain = ft.partition(jg, "memory_budget", budget=budget)
        off = ft.partition(jg, "memory_budget", budget=budget, offload=Offload(bandwidth=0))
        assert [s.name for s in off.saved] == [s.name for s in plain.saved]
        assert off.offloaded == ()


def _budgets(jg: ft.JointGraph) -> tuple[int, list[int]]:
    """full_remat's bytes, and budgets from 0 to min_cut's bytes."""
    low, _ = MemoryBudget(budget=0.0).limit(jg)
    high, _ = MemoryBudget(budget=1.0).limit(jg)
    return low, sorted({0, low // 2, low, (low + high) // 2, high})


def _recomputed_offloadable(p: ft.Partition) -> list[str]:
    problem = cut_problem(p.joint)
    costs = problem.costs()
    return [n.name for n in p.recomputed if problem[n].can_offload and costs[problem.index[n]]]


# shrunk by hypothesis: a random mask alone (infeasible budgets compare as inf)
DROPOUT = Program((InputSpec((), torch.float32),), (Step("dropout", (0,), (), ()),), (1,))


# shrunk by hypothesis: an empty value was both saved and offloaded (a tie at 0 bytes)
EMPTY = Program(
    (InputSpec((0,), torch.float32),),
    (Step("neg", (0,), (), (0,)), Step("sin", (1,), (), (0,))),
    (2,),
)


@settings(max_examples=15)
@given(programs(max_steps=6, dtypes=(torch.float32,)))
@example(DROPOUT)
@example(EMPTY)
def test_property_solver_promises(prog) -> None:  # type: ignore[no-untyped-def]
    jg = ft.joint(prog)(*prog.example_inputs())
    low, budgets = _budgets(jg)
    for b in budgets:
        if b >= low:  # bandwidth 0 is exactly today's memory_budget
            plain = ft.partition(jg, "memory_budget", max_bytes=b)
            off = ft.partition(jg, "memory_budget", max_bytes=b, offload=Offload(bandwidth=0))
            assert [s.name for s in off.saved] == [s.name for s in plain.saved]
            assert off.offloaded == ()
        try:
            free = ft.partition(jg, "memory_budget", max_bytes=b, offload=INF)
        except InvalidPartitionError:  # only values that may not leave the device do not fit
            assert b < low
            continue
        recomputed = _recomputed_offloadable(free)
        assert not recomputed, f"recomputed {recomputed} though copies are free"
    # monotone: more bandwidth or more budget never costs more
    rates = (0.0, 1e8, 1e10, math.inf)
    for b in budgets:
        assert _non_increasing([_cost(jg, b, Offload(bandwidth=r)) for r in rates])
    for r in rates:
        assert _non_increasing([_cost(jg, b, Offload(bandwidth=r)) for b in budgets])


def _non_increasing(costs: list[float]) -> bool:
    return all(x >= y or x >= y - 1e-6 * max(1.0, abs(y)) for x, y in itertools.pairwise(costs))


# ---------------------------------------------------------------------------------------------
# as a user: train with offload under jit


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(32, 64), torch.nn.Linear(64, 8)
        self.drop = torch.nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.drop(torch.tanh(self.l1(x)))).pow(2).mean()


def test_training_with_offload_under_jit_matches_eager() -> None:
    torch.manual_seed(0)
    model, ref = Block(), Block()
    ref.load_state_dict(model.state_dict())
    step = ft.jit(model, partition=MemoryBudget(budget=0.0, offload=INF))
    opt, ref_opt = torch.optim.AdamW(model.parameters()), torch.optim.AdamW(ref.parameters())
    counting = Poison()
    for i in range(3):
        x = torch.randn(16, 32)
        torch.manual_seed(i)
        with use_transfer(counting):
            loss = step(x)
            counting.poison()
            loss.backward()
        torch.manual_seed(i)
        ref_loss = ref(x)
        ref_loss.backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        torch.testing.assert_close(loss, ref_loss)
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    (p,) = step.partitions()
    assert p.offloaded and counting.out == counting.back == 3 * len(p.offloaded)


def test_a_refused_offload_is_reported_and_bad_cuts_are_refused() -> None:
    # found by review: a refused offload vanished silently; bad Cut arguments raised raw errors
    jg = ft.joint(lambda x: (x.exp() * 2).t().sin().sum())(torch.ones(3, 3))
    p = ft.partition(jg, lambda jg: Cut(offloaded=("permute", "primals_1")))
    assert p.offloaded == () and {n.name for n in p.adjusted} == {"permute", "primals_1"}
    with pytest.raises(AssertionError, match="asked to be offloaded but it is a view"):
        check_partition(
            lambda x: (x.exp() * 2).t().sin().sum(),
            (torch.ones(3, 3),),
            lambda jg: Cut(offloaded=("permute",)),
        )
    with pytest.raises(FunctransError, match=r"offloaded='mul' is a string.*e.g. \['mul'\]"):
        Cut(offloaded="mul")  # type: ignore[arg-type]
    with pytest.raises(FunctransError, match="offloaded=None is not accepted"):
        Cut(offloaded=None)  # type: ignore[arg-type]
    with pytest.raises(FunctransError, match=r"\['mul'\] are in both saved= and offloaded="):
        Cut(saved=("mul",), offloaded=("mul",))


def test_offload_with_symbolic_shapes() -> None:
    # found by review: the wait op's meta kernel refused symbolic sizes, so offload forced a
    # compile per shape (and a raw RuntimeError from ft.partition)
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w).sin().sum()

    jg = ft.joint(f, dynamic={"x": {0: "batch"}})(torch.randn(8, 4), torch.randn(4, 4))
    p = ft.partition(jg, "memory_budget", budget=0.0, offload=INF)
    assert p.offloaded and p.offloaded[0].bytes_expr == "16*s0"
    w = torch.randn(4, 4, requires_grad=True)
    step = ft.jit(f, partition="memory_budget", budget=0.0, offload=INF)
    for batch in (4, 2, 3, 5):
        x = torch.randn(batch, 4)
        (got,) = torch.autograd.grad(step(x, w), w)
        (want,) = torch.autograd.grad(f(x, w), w)
        torch.testing.assert_close(got, want)
    assert step.cache_info().misses == 2  # a static entry, then one symbolic entry
    assert all(q.offloaded for q in step.partitions())


def test_pareto_sweeps_with_offload(tmp_path) -> None:  # type: ignore[no-untyped-def]
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w).exp().sum()

    jg = ft.joint(f)(torch.ones(8, 8), torch.ones(8, 8, requires_grad=True))
    plain = ft.pareto(jg, points=3)
    moved = ft.pareto(jg, points=3, offload=INF)
    assert all(m.activation_bytes <= p.activation_bytes for m, p in zip(moved, plain, strict=True))
    assert all(p.recompute_flops == 0 for p in moved)  # free copies: nothing recomputed
    assert any(p.partition.offloaded for p in moved)
    out = ft.viz.plot_pareto(moved, tmp_path / "front.svg")
    assert "on host" in out.read_text()


class Scaled(PinnedHost):
    """Stores copies scaled (a stand-in for a compressing transfer): only its own to_device
    can read them back."""

    def to_host(self, x: torch.Tensor) -> torch.Tensor:
        return super().to_host(x) * 2

    def to_device(self, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        return super().to_device(x / 2, device)


def test_a_copy_comes_back_through_the_transfer_that_made_it() -> None:
    # found by review: backward after the use_transfer block (the usual pattern) decoded the
    # copies with the default transfer, and use_transfer leaked across threads
    import threading

    w, x = torch.randn(16, 16), torch.randn(4, 16)

    def f(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(torch.tanh(x @ w) @ w).sum()

    want = torch.func.grad(f)(w, x)
    step = ft.jit(f, partition="memory_budget", budget=0.0, offload=INF)
    leaf = w.clone().requires_grad_()
    with use_transfer(Scaled()):
        loss = step(leaf, x)
    loss.backward()
    torch.testing.assert_close(leaf.grad, want)

    counts: dict[str, int] = {}

    class Counting(PinnedHost):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

        def to_host(self, x: torch.Tensor) -> torch.Tensor:
            counts[self.name] = counts.get(self.name, 0) + 1
            return super().to_host(x)

    def run(name: str, calls: int) -> None:
        with use_transfer(Counting(name)):
            for _ in range(calls):
                step(w.clone().requires_grad_(), x).backward()

    threads = [threading.Thread(target=run, args=(n, c)) for n, c in (("a", 3), ("b", 5))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    per_call = len(step.partitions()[0].offloaded)
    assert counts == {"a": 3 * per_call, "b": 5 * per_call}


def test_a_transfer_that_breaks_its_contract_is_named() -> None:
    class Wrong(PinnedHost):
        def to_host(self, x: torch.Tensor) -> torch.Tensor:
            return x.reshape(-1).clone()

    refused = pytest.raises(FunctransError, match=r"transfer=.* has no to_host, to_device, wait")
    with refused, use_transfer(object()):  # type: ignore[type-var]
        pass
    with use_transfer(Wrong()), pytest.raises(FunctransError, match=r"Wrong.to_host returned"):
        torch.ops.functrans.to_host(torch.ones(2, 3))


def test_offload_under_jit_across_autocast_and_eval() -> None:
    # a researcher's loop: train steps under bf16 autocast, then eval without grad, with the
    # same jitted module; each state gets its own entry, offloading where it trains
    torch.manual_seed(0)
    model, ref = Block(), Block()
    ref.load_state_dict(model.state_dict())
    step = ft.jit(model, partition="memory_budget", budget=0.0, offload=INF)
    x = torch.randn(16, 32)
    for m in (model, ref):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.manual_seed(1)
            (step if m is model else ref)(x).backward()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=2e-2, atol=2e-3)  # bf16 rounding
    assert all(p.offloaded for p in step.partitions())
    model.eval()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(step(x), ref(x))  # dropout off: a new, inference entry
