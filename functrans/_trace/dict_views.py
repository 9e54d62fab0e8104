"""Recording copies of dicts: how a trace records the items it reads from a dict.

A dict the traced code reaches is replaced, where it is held (a closure cell, a module global,
a default) or where it is read from (an attribute, an item), by a :class:`DictView` for the
length of the trace: item reads, missing keys and whole reads are reported to the recorder
(:class:`ItemReads`: :class:`~functrans._trace.reads.Recorder`), and writes go through to
the original (:func:`original` gives it back).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any, Protocol

from .read_records import Source

__all__ = ["WHOLE", "DictView", "ItemReads", "original"]

#: The key a write reports when it rewrites the whole dict (``update``, ``pop``, ``clear``...).
WHOLE: Any = object()


class ItemReads(Protocol):
    """What a :class:`DictView` reports its reads and writes to: the recorder of the trace."""

    def item(self, view: DictView, key: Any, value: Any, code: types.CodeType) -> Any:
        """``view[key]`` was read by ``code`` and gave ``value``; what the reader gets."""
        ...

    def no_item(self, view: DictView, key: Any, code: types.CodeType) -> None:
        """``key`` was looked up in ``view`` by ``code`` and was not there."""
        ...

    def content_of_view(self, view: DictView, code: types.CodeType) -> None:
        """``view`` was read whole (iterated, compared, measured) by ``code``."""
        ...

    def wrote_item(self, view: DictView, key: Any) -> None:
        """The traced code wrote ``view[key]`` (:data:`WHOLE`: the whole dict)."""
        ...


class DictView(dict):  # type: ignore[type-arg]  # any keys and values, as the original's
    """A recording copy of a dict, put where the dict is held for the length of a trace:
    item reads are recorded, reading it whole (iteration, ``len``, ``keys()``...) records its
    content, and writes go through to the original."""

    __slots__ = ("_original", "_rec", "_source")

    def __init__(self, original: dict[Any, Any], rec: ItemReads, source: Source) -> None:
        super().__init__(original)
        self._original, self._rec, self._source = original, rec, source

    def __getitem__(self, key: Any) -> Any:
        try:
            value = dict.__getitem__(self, key)
        except KeyError:
            self._rec.no_item(self, key, sys._getframe(1).f_code)
            raise
        return self._rec.item(self, key, value, sys._getframe(1).f_code)

    def get(self, key: Any, default: Any = None) -> Any:
        if dict.__contains__(self, key):
            return self._rec.item(self, key, dict.__getitem__(self, key), sys._getframe(1).f_code)
        self._rec.no_item(self, key, sys._getframe(1).f_code)
        return default

    def __contains__(self, key: object) -> bool:
        if dict.__contains__(self, key):
            self._rec.item(self, key, dict.__getitem__(self, key), sys._getframe(1).f_code)
            return True
        self._rec.no_item(self, key, sys._getframe(1).f_code)
        return False

    def _whole(self) -> None:
        self._rec.content_of_view(self, sys._getframe(2).f_code)

    def __iter__(self) -> Iterator[Any]:
        self._whole()
        return dict.__iter__(self)

    def __len__(self) -> int:
        self._whole()
        return dict.__len__(self)

    def keys(self) -> Any:
        self._whole()
        return dict.keys(self)

    def values(self) -> Any:
        self._whole()
        return dict.values(self)

    def items(self) -> Any:
        self._whole()
        return dict.items(self)

    def __eq__(self, other: object) -> bool:
        self._whole()
        return dict.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        self._whole()
        return dict.__ne__(self, other)

    def __repr__(self) -> str:
        self._whole()
        return dict.__repr__(self)

    def copy(self) -> dict[Any, Any]:
        self._whole()
        return dict(dict.items(self))

    def __reduce__(self) -> Any:
        self._whole()
        return (dict, (dict(dict.items(self)),))

    # writes: on the copy and the original alike
    def _wrote(self, key: Any = WHOLE) -> None:
        self._rec.wrote_item(self, key)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._wrote(key)
        dict.__setitem__(self, key, value)
        self._original[key] = value

    def __delitem__(self, key: Any) -> None:
        self._wrote(key)
        dict.__delitem__(self, key)
        del self._original[key]

    def _sync(self) -> None:
        self._wrote()
        self._original.clear()
        self._original.update(dict.items(self))

    def update(self, *args: Any, **kwargs: Any) -> None:
        dict.update(self, *args, **kwargs)
        self._sync()

    def pop(self, *args: Any) -> Any:
        out = dict.pop(self, *args)
        self._sync()
        return out

    def popitem(self) -> Any:
        out = dict.popitem(self)
        self._sync()
        return out

    def setdefault(self, key: Any, default: Any = None) -> Any:
        out = dict.setdefault(self, key, default)
        self._sync()
        return out

    def clear(self) -> None:
        dict.clear(self)
        self._sync()

    def __ior__(self, other: Any) -> DictView:  # type: ignore[misc]  # as dict's, in place
        dict.update(self, other)
        self._sync()
        return self


def original(value: Any) -> Any:
    """``value``, or the dict a recording copy stands for."""
    return value._original if issubclass(type(value), DictView) else value
