"""What a stored trace read besides its arguments, as JSON: the guards of an entry read from disk.

An entry ``jit`` loads from disk was traced in another process, so no read of this process
recorded what it depends on (:mod:`functrans._trace.reads`). The entry carries its trace's
reads instead: each as the path from the jitted function to the object it read, how it read
it, the key, and a digest of the value it saw. :func:`load` follows each path in this
process, checks that the value there has the same digest (a global of an installed package
patched since, a class constant changed: the entry is stale, a miss) and hands back the reads
with this process's objects, which then guard the entry as a traced one's do.

A digest says what a value is without holding it: plain data by type and ``repr``, a function
by its module, name and code, a class or module by name, any other object by its type (the
key's fingerprint of the function, deep through what it reaches, already says those objects
are what the trace saw). Reads whose holder has no path (an object only a local variable led
to) or whose keys JSON cannot hold make the entry unstorable (:class:`NotStorable`).

>>> import torch
>>> from functrans._trace.reads import Recorder
>>> cfg = {"mult": 2.0}
>>> def f(x):
...     return x * cfg["mult"]
>>> with Recorder(f) as rec:
...     _ = f(torch.ones(1))
>>> doc = dump(rec.reads)
>>> [r.value for r in load(doc, f) if r.key == "mult"]
[2.0]
>>> cfg["mult"] = 3.0
>>> load(doc, f) is None
True
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

from functrans._trace.dict_views import original
from functrans._trace.read_records import NOTHING, How, Read, Source, is_atom, read_now
from functrans._trace.reads import follow
from functrans._trace.snapshots import snapshot

from .fingerprint import code_digest
from .tree_json import NotStorable

__all__ = ["dump", "load"]

_KEY_TYPES = (str, int, bool, type(None))
_CONTENT = (How.CONTENT, How.CLASS_DICT)
_ABSENT = (How.MISSING, How.NO_ITEM, How.NO_GLOBAL)


def dump(reads: Sequence[Read]) -> list[Any]:
    """``reads`` as JSON (raises :class:`NotStorable` where one cannot be found again)."""
    out = []
    for r in reads:
        path = r.where.path
        if path is None:
            raise NotStorable(f"the trace read {r.name}, which no path from the function reaches")
        steps = [[kind, key] for kind, key in path]
        if not all(isinstance(k, _KEY_TYPES) for _, k in path) or not isinstance(r.key, _KEY_TYPES):
            raise NotStorable(f"the trace read {r.name} through a key JSON cannot hold")
        value = None if r.how in _CONTENT or r.how in _ABSENT else digest(r.value)
        out.append([steps, r.how.name, r.key, r.where.name, value])
    return out


def load(doc: list[Any], root: Any) -> list[Read] | None:
    """The reads ``doc`` stored, found again from ``root`` (the jitted function), or None
    where one leads nowhere or reads another value now (the entry is stale)."""
    out = []
    holders: dict[tuple[Any, ...], Any] = {}
    for steps, how_name, key, name, value in doc:
        path = tuple((kind, k) for kind, k in steps)
        try:
            holder = holders.get(path, NOTHING)
            if holder is NOTHING:
                holder = holders[path] = original(follow(root, path))
        except Exception:
            return None
        how = How[how_name]
        now = read_now(holder, how, key)
        if how in _ABSENT:
            if now is not NOTHING:
                return None
        elif now is NOTHING:
            return None
        elif how in _CONTENT:
            now = snapshot(now)
        elif digest(now) != value:
            return None
        out.append(Read(holder, how, key, None if how in _ABSENT else now, Source(path, name)))
    return out


def digest(value: Any) -> list[Any]:
    """What ``value`` is, as JSON (see the module docstring).

    >>> digest(2.0), digest(len)
    (['v', 'float', '2.0'], ['b', 'builtins', 'len'])
    """
    if is_atom(value):
        return ["v", type(value).__qualname__, repr(value)]
    if isinstance(value, types.FunctionType):
        return ["f", value.__module__, value.__qualname__, code_digest(value.__code__)]
    if isinstance(value, types.MethodType):
        return ["m", digest(value.__func__), _name(type(value.__self__))]
    if isinstance(value, (types.BuiltinFunctionType, types.BuiltinMethodType)):
        return ["b", str(getattr(value, "__module__", None)), value.__qualname__]
    if isinstance(value, type):
        return ["c", _name(value)]
    if isinstance(value, types.ModuleType):
        return ["mod", value.__name__]
    return ["o", _name(type(value))]


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
