"""``ft.remat(model, peak_bytes=N)``: a peak budget for a model that runs eagerly.

Models that cannot be jitted (graph breaks, data-dependent control flow, libraries that
re-enter Python) still run a stack of repeated blocks, and per-block checkpointing is how
their users trade recompute for memory, placed by hand. Here the placement is planned: the
first training call with an input signature traces the model's forward and backward once
(fake tensors, nothing runs), its repeated blocks kept as regions, and the block-by-block
planner (:mod:`functrans._jit.step_plan`) chooses, per block call, between the two cuts eager
mode has: ``full_remat`` (the block is checkpointed: it saves its inputs and reruns in its
backward, eager :func:`functrans.remat` with no policy) and ``default`` (it runs as written and
autograd saves what it saves). The fewest blocks are checkpointed whose planned peak fits
``N``; the last blocks stay uncheckpointed first, since their backward runs while the blocks
before them hold what they saved. Then every call runs eagerly, the chosen blocks
checkpointed, gradients exactly eager's (checkpointing replays random numbers).

The planned peak is the traced step's simulation, which measures eager's peak within a few
percent on the families of ``benchmarks.peak_memory --family unseen`` (eager autograd saves
what ``default`` saves; an eager checkpoint recomputes as a region's ``full_remat`` does). A
later call with other shapes plans again (one plan per input signature, kept); a call under
``no_grad`` (or with no parameter that requires grad) runs as written. Eval mode is no
signal (HF models are built in eval mode and trained so): checkpointing is exact either way.
A checkpointed block takes its parameters as inputs, so its recomputation runs with the
tensors its forward ran with (under ``functional_call`` too). A limit below the lowest plan
(every block checkpointed) is an :class:`~functrans.InvalidPartitionError` naming that
peak, raised at the first training call.

>>> import torch, functrans as ft
>>> net = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
>>> budgeted = ft.remat(net, peak_bytes=1 << 30)
>>> budgeted(torch.ones(2, 8)).sum().backward()
>>> budgeted.plans()[0].checkpointed  # a large budget: nothing to checkpoint
0
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar, overload

import optree
import torch

from functrans._core.backends import capabilities, get_backend
from functrans._core.errors import InvalidArgumentError, InvalidPartitionError
from functrans._core.module_view import ModuleView
from functrans._core.pytree import NAMESPACE
from functrans._core.strategies import PeakGoal
from functrans._core.tags import PolicyLike
from functrans._core.validate import check_number
from functrans._trace.joint import joint
from functrans._trace.options import OPTIONS, TraceOptions
from functrans._trace.regions import deferred as deferred_regions
from functrans._trace.regions.graph import REGIONS
from functrans._transforms import remat as _remat
from functrans._transforms.remat import RematDecorator, RematModule

from .outline import region_calls
from .step_plan import CHOICES, plan_step

__all__ = ["BudgetedModule", "EagerPlan", "buffers_kept", "remat"]

_P = ParamSpec("_P")
_R = TypeVar("_R")
_M = TypeVar("_M", bound=torch.nn.Module)

#: the options of the planning trace
_PLANNING = TraceOptions(regions="compiled")
#: the cuts eager mode has: a checkpointed block, a block run as written
_FULL_REMAT, _DEFAULT = 0, len(CHOICES) - 1


@dataclass(frozen=True)
class EagerPlan:
    """One input signature's plan: the blocks to checkpoint (by call, in forward order), the
    planned peak (bytes above the inputs, as :func:`functrans.testing.measure_peak` measures
    a step) and how many block calls there are."""

    blocks: tuple[torch.nn.Module, ...] = dataclasses.field(repr=False)
    peak_bytes: int
    calls: int

    @property
    def checkpointed(self) -> int:
        """How many block calls are checkpointed."""
        return len(self.blocks)


class BudgetedModule(ModuleView):
    """``remat(module, peak_bytes=N)``: the module, its repeated blocks checkpointed as a plan
    for ``N`` bytes chooses (see the module docstring). Otherwise it is the module (its
    parameters, ``state_dict`` keys and attributes)."""

    _derived = ("_plans",)

    def __init__(self, module: torch.nn.Module, *, peak_bytes: int) -> None:
        super().__init__(module)
        check_number("remat", "peak_bytes", peak_bytes, at_least=0, integer=True, meaning="bytes")
        self.__dict__["_peak_bytes"] = peak_bytes
        self._derive()

    def _derive(self) -> None:
        self.__dict__["_plans"] = {}

    def plans(self) -> list[EagerPlan]:
        """The plans made so far, one per input signature."""
        return list(self.__dict__["_plans"].values())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        module = self._wrapped
        params = {k: p for k, p in module.named_parameters() if p.requires_grad}
        if not (torch.is_grad_enabled() and params):
            return module(*args, **kwargs)
        key = _signature((args, kwargs))
        plans: dict[Any, EagerPlan] = self.__dict__["_plans"]
        if key not in plans:
            plans[key] = _plan(module, params, args, kwargs, self.__dict__["_peak_bytes"])
        with _checkpointing(plans[key].blocks):
            return module(*args, **kwargs)


def _signature(tree: Any) -> Any:
    """What a plan depends on: the tree's structure and its tensors' shapes and dtypes."""
    leaves, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
    return spec, tuple(
        (tuple(x.shape), x.dtype, x.requires_grad) if isinstance(x, torch.Tensor) else type(x)
        for x in leaves
    )


def _plan(
    module: torch.nn.Module,
    params: Mapping[str, torch.Tensor],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    limit: int,
) -> EagerPlan:
    """Trace ``module``'s forward and backward with its blocks as regions; the blocks to
    checkpoint so the planned peak fits ``limit``."""

    def step(
        p: dict[str, torch.Tensor],
        b: dict[str, torch.Tensor],
        a: tuple[Any, ...],
        k: dict[str, Any],
    ) -> Any:
        return _loss(torch.func.functional_call(module, {**p, **b}, a, k))

    values = {k: p.detach() for k, p in params.items()}
    # buffers too are the trace's inputs (fake): a block reading one is still a block
    buffers = dict(module.named_buffers())
    backend = get_backend("aten")  # its decompositions are jit's: the plans' simulation is jit's
    decompositions = capabilities(backend).decompositions
    # the blocks are where checkpoints go: found as regions whatever FUNCTRANS_REGIONS says
    # (it chooses how jit's steps run; this trace only plans and never runs)
    with OPTIONS.bound(_PLANNING), deferred_regions() as held, _statistics_held(module):
        jg = joint(step, argnums=0, decompositions=decompositions)(values, buffers, args, kwargs)
    jg.attach(REGIONS, tuple(held.regions))
    calls = region_calls(jg)
    if not calls:  # no repeated blocks: nothing to place checkpoints on
        return EagerPlan((), 0, 0)
    # eager runs the ops around the blocks as autograd does: what default saves
    outcome = plan_step(
        jg, PeakGoal(limit), "remat", backend, False, (_FULL_REMAT, _DEFAULT), ("default",)
    )
    if outcome.planned is None:
        raise InvalidPartitionError(
            f"remat({type(module).__name__}, peak_bytes={limit}): below the lowest peak "
            f"planned, {outcome.lowest.peak} bytes with every one of its {len(calls)} "
            "repeated blocks checkpointed; ask for at least that, or jit the model "
            "(ft.jit(..., partition='memory_budget', peak_bytes=...) cuts inside blocks too)"
        )
    levels = outcome.planned.assignment.levels
    blocks = tuple(
        held.blocks[call] for (_, call), level in zip(calls, levels, strict=True) if level == 0
    )
    return EagerPlan(blocks, outcome.planned.peak, len(calls))


class _Call:
    """One call of a checkpointed block: whether its forward has run (a later run of its
    body is the recomputation in backward)."""

    ran = False


@contextlib.contextmanager
def buffers_kept(block: torch.nn.Module) -> Iterator[None]:
    """``block``'s buffers as they were on entry, once inside is done: a recomputation
    writes running statistics (BatchNorm's) a second time, and eager's step writes them
    once (and steps measured to plan a budget write them at all)."""
    kept = [(b, b.clone()) for b in block.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, before in kept:
                b.copy_(before)


@contextlib.contextmanager
def _statistics_held(module: torch.nn.Module) -> Iterator[None]:
    """Batch norms of ``module`` keep their running statistics while inside (the planning
    trace is not a step: it must not update them, and a trace refuses buffer writes); what
    the step holds is the same, batch statistics computed and saved either way."""
    norms = [
        m
        for m in module.modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats
    ]
    for m in norms:
        m.track_running_stats = False
    try:
        yield
    finally:
        for m in norms:
            m.track_running_stats = True


def _loss(out: Any) -> Any:
    """What the planned backward starts from: a model output's ``loss`` where it has one
    (an HF model given labels), else the output (one cotangent per floating-point leaf)."""
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, dict) and isinstance(out.get("loss"), torch.Tensor):
        return out["loss"]
    return out


@contextlib.contextmanager
def _checkpointing(blocks: Sequence[torch.nn.Module]) -> Iterator[None]:
    """``blocks`` checkpointed (eager :func:`functrans.remat`, saving only their inputs)
    while inside: each one's ``forward`` replaced on the instance, then restored as it was
    (a ``forward`` set on the instance before, ``jit_blocks``' or the user's, comes back)."""
    _missing = object()
    replaced: list[tuple[torch.nn.Module, object]] = []
    try:
        for block in dict.fromkeys(blocks):  # a module called twice is wrapped once
            before = block.__dict__.get("forward", _missing)
            block.forward = _checkpointed(block)
            replaced.append((block, before))
        yield
    finally:
        for block, before in replaced:
            if before is _missing:
                block.__dict__.pop("forward", None)
            else:
                block.__dict__["forward"] = before


def _checkpointed(block: torch.nn.Module) -> Callable[..., Any]:
    """``block``'s forward under eager remat, its parameters passed in as inputs: the
    recomputation in backward runs with the tensors the forward ran with (under
    ``functional_call`` those are the caller's, swapped back out by the time backward
    runs; rereading ``self.weight`` then would recompute with other weights)."""
    original = block.forward
    # the tables the block's parameters live in (one holds a caller's plain tensor while
    # functional_call runs: typed as Any)
    slots: list[tuple[dict[str, Any], str]] = [
        (m._parameters, k)
        for m in block.modules()
        for k, p in m._parameters.items()
        if p is not None
    ]

    def body(tensors: tuple[torch.Tensor, ...], call: _Call, *args: Any, **kwargs: Any) -> Any:
        held = [table[name] for table, name in slots]
        for (table, name), t in zip(slots, tensors, strict=True):
            table[name] = t
        try:
            if not call.ran:  # the forward
                call.ran = True
                return original(*args, **kwargs)
            with buffers_kept(block):  # the recomputation: eager's step updates them once
                return original(*args, **kwargs)
        finally:
            for (table, name), t in zip(slots, held, strict=True):
                table[name] = t

    body.__qualname__ = type(block).__name__  # errors name the block
    run = _remat.remat(body)

    def forward(*args: Any, **kwargs: Any) -> Any:
        return run(tuple(table[name] for table, name in slots), _Call(), *args, **kwargs)

    return forward


@overload
def remat(
    f: _M,
    *,
    policy: PolicyLike = ...,
    prevent_cse: bool = ...,
    static_argnums: Sequence[int] = ...,
    peak_bytes: None = ...,
) -> RematModule: ...
@overload
def remat(
    f: torch.nn.Module,
    *,
    policy: None = ...,
    prevent_cse: bool = ...,
    static_argnums: Sequence[int] = ...,
    peak_bytes: int,
) -> BudgetedModule: ...
@overload
def remat(
    f: Callable[_P, _R],
    *,
    policy: PolicyLike = ...,
    prevent_cse: bool = ...,
    static_argnums: Sequence[int] = ...,
    peak_bytes: None = ...,
) -> Callable[_P, _R]: ...
@overload
def remat(
    f: None = None,
    *,
    policy: PolicyLike = ...,
    prevent_cse: bool = ...,
    static_argnums: Sequence[int] = ...,
    peak_bytes: None = ...,
) -> RematDecorator: ...
def remat(
    f: Callable[..., Any] | None = None,
    *args: Any,
    policy: PolicyLike = None,
    prevent_cse: bool = True,
    static_argnums: Sequence[int] = (),
    peak_bytes: int | None = None,
    **torch_options: Any,
) -> RematModule | BudgetedModule | Callable[..., Any] | RematDecorator:
    """Rematerialize ``f`` in backward, saving only what ``policy`` says (JAX's
    ``checkpoint``; see :func:`functrans._transforms.remat.remat` for ``policy``,
    ``prevent_cse`` and ``static_argnums``). ``remat(model, peak_bytes=N)`` instead plans
    which of the model's repeated blocks to checkpoint so a training step's peak stays within
    ``N`` bytes, and runs the model eagerly so (:class:`BudgetedModule`, see the module
    docstring): ``torch``'s users call it ``auto_checkpoint(model, memory_budget=...)``.

    >>> import torch, functrans as ft
    >>> f = ft.remat(lambda x: torch.sin(x).sum())
    >>> f(torch.zeros(3, requires_grad=True))
    tensor(0., grad_fn=<...>)

    ``remat(f, *args)`` is ``torch.utils.checkpoint``'s call form (it runs ``f`` now): it
    raises :class:`~functrans.InvalidArgumentError` naming ``ft.checkpoint``, its drop-in.
    """
    if args or torch_options:
        _refuse_call_form(f, args, torch_options)
    if peak_bytes is None:
        if f is None:
            return _remat.remat(
                policy=policy, prevent_cse=prevent_cse, static_argnums=static_argnums
            )
        return _remat.remat(
            f, policy=policy, prevent_cse=prevent_cse, static_argnums=static_argnums
        )
    if not isinstance(f, torch.nn.Module):
        raise InvalidArgumentError(
            f"remat: peak_bytes={peak_bytes!r} takes a module (its repeated blocks are "
            f"checkpointed as a plan for the limit chooses); got f={f!r}. For a function, "
            "jit it: ft.jit(f, partition='memory_budget', peak_bytes=...)"
        )
    if policy is not None:
        raise InvalidArgumentError(
            f"remat: peak_bytes={peak_bytes!r} chooses which blocks to checkpoint (each saves "
            f"its inputs only); it takes no policy, got policy={policy!r}"
        )
    return BudgetedModule(f, peak_bytes=peak_bytes)


def _refuse_call_form(f: Any, args: tuple[Any, ...], options: dict[str, Any]) -> None:
    """``remat(f, *args, **options)``: torch's checkpoint call form, refused by name (HF's
    ``gradient_checkpointing_func=ft.remat`` calls it so, with ``use_reentrant=...``)."""
    from functrans._core.validate import describe

    given = [describe(a) for a in args] + [f"{k}={v!r}" for k, v in options.items()]
    raise InvalidArgumentError(
        f"remat({getattr(f, '__qualname__', f)!s}, {', '.join(given)}): remat takes the "
        "function only and returns it rematerialized (ft.remat(f)(*args)); "
        "torch.utils.checkpoint's call form, which runs f now and takes use_reentrant= or "
        "context_fn=, is ft.checkpoint(f, *args, **kwargs) (also what to pass as HF's "
        "gradient_checkpointing_func)"
    )
