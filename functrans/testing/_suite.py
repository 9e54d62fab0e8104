"""The property suite as a product: hypothesis tests for a partition strategy or a codegen
backend, ready to assign at module level in your own test file."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from functrans._core.tags import Policy
from functrans._cut.partition import Partition, Strategy, get_strategy, partition
from functrans._cut.problem import cut_problem
from functrans._trace.joint import joint
from functrans._trace.trace import trace
from functrans._transforms.remat import remat

from ._backend import check_compiled
from ._check import describe, partition_and_check, seeded
from ._program import Program
from ._random_programs import programs

__all__ = [
    "check_policy_tags",
    "register_backend_tests",
    "register_partitioner_tests",
    "remat_policies",
    "reproduces_eager_rng",
]


_T = TypeVar("_T", bound=Callable[..., None])


def _own_settings(test: _T) -> _T:
    """The settings every suite test needs in a project with no conftest: no deadline (the
    first example traces and partitions cold, 0.7 s where later ones take 30 ms, and
    hypothesis' 200 ms default fails it as flaky) and no too-slow health check; the number
    of examples and the rest follow the active profile when the test is made. Set as the
    test's default, not applied as a decorator: wrapping the test in ``settings(...)`` still
    works and replaces them (hypothesis refuses a second decorator)."""
    current = getattr(test, "_hypothesis_internal_use_settings", None) or settings.default
    own = settings(
        current,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    test._hypothesis_internal_use_settings = own  # type: ignore[attr-defined]  # given's default
    return test


#: ``invariant(partition, options)`` raises AssertionError when a strategy breaks its promise
Invariant = Callable[[Partition, dict[str, Any]], None]
_DTYPES = (torch.float64, torch.float32)
_aten = torch.ops.aten
# ops the random programs record (policies pick among them)
_POLICY_OPS = (
    _aten.mm, _aten.bmm, _aten.addmm, _aten.tanh, _aten.sin, _aten.mul, _aten.add, _aten.sum,
    _aten.exp, _aten.amax, _aten.bernoulli, _aten.div, _aten.relu, _aten.native_layer_norm,
    _aten.permute, _aten.view, _aten.where, _aten.cumsum, _aten.gather, _aten.clone,
)  # fmt: skip


@st.composite
def remat_policies(draw: st.DrawFn) -> Callable[..., Policy]:
    """Random remat policies: a :class:`~functrans.policies.Policy` for some ATen ops, another
    for every other op (``ft.remat(f, policy=...)`` tags a traced region's ops with them).

    >>> from hypothesis import find
    >>> policy = find(remat_policies(), lambda p: True)
    >>> policy(torch.ops.aten.mm.default) in list(Policy)
    True
    """
    chosen = draw(st.dictionaries(st.sampled_from(_POLICY_OPS), st.sampled_from(list(Policy))))
    default = draw(st.sampled_from(list(Policy)))

    def policy(op: Any, *args: Any, **kwargs: Any) -> Policy:
        return chosen.get(getattr(op, "overloadpacket", op), default)

    tags = ", ".join(f"{k}={v.name}" for k, v in chosen.items())
    policy.__name__ = policy.__qualname__ = f"policy({tags}, otherwise={default.name})"
    return policy


def check_policy_tags(p: Partition) -> None:
    """Remat tags are honored, by the rules of :class:`functrans.extend.CutProblem`: a MUST_SAVE
    value the forward computes is never recomputed (so it is saved when backward needs it); a
    MUST_RECOMPUTE value (random and effectful ops excepted: they never re-run) is never saved.

    >>> import torch, functrans as ft
    >>> f = ft.remat(lambda x: x.sin().cos().sum(), policy=ft.policies.nothing_saveable)
    >>> check_policy_tags(ft.partition(ft.joint(f)(torch.ones(3)), "default"))
    """
    broken = cut_problem(p.joint).violations([s.node for s in p.saved], p.recomputed)
    if broken:
        raise AssertionError(
            f"strategy {p.strategy!r} ignored remat tags: {'; '.join(broken)}\n{p.report()}"
        )


def _option_sets(strategy: str | Strategy, options: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    if options or not isinstance(strategy, str):
        return (options,)
    registry = importlib.import_module("functrans.partitioners")
    examples: tuple[dict[str, Any], ...] = registry.examples(strategy)
    return examples


def register_partitioner_tests(
    strategy: str | Strategy,
    *,
    invariant: Invariant | None = None,
    dtypes: Sequence[torch.dtype] = _DTYPES,
    **options: Any,
) -> Callable[[], None]:
    """A hypothesis test of ``strategy`` on random programs; assign it to a ``test_`` name.

    For each program, with ``options`` (or, for a registered name without options, each of its
    registered example option sets): outputs and gradients equal eager autograd's, the saved
    set is valid (FORWARD-phase values, no random op recomputed, both graphs verify), your
    ``invariant(partition, options)`` holds, and under a random remat policy (with one option
    set, drawn) the tags are honored (:func:`check_policy_tags`) and gradients still match.
    The number of programs comes from the active hypothesis profile (or wrap the result in
    ``hypothesis.settings``).

    >>> from hypothesis import settings
    >>> from functrans import partitioners
    >>> from functrans.extend import OpClass, op_class
    >>> from functrans.extend import Policy, policy_of
    >>> kept = (Policy.MUST_SAVE, Policy.MUST_OFFLOAD)  # tags that forbid recomputing
    >>> def inputs_only(jg):  # save what must not be recomputed; split adds the inputs
    ...     keep = [n for n in jg.forward_nodes() if op_class(n) is OpClass.RANDOM]
    ...     return keep + [n for n in jg.forward_nodes() if policy_of(n) in kept]
    >>> _ = partitioners.register("inputs_only", inputs_only, replace=True)
    >>> test_inputs_only = register_partitioner_tests("inputs_only")
    >>> settings(max_examples=3, deadline=None)(test_inputs_only)()  # or let pytest run it
    """
    name, _ = get_strategy(strategy)
    option_sets = _option_sets(strategy, options)

    @_own_settings
    @given(programs(dtypes=dtypes), remat_policies(), st.sampled_from(option_sets))
    def test(prog: Program, policy: Callable[..., Policy], tagged_opts: dict[str, Any]) -> None:
        args = prog.example_inputs()
        jg = joint(prog)(*args)
        jg.verify()
        for opts in option_sets:
            p = partition_and_check(prog, args, jg, strategy, opts)
            if invariant is not None:
                _run_invariant(invariant, p, prog, opts)
        tagged = remat(prog, policy=policy)  # the whole program is one remat region
        q = partition_and_check(tagged, args, joint(tagged)(*args), strategy, tagged_opts, prog)
        check_policy_tags(q)

    test.__name__ = test.__qualname__ = f"test_partitioner_{name}"
    return test


def _run_invariant(invariant: Invariant, p: Partition, f: Any, options: dict[str, Any]) -> None:
    try:
        invariant(p, options)
    except AssertionError as e:
        raise AssertionError(
            f"invariant of {p.strategy!r} {options or ''} failed: {e}{describe(f)}\n{p.report()}"
        ) from None


def reproduces_eager_rng(backend: Any) -> bool:
    """Whether ``backend`` runs ``dropout`` with eager PyTorch's numbers under the same seed.

    >>> reproduces_eager_rng("aten")
    True
    """
    from ._backend import _backend

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x, 0.5)

    x = torch.ones(64)
    g = trace(f)(x)
    run = _backend(backend).compile(g, [x])
    with seeded(7):
        got = run(x)[0]
    with seeded(7):
        return bool(torch.equal(got, f(x)))


def register_backend_tests(
    backend: Any,
    *,
    strategies: Sequence[str | Strategy] = ("default", "min_cut"),
    dtypes: Sequence[torch.dtype] = _DTYPES,
) -> Callable[[], None]:
    """A hypothesis test of the codegen ``backend`` on random programs (see
    :func:`~functrans.testing.check_backend`): the forward and backward graphs of each strategy's
    partition, and the inference graph, compiled and compared with eager autograd. Programs with
    random ops (``dropout``) are tested only if the backend draws the same numbers as eager
    PyTorch under the same seed (:func:`reproduces_eager_rng`).

    >>> from hypothesis import settings
    >>> test_aten = register_backend_tests("aten")
    >>> settings(max_examples=3, deadline=None)(test_aten)()
    """

    state: dict[str, bool] = {}

    @_own_settings
    @given(programs(dtypes=dtypes))
    def test(prog: Program) -> None:
        if prog.is_random:  # only where the backend draws the numbers eager autograd draws
            if "rng" not in state:
                state["rng"] = reproduces_eager_rng(backend)
            assume(state["rng"])
        args = prog.example_inputs()
        jg = joint(prog)(*args)
        for k, strategy in enumerate(strategies):
            check_compiled(prog, args, partition(jg, strategy), backend, inference=k == 0)

    label = backend if isinstance(backend, str) else type(backend).__name__
    test.__name__ = test.__qualname__ = f"test_backend_{label}"
    return test
