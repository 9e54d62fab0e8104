"""How ``jit`` compiles the entry for a call it has none for (a cache miss).

:class:`EntryCompiler` traces the jitted function over flat tensor tuples (the differentiated
inputs, then the others) while what the trace reads is recorded
(:class:`~functrans._trace.reads.Recorder`: the entry's
:class:`~functrans._jit.read_guards.ReadGuard`), and builds the entry
(:mod:`functrans._jit.build`: trace, partition, compile; or the plan ``jit(grad(f))`` traces,
:mod:`functrans._jit.planned_grad`). It compiles again where the trace shows more: inputs the
function writes in place (traced with copies, written back after each call, as AOTAutograd
does), grad mode turned on in the body under the caller's ``torch.no_grad()``, or captured
tensors baked in (lifted to inputs: the caller keys the call again).
:class:`~functrans._jit.jitted.Jitted` finds entries and runs them.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from functrans._core.dtypes import differentiable
from functrans._core.marks import leave
from functrans._core.ops import is_random
from functrans._core.pytree import Flat, first_of_pair, plain, static_value, unflatten
from functrans._core.state import State, grad_enabled
from functrans._trace.capture import reach
from functrans._trace.read_records import is_atom
from functrans._trace.reads import Recorder
from functrans._trace.trace import ArgPaths, InputMutation, arg_names

from . import planned_grad
from .apply import Entry, Twice
from .build import Builder, GradOn, Stopped, Target, grad_off, watched
from .cache import Cache, Signature, Slot, rank_key
from .captures import Captures, Lifted
from .dims import build_dynamic, chosen_dims
from .disk import store as disk_cache
from .disk.store import DiskKey
from .options import Options
from .read_guards import ReadGuard

__all__ = ["EntryCompiler"]


class EntryCompiler:
    """Compiles the entries of one jitted function ``f`` (see the module docstring); shares
    with it the captured tensors, the builder, the cache and the warnings given."""

    def __init__(
        self,
        f: Callable[..., Any],
        options: Options,
        owner: str,
        warned: set[str],
        captures: Captures,
        builder: Builder,
        cache: Cache[Entry],
    ) -> None:
        self._f, self._opts, self._owner, self._warned = f, options, owner, warned
        self._captures, self._builder, self._cache = captures, builder, cache

    def warn_once(self, key: str, message: str) -> None:
        """Warn ``message`` once per ``key`` and jitted function (called at the same depth
        from :meth:`compile` and from the jitted function's lookup: ``stacklevel`` counts
        from there)."""
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=5)

    def names(self, flat: Flat, *, every_leaf: bool = False) -> list[str]:
        """Readable names of the tensor leaves (every leaf), captured tensors included."""
        return [self._captures.name(n) for n in arg_names(self._f, flat, every_leaf=every_leaf)]

    def compile(
        self,
        flat: Flat,
        tensors: list[torch.Tensor],
        state: State,
        key: Any,
        module_names: Callable[[], Sequence[str]],
        grad_inside: bool = False,
        writes: tuple[int, ...] = (),
    ) -> Slot[Entry] | Lifted:
        """The entry for this call, or the captured tensors its trace baked in that are now
        lifted (the call's key changed: the caller keys it again). ``grad_inside``: called
        again after the body was seen to turn grad mode on under the caller's
        ``torch.no_grad()`` (a ``torch.enable_grad()`` block): eager records what that block
        computes from inputs that require grad, so the entry is a training one, traced with
        grad mode off around the body as the caller had it (its other ops stay unrecorded)
        and run with grad mode on. ``module_names``: the names of the modules behind the
        call's module flags, read once the entry is built (its signature names them)."""
        training = (grad_enabled(state) or grad_inside) and any(t.requires_grad for t in tensors)
        # grad off here, yet inputs require grad: the body may turn grad on (watched below)
        watch = not training and not state.inference and any(t.requires_grad for t in tensors)
        diff = [
            i for i, t in enumerate(tensors) if training and t.requires_grad and differentiable(t)
        ]
        chosen = set(diff)
        other = [i for i in range(len(tensors)) if i not in chosen]
        call = grad_off(self._captures.call) if grad_inside else self._captures.call
        if watch:
            call = watched(call)

        n_leaves = len(tensors)  # not the tensors: the entry keeps flat_f (Twice)

        def flat_f(
            diff_leaves: tuple[torch.Tensor, ...], other_leaves: tuple[torch.Tensor, ...]
        ) -> Any:
            leaves: list[Any] = [None] * n_leaves
            for i, t in zip(diff, diff_leaves, strict=True):
                leaves[i] = t
            for i, t in zip(other, other_leaves, strict=True):
                leaves[i] = t
            if not writes:
                a, kw = unflatten(flat, leaves)
                return call(*a, **kw)
            copies = [leaves[i].clone() for i in written]  # what the function writes to
            for i, c in zip(written, copies, strict=True):
                leaves[i] = c
            a, kw = unflatten(flat, leaves)
            return call(*a, **kw), tuple(copies)

        order = diff + other
        written = [order[p] for p in writes]  # the written inputs, by leaf
        names = self.names(flat)
        paths = [names[i] for i in diff + other]
        leave(flat_f, ArgPaths(tuple(paths)))  # errors name the arguments, not the tuples
        flat_f.__qualname__ = getattr(self._f, "__qualname__", self._owner)
        functools.update_wrapper(flat_f, self._f, assigned=(), updated=())  # sets __wrapped__
        example = (
            tuple(tensors[i].detach() for i in diff),
            tuple(tensors[i].detach() for i in other),
        )
        dims = chosen_dims(self._opts.dynamic, self._cache, tensors, key, paths, diff + other)
        plan = (
            None
            if training
            else planned_grad.plan(
                self._f,
                planned_grad.PlannedCall(
                    self._captures, self._owner, flat, example, paths, dims, tuple(written)
                ),
            )
        )
        disk = functools.partial(
            DiskKey,
            fn=self._f,
            options=self._opts,
            state=state,
            flat=flat,
            tensors=tuple(tensors[i] for i in diff + other),
            names=tuple(paths),
            planned=plan is not None,
            store=self._builder.stores,
            writes=writes,
        )
        hint_key = functools.partial(
            disk, kind="writes", decompositions=self._builder.decompositions()
        )
        if not writes:  # an earlier process found what it writes: trace with that at once
            hint = disk_cache.writes_hint(hint_key())
            lifted = self._captures.lift_steps(hint.lifted) if hint.lifted else None
            if lifted is not None:
                return lifted  # the caller keys the call again, with them as inputs
            hinted = tuple(p for p in hint.writes if p < len(order))
            if hinted:
                return self.compile(flat, tensors, state, key, module_names, grad_inside, hinted)
        scalars = _scalars(self._f)  # make_fx runs ops on captured one-element tensors
        try:
            with Recorder(
                self._f, also=_static_objects(flat, self.names(flat, every_leaf=True))
            ) as recorder:
                built = build_dynamic(
                    self._builder,
                    self._owner,
                    self.warn_once,
                    Target(flat_f, plan, after_trace=self._captures.lift),
                    example,
                    training,
                    disk,
                    dims,
                )
        except InputMutation as e:  # it writes its inputs in place: see _writing
            if e.captured:  # the trace ran those writes on the captured scalars themselves
                _restore(e.captured, scalars)
            found = self._writing(e, flat, tensors, state, key, module_names, grad_inside, writes)
            if writes:
                return found
            if isinstance(found, Lifted):  # captured tensors it writes, lifted
                disk_cache.remember_writes(hint_key(), lifted=tuple(p.steps for p in found.paths))
            elif found.entry.writes:
                disk_cache.remember_writes(hint_key(), writes=found.entry.writes)
            return found
        if isinstance(built, GradOn):  # the body turned grad mode on: a training entry
            torch._C._set_grad_enabled(False)  # as the caller had it (watch: grad was off)
            return self.compile(flat, tensors, state, key, module_names, True)
        if isinstance(built, Stopped):  # the trace baked in captured tensors, now lifted
            assert isinstance(built.value, Lifted)
            return built.value
        entry = built
        if grad_inside and entry.backward is not None:
            entry = dataclasses.replace(entry, enable_grad=True)
        if entry.backward is not None and not entry.subclass:
            twice = Twice(flat_f, len(diff), self._owner, _random_op(entry))
            entry = dataclasses.replace(entry, twice=twice)
            if entry.stages is not None:
                stages = entry.stages.twice(
                    lambda e, g: Twice(
                        flat_f if g is None else g,
                        len(diff) if g is None else g.num_diff,
                        self._owner,
                        _random_op(e),
                    )
                )
                entry = dataclasses.replace(entry, stages=stages)
        if writes:  # its last outputs are the written inputs' values; the user's, the rest
            out_flat = first_of_pair(entry.out_flat)
            entry = dataclasses.replace(entry, out_flat=out_flat, writes=writes)
        modules = module_names()
        signature = Signature.of(flat, self.names(flat, every_leaf=True), tensors, state, modules)
        reads = ReadGuard(recorder.reads)
        return Slot(
            entry, diff + other, signature, key, shape=entry.shape, rank=rank_key(key), reads=reads
        )

    def _writing(
        self,
        mutation: InputMutation,
        flat: Flat,
        tensors: list[torch.Tensor],
        state: State,
        key: Any,
        module_names: Callable[[], Sequence[str]],
        grad_inside: bool,
        writes: tuple[int, ...],
    ) -> Slot[Entry] | Lifted:
        """The entry of a function that writes in place to its inputs (``x.add_(1)``, a
        batch norm's running statistics it reaches through ``functional_call``), as
        AOTAutograd compiles one: traced again with each written input copied first, the
        copies' final values returned beside its outputs and copied into the inputs after
        every call (:func:`~functrans._jit.apply.write_back`). A captured tensor it writes is
        lifted to an input first (the call is keyed again)."""
        if mutation.captured:
            lifted = self._captures.lift_tensors(mutation.captured)
            if lifted is not None:
                return lifted
        more = tuple(sorted(set(writes) | set(mutation.inputs)))
        if more == writes:  # nothing new to copy: the trace's refusal stands
            raise mutation
        return self.compile(flat, tensors, state, key, module_names, grad_inside, more)


def _scalars(f: Any) -> dict[int, torch.Tensor]:
    """Copies of the one-element tensors ``f`` reaches (a batch norm's step counter): a trace
    keeps such captured constants real and runs ops on them, so one that writes to them in
    place changes them (see :func:`_restore`)."""
    with torch.no_grad():
        return {
            tid: t.clone()
            for tid, paths in reach(f).tensors.items()
            if (t := paths[0].read(f)).numel() <= 1 and plain(t)
        }


def _restore(written: Sequence[torch.Tensor], scalars: dict[int, torch.Tensor]) -> None:
    """Put back the values a failed trace wrote to captured one-element tensors."""
    with torch.no_grad():
        for t in written:
            old = scalars.get(id(t))
            if old is not None:
                t.copy_(old)


def _random_op(entry: Entry) -> object | None:
    """A random op ``entry``'s forward graph draws with, or None."""
    p = entry.partition
    if p is None:
        return None
    return next((n.target for n in p.forward.graph_module.graph.nodes if is_random(n)), None)


def _static_objects(flat: Flat, names: Sequence[str]) -> list[tuple[Any, str]]:
    """The static leaves of a call that are objects (a config passed as a static argument),
    with their names: what the trace reads of them is guarded too."""
    out = []
    for value, name in zip(flat.static, names, strict=False):
        value = static_value(value)
        if value is not None and not is_atom(value) and not isinstance(value, torch.Tensor):
            out.append((value, name))
    return out
