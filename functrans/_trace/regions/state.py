"""Blocks called with an object whose state they update: a stand-in in the region's trace.

HF decoder layers take the model's key/value cache (``cache=``) and call ``cache.update(keys,
values, self.layer_idx)``: a write into an object, which a region (tensors in, tensors out)
cannot hold, so every layer of a model run with ``use_cache=True`` (HF's default) was traced
inline. Where the cache's slot is empty (a training step, a prompt's first forward) what
``update`` returns depends on its arguments alone, so the block is still a region: its trace
is given a stand-in (:class:`CacheStandIn`) that answers ``update`` as that empty slot would
(a fresh copy of the slot updated) and returns the states it was given as more outputs of the
region; after each call the real cache is updated with those outputs, in the step's trace, as
the block would have updated it (:meth:`StateCall.replay`). Any other use of the stand-in (a
length query, a slot already filled, an argument computed inside the block) raises
:class:`NotStandIn` and the block is traced inline, as before.

The slot's index comes from the block's own attribute (``self.layer_idx``), a value that
differs per layer and, read by the trace, would make every layer its own region. A block whose
``update`` index equals exactly one int attribute its trace read is traced a second time with
that attribute set to a value no layer has (past any list's end, of another residue mod 2 to
16): where the graph is the same and that value reached ``update``, the index takes no part in
the block's computation, the attribute no part in its key (:func:`index_attribute`), and each
call updates the slot its own attribute names.

Kinds of state are declared in :data:`STATE_KINDS` (HF's ``Cache``, looked up only where
``transformers`` is imported).

>>> from functrans._trace.regions.state import state_kind
>>> state_kind(object()) is None
True
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch
import torch.utils._pytree as pytree

from .keys import PLAIN, Attr, Reads, SideEffect, not_reading

__all__ = [
    "STATE_KINDS",
    "CacheStandIn",
    "NotStandIn",
    "StateCall",
    "StateKind",
    "Update",
    "index_attribute",
    "state_kind",
]

#: a value of an index attribute no block has: past any list's end, and of another residue
#: than ``index`` modulo 2 to 16 (720720 is their least common multiple)
_FAR = 720720 + 1


class NotStandIn(SideEffect):
    """The block used its state object beyond what the stand-in answers: traced inline."""


class StateKind(Protocol):
    """A kind of object a block may update (an entry of :data:`STATE_KINDS`)."""

    def accepts(self, obj: Any) -> bool:
        """Whether ``obj`` is of this kind and a stand-in can answer for it."""
        ...

    def slot(self, obj: Any, index: int) -> Any | None:
        """A fresh copy of ``obj``'s slot ``index`` while that slot is empty (None: filled,
        or none to make)."""
        ...


class _HFCache:
    """HF's ``transformers.cache_utils.Cache`` with its own ``update`` and no offloading:
    a list of layers, each filled by its first ``update``."""

    @staticmethod
    def _cache_class() -> type | None:
        module = sys.modules.get("transformers.cache_utils")
        return getattr(module, "Cache", None)

    def accepts(self, obj: Any) -> bool:
        cls = self._cache_class()
        if cls is None or not isinstance(obj, cls):
            return False
        with not_reading():
            own = getattr(type(obj), "update", None) is getattr(cls, "update", None)
            return own and not getattr(obj, "offloading", False)

    def slot(self, obj: Any, index: int) -> Any | None:
        with not_reading():
            layers = obj.layers
            if 0 <= index < len(layers):
                layer = layers[index]
                return None if layer.is_initialized else copy.copy(layer)
            make = getattr(obj, "layer_class_to_replicate", None)
            return None if make is None or index < 0 else make()


#: the kinds of state a block's region may update through a stand-in
STATE_KINDS: list[StateKind] = [_HFCache()]


def state_kind(obj: Any) -> StateKind | None:
    """The kind of state ``obj`` is (None: none a stand-in answers for)."""
    if isinstance(obj, (torch.Tensor, *PLAIN)):
        return None
    return next((k for k in STATE_KINDS if k.accepts(obj)), None)


class _Input(NamedTuple):
    """An argument of ``update`` that is the region's input at ``position``."""

    position: int


class Update(NamedTuple):
    """One ``update`` a block's trace made: the slot, its class, and the rest of its
    arguments (the region's inputs as :class:`_Input`)."""

    slot: int
    slot_class: type
    leaves: tuple[Any, ...]
    spec: pytree.TreeSpec


class CacheStandIn:
    """What a block's trace is given for an HF cache: ``update`` on an empty slot, answered
    by a fresh copy of that slot; the states given are recorded as outputs."""

    def __init__(
        self, kind: StateKind, real: Any, inputs: Sequence[torch.Tensor], like: Any = None
    ) -> None:
        self._kind, self._real, self._inputs, self._like = kind, real, inputs, like
        self.updates: list[Update] = []
        self.outputs: list[torch.Tensor] = []

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *a: Any,
        **k: Any,
    ) -> Any:
        """What the empty slot ``layer_idx`` returns, updated with the states given."""
        if type(layer_idx) is not int or any(u.slot == layer_idx for u in self.updates):
            raise NotStandIn
        slot = copy.copy(self._like) if self._like is not None else None
        if slot is None:
            slot = self._kind.slot(self._real, layer_idx)
        if slot is None:  # filled already: what update returns depends on what it holds
            raise NotStandIn
        flat, spec = pytree.tree_flatten((a, k))
        leaves = tuple(self._lift(x) for x in flat)
        self.updates.append(Update(layer_idx, type(slot), leaves, spec))
        self.outputs += [key_states, value_states]
        return slot.update(key_states, value_states, *a, **k)

    def _lift(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            found = next((i for i, t in enumerate(self._inputs) if t is x), None)
            if found is None:  # made inside the block: not an argument the call can pass
                raise NotStandIn
            return _Input(found)
        if not isinstance(x, PLAIN):
            raise NotStandIn
        return x

    def __getattr__(self, name: str) -> Any:
        raise NotStandIn(name)


@dataclass
class StateCall:
    """One block call's state argument: where it sits among the call's argument leaves, the
    stand-in its last trace made, and the updates to replay after the call."""

    kind: StateKind
    real: Any
    position: int
    like: Any = None  # the slot to copy (tracing with an index no slot has)
    last: CacheStandIn | None = None
    chosen: tuple[tuple[Update, ...], Attr | None] | None = field(default=None, repr=False)

    def stand_in(self, inputs: Sequence[torch.Tensor]) -> CacheStandIn:
        self.last = CacheStandIn(self.kind, self.real, inputs, self.like)
        return self.last

    def accepts(self, updates: Sequence[Update], index: Attr | None, block: Any) -> bool:
        """Whether a region traced with ``updates`` (the slot from ``index`` of ``block``
        where given) may serve this call: each slot it fills still empty, of the class the
        trace filled."""
        for u in updates:
            at = u.slot if index is None else attr_value(block, index)
            if type(at) is not int:
                return False
            slot = self.kind.slot(self.real, at)
            if slot is None or type(slot) is not u.slot_class:
                return False
        return True

    def replay(self, outputs: Sequence[torch.Tensor], tensors: Sequence[Any], block: Any) -> None:
        """Update the real object as the block's call did, with the call's outputs."""
        assert self.chosen is not None
        updates, index = self.chosen
        for u, (k, v) in zip(updates, zip(outputs[::2], outputs[1::2], strict=True), strict=True):
            at = u.slot if index is None else attr_value(block, index)
            flat = [tensors[x.position] if isinstance(x, _Input) else x for x in u.leaves]
            a, kw = pytree.tree_unflatten(flat, u.spec)
            self.real.update(k, v, at, *a, **kw)


def attr_value(block: torch.nn.Module, attr: Attr) -> Any:
    """The value of ``attr`` (a submodule's name and a plain attribute) on ``block``."""
    with not_reading():
        return vars(block.get_submodule(attr[0])).get(attr[1])


def index_attribute(
    block: torch.nn.Module,
    reads: Reads,
    updates: Sequence[Update],
    state: StateCall,
    retrace: Callable[[], Any],
    graph_of: Callable[[Any], str],
    first: Any,
) -> Attr | None:
    """The attribute of ``block`` the slot index of its one ``update`` came from and nothing
    else used (None: none found so): the one int attribute read whose value is the index,
    which set to a far value gives the same graph (``graph_of``) with that value reaching
    ``update`` (see the module docstring)."""
    if reads.everything or len(updates) != 1:
        return None
    index = updates[0].slot
    found = [a for a in reads.attrs if _is_int(attr_value(block, a), index)]
    if len(found) != 1:
        return None
    (attr,) = found
    holder = vars(block.get_submodule(attr[0]))
    far = index + _FAR
    state.like = state.kind.slot(state.real, index)
    holder[attr[1]] = far
    try:
        with not_reading():
            again = retrace()
    except Exception:  # the far value broke the block: the index is its computation's
        return None
    finally:
        holder[attr[1]] = index
        state.like = None
    seen = state.last.updates if state.last is not None else []
    if again is None or [u.slot for u in seen] != [far]:
        return None
    # the far index reached update (and nothing else did), with the same other arguments
    if seen[0]._replace(slot=index) != updates[0]:
        return None
    return attr if graph_of(again) == graph_of(first) else None


def _is_int(value: Any, index: int) -> bool:
    return type(value) is int and value == index
