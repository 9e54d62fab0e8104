"""Options are checked when the transform is made (issue 48), not at its first training step.

``jit``, ``grad`` and ``value_and_grad`` check ``partition=`` (a registered name: the registry
loads the built-in strategies and the installed plugins before it answers), the strategy's
option names and values (the check each strategy declares when it registers) and
``static_argnums`` (against the function's signature) when they are called. Where only the call
can tell (no readable signature), the call checks. The property at the end: for any options,
``jit`` either refuses them when it is made or compiles and trains with them.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import functrans as ft
from functrans import partitioners
from functrans.extend import Offload


def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w).sum()


def scaled(x: torch.Tensor, n: float) -> torch.Tensor:
    return (x * n).sin().sum()


def one(x: torch.Tensor) -> torch.Tensor:
    return x.sin().sum()


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return self.lin(x).sum() * scale


X = torch.randn(4, 4)
W = torch.randn(4, 4)

#: the transforms made once and called later, each given partition= and options
MAKERS = {
    "jit": lambda p, **o: ft.jit(loss, partition=p, **o),
    "jit-decorator": lambda p, **o: ft.jit(partition=p, **o),
    "grad": lambda p, **o: ft.grad(loss, partition=p, **o),
    "value_and_grad": lambda p, **o: ft.value_and_grad(loss, partition=p, **o),
}


# -- 1. strategy names ----------------------------------------------------------------------


@pytest.mark.parametrize("make", MAKERS.values(), ids=MAKERS.keys())
def test_an_unknown_strategy_name_raises_when_made(make: Any) -> None:
    with pytest.raises(ft.InvalidArgumentError, match="partition='bogus'") as info:
        make("bogus")
    message = str(info.value)
    assert "'memory_budget'" in message and "'min_cut'" in message  # the registered names
    assert isinstance(info.value, ft.UnknownNameError)  # what the call raised before


def test_a_misspelt_strategy_name_suggests_the_registered_one() -> None:
    with pytest.raises(ft.InvalidArgumentError, match=r"^jit: .*did you mean 'min_cut'\?"):
        ft.jit(loss, partition="mincut")


def test_an_unknown_strategy_name_raises_before_an_inference_call_could_hide_it() -> None:
    # an inference call never partitions: before, it ran without complaint
    with pytest.raises(ft.InvalidArgumentError, match="bogus"):
        ft.jit(loss, partition="bogus")(X, W)


def test_every_registered_name_and_alias_is_accepted_when_made() -> None:
    # the registry loads the built-in modules ("optimal" lives in memory_budget.py) and the
    # installed plugins before it answers
    for name in partitioners.names(aliases=True):
        for options in partitioners.examples(name):
            ft.jit(loss, partition=name, **options)


# -- 2. option names ------------------------------------------------------------------------


@pytest.mark.parametrize("make", MAKERS.values(), ids=MAKERS.keys())
def test_a_misspelt_option_raises_when_made(make: Any) -> None:
    with pytest.raises(ft.InvalidArgumentError, match=r"budgt=0\.3 \(did you mean budget\?\)"):
        make("memory_budget", budgt=0.3)


def test_a_misspelt_option_of_the_default_strategy_raises_when_made() -> None:
    # jit's default is min_cut, which takes **options: its signature accepts any name
    with pytest.raises(ft.InvalidArgumentError, match=r"^jit: min_cut: unknown option"):
        ft.jit(loss, recompute_view=False)


def test_an_option_of_a_strategy_that_takes_none_raises_when_made() -> None:
    with pytest.raises(ft.InvalidArgumentError, match=r"budget=0\.5"):
        ft.jit(loss, partition="default", budget=0.5)


# -- 3. option values -----------------------------------------------------------------------

BAD_VALUES = [
    ("memory_budget", {"budget": -1}, r"budget=-1 \(int\) is not accepted"),
    ("memory_budget", {"budget": "x"}, r"budget='x' \(str\) is not accepted"),
    ("memory_budget", {"budget": math.nan}, r"budget=nan"),
    ("memory_budget", {"peak_bytes": -5}, r"peak_bytes=-5 \(int\) is not accepted"),
    ("memory_budget", {"max_bytes": 1.5}, r"max_bytes=1\.5 \(float\) is not accepted"),
    ("memory_budget", {"budget": 0.5, "solver": "fast"}, r"solver='fast'"),
    ("memory_budget", {"budget": 0.5, "time_limit": 0}, r"time_limit=0"),
    ("memory_budget", {"budget": 0.5, "max_bytes": 10}, r"not both"),
    ("memory_budget", {}, r"needs a limit"),
    ("memory_budget", {"peak_bytes": 10**6, "solver": "greedy"}, r"needs solver='ilp'"),
    ("optimal", {}, r"optimal needs budget="),
    ("optimal", {"budget": 0.5, "solver": "greedy"}, r"optimal always solves the ILP"),
    ("min_cut", {"prefer_weight": 0}, r"prefer_weight=0"),
    ("min_cut", {"reduction_ratio": -1}, r"reduction_ratio=-1"),
    ("min_cut", {"recompute_views": "yes"}, r"recompute_views='yes'"),
    ("min_peak", {"time_limit": -1}, r"time_limit=-1"),
    ("min_peak", {"cost": "time"}, r"cost='time'"),
]


@pytest.mark.parametrize(
    "strategy, options, fragment", BAD_VALUES, ids=[f"{s}-{o}" for s, o, _ in BAD_VALUES]
)
def test_a_bad_option_value_raises_when_jit_is_made(
    strategy: str, options: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(ft.InvalidArgumentError, match=fragment) as info:
        ft.jit(loss, partition=strategy, **options)
    assert str(info.value).startswith(f"jit: {strategy}")  # the transform, then the strategy


@pytest.mark.parametrize("make", MAKERS.values(), ids=MAKERS.keys())
def test_a_bad_option_value_raises_when_any_transform_is_made(make: Any) -> None:
    with pytest.raises(ft.InvalidArgumentError, match=r"peak_bytes=-5 .* int >= 0"):
        make("memory_budget", peak_bytes=-5)


def test_vjp_checks_the_values_before_it_traces() -> None:
    traced = []

    def f(x: torch.Tensor) -> torch.Tensor:
        traced.append(x)
        return x.sin().sum()

    with pytest.raises(ft.InvalidArgumentError, match=r"^vjp: memory_budget: budget=-1"):
        ft.vjp(f, torch.ones(3), partition="memory_budget", budget=-1)
    assert not traced


def test_partition_runs_the_declared_check_before_the_strategy() -> None:
    ran = []

    def levels(joint: ft.JointGraph, **options: object) -> list[Any]:
        ran.append(options)
        return []

    def check(options: Any) -> None:
        level = options.get("level", 1)
        if not (isinstance(level, int) and level >= 1):
            raise ft.InvalidArgumentError(f"levels: level={level!r}; level must be an int >= 1")

    partitioners.register("test_options_levels", levels, check_options=check, replace=True)
    with pytest.raises(ft.InvalidArgumentError, match=r"^jit: levels: level=0"):
        ft.jit(loss, partition="test_options_levels", level=0)
    jg = ft.joint(loss)(X, W)
    with pytest.raises(ft.InvalidArgumentError, match=r"^levels: level=0"):
        ft.partition(jg, "test_options_levels", level=0)
    assert not ran
    ft.partition(jg, "test_options_levels", level=2)
    assert ran == [{"level": 2}]


def test_valid_options_still_compile_and_train() -> None:
    w = W.clone().requires_grad_()
    step = ft.jit(loss, partition="memory_budget", budget=0.5, solver="greedy")
    step(X, w).backward()
    ref = W.clone().requires_grad_()
    loss(X, ref).backward()
    torch.testing.assert_close(w.grad, ref.grad)


# -- 4. static_argnums ----------------------------------------------------------------------


@pytest.mark.parametrize("bad", [5, 2, -3, (0, 7)])
def test_static_argnums_out_of_the_signature_raise_when_jit_is_made(bad: Any) -> None:
    with pytest.raises(ft.InvalidArgumentError, match=r"^jit: static_argnums=") as info:
        ft.jit(scaled, static_argnums=bad)
    assert "scaled(x, n) takes 2 positional parameters" in str(info.value)
    assert "range(-2, 2)" in str(info.value)


def test_static_argnums_on_a_function_without_positional_parameters() -> None:
    with pytest.raises(ft.InvalidArgumentError, match="takes no positional parameters"):
        ft.jit(lambda *, x: x.sum(), static_argnums=-1)


def test_negative_static_argnums_count_from_the_end() -> None:
    step = ft.jit(scaled, static_argnums=-1)
    x = torch.ones(3, requires_grad=True)
    step(x, 2.0).backward()
    torch.testing.assert_close(x.grad, 2.0 * torch.cos(torch.full((3,), 2.0)))


def test_a_function_with_star_args_takes_any_static_index() -> None:
    def f(x: torch.Tensor, *rest: float) -> torch.Tensor:
        return (x * sum(rest)).sum()

    step = ft.jit(f, static_argnums=(3,))
    assert step(torch.ones(2), 1.0, 2.0, 3.0).item() == 12.0


def test_jit_of_a_module_counts_the_forward_parameters() -> None:
    with pytest.raises(ft.InvalidArgumentError, match=r"Scaled\.forward\(x, scale\) takes 2"):
        ft.jit(Scaled(), static_argnums=2)
    model = ft.jit(Scaled(), static_argnums=1)
    model(torch.ones(2, 3), 2.0).backward()


def test_jit_of_a_module_counts_a_negative_static_index_from_the_forwards_end() -> None:
    """-1 is the forward's last parameter, not the module's buffers (which a shift by the
    parameters and buffers ahead of the forward's arguments made it once)."""
    model = ft.jit(Scaled(), static_argnums=-1)
    x = torch.ones(2, 3)
    model(x, 2.0).backward()
    model(x, 2.0).backward()
    assert model.cache_info().misses == 1
    model(x, 3.0)
    assert model.cache_info().misses == 2


def test_remat_static_argnums_out_of_the_signature_raise_when_made() -> None:
    with pytest.raises(ft.InvalidArgumentError, match=r"^remat: static_argnums=\(9,\)") as info:
        ft.remat(one, static_argnums=9)
    assert "one(x) takes 1 positional parameter;" in str(info.value)
    with pytest.raises(ft.InvalidArgumentError, match=r"Scaled\.forward\(x, scale\)"):
        ft.remat(Scaled(), static_argnums=(0, 5))
    with pytest.raises(ft.InvalidArgumentError, match=r"static_argnums=\(9,\)"):
        ft.remat(static_argnums=9)(one)  # the decorator form


def test_remat_without_a_signature_checks_the_range_at_the_call() -> None:
    region = ft.remat(torch.sin, static_argnums=3)  # a builtin: no signature to read
    with pytest.raises(ft.InvalidArgumentError, match=r"^remat: static_argnums=\(3,\)"):
        region(torch.ones(2))


def test_remat_refuses_a_tensor_at_a_static_position_by_name() -> None:
    region = ft.remat(scaled, static_argnums=(1,))
    x = torch.ones(3, requires_grad=True)
    with pytest.raises(ft.InvalidArgumentError, match=r"argument 1 \(n\) is a tensor"):
        region(x, torch.tensor(2.0, requires_grad=True))
    region(x, 2.0).backward()  # a Python value is what static means
    torch.testing.assert_close(x.grad, 2.0 * torch.cos(torch.full((3,), 2.0)))


# -- the property ---------------------------------------------------------------------------

#: the options each strategy takes (the typo takes none: it is no strategy)
TAKES: dict[str, list[str]] = {
    "default": [],
    "full_remat": [],
    "checkpoint": [],
    "min_cut": ["recompute_views", "ban_reductions", "reduction_ratio", "prefer_weight"],
    "memory_budget": [
        "budget",
        "max_bytes",
        "peak_bytes",
        "solver",
        "cost",
        "time_limit",
        "at",
        "offload",
    ],
    "optimal": ["budget", "cost", "time_limit", "at", "offload"],
    "min_peak": ["cost", "time_limit"],
    "min_cutt": [],  # a typo
}

#: values each option accepts. Values that only a graph can refuse (a peak below the lowest
#: reachable, sizes for a dimension the trace has not named) are left out: those are the
#: call's to raise.
VALID: dict[str, list[Any]] = {
    "budget": [0.0, 0.5, 1.0, 2.5, None],
    "max_bytes": [0, 4096, 10**6, None],
    "peak_bytes": [10**7, None],
    "solver": ["ilp", "greedy"],
    "cost": ["flops", lambda n: 1.0],
    "time_limit": [1.0, 20.0, math.inf],
    "at": [None, {}],
    "offload": [None, Offload(bandwidth=math.inf)],
    "recompute_views": [True, False],
    "ban_reductions": [True, False],
    "reduction_ratio": [0.0, 4.0, math.inf],
    "prefer_weight": [1, 4, 64],
}
#: values no strategy accepts for the option
INVALID: dict[str, list[Any]] = {
    "budget": [-1, -0.5, math.nan, math.inf, "0.5", True],
    "max_bytes": [-1, 1.5, "1", False],
    "peak_bytes": [-5, 0.5, "x"],
    "solver": ["fast", 3, None],
    "cost": ["time", 5],
    "time_limit": [0, -1, math.nan, "1"],
    "at": [{"batch": -1}, "x", {3: 4}],
    "offload": ["host", 1e9],
    "recompute_views": ["yes", 1, None],
    "ban_reductions": [None, 0],
    "reduction_ratio": [-1, "x", math.nan],
    "prefer_weight": [0, 1.5, True],
}
#: names no strategy takes: typos, and names of other layers
TYPOS = ["budgt", "solvr", "recompute_view", "timelimit", "level", "backend_options"]


@st.composite
def option_sets(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A strategy name and options for it: its own names (``budget`` three times in four,
    where it takes one), one time in four another strategy's or a typo; each value valid four
    times in five."""
    name = draw(st.sampled_from(sorted(TAKES)))
    keys = []
    if "budget" in TAKES[name] and draw(st.integers(0, 3)) > 0:
        keys.append("budget")
    if TAKES[name]:
        keys += draw(st.lists(st.sampled_from(TAKES[name]), max_size=3, unique=True))
    if draw(st.integers(0, 3)) == 0:
        keys.append(draw(st.sampled_from(sorted(VALID) + TYPOS)))
    options = {}
    for key in dict.fromkeys(keys):
        bad = key not in VALID or draw(st.integers(0, 4)) == 0
        options[key] = draw(st.sampled_from(INVALID.get(key, [0.5]) if bad else VALID[key]))
    return name, options


@given(option_sets())
@example(("memory_budget", {"budget": 0.0, "peak_bytes": 10_000_000}))  # peak ILP found no set
def test_options_either_raise_when_made_or_train(drawn: tuple[str, dict[str, Any]]) -> None:
    name, options = drawn
    try:
        step = ft.jit(loss, partition=name, **options)
    except ft.InvalidArgumentError:
        return
    w = W.clone().requires_grad_()
    step(X, w).backward()  # nothing left for the call to refuse
    ref = W.clone().requires_grad_()
    loss(X, ref).backward()
    torch.testing.assert_close(w.grad, ref.grad)
