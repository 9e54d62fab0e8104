"""What a block's trace reads, as keys: when two calls of a block may share one traced region.

A block's key (:func:`block_state`) holds its structure: each submodule's class, forward code,
``training`` flag and the names of its plain attributes, the tensor slots (parameters and
buffers) in order, and hooks make no key at all (a hooked block is traced inline). The values
of the plain attributes are kept apart (:attr:`BlockState.attrs`): a region is reused by a call
whose attributes equal the traced call's on every attribute that trace *read*
(:func:`reading` records them). Hugging Face decoder layers differ in ``layer_idx``, which a
training step without a KV cache never reads: one region serves every layer; an attribute the
forward reads (a dropout ``p``, a sliding window) keeps differing blocks apart.

>>> import torch
>>> class Layer(torch.nn.Module):
...     def __init__(self, idx):
...         super().__init__()
...         self.idx, self.scale = idx, 2.0
...     def forward(self, x):
...         return x * self.scale
>>> a, b = block_state(Layer(0)), block_state(Layer(1))
>>> a.structure == b.structure, a.attrs == b.attrs
(True, False)
>>> m = Layer(3)
>>> with reading(m) as reads:
...     _ = m(torch.ones(1))
>>> ("", "scale") in reads.attrs, ("", "idx") in reads.attrs, type(m) is Layer
(True, False, True)
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "PLAIN",
    "Attr",
    "BlockState",
    "Reads",
    "aliasing",
    "attrs_snapshot",
    "block_state",
    "code_key",
    "global_hooks",
    "has_hooks",
    "matches",
    "not_reading",
    "reading",
    "restore_changed",
    "tensor_key",
    "value_key",
]

PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format)
_MODULE_SLOTS = frozenset(
    {"_parameters", "_buffers", "_modules", "training", "_non_persistent_buffers_set"}
)

Attr = tuple[str, str]  # (submodule name, attribute)


def value_key(v: Any) -> Any:
    """A hashable stand-in for a plain value (by value) or any other object (by identity)."""
    if isinstance(v, PLAIN):
        return (type(v), v)
    if isinstance(v, (tuple, list, frozenset)) and len(v) < 64:
        return (type(v), tuple(value_key(x) for x in v))
    if isinstance(v, dict) and len(v) < 64 and all(isinstance(k, str) for k in v):
        return (dict, tuple((k, value_key(x)) for k, x in v.items()))
    return ("id", id(v))


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
    "_global_module_registration_hooks",
    "_global_parameter_registration_hooks",
    "_global_buffer_registration_hooks",
)


def has_hooks(m: torch.nn.Module) -> bool:
    """Whether ``m`` or a submodule has a forward or backward hook."""
    return any(bool(getattr(sub, name, None)) for sub in m.modules() for name in _HOOKS)


def global_hooks() -> bool:
    """Whether a global module hook is registered."""
    mod = torch.nn.modules.module
    return any(bool(getattr(mod, name, None)) for name in _GLOBAL_HOOKS)


def _size_key(s: Any) -> Any:
    """An int, or a symbolic size by its expression (one trace's symbols mean one thing)."""
    return ("sym", str(s.node.expr)) if isinstance(s, torch.SymInt) else s


def tensor_key(t: torch.Tensor) -> Any:
    """A tensor's metadata as its trace reads it (sizes, strides, offset, dtype, device, grad)."""
    sizes = tuple(map(_size_key, (*t.shape, "|", *t.stride(), "|", t.storage_offset())))
    return (sizes, t.dtype, t.device, t.requires_grad)


def aliasing(tensors: list[torch.Tensor]) -> tuple[int, ...]:
    """Which earlier tensor each one is (the same object), else its own index."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(id(t), i) for i, t in enumerate(tensors))


def code_key(fn: Any) -> Any:
    """A function's code, closure values and defaults."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return ("id", id(fn))
    cells = tuple(value_key(c.cell_contents) for c in fn.__closure__ or ())
    defaults = value_key(fn.__defaults__)
    return (id(code), cells, defaults)


@dataclass(frozen=True)
class BlockState:
    """A module's key: its :attr:`structure` (hashable), the values of its submodules' plain
    attributes, and its tensor slots in order (the tables holding them, and their names)."""

    structure: Any
    attrs: dict[Attr, Any]
    slots: list[tuple[dict[str, Any], str]] = field(compare=False)


def block_state(m: torch.nn.Module) -> BlockState:
    """The key of ``m`` (see :class:`BlockState`)."""
    parts: list[Any] = []
    attrs: dict[Attr, Any] = {}
    slots: list[tuple[dict[str, Any], str]] = []
    for name, sub in m.named_modules(remove_duplicate=False):
        fwd = sub.__dict__.get("forward", type(sub).forward)
        plain = [(k, v) for k, v in vars(sub).items() if k not in _MODULE_SLOTS]
        attrs.update(((name, k), value_key(v)) for k, v in plain)
        parts.append((name, type(sub), code_key(fwd), sub.training, tuple(k for k, _ in plain)))
        for table in (sub._parameters, sub._buffers):
            for k, t in table.items():
                parts.append((name, k, t is None))
                if t is not None:
                    slots.append((table, k))
    return BlockState(tuple(parts), attrs, slots)


def attrs_snapshot(m: torch.nn.Module) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Each submodule's attribute table and a copy of it (see :func:`restore_changed`)."""
    return [(sub.__dict__, dict(sub.__dict__)) for sub in m.modules()]


def restore_changed(snap: list[tuple[dict[str, Any], dict[str, Any]]]) -> bool:
    """Put back every attribute table that changed since :func:`attrs_snapshot`; whether one
    had."""
    changed = False
    for live, before in snap:
        if live.keys() != before.keys() or any(live[k] is not before[k] for k in before):
            changed = True
            live.clear()
            live.update(before)
    return changed


# ---------------------------------------------------------------------------------------------
# Which attributes a trace reads


@dataclass
class Reads:
    """The plain attributes a block's trace read (:attr:`everything`: it read an attribute
    table as a whole, so every attribute counts)."""

    attrs: set[Attr] = field(default_factory=set)
    everything: bool = False


_READS: contextvars.ContextVar[tuple[Reads, dict[int, list[str]]] | None] = contextvars.ContextVar(
    "functrans_region_reads", default=None
)
# nn.Module.__getattr__ (parameters, buffers, submodules) reads __dict__ for its tables only
_MODULE_GETATTR = torch.nn.Module.__getattr__.__code__
_RECORDING: dict[type, type] = {}


def _recording(cls: type) -> type:
    """``cls`` with every attribute read recorded while :func:`reading` is entered."""
    found = _RECORDING.get(cls)
    if found is not None:
        return found
    get: Any = cls.__getattribute__  # the class's own reading (object's, usually)

    def __getattribute__(self: Any, name: str) -> Any:
        seen = _READS.get()
        if seen is not None:
            reads, names = seen
            if name == "__dict__":
                if sys._getframe(1).f_code is not _MODULE_GETATTR:
                    reads.everything = True
            else:
                for sub in names.get(id(self), ()):
                    reads.attrs.add((sub, name))
        return get(self, name)

    namespace = {
        "__getattribute__": __getattribute__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
    }
    found = _RECORDING[cls] = type(cls.__name__, (cls,), namespace)
    return found


@contextlib.contextmanager
def reading(m: torch.nn.Module) -> Iterator[Reads]:
    """Record which plain attributes of ``m`` and its submodules are read meanwhile (their
    classes swapped for recording subclasses, as ``torch.nn.utils.parametrize`` does). A class
    that refuses the swap (``__slots__``) counts as having read everything."""
    reads = Reads()
    names: dict[int, list[str]] = {}
    swapped: list[tuple[Any, type]] = []
    for name, sub in m.named_modules(remove_duplicate=False):
        names.setdefault(id(sub), []).append(name)
    try:
        for sub in m.modules():
            cls = type(sub)
            try:
                sub.__class__ = _recording(cls)
            except TypeError:
                reads.everything = True
                continue
            swapped.append((sub, cls))
        token = _READS.set((reads, names))
        try:
            yield reads
        finally:
            _READS.reset(token)
    finally:
        for sub, cls in swapped:
            sub.__class__ = cls


@contextlib.contextmanager
def not_reading() -> Iterator[None]:
    """Inside :func:`reading`: reads made meanwhile are not the block's (functrans' own
    bookkeeping around the call)."""
    token = _READS.set(None)
    try:
        yield
    finally:
        _READS.reset(token)


def matches(traced: dict[Attr, Any], reads: Reads, attrs: dict[Attr, Any]) -> bool:
    """Whether a call with ``attrs`` may reuse a region traced with ``traced`` that read
    ``reads``."""
    if reads.everything:
        return traced == attrs
    return all(attrs.get(a) == traced.get(a) for a in reads.attrs)
