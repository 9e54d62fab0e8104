"""A read, as recorded: how it was read, from where, what it gave, and what it gives now.

Each value a trace reads from outside its arguments is one :class:`Read` (see
:mod:`functrans._trace.reads`): the ``holder`` it was read from, ``how`` (:class:`How`: an
attribute, a class attribute, an item, a global, a cell, a whole content...), the ``key``, the
``value`` it had and the :class:`Source` that says how the holder was reached and names it.
:func:`read_now` reads it again (what a guard compares); :func:`is_atom` says which values are
plain data compared by value; :func:`resolve` tells where an attribute read came from.

>>> r = Read({"mult": 2.0}, How.ITEM, "mult", 2.0, Source(None, "cfg"))
>>> r.name, r.now(), is_atom(r.value)
("cfg['mult']", 2.0, True)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from functrans._core import marks

from .class_hooks import class_attrs

__all__ = [
    "ATOMS",
    "NOTHING",
    "How",
    "Read",
    "Source",
    "StandsFor",
    "Step",
    "content_of",
    "describe_key",
    "is_atom",
    "read_now",
    "resolve",
    "table_of",
]

#: One step of a :class:`Source`'s path: ``(kind, key)``, kinds the rows of
#: :func:`functrans._trace.reads.follow`'s table.
Step = tuple[str, Any]


class How(enum.Enum):
    """Where a read value came from (what a guard reads again)."""

    ATTR = "attribute"  # holder.__dict__[key]
    CLASS = "class attribute"  # key not in holder.__dict__; type(holder).<key>
    TABLE = "module table"  # an nn.Module's _parameters/_buffers/_modules [key]
    COMPUTED = "computed"  # getattr(holder, key) answered otherwise (slots, __getattr__)
    MISSING = "missing"  # getattr(holder, key) raised AttributeError
    ITEM = "item"  # holder[key] (a dict)
    NO_ITEM = "no item"  # key not in holder (a dict)
    GLOBAL = "global"  # holder[key]: a namespace (a function's globals, a module's __dict__)
    NO_GLOBAL = "no global"  # key not in that namespace (a builtin)
    CELL = "cell"  # holder.cell_contents (a closure cell)
    CONTENT = "content"  # the holder as a whole (a container, an object's __dict__)
    CLASS_DICT = "class"  # a user class's own attributes, as a whole


@dataclass(frozen=True)
class Source:
    """How a holder was reached: its path from the recorder's root (None where it cannot be
    followed again) and its readable name (``model.config``)."""

    path: tuple[Step, ...] | None
    name: str

    def then(self, step: Step, name: str) -> Source:
        return Source(None if self.path is None else (*self.path, step), name)


@dataclass(frozen=True, eq=False)
class Read:
    """One value the trace read from outside its arguments: ``how`` it was read, from which
    ``holder`` (held: its identity is what a guard compares), under which ``key``, and the
    ``value`` it had (a :func:`snapshot` for :attr:`How.CONTENT` and :attr:`How.CLASS_DICT`)."""

    holder: Any
    how: How
    key: Any
    value: Any
    where: Source

    @property
    def name(self) -> str:
        """How a message names it: ``model.config.output_hidden_states``, ``cfg['mult']``."""
        return describe_key(self.where.name, self.how, self.key)

    def now(self) -> Any:
        """What this read gives now (:data:`NOTHING` where it finds nothing; the current
        content, not a snapshot, for :attr:`How.CONTENT` and :attr:`How.CLASS_DICT`)."""
        return read_now(self.holder, self.how, self.key)


#: What :meth:`Read.now` gives where a read finds nothing.
NOTHING: Any = type("Nothing", (), {"__repr__": lambda self: "(absent)"})()

_IN_DICT = (How.ATTR, How.ITEM, How.GLOBAL, How.TABLE)
#: an nn.Module's tables, which a :attr:`How.TABLE` read reads
_TABLES = ("_parameters", "_buffers", "_modules")


def read_now(holder: Any, how: How, key: Any) -> Any:
    """What reading ``holder``'s ``key`` as ``how`` gives now (see :meth:`Read.now`)."""
    try:
        if how in _IN_DICT:
            return table_of(holder, how, key).get(key, NOTHING)
        if how is How.CELL:
            return holder.cell_contents
        if how is How.CLASS:
            if key in (_instance_dict(holder) or {}):
                return NOTHING  # set on the object itself: not the class's any more
            return getattr(type(holder), key, NOTHING)
        if how in (How.COMPUTED, How.MISSING):
            return getattr(holder, key, NOTHING)
        if how in (How.NO_ITEM, How.NO_GLOBAL):
            return holder.get(key, NOTHING)
        return content_of(holder, how)
    except Exception:
        return NOTHING


def table_of(holder: Any, how: How, key: Any) -> Any:
    """The dict a dict-backed read (attribute, item, global, module table) reads."""
    if how is How.ATTR:
        return vars(holder)
    if how is How.TABLE:
        attrs = vars(holder)
        for name in _TABLES:
            table = attrs.get(name)
            if table is not None and key in table:
                return table
        return attrs
    return holder


def content_of(holder: Any, how: How) -> Any:
    """What a content read compares: a user class's own attributes, a container, or an
    object's ``__dict__``."""
    if how is How.CLASS_DICT:
        return class_attrs(holder)
    if issubclass(type(holder), (dict, list, tuple, set, frozenset, np.ndarray)):
        return holder
    return vars(holder)


def describe_key(holder: str, how: How, key: Any) -> str:
    """The readable name of ``holder``'s ``key`` read as ``how``."""
    if how in (How.ITEM, How.NO_ITEM):
        return f"{holder}[{key!r}]"
    if how in (How.CONTENT, How.CLASS_DICT, How.CELL):
        return holder
    if how in (How.GLOBAL, How.NO_GLOBAL):
        return f"{holder}.{key}" if holder else str(key)
    return f"{holder}.{key}" if holder else str(key)


#: Values guarded by value (compared with ``==`` and their exact type): plain data.
ATOMS = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    enum.Enum,
)


def is_atom(v: Any) -> bool:
    """Whether ``v`` is plain data compared by value (tuples and frozensets of atoms too)."""
    if issubclass(type(v), ATOMS):
        return True
    if type(v) in (tuple, frozenset, torch.Size):
        return all(is_atom(x) for x in v)
    return False


# -- where an attribute read came from --------------------------------------------------------

_ABSENT = object()


def _class_lookup(cls: type, name: str) -> Any:
    for klass in cls.__mro__:
        found = klass.__dict__.get(name, _ABSENT)
        if found is not _ABSENT:
            return found
    return _ABSENT


@dataclass(frozen=True)
class StandsFor:
    """The record on a function functrans installs on a class while a trace runs: the
    function it replaces, what reads of it record."""

    original: Any


def resolve(obj: Any, name: str, value: Any) -> tuple[How | None, Any]:
    """Where ``obj.<name>`` (which gave ``value``) came from, and the value a guard compares
    (for a class attribute: what the class holds, a function rather than a bound method)."""
    attrs = _instance_dict(obj)
    if attrs is not None and name in attrs and attrs[name] is value:
        return How.ATTR, value
    cls = type(obj)
    raw = _class_lookup(cls, name)
    if raw is not _ABSENT:
        if issubclass(type(raw), property):  # its getter's reads are recorded
            return How.CLASS, raw
        if hasattr(type(raw), "__set__") or hasattr(type(raw), "__delete__"):
            return How.COMPUTED, value  # a slot, a C getter: the object's own value
        try:
            on_class = getattr(cls, name)
        except AttributeError:
            return How.COMPUTED, value
        # a method functrans patches for the length of a trace (``ModuleDict.values``, to find
        # blocks) reads as the method it stands for: the one a guard finds after the trace
        patched = marks.read(on_class, StandsFor)
        return How.CLASS, on_class if patched is None else patched.original
    if issubclass(type(obj), torch.nn.Module) and attrs is not None:
        for table in _TABLES:
            held = attrs.get(table)
            if held is not None and name in held and held[name] is value:
                return How.TABLE, value
    return How.COMPUTED, value


def _instance_dict(obj: Any) -> dict[str, Any] | None:
    try:
        d = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        return None
    return d if issubclass(type(d), dict) else None
