"""``jit(f)``: trace on first call, partition, compile, and run as one autograd node.

A compiled entry is reused only when eager would compute the same thing. Its key holds
everything the trace read: the arguments' pytree structure and static values; each tensor's
type, dispatch keys, shape, strides, dtype, device and ``requires_grad``; the global state
(grad and inference mode, autocast per device, default dtype, deterministic algorithms: see
:mod:`functrans._core.state`); the ``training`` flag of every module the function reaches; and the
tensors it captures (closures, globals, module attributes), which are lifted to graph inputs and
re-read on every call (:mod:`functrans._trace.capture`); ``torch.Generator`` arguments, keyed by
device and drawn from at run time (:meth:`Jitted._run_drawing`). Calls are looked up through
cheap guards first (:class:`~functrans._core.tree_guards.Guards`), then by the exact key; the
cache keeps the ``cache_size`` most recently used entries (:mod:`functrans._jit.cache`).

Training calls run the forward graph inside a ``torch.autograd.Function`` that saves exactly the
partition's saved values; inference calls (nothing requires grad, or grad mode off) run a
forward-only graph that saves nothing, unless the body turns grad mode back on itself (see
:meth:`~functrans._jit.entry_compiler.EntryCompiler.compile`, which builds the entry for a
call the cache has none for). Under torch.func transforms (``vmap``, ``grad``, ``jvp``) and
inside other functrans traces the function runs as written, so the transform sees its ops.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Generic, ParamSpec, TypeVar

import torch

from functrans._core.context import runs_as_written
from functrans._core.dynamo_skip import compiling, outside_dynamo
from functrans._core.errors import TraceError, UnsupportedOpError
from functrans._core.pytree import (
    Flat,
    exact_key,
    flatten_leaves,
    leaves_of,
    plain,
    unflatten,
    wrap_static,
)
from functrans._core.stack import transform_frame
from functrans._core.state import (
    GLOBAL_HOOKS,
    ModuleFlags,
    State,
    capture,
    eager_fast_path,
    hooked,
    module_state,
    no_autocast,
)
from functrans._cut.partition import Partition
from functrans._trace.capture import Reach, Reader, reach

from .apply import (
    Apply,
    ApplySubclass,
    Entry,
    apply_graphs,
    inner_tensors,
    run_forward,
    write_back,
)
from .build import DISK_STORES, Builder
from .cache import Cache, CacheInfo, Slot, leaves_order, rank_key
from .captures import CAPTURED, Captures, Lifted
from .entry_compiler import EntryCompiler
from .options import CACHE_SIZE, Options

__all__ = ["CACHE_SIZE", "DISK_STORES", "CacheInfo", "Jitted", "Outcome"]

_P = ParamSpec("_P")
_R = TypeVar("_R")
_Q = ParamSpec("_Q")
_S = TypeVar("_S")

#: Times a call is keyed again after compiles that lifted captured tensors, before giving up.
_REKEYS = 4


class Outcome(enum.Enum):
    """What :meth:`Jitted._lookup` answers where it has no entry to run."""

    #: the call cannot be compiled (tensor subclasses, hooks): run the function as written
    AS_WRITTEN = "as written"
    #: the compile lifted captured tensors (:class:`~functrans._jit.captures.Lifted`): the
    #: call's key changed, key it again with them as inputs
    REKEY = "rekey"


AS_WRITTEN = Outcome.AS_WRITTEN
REKEY = Outcome.REKEY

_GENERATOR = torch.Generator


def _VALID(slot: Slot[Entry]) -> bool:
    """Whether what ``slot``'s trace read reads the same now (the guarded path's last check)."""
    return slot.reads.holds()


class Jitted(Generic[_P, _R]):
    """The callable ``jit(f)`` returns (see :func:`jit`): called like ``f``, with the same
    parameters and result type, plus :meth:`cache_info` and :meth:`partitions`."""

    def __init__(
        self,
        f: Callable[_P, _R],
        options: Options,
        module_names: Callable[[], Sequence[str]] | None = None,
        shown: bool = True,
        owner: str | None = None,
        as_written: Callable[_P, _R] | None = None,
    ) -> None:
        """``module_names``: for a caller that passes the module flags itself (``jit(module)``
        does), the names of the modules behind them; ``shown``: named in messages (False for
        the jit ``grad`` runs through); ``owner``: the name its warnings and errors give it
        (``jit(f)`` unless given); ``as_written``: what runs a call that cannot be compiled
        (hooks, an eager-only module path, a tensor subclass it cannot take apart), ``f``
        unless given (``grad`` gives torch's autograd run eagerly)."""
        self._f, self._opts = f, options
        self._uncompiled = f if as_written is None else as_written
        self._shown = shown  # named in messages (not where grad reuses its trace through it)
        self._owner = owner or f"jit({getattr(f, '__qualname__', type(f).__name__)})"
        self._cache: Cache[Entry] = Cache(self._owner, options.cache_size)
        self._lock = threading.RLock()
        self._times = CacheInfo()
        self._warned: set[str] = set()
        self._captures = Captures(f, self._owner, self._warned)  # lifted to inputs
        self._builder = Builder(options, self._times)
        self._compiler = EntryCompiler(
            f, options, self._owner, self._warned, self._captures, self._builder, self._cache
        )
        self._modules: Reader | None = None  # the modules it reaches (None: not walked yet)
        self._walked: Reach | None = None  # that walk, until a first compile prelifts from it
        self._module_names: tuple[str, ...] = ()
        self._given_names = module_names
        #: the function with the modules a call passes bound (see _with_modules), by modules
        self._bound: dict[Any, Jitted[..., Any]] = {}
        #: stand-ins for generator arguments, by (place among the call's generators, device)
        self._generators: dict[tuple[int, torch.device], torch.Generator] = {}
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
        return dataclasses.replace(self._times, entries=len(c), **counts)

    def partitions(self) -> list[Partition]:
        """The partition of every cached training specialization (saved values, bytes, ...)."""
        return [s.entry.partition for s in self._cache.slots() if s.entry.partition]

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        if compiling():  # torch.compile around this call: it runs here, as a graph break
            result: _R = outside_dynamo(self._call_here, args, kwargs)
            return result
        return self._call_here(*args, **kwargs)

    def _call_here(self, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        if runs_as_written():
            with transform_frame("jit", self._f, self._shown):
                return self._f(*args, **kwargs)
        if _holds_module(args, kwargs):
            return self._with_modules(args, kwargs)  # type: ignore[no-any-return]  # f's result
        ran = self._run(args, kwargs, None)
        if ran is None:
            with transform_frame("jit", self._f, self._shown):
                return self._uncompiled(*args, **kwargs)
        outs, entry, _ = ran
        result: _R = unflatten(entry.out_flat, outs)  # the same tree f returns
        return result

    def _with_modules(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call that passes modules as arguments (``step(model, x)``), run as the function
        with those modules bound, as if it closed over them: their parameters and buffers are
        read on every call (gradients reach them, buffers it updates are written back), what
        its trace reads of them is guarded. One jitted function per set of modules."""
        at = tuple(i for i, a in enumerate(args) if isinstance(a, torch.nn.Module))
        names = tuple(k for k, v in kwargs.items() if isinstance(v, torch.nn.Module))
        key = (tuple((i, id(args[i])) for i in at), tuple((k, id(kwargs[k])) for k in names))
        with self._lock:
            inner = self._bound.get(key)
            if inner is None:
                inner = self._bound[key] = self._bind(args, kwargs, at, names)
        rest = tuple(a for i, a in enumerate(args) if i not in at)
        return inner(*rest, **{k: v for k, v in kwargs.items() if k not in names})

    def _bind(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        at: tuple[int, ...],
        names: tuple[str, ...],
    ) -> Jitted[..., Any]:
        f = self._f
        if len(at) + len(names) == 1:  # guards name it model, as jit(model)'s do
            model = args[at[0]] if at else kwargs[names[0]]

            def bound(*rest: Any, **kw: Any) -> Any:
                if not at:
                    return f(*rest, **kw, **{names[0]: model})
                full = list(rest)
                full.insert(at[0], model)
                return f(*full, **kw)

        else:
            models: dict[int | str, Any] = {i: args[i] for i in at}
            models.update({k: kwargs[k] for k in names})

            def bound(*rest: Any, **kw: Any) -> Any:
                full = list(rest)
                for i in at:
                    full.insert(i, models[i])
                return f(*full, **kw, **{k: models[k] for k in names})

        functools.update_wrapper(bound, f)
        statics = tuple(
            i - sum(1 for j in at if j < i) for i in self._opts.static_argnums if i not in at
        )
        return Jitted(bound, dataclasses.replace(self._opts, static_argnums=statics))

    def run_or_none(
        self, args: Any, kwargs: Any, module_flags: ModuleFlags
    ) -> tuple[list[Any], Entry, Sequence[torch.Tensor]] | None:
        """For callers that check :func:`~functrans._core.context.runs_as_written` and read the
        module flags themselves: flat outputs, the entry that computed them and the inputs in
        the entry's order; None where the call must run as written (tensor subclasses)."""
        return self._run(args, kwargs, module_flags)

    def _run(
        self, args: Any, kwargs: Any, module_flags: ModuleFlags | None, drawing: bool = False
    ) -> tuple[list[Any], Entry, Sequence[torch.Tensor]] | None:
        """Flat outputs, the entry that computed them and the inputs in the entry's order;
        None where the call must run as written.

        This is every call's path: each line here costs on every step of a training loop."""
        if not drawing and (
            _GENERATOR in map(type, args) or (kwargs and _GENERATOR in map(type, kwargs.values()))
        ):
            return self._run_drawing(args, kwargs, module_flags)
        statics = self._opts.static_argnums
        tree_args = wrap_static(args, statics) if statics else args
        for _ in range(_REKEYS):  # again after a compile that lifted captured tensors
            state = capture(self._module_flags() if module_flags is None else module_flags)
            reader = self._captures.reader
            if reader.size:
                captured = reader.read(self._f)
                if captured is None:  # a path no longer leads anywhere: walk again
                    self._forget()
                    continue
                tree = (tree_args, {**kwargs, CAPTURED: captured})
            else:
                tree = (tree_args, kwargs)
            found = self._cache.guards.find(tree, state, _VALID)
            ordered: Sequence[torch.Tensor]
            if found is not None:
                slot, ordered = found
                self._cache.touch(slot)
                apply = apply_graphs
            else:
                looked = self._lookup(tree, state)
                if looked is AS_WRITTEN:
                    return None
                if looked is REKEY:
                    continue
                assert not isinstance(looked, Outcome)
                slot, ordered = looked
                apply = Apply.apply
            entry = slot.entry
            if entry.enable_grad:  # see EntryCompiler.compile: grad off outside, on in the body
                with torch.enable_grad(), no_autocast(state):
                    outs = _execute(apply, entry, ordered)
            elif entry.subclass:
                apply = ApplySubclass.apply
                if entry.backward is None:
                    ordered = inner_tensors(ordered)
                with no_autocast(state):
                    outs = _execute(apply, entry, ordered)
            elif state.autocast_cpu is not None or state.autocast_cuda is not None:
                with no_autocast(state):
                    outs = _execute(apply, entry, ordered)
            else:
                outs = _execute(apply, entry, ordered)
            if entry.writes:  # the inputs it writes in place: written back, as eager leaves them
                outs = write_back(entry, outs, ordered)
            return outs, entry, ordered
        raise TraceError(f"{self._owner}: the captured tensors keep changing while compiling")

    def _run_drawing(
        self, args: Any, kwargs: Any, module_flags: ModuleFlags | None
    ) -> tuple[list[Any], Entry, Sequence[torch.Tensor]] | None:
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
            self._modules, self._walked = reader, found
            self._module_names = (*(p.name for p in reader.paths), "")  # and global hooks
        reads: ModuleFlags = ((GLOBAL_HOOKS, module_state(GLOBAL_HOOKS)),)
        if not reader.size:
            return reads
        modules = reader.read(self._f)
        if modules is None:  # a module moved: walk again (once; a fresh walk reads)
            self._forget()
            return self._module_flags()
        return tuple([(m, module_state(m)) for m in modules]) + reads

    def _modules_named(self) -> Sequence[str]:
        """The names of the modules behind the module flags (and the global hooks)."""
        return self._module_names if self._given_names is None else self._given_names()

    def _forget(self) -> None:
        """A captured tensor or module moved: forget the paths and entries, walk again."""
        with self._lock:
            self._captures.forget()
            self._modules = self._walked = None
            self._cache.clear()

    def _lookup(self, tree: Any, state: State) -> tuple[Slot[Entry], list[torch.Tensor]] | Outcome:
        """The exact path: the entry by its full key (compiled on a miss) and the inputs in
        its order, or what to do instead; the guarded path above is the same lookup, cheaper,
        for trees :class:`~functrans._core.tree_guards.Guards` can describe."""
        why = hooked(state.modules)
        if why is not None:  # a hook runs every call; a trace would run it once
            self._compiler.warn_once(
                f"hooks: {why}",
                f"{self._owner}: {why}: a hook runs on every call (a probe, an activation "
                "cache, a patch) and a compiled graph would have run it once, while tracing; "
                "calls run as written (eagerly) while hooks are registered, and compile "
                "again once they are removed",
            )
            return AS_WRITTEN
        fast = eager_fast_path(state.modules)
        if fast is not None:  # eager's results there differ from the traced path's
            self._compiler.warn_once(
                "fast path",
                f"{self._owner}: {fast.why}, a path a trace cannot follow; calls run as "
                f"written (eagerly) meanwhile. {fast.fix}",
            )
            return AS_WRITTEN
        leaves, spec = leaves_of(tree)
        try:
            tensors, flat = flatten_leaves(leaves, spec, self._opts.static_argnums)
        except UnsupportedOpError as e:  # a tensor subclass it cannot take apart
            self._compiler.warn_once(
                type(e).__name__, f"{self._owner}: {e}; this call runs as written"
            )
            return AS_WRITTEN
        if not all(map(plain, tensors)):
            return self._as_written(flat, tensors)
        if flat.wrappers:  # subclass tensors stay whole here: trace and joint take them apart
            tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
            flat = dataclasses.replace(flat, wrappers=())
        key = (exact_key(flat, tensors), state)
        try:
            hash(key)
        except TypeError as e:  # a subclass whose flatten context cannot be keyed
            self._compiler.warn_once(
                "unhashable",
                f"{self._owner}: {e} in an input's metadata; this call runs as written",
            )
            return AS_WRITTEN
        slot = self._cache.exact(key) or self._cache.find_dynamic(rank_key(key), tensors)
        if slot is None:
            with self._lock:  # one thread compiles; the others wait and then hit
                slot = self._cache.exact(key)
                walked, self._walked = self._walked, None
                if slot is None and walked is not None and self._captures.prelift(walked, tensors):
                    return REKEY  # the module buffers it reads are inputs now: key again
                if slot is None:
                    with transform_frame("jit", self._f, self._shown):
                        compiled = self._compiler.compile(
                            flat, tensors, state, key, self._modules_named
                        )
                    if isinstance(compiled, Lifted):  # the key now covers them: key again
                        self._cache.clear()  # entries compiled before take fewer inputs
                        return REKEY
                    slot = compiled
                    positions = leaves_order(flat, slot.order)
                    self._cache.insert(tree, leaves, positions, slot)
                else:
                    self._cache.touch(slot)
        else:
            self._cache.touch(slot)
        return slot, [tensors[i] for i in slot.order]

    def _as_written(self, flat: Flat, tensors: list[torch.Tensor]) -> Outcome:
        """Tensor subclasses (DTensor, fake tensors of another tracer...) are not compiled."""
        names = self._compiler.names(flat)
        odd = [(n, type(t)) for n, t in zip(names, tensors, strict=True) if not plain(t)]
        name, kind = odd[0]
        fake = isinstance(tensors[0], torch._subclasses.FakeTensor)
        if not fake and kind.__qualname__ not in self._warned:
            self._warned.add(kind.__qualname__)
            warnings.warn(
                f"{self._owner}: argument {name} is a {kind.__qualname__}; jit compiles plain "
                "tensors only, so this call runs the function as written (not compiled).",
                stacklevel=4,
            )
        return AS_WRITTEN


def _holds_module(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call passes a module as an argument (a few type checks a call)."""
    return any(isinstance(a, torch.nn.Module) for a in args) or any(
        isinstance(v, torch.nn.Module) for v in kwargs.values()
    )


def _execute(apply: Callable[..., Any], entry: Entry, ordered: Sequence[torch.Tensor]) -> Any:
    if entry.backward is None:
        return run_forward(entry, ordered)
    if entry.stages is not None:  # returned intermediates stay connected: see staged
        return entry.stages.run(entry, apply, ordered)
    outs = list(apply(entry, *ordered))
    for i in entry.own_nodes:  # see Entry.own_nodes
        outs[i] = outs[i].view_as(outs[i])
    return outs
