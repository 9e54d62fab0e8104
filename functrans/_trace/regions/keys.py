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
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import reads

__all__ = [
    "PLAIN",
    "Attr",
    "BlockState",
    "Reads",
    "SideEffect",
    "aliasing",
    "attrs_snapshot",
    "block_state",
    "code_key",
    "global_hooks",
    "has_hooks",
    "matches",
    "not_reading",
    "reading",
    "replay",
    "restore_changed",
    "tensor_key",
    "value_key",
]

PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format)
_MODULE_SLOTS = frozenset(
    {"_parameters", "_buffers", "_modules", "training", "_non_persistent_buffers_set"}
)

Attr = tuple[str, str]  # (submodule name, attribute)


def value_key(v: Any, depth: int = 0) -> Any:
    """A hashable stand-in for a plain value (by value), a Python function (by its code,
    globals, closure values and defaults: torchtune gives each attention module a closure
    of its own over the same values), or any other object (by identity)."""
    if isinstance(v, PLAIN):
        return (type(v), v)
    if depth > 4:  # a closure over itself, a deep nest: by identity
        return ("id", id(v))
    if isinstance(v, (tuple, list, frozenset)) and len(v) < 64:
        return (type(v), tuple(value_key(x, depth + 1) for x in v))
    if isinstance(v, dict) and len(v) < 64 and all(isinstance(k, str) for k in v):
        return (dict, tuple((k, value_key(x, depth + 1)) for k, x in v.items()))
    if type(v) is types.FunctionType and not v.__dict__:
        return ("fn", id(v.__globals__), *code_key(v, depth + 1))
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


def code_key(fn: Any, depth: int = 0) -> Any:
    """A function's code, closure values and defaults."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return ("id", id(fn))
    cells = tuple(_cell_key(c, depth) for c in fn.__closure__ or ())
    defaults = value_key(fn.__defaults__, depth)
    kwdefaults = value_key(getattr(fn, "__kwdefaults__", None), depth)
    return (id(code), cells, defaults, kwdefaults)


def _cell_key(cell: Any, depth: int) -> Any:
    try:
        return value_key(cell.cell_contents, depth)
    except ValueError:  # an empty cell (a name the function defines later)
        return ("empty",)


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
    table as a whole, so every attribute counts), and every read it made
    (:attr:`recorded`: replayed onto a block that reuses the region, see :func:`replay`)."""

    attrs: set[Attr] = field(default_factory=set)
    everything: bool = False
    recorded: list[reads.Read] = field(default_factory=list)


@contextlib.contextmanager
def reading(m: torch.nn.Module) -> Iterator[Reads]:
    """Record which plain attributes of ``m`` and its submodules are read meanwhile: through
    the trace's recorder (:mod:`functrans._trace.reads`; ``jit``'s, which guards what the
    whole step reads), or one of its own where none runs. Filled when the block exits."""
    found = Reads()
    rec = reads.current()
    own = rec is None
    if rec is None:
        rec = reads.Recorder(m).__enter__()
    elif rec.source_of(m) is None:
        rec.learn(m, reads.Source(None, type(m).__qualname__))
    names: dict[int, list[str]] = {}
    with reads.not_reading():
        for name, sub in m.named_modules(remove_duplicate=False):
            names.setdefault(id(sub), []).append(name)
    mark = rec.mark()
    try:
        yield found
    finally:
        found.recorded = rec.since(mark)
        if own:
            rec.__exit__(None, None, None)
        for r in found.recorded:
            subs = names.get(id(r.holder), ())
            if r.how is reads.How.ATTR:
                found.attrs.update((sub, r.key) for sub in subs)
            elif r.how is reads.How.CONTENT and subs:
                found.everything = True


class SideEffect(Exception):
    """The block changed its own attributes while traced: it is traced inline."""


def not_reading() -> contextlib.AbstractContextManager[None]:
    """Inside :func:`reading`: reads made meanwhile are not the block's (functrans' own
    bookkeeping around the call)."""
    return reads.not_reading()  # type: ignore[no-any-return]  # a context manager


def replay(found: Reads, traced: torch.nn.Module, block: torch.nn.Module) -> None:
    """Record for ``block``, which reuses the region ``traced``'s trace made, what that trace
    read of ``traced`` (its own attributes, its submodules', the dicts and objects they hold),
    read off ``block`` now: what the step depends on of ``block``. Reads of anything else
    (shared configs, globals) were recorded by the trace already."""
    rec = reads.current()
    if rec is None or traced is block:
        return
    was, now = rec.source_of(traced), rec.source_of(block)
    if was is None or now is None or was.path is None:
        return
    n = len(was.path)
    out = []
    for r in found.recorded:
        path = r.where.path
        if path is None or path[:n] != was.path:
            continue
        rel = path[n:]
        try:
            holder = reads.follow(block, rel)
        except Exception:  # the blocks differ where the region's key did not look
            continue
        value = reads.read_now(holder, r.how, r.key)
        if r.how in (reads.How.CONTENT, reads.How.CLASS_DICT):
            value = reads.snapshot(value)
        elif value is reads.NOTHING:
            value = None
        where = reads.Source(
            None if now.path is None else (*now.path, *rel),
            now.name + r.where.name[len(was.name) :],
        )
        out.append(reads.Read(holder, r.how, r.key, value, where))
    rec.add(out)


def matches(traced: dict[Attr, Any], found: Reads, attrs: dict[Attr, Any]) -> bool:
    """Whether a call with ``attrs`` may reuse a region traced with ``traced`` that read
    ``found``."""
    if found.everything:
        return traced == attrs
    return all(attrs.get(a) == traced.get(a) for a in found.attrs)
