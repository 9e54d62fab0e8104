"""``budget_blocks``: a peak budget for an FSDP2 training step, held on every rank.

Under FSDP2 a rank's step peak is mostly FSDP's own: each unit's parameters all-gathered,
its unsharded gradients, the reduce-scatter's input and output, and the blocks' saved
activations between them. The first are FSDP's schedule, run eagerly in hooks outside any
trace; how long a collective's buffer lives after the caller's ``wait`` is up to the process
group's worker thread (gloo frees it there, a moment later: the measured step peak varies by
up to one unit's unsharded bytes from step to step). So the step's peak is not a sum a
planner can read off the blocks' graphs; it is measured. :func:`budget_blocks` compiles each
block's ``forward`` (as :func:`~functrans.distributed.jit_blocks` does) under cuts chosen by
measuring the user's own ``step`` on every rank:

- a plan (a cut per block, from :data:`CUTS`: ``full_remat`` saves only each block's input,
  ``default`` all that autograd may) is measured over ``rounds`` steps after one that warms it
  (compiles its new cuts); its **bound** is the highest peak any rank measured, and at least
  the lowest one plus the largest unit's unsharded bytes under a process group (the one
  buffer a collective's thread may still hold), so a later step's peak stays within it;
- the uniform plans are measured from the one that recomputes least (``default``) down; the
  first whose bound is within ``peak_bytes`` is kept, then its last blocks move to cuts that
  save more as far as the bound allows (a block's backward runs while the blocks before it
  hold what they saved: the last blocks' savings cost the peak least), each move measured;
- every rank takes the same plan (bounds are the maximum over ranks), and what the measuring
  steps change is put back: gradients, buffers and the random number generators' states.

A limit below every uniform plan's bound is an :class:`~functrans.InvalidPartitionError`
naming the lowest bound, the blocks left as they were; limits that differ between ranks are
refused on every rank. An error ``step`` raises on one rank is raised there, the blocks left
as they were; the other ranks wait for it at their next collective, as in any step. The plan
holds for the step measured: a step with other shapes recompiles the same cuts, unmeasured
(call again to budget it).

>>> import torch
>>> from functrans.distributed import budget_blocks
>>> budget_blocks(torch.nn.Linear(2, 2), lambda: None, peak_bytes=1 << 20)
Traceback (most recent call last):
...
functrans._core.errors.InvalidArgumentError: budget_blocks: Linear has no FSDP unit...
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from functrans._core.errors import InvalidArgumentError, InvalidPartitionError
from functrans._core.marks import leave, marked
from functrans._core.tags import PolicyLike
from functrans._core.validate import check_number
from functrans._jit.eager_budget import buffers_kept
from functrans._jit.step_plan import CHOICES, Choice, folded, largest_passing
from functrans.testing import measure_peak

from ._blocks import JitBlock, chosen_blocks, compiled_forward

__all__ = ["CUTS", "StepBudget", "Trial", "budget_blocks"]

#: the cuts a block may take, from the one that saves least to the one that saves most
CUTS: tuple[Choice, ...] = CHOICES


@dataclass(frozen=True)
class Trial:
    """One plan measured: each block's cut (indices into :data:`CUTS`, blocks in forward
    order), the step peaks measured (per round, the highest of the ranks), the bound taken
    from them, and the FLOPs the blocks' backward recomputes."""

    levels: tuple[int, ...]
    measured: tuple[int, ...]
    bound: int
    recompute_flops: int

    @property
    def cuts(self) -> tuple[str, ...]:
        """Each block's cut, by its label in :data:`CUTS`."""
        return tuple(CUTS[level].label for level in self.levels)


@dataclass(frozen=True)
class StepBudget:
    """What :func:`budget_blocks` chose: the plan kept (``chosen``), the limit, the margin
    added for a collective's late free (the largest unit's unsharded bytes under a process
    group, 0 without one), and every plan measured on the way, in order."""

    limit: int
    margin: int
    chosen: Trial
    tried: tuple[Trial, ...]

    @property
    def peak_bytes(self) -> int:
        """The chosen plan's bound: the most a step measured is expected to hold on a rank."""
        return self.chosen.bound

    def describe(self) -> str:
        """The chosen cuts (runs of equal cuts folded), the bound and the limit."""
        cuts = folded(self.chosen.cuts)
        return f"{cuts}: bound {self.peak_bytes} of {self.limit} bytes ({len(self.tried)} measured)"


def budget_blocks(
    model: torch.nn.Module,
    step: Callable[[], Any],
    *,
    peak_bytes: int,
    policy: PolicyLike | Literal[False] = False,
    blocks: Sequence[torch.nn.Module] | None = None,
    rounds: int = 3,
    **jit_options: Any,
) -> StepBudget:
    """Compile the ``forward`` of every innermost FSDP unit of ``model`` (or of ``blocks``)
    with ``ft.jit``, each cut so that ``step()`` (one batch's forward and backward, no
    optimizer step: called on every rank alike) peaks within ``peak_bytes`` on every rank,
    recomputing as little as the measured plans allow (see the module docstring).
    ``policy``, ``blocks`` and ``jit_options`` (``backend``, not ``partition``: the budget
    chooses it) as for :func:`~functrans.distributed.jit_blocks`; ``rounds``: the steps each
    plan is measured over."""
    check_number(
        "budget_blocks", "peak_bytes", peak_bytes, at_least=0, integer=True, meaning="bytes"
    )
    check_number("budget_blocks", "rounds", rounds, at_least=1, integer=True, meaning="steps")
    if not callable(step):
        raise InvalidArgumentError(
            f"budget_blocks: step={step!r} is not accepted; pass a function of no arguments "
            "that runs one batch's forward and backward"
        )
    if "partition" in jit_options:
        raise InvalidArgumentError(
            f"budget_blocks: partition={jit_options['partition']!r} is not accepted; the "
            "budget chooses each block's cut (use jit_blocks to name one)"
        )
    chosen = chosen_blocks("budget_blocks", model, blocks)
    done = [type(b).__name__ for b in chosen if marked(b, JitBlock)]
    if done:
        raise InvalidArgumentError(
            f"budget_blocks: {done[0]} is already compiled by jit_blocks or budget_blocks; "
            "budget a model whose blocks run as written"
        )
    _same_on_every_rank(peak_bytes)
    plan = _Plans(model, chosen, step, policy, jit_options, rounds)
    try:
        with _restored(model):
            budget = plan.search(peak_bytes)
    except BaseException:
        plan.put_back()
        raise
    plan.install(budget.chosen)
    return budget


class _Plans:
    """The blocks, their compiled cuts (each compiled once) and the plans measured."""

    def __init__(
        self,
        model: torch.nn.Module,
        blocks: list[torch.nn.Module],
        step: Callable[[], Any],
        policy: PolicyLike | Literal[False],
        jit_options: dict[str, Any],
        rounds: int,
    ) -> None:
        self.model, self.blocks, self.step, self.rounds = model, blocks, step, rounds
        self.policy, self.jit_options = policy, jit_options
        self.bodies = [b.forward for b in blocks]  # the units' own forwards
        self.original = [b.__dict__.get("forward") for b in blocks]  # put back on failure
        self.compiled: dict[tuple[int, int], Any] = {}
        self.seen: dict[tuple[int, ...], Trial] = {}
        collectives = dist.is_available() and dist.is_initialized()
        self.margin = max(_unsharded_bytes(b) for b in blocks) if collectives else 0

    def forward(self, i: int, level: int) -> Any:
        if (i, level) not in self.compiled:
            cut = CUTS[level]
            options = {"partition": cut.strategy, **dict(cut.options), **self.jit_options}
            self.compiled[i, level] = compiled_forward(self.bodies[i], self.policy, options)
        return self.compiled[i, level]

    def measure(self, levels: tuple[int, ...]) -> Trial:
        if levels not in self.seen:
            for i, level in enumerate(levels):
                self.blocks[i].forward = self.forward(i, level)
            _fresh(self.model)
            self.step()  # compiles the cuts new to this plan
            peaks = [_measured(self.model, self.step) for _ in range(self.rounds)]
            worst = _highest_on_any_rank(peaks)
            bound = max(max(worst), min(worst) + self.margin)
            recompute = sum(
                p.recompute_flops
                for i, level in enumerate(levels)
                for p in self.forward(i, level).partitions()
            )
            self.seen[levels] = Trial(levels, tuple(worst), bound, recompute)
        return self.seen[levels]

    def search(self, limit: int) -> StepBudget:
        n = len(self.blocks)
        trials: list[Trial] = []
        start: tuple[int, ...] | None = None
        for level in reversed(range(len(CUTS))):  # from the cut that recomputes least
            trial = self.measure((level,) * n)
            trials.append(trial)
            if trial.bound <= limit:
                start = (level,) * n
                break
        if start is None:
            lowest = min(trials, key=lambda t: t.bound)
            late = (
                f"; the bound is at least the least plus {self.margin} for a buffer a "
                "collective frees late"
                if self.margin
                else ""
            )
            raise InvalidPartitionError(
                f"budget_blocks: peak_bytes={limit} is below every plan measured: the lowest "
                f"step peak bound is {lowest.bound} bytes (every block {lowest.cuts[0]}: "
                f"measured {min(lowest.measured)}-{max(lowest.measured)} on the worst "
                f"rank{late}); ask for at least that"
            )
        levels = list(start)
        for level in reversed(range(start[0] + 1, len(CUTS))):  # from the cut saving most
            below = [i for i, lv in enumerate(levels) if lv < level]

            def moved(
                m: int,
                below: list[int] = below,
                level: int = level,
                now: tuple[int, ...] = tuple(levels),
            ) -> tuple[int, ...]:
                trial = list(now)
                for i in below[len(below) - m :]:
                    trial[i] = level
                return tuple(trial)

            fits = largest_passing(len(below), lambda m: self.measure(moved(m)).bound <= limit)
            if fits:
                levels = list(moved(fits))
        chosen = self.measure(tuple(levels))
        return StepBudget(limit, self.margin, chosen, tuple(self.seen.values()))

    def install(self, trial: Trial) -> None:
        for i, (block, level) in enumerate(zip(self.blocks, trial.levels, strict=True)):
            block.forward = self.forward(i, level)
            leave(block, JitBlock())

    def put_back(self) -> None:
        for block, forward in zip(self.blocks, self.original, strict=True):
            if forward is None:
                block.__dict__.pop("forward", None)
            else:
                block.forward = forward


def _unsharded_bytes(block: torch.nn.Module) -> int:
    """The bytes of ``block``'s parameters unsharded (a DTensor's numel is its global one)."""
    return sum(p.numel() * p.element_size() for p in block.parameters())


def _fresh(model: torch.nn.Module) -> None:
    """No gradients (as after ``zero_grad()``), the ranks aligned."""
    for p in model.parameters():
        p.grad = None
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _measured(model: torch.nn.Module, step: Callable[[], Any]) -> int:
    """The peak of one step from no gradients, above what was live before it."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    _fresh(model)
    return measure_peak(step, device=device).peak_bytes


def _same_on_every_rank(limit: int) -> None:
    """Every rank must search for the same limit (ranks taking different plans would issue
    different steps and wait on each other's collectives): refused on every rank at once."""
    least, most = _highest_on_any_rank([-limit, limit])
    if -least != most:
        raise InvalidArgumentError(
            f"budget_blocks: peak_bytes={limit} on this rank, but the ranks asked for "
            f"{-least} to {most}; pass the same limit on every rank"
        )


def _highest_on_any_rank(peaks: list[int]) -> list[int]:
    """Each round's peak, the highest of all ranks (as it is, without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return peaks
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(peaks, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(v) for v in t.tolist()]


@contextlib.contextmanager
def _restored(model: torch.nn.Module) -> Iterator[None]:
    """Put back what measuring steps change: gradients, buffers, random number generators."""
    grads = [(p, p.grad) for p in model.parameters()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        with buffers_kept(model):
            yield
    finally:
        for p, g in grads:
            p.grad = g
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
