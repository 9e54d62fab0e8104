"""What a trace read from outside its arguments, checked on every call of the entry it built.

:class:`ReadGuard` turns the :class:`~functrans._trace.reads.Read` records of one trace into one
generated function of straight-line checks (what Dynamo's Python guards were): each read is read
again the cheapest way its :class:`~functrans._trace.reads.How` allows (an item of an object's
``__dict__``, of a module table, of a namespace; an attribute of a class) and compared with what
the trace saw: plain data by value and exact type, bound methods by what they bind, anything
else by identity. The objects read from are bound to the function's parameters once, so a check
is a handful of bytecodes. A call reuses an entry only when all of its reads give what its
trace saw; :meth:`ReadGuard.changes` names what changed for the recompile log
(``model.config.output_hidden_states False -> True``).

>>> import torch
>>> from functrans._trace.reads import Recorder
>>> cfg = {"mult": 2.0}
>>> def f(x):
...     return x * cfg["mult"]
>>> with Recorder(f) as rec:
...     _ = f(torch.ones(1))
>>> guard = ReadGuard(rec.reads)
>>> guard.holds()
True
>>> cfg["mult"] = 3.0
>>> guard.holds(), guard.changes()
(False, ["cfg['mult'] 2.0 -> 3.0"])
"""

from __future__ import annotations

import keyword
import operator
import types
from collections.abc import Callable, Sequence
from typing import Any

from functrans._trace.class_hooks import class_attrs
from functrans._trace.read_records import NOTHING, How, Read, content_of, is_atom, table_of
from functrans._trace.snapshots import Same

__all__ = ["ALWAYS", "ReadGuard"]


def _expected(value: Any) -> Any:
    """What a read value is compared as: plain data by value, a bound method by what it binds
    (its ``==``), anything else by identity."""
    if is_atom(value) or isinstance(value, types.MethodType):
        return value
    return Same(value)


class ReadGuard:
    """The reads of one trace as checks (see the module docstring); ``holds()`` on a call,
    ``changes()`` after one failed."""

    def __init__(self, reads: Sequence[Read]) -> None:
        self.reads = _first_of_each(reads)
        self._check = _Codegen(self.reads).function() if self.reads else _always

    def __bool__(self) -> bool:
        return bool(self.reads)

    def __len__(self) -> int:
        return len(self.reads)

    def holds(self) -> bool:
        """Whether every read gives what the trace saw."""
        try:
            return self._check()
        except Exception:  # a read that raises now (a deleted attribute...) changed
            return False

    def changes(self) -> list[str]:
        """What changed, one phrase per read (``cfg['mult'] 2.0 -> 3.0``)."""
        out = []
        for r in self.reads:
            now = r.now()
            if not _same(r, now):
                out.append(_phrase(r, now))
        return out


def _always() -> bool:
    return True


def _first_of_each(reads: Sequence[Read]) -> tuple[Read, ...]:
    """Each read once (the first: what the state was before the trace changed anything)."""
    seen: set[tuple[int, How, Any]] = set()
    out = []
    for r in reads:
        try:
            key = (id(r.holder), r.how, r.key)
            hash(key)
        except TypeError:  # an unhashable dict key: kept as read
            out.append(r)
            continue
        if key not in seen:
            seen.add(key)
            out.append(r)
    return tuple(out)


_DICT_BACKED = (How.ATTR, How.ITEM, How.GLOBAL, How.TABLE)


class _Codegen:
    """The source of one check function over ``reads``: every value it compares with or reads
    from is a parameter with a default (a fast local), each read one ``and``-ed test; a class
    attribute is tested once for all the objects that read it (each of them: of that class,
    and holding no attribute of that name itself)."""

    def __init__(self, reads: Sequence[Read]) -> None:
        self._values: dict[int, str] = {}  # id -> parameter name
        self._bound: list[tuple[str, Any]] = []
        self._tests: list[str] = []
        typed: dict[int, Any] = {}
        absent: dict[int, tuple[Any, set[Any]]] = {}
        on_class: set[tuple[int, Any]] = set()
        for r in reads:
            how = r.how
            if how in _DICT_BACKED:
                table = self._bind(table_of(r.holder, how, r.key))
                self._compare(f"{table}[{self._bind(r.key)}]", r.value)
                if how is How.TABLE:
                    _absent_from(absent, r)
            elif how is How.CELL:
                self._compare(f"{self._bind(r.holder)}.cell_contents", r.value)
            elif how is How.CLASS:
                cls = type(r.holder)
                typed.setdefault(id(r.holder), r.holder)
                _absent_from(absent, r)
                if (id(cls), r.key) not in on_class:
                    on_class.add((id(cls), r.key))
                    self._compare(_attribute(self._bind(cls), r.key, self._bind), r.value)
            elif how is How.COMPUTED:
                self._compare(_attribute(self._bind(r.holder), r.key, self._bind), r.value)
            elif how is How.MISSING:
                key, holder = self._bind(r.key), self._bind(r.holder)
                self._tests.append(f"getattr({holder}, {key}, {self._bind(NOTHING)}) is _NOTHING")
            elif how in (How.NO_ITEM, How.NO_GLOBAL):
                absent.setdefault(id(r.holder), (r.holder, set()))[1].add(r.key)
            elif how is How.CLASS_DICT:
                self._tests.append(f"{self._bind(r.value)} == _class_attrs({self._bind(r.holder)})")
            else:  # CONTENT: a container, or an object's __dict__
                now = content_of(r.holder, how)
                self._tests.append(f"{self._bind(r.value)} == {self._bind(now)}")
        if absent:  # one test for all: the dicts that lack keys, and those keys
            dicts = self._bind(tuple(d for d, _ in absent.values()))
            keys = self._bind(tuple(frozenset(k) for _, k in absent.values()))
            self._tests.append(f"all(map(_isdisjoint, map(_keys, {dicts}), {keys}))")
        if typed:  # one test for all: the objects whose class was read, and those classes
            objs = self._bind(tuple(typed.values()))
            classes = self._bind(tuple(type(o) for o in typed.values()))
            self._tests.append(f"all(map(_is, map(type, {objs}), {classes}))")

    def _bind(self, value: Any) -> str:
        """The parameter holding ``value`` (bound once per object)."""
        found = self._values.get(id(value))
        if found is None:
            found = self._values[id(value)] = f"v{len(self._bound)}"
            self._bound.append((found, value))
        return found

    def _compare(self, expr: str, value: Any) -> None:
        """``expr`` gives what the trace read as ``value``."""
        if is_atom(value):
            want, kind = self._bind(value), self._bind(type(value))
            if value != value:  # NaN: equal to nothing, itself included
                self._tests.append(f"((v := {expr}) != v and type(v) is {kind})")
            else:
                self._tests.append(f"((v := {expr}) == {want} and type(v) is {kind})")
        elif isinstance(value, types.MethodType):
            self._tests.append(f"{expr} == {self._bind(value)}")
        else:
            self._tests.append(f"{expr} is {self._bind(value)}")

    def function(self) -> Callable[[], bool]:
        params = ", ".join(f"{name}={name}" for name, _ in self._bound)
        body = " and\n        ".join(self._tests) or "True"
        source = f"def holds({params}):\n    return bool(\n        {body}\n    )\n"
        namespace: dict[str, Any] = dict(self._bound)
        namespace.update(_NOTHING=NOTHING, _class_attrs=class_attrs, _is=operator.is_)
        # a dict's keys view looks each (few) key up in the dict, not the other way round
        namespace.update(_isdisjoint=type({}.keys()).isdisjoint, _keys=dict.keys)
        exec(compile(source, "<functrans read guard>", "exec"), namespace)
        check: Callable[[], bool] = namespace["holds"]
        return check


def _attribute(obj: str, key: Any, bind: Callable[[Any], str]) -> str:
    """``obj.key`` as source (``getattr`` where ``key`` is no identifier)."""
    if isinstance(key, str) and key.isidentifier() and not keyword.iskeyword(key):
        return f"{obj}.{key}"  # a module-level function: no name mangling
    return f"getattr({obj}, {bind(key)})"


def _absent_from(absent: dict[int, tuple[Any, set[Any]]], r: Read) -> None:
    """A class attribute or table entry is read only while the instance holds none."""
    attrs = getattr(r.holder, "__dict__", None)
    if isinstance(attrs, dict):
        absent.setdefault(id(attrs), (attrs, set()))[1].add(r.key)


# -- naming what changed ----------------------------------------------------------------------


def _same(r: Read, now: Any) -> bool:
    if r.how in (How.NO_ITEM, How.NO_GLOBAL, How.MISSING):
        return now is NOTHING
    if r.how in (How.CONTENT, How.CLASS_DICT):
        try:
            return bool(r.value == now)
        except Exception:
            return False
    try:
        return bool(_expected(r.value) == now) and type(r.value) is type(now)
    except Exception:
        return False


def _phrase(r: Read, now: Any) -> str:
    name = r.name
    if r.how in (How.CONTENT, How.CLASS_DICT):
        return f"{name} changed (read whole: {_diff(r.value, now)})"
    if r.how in (How.NO_ITEM, How.NO_GLOBAL, How.MISSING):
        return f"{name} (absent) -> {_show(now)}"
    if r.how is How.CLASS and r.key in getattr(r.holder, "__dict__", {}):
        return f"{name}: now set on the object itself ({_show(now)}), not read from its class"
    return f"{name} {_show(r.value)} -> {_show(now)}"


def _show(v: Any) -> str:
    if v is NOTHING:
        return "(absent)"
    if isinstance(v, Same):
        v = v.obj
    if is_atom(v):
        return repr(v)
    if isinstance(v, types.MethodType):
        return f"{type(v.__self__).__qualname__}.{v.__func__.__qualname__}"
    name = getattr(v, "__qualname__", None) or getattr(v, "__name__", None)
    what = f"{type(v).__qualname__} {name}" if isinstance(name, str) else type(v).__qualname__
    return f"<{what} at {id(v):#x}>"


def _diff(old: Any, new: Any) -> str:
    if isinstance(old, dict) and isinstance(new, dict):
        keys = [k for k in {**old, **new} if not _equal(old.get(k, NOTHING), new.get(k, NOTHING))]
        return ", ".join(
            f"{k!r}: {_show(old.get(k, NOTHING))} -> {_show(new.get(k, NOTHING))}" for k in keys[:4]
        )
    if isinstance(old, (list, tuple)) and isinstance(new, (list, tuple)):
        if len(old) != len(new):
            return f"length {len(old)} -> {len(new)}"
        at = [i for i, (a, b) in enumerate(zip(old, new, strict=True)) if not _equal(a, b)]
        return ", ".join(f"[{i}] {_show(old[i])} -> {_show(new[i])}" for i in at[:4])
    return f"{_show(old)} -> {_show(new)}"


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return False


#: A guard with nothing to check.
ALWAYS = ReadGuard(())
