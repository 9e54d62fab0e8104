"""``jit``'s cache: bounded (least recently used out), with reasons for every recompile.

Each entry remembers what it was compiled for (:class:`Signature`: structure, static values,
tensor metadata, global state). A miss after the first names what differs from the most
recently used entry ("x: shape[1] 32 -> 48", "model.drop.training True -> False") in the
``recompiles`` log; a function recompiled again and again warns once, and a Python float
argument whose value keeps changing (a learning rate, a temperature) warns on its second new
value, since every value is baked into the graph.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

import torch

from functrans._core.logs import log
from functrans._core.pytree import Flat
from functrans._core.state import State, describe
from functrans._core.tree_guards import Guards

from .read_guards import ALWAYS, ReadGuard

__all__ = [
    "RECOMPILE_WARNING",
    "Cache",
    "CacheInfo",
    "RecompileWarning",
    "Signature",
    "Slot",
    "TensorMeta",
    "changed_dims",
    "rank_key",
]

#: Misses after which a jitted function warns that it keeps recompiling (torch's limit is 8).
RECOMPILE_WARNING = 8

_E = TypeVar("_E")


class RecompileWarning(UserWarning):
    """A jitted function recompiles often (each recompile traces and compiles again)."""


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


class TensorMeta(NamedTuple):
    """What a compiled entry depends on of one tensor argument (a tuple: compared field by
    field to name what changed)."""

    type: type
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorMeta:
        return cls(type(t), tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)


@dataclass(frozen=True)
class Signature:
    """What one entry was compiled for, kept to explain later misses."""

    flat: Flat
    names: tuple[str, ...]  # every leaf's name (``x``, ``params['w']``), in flat order
    tensors: tuple[TensorMeta, ...]
    state: State
    module_names: tuple[str, ...]

    @classmethod
    def of(
        cls,
        flat: Flat,
        names: Sequence[str],
        tensors: Sequence[torch.Tensor],
        state: State,
        module_names: Sequence[str],
    ) -> Signature:
        meta = tuple(TensorMeta.of(t) for t in tensors)
        return cls(flat, tuple(names), meta, state, tuple(module_names))


def differences(old: Signature, new: Signature) -> list[str]:
    """What changed from ``old`` to ``new``, one phrase each (empty when nothing did)."""
    if old.flat.spec != new.flat.spec:
        return [f"the argument structure changed: {old.flat.spec} -> {new.flat.spec}"]
    out = []
    old_meta, new_meta = iter(old.tensors), iter(new.tensors)
    leaves = zip(
        new.names,
        old.flat.is_tensor,
        new.flat.is_tensor,
        old.flat.static,
        new.flat.static,
        strict=True,
    )
    for name, was_t, is_t, a, b in leaves:
        before = next(old_meta) if was_t else None
        after = next(new_meta) if is_t else None
        if was_t != is_t:
            out.append(f"{name}: {_leaf(was_t, a)} -> {_leaf(is_t, b)}")
        elif not is_t and not _same(a, b):
            out.append(f"{name}: {a!r} -> {b!r}")
        elif is_t:
            changes = [
                _tensor_change(field, x, y)
                for field, x, y in zip(TensorMeta._fields, before or (), after or (), strict=True)
                if x != y
            ]
            out.extend(f"{name}: {c}" for c in changes)
    return out + describe(old.state, new.state, new.module_names)


def _leaf(is_tensor: bool, value: Any) -> str:
    return "a tensor" if is_tensor else repr(value)


def _tensor_change(field: str, a: Any, b: Any) -> str:
    if field == "shape" and len(a) == len(b):
        dims = [
            f"shape[{i}] {x} -> {y}" for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y
        ]
        return ", ".join(dims)
    fmt = (lambda v: v.__qualname__) if field == "type" else str
    return f"{field} {fmt(a)} -> {fmt(b)}".replace("torch.", "")


def _same(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and (a is b or bool(a == b) or (a != a and b != b))
    except Exception:
        return a is b


@dataclass(eq=False)
class Slot(Generic[_E]):
    """One cache entry: the compiled value, the tensor order it takes, what it was compiled
    for, its exact key and when it was last used."""

    entry: _E
    order: list[int]
    signature: Signature
    key: Any
    used: int = 0
    #: a dynamic entry's guards (:class:`~functrans._core.shapes.ShapeGuard`) and the key it is
    #: found under by inputs of any size (:func:`rank_key`); None for a static entry
    shape: Any = None
    rank: Any = None
    #: what its trace read besides its arguments, checked before every reuse
    reads: ReadGuard = ALWAYS

    def valid(self) -> bool:
        """Whether what its trace read still reads the same (its other guards matched)."""
        return self.reads.holds()


class Cache(Generic[_E]):
    """Entries by exact key and by guards (see :class:`~functrans._core.tree_guards.Guards`),
    at most ``size`` of them; counts hits, misses and evictions for ``cache_info``. Entries of
    one key differ in what their traces read (:attr:`Slot.reads`): a lookup takes the first
    whose reads still read the same."""

    def __init__(self, owner: str, size: int) -> None:
        self.owner, self.size = owner, size
        self.by_key: dict[Any, list[Slot[_E]]] = {}
        self.guards: Guards[Slot[_E]] = Guards()
        #: dynamic entries by :func:`rank_key` (most recent last)
        self.dynamic: dict[Any, list[Slot[_E]]] = {}
        self.hits = self.misses = self.evictions = 0
        self._ticks = itertools.count(1)
        self._last: Slot[_E] | None = None
        self._warned: set[str] = set()
        self._float_changes: dict[str, int] = {}

    def touch(self, slot: Slot[_E]) -> None:
        """Count a hit on ``slot`` and mark it most recently used."""
        slot.used = next(self._ticks)
        self._last = slot
        self.hits += 1

    def slots(self) -> list[Slot[_E]]:
        """Every entry."""
        return [s for slots in self.by_key.values() for s in slots]

    def __len__(self) -> int:
        return sum(map(len, self.by_key.values()))

    def exact(self, key: Any) -> Slot[_E] | None:
        """The entry compiled for ``key`` whose reads still read the same."""
        for slot in self.by_key.get(key, ()):
            if slot.valid():
                return slot
        return None

    def insert(self, tree: Any, leaves: list[Any], positions: list[int], slot: Slot[_E]) -> None:
        """Add ``slot`` (compiled after a miss), evicting the least recently used beyond
        ``size``; ``positions``: its tensors' positions among ``leaves``. Call with the
        writers' lock held."""
        self._explain(slot.signature)
        self.misses += 1
        slot.used = next(self._ticks)
        self.by_key.setdefault(slot.key, []).insert(0, slot)  # the newest first
        self.guards.add(tree, leaves, positions, slot.signature.state, slot, slot.shape)
        if slot.shape is not None:
            self.dynamic.setdefault(slot.rank, []).append(slot)
        self._last = slot
        while len(self) > self.size:
            victim = min(self.slots(), key=lambda s: s.used)
            same_key = self.by_key[victim.key]
            same_key.remove(victim)
            if not same_key:
                del self.by_key[victim.key]
            self.guards.remove(victim)
            if victim.shape is not None:
                self.dynamic[victim.rank].remove(victim)
            self.evictions += 1

    def find_dynamic(self, rank: Any, tensors: Sequence[torch.Tensor]) -> Slot[_E] | None:
        """The most recent dynamic entry for inputs like these (same :func:`rank_key`) whose
        shape guards ``tensors`` (the call's tensors, in flat order) and reads pass."""
        for slot in reversed(self.dynamic.get(rank, ())):
            if slot.shape.matches([tensors[i] for i in slot.order]) and slot.valid():
                return slot
        return None

    def dynamic_relative(self, rank: Any) -> Slot[_E] | None:
        """The most recently used dynamic entry for inputs like ``rank``'s except in which
        sizes are 0 or 1 (a batch of one, after larger batches went symbolic)."""
        found = [s for r, slots in self.dynamic.items() if _relatives(r, rank) for s in slots]
        return max(found, key=lambda s: s.used) if found else None

    def last_like(self, rank: Any) -> Slot[_E] | None:
        """The most recently used entry whose inputs differ from ``rank``'s only in sizes."""
        found = [s for s in self.slots() if s.rank == rank]
        return max(found, key=lambda s: s.used) if found else None

    def clear(self) -> None:
        self.by_key.clear()
        self.dynamic.clear()
        self.guards = Guards()
        self._last = None

    def _explain(self, new: Signature) -> None:
        old = self._last
        if old is None:
            return
        reasons = differences(old.signature, new) + old.reads.changes()
        reasons = reasons or ["no difference found in the guards"]
        log("recompiles", f"recompiling {self.owner}", lambda: "\n".join(reasons))
        for name in _changed_floats(old.signature, new):
            self._warn_float(name, reasons)
        if self.misses + 1 == RECOMPILE_WARNING and "storm" not in self._warned:
            self._warned.add("storm")
            warnings.warn(
                f"{self.owner} has been compiled {RECOMPILE_WARNING} times; each compile "
                f"traces and partitions again. This time: {'; '.join(reasons)}. Set "
                "FUNCTRANS_LOGS=recompiles to see every reason; pass values that change on "
                "every call as tensors, not Python numbers.",
                RecompileWarning,
                stacklevel=5,
            )

    def _warn_float(self, name: str, reasons: list[str]) -> None:
        """Warn the second time the float argument ``name`` changes value."""
        count = self._float_changes[name] = self._float_changes.get(name, 0) + 1
        if count == 2:
            reason = next((r for r in reasons if r.startswith(f"{name}:")), name)
            warnings.warn(
                f"{self.owner}: argument {reason} is a Python float whose value keeps "
                "changing; numbers are baked into the compiled graph, so every new value "
                "compiles anew. Pass it as a tensor (torch.tensor(value)) to make it a graph "
                "input, or mark it static_argnums if a few values are all it takes.",
                RecompileWarning,
                stacklevel=6,
            )


def _changed_floats(old: Signature, new: Signature) -> list[str]:
    """Names of the static float leaves whose value differs between ``old`` and ``new``."""
    if old.flat.spec != new.flat.spec:
        return []
    return [
        name
        for name, a, b, is_t in zip(
            new.names, old.flat.static, new.flat.static, new.flat.is_tensor, strict=True
        )
        if not is_t and type(a) is float and type(b) is float and not _same(a, b)
    ]


def rank_key(exact: Any) -> Any:
    """An exact key (:func:`~functrans._core.pytree.exact_key`, state) with every size of 2 or
    more (and every stride) forgotten: what a dynamic entry is filed under, and what ``"auto"``
    compares. Sizes 0 and 1 stay: torch specialises them (broadcasting, squeezing), so calls
    with a size-1 batch form their own group: a static entry first, a dynamic one when a second
    shape of that group comes."""
    (spec, statics, meta, wrappers), state = exact
    ranks = tuple((m[0], tuple(min(s, 2) for s in m[1]), *m[3:]) for m in meta)
    return (spec, statics, ranks, wrappers), state


def _relatives(a: Any, b: Any) -> bool:
    """Whether two :func:`rank_key` values differ at most in which sizes are 0 or 1."""
    (spec_a, statics_a, ranks_a, wrappers_a), state_a = a
    (spec_b, statics_b, ranks_b, wrappers_b), state_b = b
    if (spec_a, statics_a, wrappers_a, state_a) != (spec_b, statics_b, wrappers_b, state_b):
        return False
    return len(ranks_a) == len(ranks_b) and all(
        x[0] == y[0] and len(x[1]) == len(y[1]) and x[2:] == y[2:]
        for x, y in zip(ranks_a, ranks_b, strict=True)
    )


def changed_dims(old: Signature, tensors: Sequence[torch.Tensor]) -> list[set[int]]:
    """Per tensor (in flat order), the dimensions whose size differs from ``old``'s."""
    return [
        {d for d, (a, b) in enumerate(zip(m.shape, t.shape, strict=True)) if a != b}
        for m, t in zip(old.tensors, tensors, strict=True)
    ]


def leaves_order(flat: Flat, order: Sequence[int]) -> list[int]:
    """Positions among all leaves of the tensors, in an entry's ``order``."""
    at = [i for i, t in enumerate(flat.is_tensor) if t]
    return [at[i] for i in order]
