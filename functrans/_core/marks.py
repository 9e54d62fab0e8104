"""What one part of functrans leaves on an object for another: typed records under one attribute.

A transform that needs to tell a later one something about a callable (``grad`` telling ``vmap``
what it differentiates, ``jit`` telling the tracer the argument paths it re-packed) or about an
exception (this one came from the user's code) leaves a frozen record with :func:`leave`, and the
reader asks for the record's type with :func:`read`. Every record lives under the single
attribute ``__functrans__``, a tuple holding at most one record of each type, so the records are
named types the type checker follows instead of a dozen ad-hoc attribute names, and a record is
found by its class, never by a string.

``functools.wraps`` copies ``__dict__``, so a wrapper of a marked function carries its records
as an attribute would; records that must not follow a wrapper hold the function they describe
(``GradSpec.run``) and the reader compares it.

>>> from dataclasses import dataclass
>>> @dataclass(frozen=True)
... class Note:
...     text: str
>>> def f():
...     pass
>>> leave(f, Note("first")); leave(f, Note("second"))
>>> read(f, Note)
Note(text='second')
>>> read(lambda: None, Note) is None
True
"""

from __future__ import annotations

import contextlib
from typing import TypeVar

__all__ = ["MARK", "leave", "marked", "read"]

#: The one attribute functrans writes on objects it hands back or passes through.
MARK = "__functrans__"

_R = TypeVar("_R")


def leave(obj: object, record: object) -> None:
    """Attach ``record`` to ``obj``, replacing a record of the same type. Objects that take no
    attributes (a built-in function, some built-in exceptions) are left as they are."""
    kept = tuple(r for r in getattr(obj, MARK, ()) if type(r) is not type(record))
    with contextlib.suppress(AttributeError, TypeError):
        setattr(obj, MARK, (*kept, record))


def read(obj: object, kind: type[_R]) -> _R | None:
    """The record of type ``kind`` left on ``obj`` (or on the object a wrapper copied its
    attributes from), or None.

    >>> read(object(), int) is None
    True
    """
    records = getattr(obj, MARK, ())
    if not isinstance(records, tuple):  # an unrelated object answering every getattr
        return None
    for record in records:
        if isinstance(record, kind):
            return record
    return None


def marked(obj: object, kind: type[object]) -> bool:
    """Whether ``obj`` carries a record of type ``kind``.

    >>> marked(len, int)
    False
    """
    return read(obj, kind) is not None
