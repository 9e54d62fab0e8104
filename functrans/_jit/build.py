"""One compiled entry of a jitted function: trace, partition, compile, and the :class:`Entry`.

An inference call (nothing requires grad, or grad mode off) traces a forward-only graph; a
training call traces the joint graph, partitions it and compiles forward and backward. Both
traces go through the on-disk cache (:meth:`Builder._traced`), and both end in the one
:class:`~functrans._jit.apply.Entry` constructor, :func:`_entry`.

A forward trace of a call whose inputs require grad under ``torch.no_grad()`` watches the body
(:func:`watched`): eager records what a ``torch.enable_grad()`` block in the body computes, so a
body that turns grad mode on stops the trace at its first such op (before the on-disk cache
stores it) and :meth:`Builder.build` answers :data:`GRAD_ON`; the caller builds a training
entry instead (see :meth:`~functrans._jit.entry_compiler.EntryCompiler.compile`).

>>> import torch, functrans as ft
>>> f = ft.jit(lambda x: (x * 2).sum())
>>> x = torch.ones(3, requires_grad=True)
>>> f(x).backward(); x.grad.tolist()
[2.0, 2.0, 2.0]
"""

from __future__ import annotations

import enum
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch

from functrans._core.backends import Backend, capabilities, get_backend
from functrans._core.boxed import boxed
from functrans._core.dtypes import differentiable
from functrans._core.errors import InvalidPartitionError
from functrans._core.graph import JointGraph
from functrans._core.logs import log, slow
from functrans._core.pytree import Flat, plain
from functrans._core.shapes import Dims, ShapeGuard, shape_env_of
from functrans._core.stack import ControlFlow
from functrans._core.state import autocast_off
from functrans._cut.partition import Partition, partition
from functrans._trace.joint import joint
from functrans._trace.options import OPTIONS
from functrans._trace.passes import no_gc
from functrans._trace.regions import deferred as deferred_regions
from functrans._trace.regions import stats as region_stats
from functrans._trace.regions.graph import REGIONS
from functrans._trace.trace import trace

from . import staged
from .apply import Entry, OutMeta, inner_tensors, saved_inputs
from .cache import CacheInfo
from .disk import store as disk_cache
from .disk.store import DiskKey
from .options import Options
from .outline import OUTLINED
from .planned_grad import Plan
from .staged_plan import stitched
from .step_plan import Outcome, blockwise, outlined

__all__ = [
    "DISK_STORES",
    "GRAD_ON",
    "Builder",
    "Built",
    "GradOn",
    "Stopped",
    "Target",
    "grad_off",
    "watched",
]

_G = TypeVar("_G")

#: Traces a jitted function stores in the on-disk cache (each costs a recorded trace, about
#: twice a plain one on CPython 3.11): the first calls, which every restart pays again.
DISK_STORES = 4


class GradOn(enum.Enum):
    """What :meth:`Builder.build` answers where the body turned grad mode on under the
    caller's ``torch.no_grad()`` (seen by :func:`watched`)."""

    GRAD_ON = "grad on"


GRAD_ON: Literal[GradOn.GRAD_ON] = GradOn.GRAD_ON


@dataclass(frozen=True)
class Target:
    """What one compile traces: the flat function ``fn(diff_leaves, other_leaves)`` and, for
    an inference entry of ``jit(grad(f))`` or ``jit(vmap(grad(f)))``, the plan to trace
    instead (:mod:`functrans._jit.planned_grad`)."""

    fn: Callable[..., Any]
    plan: Plan | None = None
    #: run on the traced graph before anything is partitioned or compiled; a result other
    #: than None stops the build, which answers it as :class:`Stopped` (jit lifts the
    #: captured tensors a trace baked in, and traces again with them as inputs)
    after_trace: Callable[[torch.fx.GraphModule], object] | None = None


@dataclass(frozen=True)
class Stopped:
    """What :meth:`Builder.build` answers where :attr:`Target.after_trace` stopped it."""

    value: object


#: What :meth:`Builder.build` answers: the entry, or why there is none yet.
Built = Entry | GradOn | Stopped


class _GradTurnedOn(ControlFlow):
    """Raised by :class:`_GradWatch` inside the body: stops the trace (caught in
    :meth:`Builder.build`, which answers :data:`GRAD_ON`)."""


class _GradWatch(torch.overrides.TorchFunctionMode):
    """Raises :class:`_GradTurnedOn` at the first torch call the body makes with grad mode on.
    The trace stops there, before the on-disk cache stores it: a stored forward trace of a call
    whose inputs require grad is one whose body left grad mode off."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is not _SET_GRAD and torch.is_grad_enabled():  # the setter itself is seen
            raise _GradTurnedOn
        return func(*args, **(kwargs or {}))


_SET_GRAD = torch._C._set_grad_enabled


def watched(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` stopping at its first torch op run with grad mode on (see :class:`_GradWatch`)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        with _GradWatch():
            return call(*args, **kwargs)

    return run


def grad_off(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` with grad mode off around it (the joint graph traces with it on)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return call(*args, **kwargs)

    return run


class Builder:
    """Builds the entries of one jitted function and adds up its stage times in ``times``."""

    def __init__(self, options: Options, times: CacheInfo) -> None:
        self.options, self._times = options, times
        self.disk_misses = 0  # traces the on-disk cache did not have

    def decompositions(self) -> Any:
        """The decompositions its traces use: the option, or the backend's (``"auto"``)."""
        decompositions = self.options.decompositions
        if decompositions == "auto":
            backend = get_backend(self.options.backend)
            decompositions = capabilities(backend).decompositions
        return decompositions

    @property
    def stores(self) -> bool:
        """Whether the next trace the on-disk cache misses is stored (the first few are)."""
        return self.disk_misses < DISK_STORES

    def _traced(
        self,
        disk: Callable[..., DiskKey],
        kind: str,
        decompositions: Any,
        make: Callable[[], _G],
        dims: Dims | None,
    ) -> _G:
        """``make()`` (a trace symbolic in ``dims``), through the on-disk cache
        (:mod:`functrans._jit.disk.store`)."""
        key = disk(kind=kind, decompositions=decompositions, dims=dims)
        g, hit = disk_cache.traced(key, make)
        self._times.disk_hits += hit
        self.disk_misses += not hit
        return g

    def build(
        self,
        target: Target,
        example: Any,
        training: bool,
        disk: Callable[..., DiskKey],
        dims: Dims | None = None,
    ) -> Built:
        """The entry for ``example`` (``(diff_leaves, other_leaves)``), symbolic in ``dims``
        (or :class:`GradOn`, or :class:`Stopped` by :attr:`Target.after_trace`). The cyclic garbage
        collector waits meanwhile: trace, partition and compile build graphs that stay alive
        until the entry is made, and a collection in between scans them and the whole heap
        (0.17 s once torch is imported) for nothing."""
        name = getattr(target.fn, "__qualname__", type(target.fn).__name__)
        step = "training step" if training else "call"
        strategy = self.options.partition
        what = f"compiling {name}'s {step} (trace, partition {strategy!r}, codegen)"
        with OPTIONS.bound(self.options.trace), no_gc(), slow(lambda: what):
            return self._build(target, example, training, disk, dims)

    def _build(
        self,
        target: Target,
        example: Any,
        training: bool,
        disk: Callable[..., DiskKey],
        dims: Dims | None,
    ) -> Built:
        backend = get_backend(self.options.backend)
        decompositions = self.decompositions()
        inputs = inner_tensors([*example[0], *example[1]])
        subclass = not all(map(plain, [*example[0], *example[1]]))
        t0 = time.perf_counter()
        if not training:
            stitched = target.plan(decompositions, backend) if target.plan is not None else None
            traced = target.fn if stitched is None else stitched.fn
            try:
                g = self._traced(
                    disk,
                    "forward",
                    decompositions,
                    lambda: trace(
                        traced, decompositions=decompositions, cse=stitched is None, dynamic=dims
                    )(*example),
                    dims,
                )
            except _GradTurnedOn:
                return GRAD_ON
            stop = _after_trace(target, g.graph_module)
            if stop is not None:
                self._times.trace_s += time.perf_counter() - t0
                return stop
            t1 = time.perf_counter()
            fwd = backend.compile(g, inputs)
            self._times.trace_s += t1 - t0
            self._times.compile_s += time.perf_counter() - t1
            vals = list(g.output_nodes())
            entry = _entry(
                forward=fwd,
                backward=None,
                out_flat=g.out_flat,
                primals=g.placeholders(),
                outputs=vals,
                wants=[False] * len(vals),
                differentiable=[False] * len(vals),
                num_diff=0,
                num_inputs=len(inputs),
                partition=stitched.partition if stitched is not None else None,
                subclass=subclass,
                dims=dims,
                forward_graph=g.graph_module,
            )
            return entry
        reused = region_stats.reused

        def traced_joint() -> JointGraph:
            return joint(target.fn, argnums=0, decompositions=decompositions, dynamic=dims)(
                *example
            )

        def traced_keeping_regions() -> JointGraph:
            with deferred_regions() as held:
                jg = traced_joint()
            jg.attach(REGIONS, tuple(held.regions))
            return jg

        outlines = self._outlines(dims, subclass)
        if outlines:  # its region ops kept, the regions stored beside it
            jg = self._traced(disk, "joint-regions", decompositions, traced_keeping_regions, dims)
        else:
            jg = self._traced(disk, "joint", decompositions, traced_joint, dims)
        self._times.regions_reused += region_stats.reused - reused
        stop = _after_trace(target, jg.graph_module)
        if stop is not None:
            self._times.trace_s += time.perf_counter() - t0
            return stop
        t1 = time.perf_counter()
        planned: Partition | None = None
        unmet: Outcome | None = None
        if outlines and jg.attached(REGIONS):
            found = self._outlined(jg, backend)
            if isinstance(found, JointGraph):
                jg = found
            elif found.planned is not None:

                def unrolled() -> JointGraph:
                    return self._traced(disk, "joint", decompositions, traced_joint, dims)

                opts = self.options
                planned = found.best(unrolled, str(opts.partition), opts.partition_options)
                jg = planned.joint
            else:  # a peak goal no block-by-block plan meets: the unrolled step's ILP
                unmet = found
                jg = self._traced(disk, "joint", decompositions, traced_joint, dims)
        if not any(jg.differentiable):  # e.g. a body under torch.no_grad(): nothing to save
            # the joint's forward, which saves nothing (a forward trace of its own would not
            # have its inputs require grad: a torch.autograd.grad the body takes of them would
            # fail there), run as the body ran, with autograd off
            self._times.trace_s += t1 - t0
            return self._forward_of(jg, inputs, subclass, dims)
        wants = _tangent_mask(jg)
        at = staged.cuts(jg, [w and d for w, d in zip(wants, jg.differentiable, strict=True)])
        if at and dims is None and not subclass:  # returned intermediates: see staged
            self._times.trace_s += t1 - t0
            done = self._staged(jg, at, len(example[0]), inputs, backend)
            if done is None and _calls_regions(jg):  # cut the unrolled forward
                flat = self._traced(disk, "joint", decompositions, traced_joint, dims)
                mask = [w and d for w, d in zip(wants, flat.differentiable, strict=True)]
                at = staged.cuts(flat, mask)
                done = self._staged(flat, at, len(example[0]), inputs, backend)
            if done is not None:
                return done
            t0 = t1 = time.perf_counter()
        elif at:  # symbolic sizes or tensor subclasses: one node, and say so (never silent)
            _warn_unstaged(dims is not None)
        try:
            p = planned or partition(jg, self.options.partition, **self.options.partition_options)
        except InvalidPartitionError as e:
            if unmet is None:
                raise
            raise InvalidPartitionError(f"{e}. {unmet.why()}") from e
        self._times.trace_s += t1 - t0
        self._times.partition_s += time.perf_counter() - t1
        return self._trained(jg, p, backend, inputs, len(example[0]), subclass, dims)

    def _trained(
        self,
        jg: JointGraph,
        p: Partition,
        backend: Backend,
        inputs: list[torch.Tensor],
        num_diff: int,
        subclass: bool,
        dims: Dims | None,
    ) -> Entry:
        """The training entry of ``jg`` cut as ``p``: its graphs compiled by ``backend``."""
        t2 = time.perf_counter()
        for o in jg.attached(OUTLINED):  # the region cuts it calls (a plan's others never are)
            o.compile()
        fwd = backend.compile(p.forward, inputs)
        bwd = boxed(backend.compile(p.backward, []))
        log(
            "codegen",
            f"forward and backward compiled by {self.options.backend!r}",
            lambda: f"{p.forward.graph_module.code}\n{p.backward.graph_module.code}",
        )
        self._times.compile_s += time.perf_counter() - t2
        outputs = jg.forward_outputs()
        saved = saved_inputs(p.forward.graph_module, len(outputs), num_diff)
        return _joint_entry(jg, fwd, bwd, p, num_diff, len(inputs), subclass, dims, saved=saved)

    def _staged(
        self,
        jg: JointGraph,
        at: list[torch.fx.Node],
        num_diff: int,
        inputs: list[torch.Tensor],
        backend: Backend,
    ) -> Entry | None:
        """The entry of a step whose outputs ``at`` other outputs are computed from: its
        forward cut after each, each stage its own compiled entry (:mod:`.staged`), and their
        partitions stitched as they run (:mod:`.staged_plan`). None where the forward cannot
        be cut, or its first stage cannot be cut as the strategy asks."""
        cut = staged.stage_graphs(jg, at, num_diff) if at else None
        if cut is None:
            return None
        stages = []
        head = staged.headed(jg, cut)
        if head is not None:  # the first stage is the step, its regions kept
            t0 = time.perf_counter()
            try:
                hp = partition(head.joint, self.options.partition, **self.options.partition_options)
            except InvalidPartitionError as e:
                warnings.warn(
                    f"functrans.jit: the step returns intermediates that other outputs are "
                    f"computed from, and its first stage cannot be cut as "
                    f"{self.options.partition!r} asks ({e}); it runs as one compiled node: "
                    "retain_grad(), hooks and autograd.grad on those intermediates do not see "
                    "the gradient from the outputs computed from them",
                    UserWarning,
                    stacklevel=2,
                )
                return None
            self._times.partition_s += time.perf_counter() - t0
            first = self._trained(head.joint, hp, backend, inputs, num_diff, False, None)
            takes = tuple(staged.Source(-1, i) for i in range(len(inputs)))
            stages.append(staged.Stage(first, takes))
            graphs, gives = head.later, head.gives
        else:
            if _calls_regions(jg):  # the stages are cut from the unrolled forward
                return None
            graphs, gives = tuple(cut.graphs), cut.gives
        decompositions = self.decompositions()
        for g in graphs:
            t0 = time.perf_counter()
            example = g.examples()
            with autocast_off():  # the graph holds the step's casts
                sjg = joint(g, argnums=0, decompositions=decompositions)(*example)
            t1 = time.perf_counter()
            sp = partition(sjg, self.options.partition, **self.options.partition_options)
            self._times.trace_s += t1 - t0
            self._times.partition_s += time.perf_counter() - t1
            ins = [*example[0], *example[1]]
            entry = self._trained(sjg, sp, backend, ins, g.num_diff, False, None)
            stages.append(staged.Stage(entry, g.takes, g))
        run = staged.Stages(tuple(stages), gives)
        p = stitched(jg, run, str(self.options.partition))
        fwd, bwd = _unstaged, _unstaged_backward
        return _joint_entry(jg, fwd, bwd, p, num_diff, len(inputs), False, None, stages=run)

    def _forward_of(
        self, jg: JointGraph, inputs: list[torch.Tensor], subclass: bool, dims: Dims | None
    ) -> Entry:
        """An inference entry running ``jg``'s forward (a training call whose outputs do not
        require grad), without autograd."""
        p = partition(jg, "default")
        t1 = time.perf_counter()
        fwd = get_backend(self.options.backend).compile(p.forward, inputs)
        self._times.compile_s += time.perf_counter() - t1
        outputs = jg.forward_outputs()
        n = len(outputs)

        def forward(*tensors: torch.Tensor) -> list[Any]:  # the outputs, not what it saves
            with torch.no_grad():
                return list(fwd(*tensors))[:n]

        return _entry(
            forward=forward,
            backward=None,
            out_flat=jg.fn_out,
            primals=p.forward.placeholders(),
            outputs=outputs,
            wants=[False] * len(outputs),
            differentiable=[False] * len(outputs),
            num_diff=0,
            num_inputs=len(inputs),
            partition=None,
            subclass=subclass,
            dims=dims,
            forward_graph=p.forward.graph_module,
        )

    def _outlines(self, dims: Dims | None, subclass: bool) -> bool:
        """Whether a training step compiles its repeated regions once
        (the default, :mod:`functrans._jit.outline`)."""
        opts = self.options
        return dims is None and not subclass and blockwise(opts.partition, opts.partition_options)

    def _outlined(self, jg: JointGraph, backend: Backend) -> JointGraph | Outcome:
        return outlined(jg, self.options.partition, self.options.partition_options, backend)


def _calls_regions(jg: JointGraph) -> bool:
    """Whether ``jg`` calls regions (kept, or outlined)."""
    return bool(jg.attached(OUTLINED)) or bool(jg.attached(REGIONS))


def _after_trace(target: Target, gm: torch.fx.GraphModule) -> Stopped | None:
    if target.after_trace is None:
        return None
    value = target.after_trace(gm)
    return None if value is None else Stopped(value)


def _entry(
    *,
    forward: Callable[..., list[Any]],
    backward: Callable[[list[Any]], list[Any]] | None,
    out_flat: Flat,
    primals: Sequence[torch.fx.Node],
    outputs: Sequence[torch.fx.Node],
    wants: Sequence[bool],
    differentiable: Sequence[bool],
    num_diff: int,
    num_inputs: int,
    partition: Partition | None,
    subclass: bool,
    dims: Dims | None,
    absent: tuple[int, ...] = (),
    grad_outputs: tuple[frozenset[int], ...] = (),
    saved_inputs: tuple[tuple[int, int], ...] = (),
    forward_graph: torch.fx.GraphModule | None = None,
    stages: staged.Stages | None = None,
) -> Entry:
    """The entry of compiled graphs over the traced ``primals`` with forward ``outputs``
    (``wants``: which take a tangent; ``differentiable``: which require grad); ``backward``
    None: an inference entry."""
    return Entry(
        forward=forward,
        backward=backward,
        out_flat=out_flat,
        out_meta=tuple(
            OutMeta.of(v.meta["val"], w, d)
            for v, w, d in zip(outputs, wants, differentiable, strict=True)
        ),
        num_diff=num_diff,
        num_inputs=num_inputs,
        partition=partition,
        copies=_copies(list(primals), list(outputs)),
        subclass=subclass or bool(out_flat.wrappers),
        shape=_shape_guard(primals) if dims is not None else None,
        saved_tensors=(
            _saved_tensors(partition) if backward is not None and partition is not None else None
        ),
        absent=absent,
        grad_outputs=grad_outputs,
        saved_inputs=saved_inputs,
        forward_graph=forward_graph,
        stages=stages,
    )


def _joint_entry(
    jg: JointGraph,
    forward: Callable[..., list[Any]],
    backward: Callable[[list[Any]], list[Any]],
    p: Partition,
    num_diff: int,
    num_inputs: int,
    subclass: bool,
    dims: Dims | None,
    saved: tuple[tuple[int, int], ...] = (),
    stages: staged.Stages | None = None,
) -> Entry:
    """The training entry of ``jg`` cut as ``p``, run by ``forward`` and ``backward`` (or by
    ``stages``)."""
    wants = _tangent_mask(jg)
    tangents = set(jg.tangents())
    return _entry(
        forward=forward,
        backward=backward,
        out_flat=jg.fn_out,
        primals=[n for n in jg.placeholders() if n not in tangents],
        outputs=jg.forward_outputs(),
        wants=wants,
        differentiable=[w and d for w, d in zip(wants, jg.differentiable, strict=True)],
        num_diff=num_diff,
        num_inputs=num_inputs,
        partition=p,
        subclass=subclass,
        dims=dims,
        absent=jg.absent_grads(),
        grad_outputs=_grad_outputs(jg, wants),
        saved_inputs=saved,
        stages=stages,
    )


def _warn_unstaged(dynamic: bool) -> None:
    why = "it has symbolic sizes (dynamic=)" if dynamic else "its tensors are subclasses"
    warnings.warn(
        "functrans.jit: the step returns intermediates that other outputs are computed from, "
        f"and {why}, so it runs as one compiled node: retain_grad(), hooks and "
        "autograd.grad on those intermediates do not see the gradient from the outputs "
        "computed from them. Jit it with static sizes (dynamic=False) where they must",
        UserWarning,
        stacklevel=2,
    )


def _unstaged(*_: torch.Tensor) -> list[Any]:
    raise AssertionError("a staged step runs its stages (Entry.stages)")


def _unstaged_backward(_: list[Any]) -> list[Any]:
    raise AssertionError("a staged step runs its stages (Entry.stages)")


def _shape_guard(placeholders: Sequence[torch.fx.Node]) -> ShapeGuard | None:
    """The guards of a symbolic trace over its inputs (None where it came out static)."""
    vals = [n.meta["val"] for n in placeholders]
    env = shape_env_of(vals)
    return None if env is None else ShapeGuard.of(vals, env)


def _saved_tensors(p: Partition) -> tuple[bool, ...] | None:
    """Which saved values are tensors, None where all are (a dynamic forward saves sizes)."""
    mask = tuple(isinstance(s.node.meta.get("val"), torch.Tensor) for s in p.saved)
    return None if all(mask) else mask


_COPY_OPS = (torch.ops.aten.clone.default, torch.ops.aten.alias.default)


def _copies(inputs: list[Any], outputs: list[Any]) -> dict[int, int]:
    """``{output index: input index}`` for outputs that are unmodified copies of an input."""
    where = {n: i for i, n in enumerate(inputs)}
    found: dict[int, int] = {}
    for i, node in enumerate(outputs):
        while getattr(node, "op", None) == "call_function" and node.target in _COPY_OPS:
            node = node.args[0]
        if node in where:
            found[i] = where[node]
    return found


def _grad_outputs(jg: JointGraph, wants: Sequence[bool]) -> tuple[frozenset[int], ...]:
    """Per gradient, the flat outputs it is computed from (:attr:`Entry.grad_outputs`):
    :meth:`~functrans._core.graph.JointGraph.grad_tangents` with each tangent replaced by the
    output it is the tangent of."""
    output_of = [i for i, w in enumerate(wants) if w]
    return tuple(frozenset(output_of[t] for t in ts) for ts in jg.grad_tangents())


def _tangent_mask(jg: Any) -> list[bool]:
    """Which forward outputs took a tangent in the joint graph (floating-point and complex
    outputs, in order)."""
    return [differentiable(v.meta["val"]) for v in jg.forward_outputs()]
