"""``jit(f)``: trace on first call, partition, compile, and run as one autograd node.

A compiled entry is reused only when eager would compute the same thing. Its key holds
everything the trace read: the arguments' pytree structure and static values; each tensor's
type, dispatch keys, shape, strides, dtype, device and ``requires_grad``; the global state
(grad and inference mode, autocast per device, default dtype, deterministic algorithms: see
:mod:`functrans._core.state`); the ``training`` flag of every module the function reaches; and the
tensors it captures (closures, globals, module attributes), which are lifted to graph inputs and
re-read on every call (:mod:`functrans._trace.capture`); ``torch.Generator`` arguments, keyed by
device and drawn from at run time (:meth:`Jitted._run_drawing`). Calls are looked up through
cheap guards first (:class:`~functrans._core.pytree.Guards`), then by the exact key; the cache keeps
the ``cache_size`` most recently used entries (:mod:`functrans._jit.cache`).

Training calls run the forward graph inside a ``torch.autograd.Function`` that saves exactly the
partition's saved values; inference calls (nothing requires grad, or grad mode off) run a
forward-only graph that saves nothing, unless the body turns grad mode back on itself (see
:meth:`Jitted._compile`). Under torch.func transforms (``vmap``, ``grad``, ``jvp``) and inside
other functrans traces the function runs as written, so the transform sees its ops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, ParamSpec, TypeVar

import torch

from functrans._core.backends import get_backend
from functrans._core.boxed import boxed
from functrans._core.context import _TRACING, is_tracing
from functrans._core.dtypes import differentiable
from functrans._core.dynamo_skip import compiling, outside_dynamo
from functrans._core.errors import TraceError, UnsupportedOpError
from functrans._core.logs import log
from functrans._core.pytree import (
    Flat,
    exact_key,
    flatten_leaves,
    leaves_of,
    unflatten,
    wrap_static,
)
from functrans._core.shapes import (
    Dims,
    DynamicSpecError,
    EveryInput,
    JitDynamic,
    ShapeGuard,
    resolve,
    shape_env_of,
)
from functrans._core.stack import transform_frame
from functrans._core.state import (
    GLOBAL_HOOKS,
    FunctionValues,
    ModuleFlags,
    State,
    capture,
    grad_enabled,
    hooked,
    module_state,
    no_autocast,
)
from functrans._cut.partition import Partition, Strategy, partition
from functrans._trace.capture import Path, Reader, captured_constants, reach, swapped
from functrans._trace.decomp import Decompositions
from functrans._trace.joint import joint
from functrans._trace.regions import stats as region_stats
from functrans._trace.trace import arg_names, trace
from functrans._trace.unify import Pairs
from functrans._transforms.plans import (
    GRAD_SPEC,
    PER_EXAMPLE,
    GradSpec,
    PerExample,
    VmapOfGrad,
    grad_name,
    plan_per_example,
)

from .apply import Apply, ApplySubclass, Entry, OutMeta, apply_graphs, inner_tensors, saved_inputs
from .cache import Cache, Signature, Slot, changed_dims, leaves_order, rank_key
from .disk import store as disk_cache
from .disk.store import DiskKey

__all__ = ["CACHE_SIZE", "CacheInfo", "Jitted"]

_P = ParamSpec("_P")
_R = TypeVar("_R")
_Q = ParamSpec("_Q")
_S = TypeVar("_S")
_G = TypeVar("_G")

#: Default number of compiled entries a jitted function keeps (least recently used out).
CACHE_SIZE = 32
#: Traces a jitted function stores in the on-disk cache (each costs a recorded trace, about
#: twice a plain one on CPython 3.11): the first calls, which every restart pays again.
DISK_STORES = 4

# the keyword under which captured tensors travel with the arguments
_CAPTURED = "__functrans_captured__"


@dataclass
class CacheInfo:
    """Cache statistics and cumulative stage times (seconds) of a jitted function."""

    hits: int = 0
    misses: int = 0
    entries: int = 0
    evictions: int = 0
    #: traces read from the on-disk cache instead of traced (:mod:`functrans._jit.disk.store`)
    disk_hits: int = 0
    #: block calls whose trace was a copy of a region traced before
    #: (:mod:`functrans._trace.regions`)
    regions_reused: int = 0
    trace_s: float = 0.0
    partition_s: float = 0.0
    compile_s: float = 0.0


@dataclass(frozen=True)
class _Options:
    """What :func:`jit` was asked for (see its parameters)."""

    partition: str | Strategy
    backend: str
    static_argnums: tuple[int, ...]
    decompositions: Decompositions
    partition_options: dict[str, Any]
    cache_size: int = CACHE_SIZE
    dynamic: JitDynamic = "auto"


#: On a jit's flat function: how to build the function to trace instead (``jit(grad(f))``).
_PLANNED = "__functrans_planned__"


class _Retry(Exception):
    """A compile found captured tensors to lift: read them and look the call up again."""

    __functrans_control_flow__ = True


class _GradOn(Exception):
    """A trace under ``torch.no_grad()`` saw the body turn grad mode on (see _compile)."""

    __functrans_control_flow__ = True


class _GradWatch(torch.overrides.TorchFunctionMode):
    """Raises :class:`_GradOn` at the first torch call the body makes with grad mode on. The
    trace stops there, before the on-disk cache stores it: a stored forward trace of a call
    whose inputs require grad is one whose body left grad mode off."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is not _SET_GRAD and torch.is_grad_enabled():  # the setter itself is seen
            raise _GradOn
        return func(*args, **(kwargs or {}))


_SET_GRAD = torch._C._set_grad_enabled


def _watched(call: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        with _GradWatch():
            return call(*args, **kwargs)

    return run


def _grad_off(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` with grad mode off around it (the joint graph traces with it on)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return call(*args, **kwargs)

    return run


class _AsWritten(Exception):
    """The call cannot be compiled (tensor subclasses): run the function as written."""

    __functrans_control_flow__ = True


_functorch_active = torch._C._are_functorch_transforms_active


def inline() -> bool:
    """Whether a jitted call should run its function as written: under torch.func transforms
    (``vmap``, ``grad``, ``jvp``: they must see the ops) and inside another functrans trace
    (the outer graph records the ops, as a nested ``jax.jit`` inlines)."""
    return bool(_functorch_active()) or is_tracing()


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_GENERATOR = torch.Generator


def _plain(t: torch.Tensor) -> bool:
    return type(t) is torch.Tensor or type(t) is torch.nn.Parameter


class Jitted(Generic[_P, _R]):
    """The callable ``jit(f)`` returns (see :func:`jit`): called like ``f``, with the same
    parameters and result type, plus :meth:`cache_info` and :meth:`partitions`."""

    def __init__(
        self,
        f: Callable[_P, _R],
        options: _Options,
        module_names: Callable[[], Sequence[str]] | None = None,
    ) -> None:
        """``module_names``: for a caller that passes the module flags itself (``jit(module)``
        does), the names of the modules behind them."""
        self._f, self._opts = f, options
        self._owner = f"jit({getattr(f, '__qualname__', type(f).__name__)})"
        self._cache: Cache[Entry] = Cache(self._owner, options.cache_size)
        self._lock = threading.RLock()
        self._times = CacheInfo()
        self._captures: tuple[Path, ...] = ()  # captured tensors lifted to inputs
        self._captured = Reader(())
        self._modules: Reader | None = None  # the modules it reaches (None: not walked yet)
        self._module_names: tuple[str, ...] = ()
        self._given_names = module_names
        self._warned: set[str] = set()
        self._disk_misses = 0  # traces the on-disk cache did not have
        self._reads: tuple[FunctionValues, ...] = ()  # the plain globals f's code reads
        #: stand-ins for generator arguments, by (place among the call's generators, device)
        self._generators: dict[tuple[int, torch.device], torch.Generator] = {}
        self._pairs = Pairs()  # static traces to generalise (dynamic="auto")
        functools.update_wrapper(self, f)

    def __reduce__(self) -> tuple[Any, ...]:
        """Copied (``pickle``, ``torch.save``, ``copy.deepcopy``) as the function and the
        options: compiled entries hold kernels, locks and graphs; the copy compiles again on
        first use. The function itself must pickle (a module-level function does)."""
        return (Jitted, (self._f, self._opts, self._given_names))

    @property
    def fn(self) -> Callable[_P, _R]:
        """The function this compiles."""
        return self._f

    def rewrap(self, g: Callable[_Q, _S]) -> Jitted[_Q, _S]:
        """``g`` jitted with this function's options (``vmap(jit(f))`` compiles the batched
        function this way, as ``jax.vmap(jax.jit(f))`` does)."""
        return Jitted(g, self._opts)

    def cache_info(self) -> CacheInfo:
        """Hits, misses, entries, evictions and time spent tracing, partitioning, compiling."""
        c = self._cache
        counts = {"hits": c.hits, "misses": c.misses, "evictions": c.evictions}
        return dataclasses.replace(self._times, entries=len(c.by_key), **counts)

    def partitions(self) -> list[Partition]:
        """The partition of every cached training specialization (saved values, bytes, ...)."""
        return [s.entry.partition for s in self._cache.by_key.values() if s.entry.partition]

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        if compiling():  # torch.compile around this call: it runs here, as a graph break
            result: _R = outside_dynamo(self._call_here, args, kwargs)
            return result
        return self._call_here(*args, **kwargs)

    def _call_here(self, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        if _functorch_active() or _TRACING.get():
            with transform_frame("jit", self._f):
                return self._f(*args, **kwargs)  # see inline()
        try:
            outs, entry, _ = self._run(args, kwargs, None)
        except _AsWritten:
            with transform_frame("jit", self._f):
                return self._f(*args, **kwargs)
        result: _R = unflatten(entry.out_flat, outs)  # the same tree f returns
        return result

    def run_or_none(
        self, args: Any, kwargs: Any, module_flags: ModuleFlags
    ) -> tuple[list[Any], Entry, Sequence[torch.Tensor]] | None:
        """For callers that check :func:`inline` and read the module flags themselves: flat
        outputs, the entry that computed them and the inputs in the entry's order; None where
        the call must run as written (tensor subclasses)."""
        try:
            return self._run(args, kwargs, module_flags)
        except _AsWritten:
            return None

    def _run(
        self, args: Any, kwargs: Any, module_flags: ModuleFlags | None, drawing: bool = False
    ) -> tuple[list[Any], Entry, Sequence[torch.Tensor]]:
        """Flat outputs, the entry that computed them and the inputs in the entry's order.

        This is every call's path: each line here costs on every step of a training loop."""
        if not drawing and (
            _GENERATOR in map(type, args) or (kwargs and _GENERATOR in map(type, kwargs.values()))
        ):
            return self._run_drawing(args, kwargs, module_flags)
        statics = self._opts.static_argnums
        tree_args = wrap_static(args, statics) if statics else args
        for _ in range(4):  # a retry follows a compile that found captured tensors to lift
            state = capture(self._module_flags() if module_flags is None else module_flags)
            if self._captured.size:
                captured = self._captured.read(self._f)
                if captured is None:  # a path no longer leads anywhere: walk again
                    self._forget()
                    continue
                tree = (tree_args, {**kwargs, _CAPTURED: captured})
            else:
                tree = (tree_args, kwargs)
            found = self._cache.guards.find(tree, state)
            ordered: Sequence[torch.Tensor]
            if found is not None:
                slot, ordered = found
                self._cache.touch(slot)
                apply = apply_graphs
            else:
                try:
                    slot, ordered = self._lookup(tree, state)
                except _Retry:
                    continue
                apply = Apply.apply
            entry = slot.entry
            if entry.enable_grad:  # see _compile: grad mode off outside, on in the body
                with torch.enable_grad(), no_autocast(state):
                    return _execute(apply, entry, ordered), entry, ordered
            if entry.subclass:
                apply = ApplySubclass.apply
                if entry.backward is None:
                    ordered = inner_tensors(ordered)
            if state.autocast_cpu is not None or state.autocast_cuda is not None:  # no_autocast
                with no_autocast(state):
                    return _execute(apply, entry, ordered), entry, ordered
            if entry.backward is None:
                return entry.forward(*ordered), entry, ordered
            return list(apply(entry, *ordered)), entry, ordered
        raise TraceError(f"{self._owner}: the captured tensors keep changing while compiling")

    def _run_drawing(
        self, args: Any, kwargs: Any, module_flags: ModuleFlags | None
    ) -> tuple[list[Any], Entry, Sequence[torch.Tensor]]:
        """:meth:`_run` for a call with ``torch.Generator`` arguments. Generators are inputs,
        like tensors: keyed by device, drawn from at run time. Each is replaced by this
        function's own stand-in generator for its place and device (the n-th distinct
        generator of the call by the n-th stand-in, so one generator passed twice stays one),
        which the trace records and the graph draws from; the stand-in takes the generator's
        state before the call and hands it back after, so the numbers drawn and the state left
        behind are eager's. Such calls run one at a time (a stand-in holds one call's state)."""
        with self._lock:
            stand_ins: dict[int, torch.Generator] = {}
            pairs: list[tuple[torch.Generator, torch.Generator]] = []

            def stand_in(v: Any) -> Any:
                if type(v) is not _GENERATOR:
                    return v
                found = stand_ins.get(id(v))
                if found is None:
                    key = (len(stand_ins), v.device)
                    found = self._generators.get(key)
                    if found is None:
                        found = self._generators[key] = torch.Generator(device=v.device)
                    stand_ins[id(v)] = found
                    pairs.append((v, found))
                return found

            a = tuple(map(stand_in, args))
            kw = {k: stand_in(v) for k, v in kwargs.items()}
            for real, mine in pairs:
                mine.set_state(real.get_state())
            try:
                return self._run(a, kw, module_flags, drawing=True)
            finally:
                for real, mine in pairs:
                    real.set_state(mine.get_state())

    def _module_flags(self) -> ModuleFlags:
        """``(module, training)`` of every module the function reaches, read now."""
        reader = self._modules
        if reader is None:
            found = reach(self._f)
            reader = Reader([p for p, _ in found.modules]).readable(self._f)
            self._modules = reader
            self._module_names = tuple(p.name for p in reader.paths)
            values = FunctionValues(self._f, found.values)
            self._reads = (values,) if values.names else ()
            self._module_names += ("",) * (len(self._reads) + 1)  # globals, global hooks
        reads: ModuleFlags = tuple([(r, module_state(r)) for r in self._reads])
        reads += ((GLOBAL_HOOKS, module_state(GLOBAL_HOOKS)),)
        if not reader.size:
            return reads
        modules = reader.read(self._f)
        if modules is None:  # a module moved: walk again (once; a fresh walk reads)
            self._forget()
            return self._module_flags()
        return tuple([(m, module_state(m)) for m in modules]) + reads

    def _forget(self) -> None:
        """A captured tensor or module moved: forget the paths and entries, walk again."""
        with self._lock:
            self._captures, self._captured, self._modules = (), Reader(()), None
            self._cache.clear()

    def _lookup(self, tree: Any, state: State) -> tuple[Slot[Entry], list[torch.Tensor]]:
        """The exact path: the entry by its full key (compiled on a miss); the guarded path
        above is the same lookup, cheaper, for trees :class:`Guards` can describe."""
        why = hooked(state.modules)
        if why is not None:  # a hook runs every call; a trace would run it once
            self._warn_once(
                f"hooks: {why}",
                f"{self._owner}: {why}: a hook runs on every call (a probe, an activation "
                "cache, a patch) and a compiled graph would have run it once, while tracing; "
                "calls run as written (eagerly) while hooks are registered, and compile "
                "again once they are removed",
            )
            raise _AsWritten
        leaves, spec = leaves_of(tree)
        try:
            tensors, flat = flatten_leaves(leaves, spec, self._opts.static_argnums)
        except UnsupportedOpError as e:  # a tensor subclass it cannot take apart
            self._warn_once(type(e).__name__, f"{self._owner}: {e}; this call runs as written")
            raise _AsWritten from e
        if not all(map(_plain, tensors)):
            self._as_written(flat, tensors)
        if flat.wrappers:  # subclass tensors stay whole here: trace and joint take them apart
            tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
            flat = dataclasses.replace(flat, wrappers=())
        key = (exact_key(flat, tensors), state)
        try:
            hash(key)
        except TypeError as e:  # a subclass whose flatten context cannot be keyed
            self._warn_once(
                "unhashable",
                f"{self._owner}: {e} in an input's metadata; this call runs as written",
            )
            raise _AsWritten from e
        slot = self._cache.by_key.get(key) or self._cache.find_dynamic(rank_key(key), tensors)
        if slot is None:
            with self._lock:  # one thread compiles; the others wait and then hit
                slot = self._cache.by_key.get(key)
                if slot is None:
                    with transform_frame("jit", self._f):
                        slot = self._compile(flat, tensors, state, key)
                    positions = leaves_order(flat, slot.order)
                    self._cache.insert(tree, leaves, positions, slot)
                else:
                    self._cache.touch(slot)
        else:
            self._cache.touch(slot)
        return slot, [tensors[i] for i in slot.order]

    def _as_written(self, flat: Flat, tensors: list[torch.Tensor]) -> None:
        """Tensor subclasses (DTensor, fake tensors of another tracer...) are not compiled."""
        names = self._names(flat)
        odd = [(n, type(t)) for n, t in zip(names, tensors, strict=True) if not _plain(t)]
        name, kind = odd[0]
        fake = isinstance(tensors[0], torch._subclasses.FakeTensor)
        if not fake and kind.__qualname__ not in self._warned:
            self._warned.add(kind.__qualname__)
            warnings.warn(
                f"{self._owner}: argument {name} is a {kind.__qualname__}; jit compiles plain "
                "tensors only, so this call runs the function as written (not compiled).",
                stacklevel=4,
            )
        raise _AsWritten

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=5)

    def _names(self, flat: Flat, *, every_leaf: bool = False) -> list[str]:
        """Readable names of the tensor leaves (every leaf), captured tensors included."""
        names = arg_names(self._f, flat, every_leaf=every_leaf)
        prefix = f"{_CAPTURED}["
        out = []
        for n in names:
            if n.startswith(prefix):
                i = int(n[len(prefix) :].split("]", 1)[0])
                n = f"{self._captures[i].name} (captured)"
            out.append(n)
        return out

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        """The user's function, with captured tensors swapped for the traced ones."""
        captured = kwargs.pop(_CAPTURED, None)
        if captured is None:
            return self._f(*args, **kwargs)
        with swapped(self._captures, self._f, captured):
            return self._f(*args, **kwargs)

    def _compile(
        self,
        flat: Flat,
        tensors: list[torch.Tensor],
        state: State,
        key: Any,
        grad_inside: bool = False,
    ) -> Slot[Entry]:
        """The entry for this call. ``grad_inside``: called again after the body was seen to
        turn grad mode on under the caller's ``torch.no_grad()`` (a ``torch.enable_grad()``
        block): eager records what that block computes from inputs that require grad, so the
        entry is a training one, traced with grad mode off around the body as the caller had
        it (its other ops stay unrecorded) and run with grad mode on."""
        training = (grad_enabled(state) or grad_inside) and any(t.requires_grad for t in tensors)
        # grad off here, yet inputs require grad: the body may turn grad on (watched below)
        watch = not training and not state.inference and any(t.requires_grad for t in tensors)
        diff = [
            i for i, t in enumerate(tensors) if training and t.requires_grad and differentiable(t)
        ]
        chosen = set(diff)
        other = [i for i in range(len(tensors)) if i not in chosen]
        call = _grad_off(self._call) if grad_inside else self._call
        if watch:
            call = _watched(call)

        def flat_f(
            diff_leaves: tuple[torch.Tensor, ...], other_leaves: tuple[torch.Tensor, ...]
        ) -> Any:
            leaves: list[Any] = [None] * len(tensors)
            for i, t in zip(diff, diff_leaves, strict=True):
                leaves[i] = t
            for i, t in zip(other, other_leaves, strict=True):
                leaves[i] = t
            a, kw = unflatten(flat, leaves)
            return call(*a, **kw)

        names = self._names(flat)
        paths = [names[i] for i in diff + other]
        flat_f.__functrans_paths__ = paths  # type: ignore[attr-defined]  # arg_names reads it
        flat_f.__qualname__ = getattr(self._f, "__qualname__", self._owner)
        functools.update_wrapper(flat_f, self._f, assigned=(), updated=())  # sets __wrapped__
        example = (
            tuple(tensors[i].detach() for i in diff),
            tuple(tensors[i].detach() for i in other),
        )
        spec = getattr(self._f, GRAD_SPEC, None)
        batched = getattr(self._f, PER_EXAMPLE, None)
        dims = self._dims(flat, tensors, key, paths, diff + other)
        if not training and spec is not None and spec.run is self._f and _chosen(spec, dims):
            setattr(flat_f, _PLANNED, self._planned_grad(spec, flat, example, paths))
        elif (
            not training
            and batched is not None
            and batched.run is self._f
            and _chosen(batched.spec, dims)
        ):
            plan = self._planned_per_example(batched, flat, example, paths)
            setattr(flat_f, _PLANNED, plan)
        disk = functools.partial(
            DiskKey,
            fn=self._f,
            options=self._opts,
            state=state,
            flat=flat,
            tensors=tuple(tensors[i] for i in diff + other),
            names=tuple(paths),
            planned=getattr(flat_f, _PLANNED, None) is not None,
            store=self._disk_misses < DISK_STORES,
        )
        try:
            entry, gm = self._build_dynamic(flat_f, example, training, disk, dims)
        except _GradOn:
            torch._C._set_grad_enabled(False)  # as the caller had it (watch: grad was off)
            return self._compile(flat, tensors, state, key, grad_inside=True)
        self._lift_captures(gm)
        if grad_inside and entry.backward is not None:
            entry = dataclasses.replace(entry, enable_grad=True)
        modules = self._module_names if self._given_names is None else self._given_names()
        signature = Signature.of(flat, self._names(flat, every_leaf=True), tensors, state, modules)
        return Slot(entry, diff + other, signature, key, shape=entry.shape, rank=rank_key(key))

    def _dims(
        self, flat: Flat, tensors: list[torch.Tensor], key: Any, paths: list[str], order: list[int]
    ) -> Dims | None:
        """The symbolic dimensions of this compile (None: static), over the traced function's
        inputs (``order``: their flat positions): as ``dynamic=`` asks, or with ``"auto"``,
        the dimensions whose size changed since the last entry for inputs like these."""
        dynamic = self._opts.dynamic
        if dynamic is False:
            return None
        ordered = [tensors[i] for i in order]
        if dynamic is True:  # tensors it reads (a closure's weights) keep their sizes, as torch's
            dynamic = EveryInput(static=tuple(p for p in paths if p.endswith(" (captured)")))
        if dynamic != "auto":
            return resolve(dynamic, paths, ordered)
        rank = rank_key(key)
        last = self._cache.last_like(rank)
        if last is None:
            # a new group of 0/1 sizes (a batch of one): symbolic at once in the dimensions
            # already seen to vary, if a related entry is symbolic (torch keeps the 1 fixed)
            related = self._cache.dynamic_relative(rank)
            if related is None or related.shape is None:
                return None
            return tuple(
                dict.fromkeys(sorted(related.shape.symbolic[k])) for k in range(len(order))
            )
        changed = changed_dims(last.signature, tensors)
        before = last.shape.symbolic if last.shape is not None else [set()] * len(order)
        # last.shape.symbolic is in that entry's order, which is ours (same structure)
        dims = tuple(
            dict.fromkeys(sorted(changed[i] | set(before[k]))) for k, i in enumerate(order)
        )
        return dims if any(dims) else None

    def _build_dynamic(
        self,
        flat_f: Callable[..., Any],
        example: Any,
        training: bool,
        disk: Callable[..., DiskKey],
        dims: Dims | None,
    ) -> tuple[Entry, torch.fx.GraphModule]:
        """:meth:`_build` with ``dims`` symbolic; where the backend compiles static shapes
        only, or the symbolic trace fails, a static entry (and a ``dynamic`` log line)."""
        if dims is None:
            return self._build(flat_f, example, training, disk)
        backend = get_backend(self._opts.backend)
        why = None
        if not getattr(backend, "dynamic", False):
            why = f"backend {self._opts.backend!r} compiles static shapes only"
        elif getattr(flat_f, _PLANNED, None) is not None:
            why = "a planned gradient (grad(f, partition=...)) is traced at static shapes"
        elif any(type(t) not in _PLAIN_TYPES for t in [*example[0], *example[1]]):
            why = "tensor subclass inputs are traced at static shapes"
        if why is None:
            try:
                with _quiet_fake_tensor_log():
                    return self._build(flat_f, example, training, disk, dims)
            except (_Retry, _GradOn, DynamicSpecError):  # the inputs break the user's dynamic=
                raise
            except Exception as e:  # the static trace reports real errors
                why = f"the symbolic trace failed ({type(e).__name__}: {e})"
        log("dynamic", f"{self._owner}: one entry per shape", lambda: why or "")
        if self._opts.dynamic != "auto":  # asked for by name: say so once, not only in logs
            asked = True if isinstance(self._opts.dynamic, EveryInput) else self._opts.dynamic
            self._warn_once(
                "dynamic",
                f"{self._owner}: dynamic={asked!r} was asked for, but {why}; "
                "it compiles an entry per shape (FUNCTRANS_LOGS=dynamic says why each time)",
            )
        return self._build(flat_f, example, training, disk)

    def _lift_captures(self, gm: torch.fx.GraphModule) -> None:
        """Lift the captured tensors the trace baked in as constants (raises :class:`_Retry`
        to trace again with them as inputs); tell the user about those it cannot lift."""
        constants = captured_constants(gm)
        if not constants:
            return
        found = reach(self._f)
        lifted = {p.steps for p in self._captures}
        new: list[Path] = []
        for t, where in constants:
            paths = found.tensors.get(id(t), [])
            # every path to it: a tensor tied into two modules is two inputs (autograd adds
            # up their gradients), and stays right if the tie is broken later
            fresh = [p for p in paths if p.writable and p.steps not in lifted]
            lifted.update(p.steps for p in fresh)
            new.extend(fresh)
            if not fresh:
                self._baked(t, paths, where)
        if new:
            self._captures = (*self._captures, *new)
            self._captured = Reader(self._captures)
            self._cache.clear()  # entries compiled before take fewer inputs
            raise _Retry

    def _baked(self, t: torch.Tensor, paths: list[Path], where: str) -> None:
        if not paths:
            what = f"a captured tensor ({_describe(t)}) that functrans cannot find a path to"
        elif all(p.writable for p in paths):
            what = (
                f"captured tensor {paths[0].name} through a path functrans cannot find (it "
                "only finds closures, globals, attributes, containers and module tables)"
            )
        else:
            stuck = next(p for p in paths if not p.writable)
            what = (
                f"captured tensor {stuck.name} (inside a tuple or an object functrans "
                "cannot write to while tracing)"
            )
        hint = (
            "Pass it as an argument (or keep it in a list, dict, closure variable, module "
            "attribute or parameter, where it is lifted to a graph input automatically)."
        )
        if t.requires_grad:
            raise TraceError(
                f"{self._owner} reads {what}{where}, and it requires grad: compiled as a "
                f"constant it would get no gradient. {hint}"
            )
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(
                f"{self._owner} reads {what}{where}; it is compiled in as a constant, so "
                f"replacing that tensor later will not be seen. {hint}",
                stacklevel=6,
            )

    def _planned_grad(
        self, spec: GradSpec, flat: Flat, example: Any, paths: list[str]
    ) -> Callable[[Any], Callable[..., Any]]:
        """For ``jit(grad(f, partition=s))``: (given the decompositions) the function to trace
        instead of the inlined gradient: ``f``'s joint graph cut by ``s``, its forward then its
        backward, so the compiled graph saves between them what ``s`` chose and recomputes the
        rest (traced without CSE, which would merge the recomputation back)."""
        from functrans._transforms.grad import check_differentiable, scalar_output

        leaves = [*example[1]]  # an inference entry: no input is differentiated
        target = self._swapping(spec.f)

        def plan(decompositions: Decompositions) -> Callable[..., Any]:
            a, kw = unflatten(flat, leaves)
            with transform_frame(grad_name(spec), spec.f):  # errors name jit(grad(f))
                check_differentiable(spec.f, a, spec.argnums)
                jg = joint(
                    target,
                    argnums=spec.argnums,
                    has_aux=spec.has_aux,
                    decompositions=decompositions,
                )(*a, **kw)
            p = partition(jg, spec.partition, **dict(spec.options))

            def stitched(diff: tuple[Any, ...], other: tuple[Any, ...]) -> Any:
                a, kw = unflatten(flat, list(other))
                value, saved = p.forward(*a, **kw)
                out = scalar_output(spec.f, value, spec.has_aux)
                grads = p.backward(saved, (torch.ones_like(out),))
                if spec.with_value:
                    return value, grads
                return (grads, value[1]) if spec.has_aux else grads

            stitched.__qualname__ = getattr(spec.f, "__qualname__", self._owner)
            stitched.__functrans_paths__ = paths  # type: ignore[attr-defined]
            stitched.__functrans_partition__ = p  # type: ignore[attr-defined]  # partitions()
            return stitched

        return plan

    def _planned_per_example(
        self, batched: VmapOfGrad, flat: Flat, example: Any, paths: list[str]
    ) -> Callable[[Any], Callable[..., Any] | None]:
        """For ``jit(vmap(grad(f, partition=s)))``: as :meth:`_planned_grad`, for the
        per-example joint graph eager ``vmap(grad)`` plans (None where that plan does not
        apply: the batched function is traced as it is)."""
        spec, leaves, target = batched.spec, [*example[1]], self._swapping(batched.spec.f)

        def plan_for(a: tuple[Any, ...]) -> PerExample | None:
            return plan_per_example(spec, target, batched.in_dims, batched.randomness, a)

        def plan(decompositions: Decompositions) -> Callable[..., Any] | None:
            a, kw = unflatten(flat, leaves)
            first = plan_for(a)
            if first is None:
                return None
            with transform_frame("vmap", spec.f), transform_frame(grad_name(spec), spec.f):
                jg = joint(
                    first.total, argnums=spec.argnums, has_aux=True, decompositions=decompositions
                )(*first.args, **kw)
            p = partition(jg, spec.partition, **dict(spec.options))

            def stitched(diff: tuple[Any, ...], other: tuple[Any, ...]) -> Any:
                a, kw = unflatten(flat, list(other))
                again = plan_for(a)
                assert again is not None  # the same shapes as the plan above
                (total, values), saved = p.forward(*again.args, **kw)
                grads = p.backward(saved, (torch.ones_like(total),))
                return again.finish(values, grads)

            stitched.__qualname__ = getattr(spec.f, "__qualname__", self._owner)
            stitched.__functrans_paths__ = paths  # type: ignore[attr-defined]
            stitched.__functrans_partition__ = p  # type: ignore[attr-defined]
            return stitched

        return plan

    def _swapping(self, f: Callable[..., Any]) -> Callable[..., Any]:
        """``f`` with this function's captured tensors swapped for the traced ones (passed
        under ``_CAPTURED``), as :meth:`_call` does for the whole function."""

        def target(*a: Any, **kw: Any) -> Any:
            captured = kw.pop(_CAPTURED, None)
            if captured is None:
                return f(*a, **kw)
            with swapped(self._captures, self._f, captured):
                return f(*a, **kw)

        functools.update_wrapper(target, f, updated=())
        return target

    def _traced(
        self,
        disk: Callable[..., DiskKey],
        kind: str,
        decompositions: Any,
        make: Callable[[Dims | None], _G],
        dims: Dims | None,
    ) -> _G:
        """``make(dims)`` (a trace symbolic in ``dims``), through the on-disk cache
        (:mod:`functrans._jit.disk.store`); with ``dynamic="auto"``, generalised from two
        static traces where they unify (:mod:`functrans._trace.unify`)."""
        key = disk(kind=kind, decompositions=decompositions, dims=dims)
        kw = disk.keywords  # type: ignore[attr-defined]
        group = (
            kind,
            decompositions,
            rank_key((exact_key(kw["flat"], kw["tensors"]), kw["state"])),
        )
        run = (
            self._pairs.make(group, make, dims)
            if self._opts.dynamic == "auto"
            else lambda: make(dims)
        )
        g, hit = disk_cache.traced(key, run)
        self._times.disk_hits += hit
        self._disk_misses += not hit
        return g

    def _build(
        self,
        flat_f: Callable[..., Any],
        example: Any,
        training: bool,
        disk: Callable[..., DiskKey],
        dims: Dims | None = None,
    ) -> tuple[Entry, torch.fx.GraphModule]:
        backend = get_backend(self._opts.backend)
        decompositions = self._opts.decompositions
        if decompositions == "auto":
            decompositions = getattr(backend, "decompositions", "core")
        inputs = inner_tensors([*example[0], *example[1]])
        subclass = any(type(t) not in _PLAIN_TYPES for t in [*example[0], *example[1]])
        t0 = time.perf_counter()
        if not training:
            planned = getattr(flat_f, _PLANNED, None)
            stitched = planned(decompositions) if planned is not None else None
            traced = flat_f if stitched is None else stitched
            g = self._traced(
                disk,
                "forward",
                decompositions,
                lambda d: trace(
                    traced, decompositions=decompositions, cse=stitched is None, dynamic=d
                )(*example),
                dims,
            )
            t1 = time.perf_counter()
            fwd = backend.compile(g, inputs)
            self._times.trace_s += t1 - t0
            self._times.compile_s += time.perf_counter() - t1
            vals = [n for n in g.output_nodes()]
            entry = Entry(
                forward=fwd,
                backward=None,
                out_flat=g.out_flat,
                out_meta=tuple(OutMeta.of(v.meta["val"], False, False) for v in vals),
                num_diff=0,
                num_inputs=len(inputs),
                partition=getattr(traced, "__functrans_partition__", None),
                copies=_copies(g.placeholders(), vals),
                subclass=subclass or bool(g.out_flat.wrappers),
                shape=_shape_guard(g.placeholders()) if dims is not None else None,
            )
            return entry, g.graph_module
        reused = region_stats.reused
        jg = self._traced(
            disk,
            "joint",
            decompositions,
            lambda d: joint(flat_f, argnums=0, decompositions=decompositions, dynamic=d)(*example),
            dims,
        )
        self._times.regions_reused += region_stats.reused - reused
        if not any(jg.differentiable):  # e.g. a body under torch.no_grad(): nothing to save
            self._times.trace_s += time.perf_counter() - t0
            entry, gm = self._build(flat_f, example, False, disk, dims)
            # its inputs require grad: run it as the body did, with autograd off
            return dataclasses.replace(entry, forward=_without_grad(entry.forward)), gm
        t1 = time.perf_counter()
        p = partition(jg, self._opts.partition, **self._opts.partition_options)
        t2 = time.perf_counter()
        fwd = backend.compile(p.forward, inputs)
        bwd = boxed(backend.compile(p.backward, []))
        log(
            "codegen",
            f"forward and backward compiled by {self._opts.backend!r}",
            lambda: f"{p.forward.graph_module.code}\n{p.backward.graph_module.code}",
        )
        self._times.trace_s += t1 - t0
        self._times.partition_s += t2 - t1
        self._times.compile_s += time.perf_counter() - t2
        wants = _tangent_mask(jg)
        tangents = set(jg.tangents())
        primals = [n for n in jg.placeholders() if n not in tangents]
        entry = Entry(
            forward=fwd,
            backward=bwd,
            out_flat=jg.fn_out,
            out_meta=tuple(
                OutMeta.of(v.meta["val"], w, w and d)
                for v, w, d in zip(jg.forward_outputs(), wants, jg.differentiable, strict=True)
            ),
            num_diff=len(example[0]),
            num_inputs=len(inputs),
            partition=p,
            copies=_copies(primals, jg.forward_outputs()),
            subclass=subclass or bool(jg.fn_out.wrappers),
            shape=_shape_guard(primals) if dims is not None else None,
            saved_tensors=_saved_tensors(p),
            absent=jg.absent_grads(),
            saved_inputs=saved_inputs(
                p.forward.graph_module, len(jg.forward_outputs()), len(example[0])
            ),
        )
        return entry, jg.graph_module


@contextlib.contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    """torch logs every meta kernel a symbolic trace cannot run (``F.pad`` of a size-dependent
    amount) as an error with a traceback; jit then compiles the call at static shapes, so the
    traceback is noise: the ``dynamic`` log says why."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _chosen(spec: GradSpec, dims: Dims | None) -> bool:
    """Whether ``jit(grad(f))`` traces the gradient from a plan (``f``'s joint graph cut by
    the ``partition=`` grad was given), not inline: always with static shapes; with symbolic
    ones only for a strategy the user chose (plans are traced at static shapes), since the
    inline gradient saves what ``"default"`` would."""
    return dims is None or spec.partition != "default" or bool(spec.options)


def _shape_guard(placeholders: Sequence[torch.fx.Node]) -> ShapeGuard | None:
    """The guards of a symbolic trace over its inputs (None where it came out static)."""
    vals = [n.meta["val"] for n in placeholders]
    env = shape_env_of(vals)
    return None if env is None else ShapeGuard.of(vals, env)


def _saved_tensors(p: Partition) -> tuple[bool, ...] | None:
    """Which saved values are tensors, None where all are (a dynamic forward saves sizes)."""
    mask = tuple(isinstance(s.node.meta.get("val"), torch.Tensor) for s in p.saved)
    return None if all(mask) else mask


def _without_grad(forward: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
    def run(*tensors: torch.Tensor) -> list[Any]:
        with torch.no_grad():
            return forward(*tensors)

    return run


def _execute(apply: Callable[..., Any], entry: Entry, ordered: Sequence[torch.Tensor]) -> Any:
    if entry.backward is None:
        return entry.forward(*ordered)
    return list(apply(entry, *ordered))


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


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


def _tangent_mask(jg: Any) -> list[bool]:
    """Which forward outputs took a tangent in the joint graph (floating-point and complex
    outputs, in order)."""
    return [differentiable(v.meta["val"]) for v in jg.forward_outputs()]
