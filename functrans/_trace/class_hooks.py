"""The recording hooks a trace installs on the classes of the objects it reaches.

For the length of a trace, the class of every object whose reads are recorded answers
attribute reads (and writes) through a recording ``__getattribute__`` (``__getattr__``,
``__setattr__``, ``__delattr__``) installed on the class and removed after; the objects keep
their type. A hook reports to the recorder the running trace has (:class:`Listener`:
:class:`~functrans._trace.reads.Recorder`), and hands every read made by functrans' or torch's
machinery straight through. Several recorders share a class's hooks (:func:`hook` counts them).

>>> class Cfg:
...     mult = 2
>>> hook(Cfg, lambda: None), "__getattribute__" in vars(Cfg), class_attrs(Cfg)["mult"]
(True, True, 2)
>>> unhook(Cfg); "__getattribute__" in vars(Cfg)
False
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Callable, Container
from typing import Any, Protocol

import torch

from .read_scope import MODULE_INTERNALS, role_of

__all__ = ["Listener", "class_attrs", "hook", "unhook"]


class Listener(Protocol):
    """What the hooks report a read or write to: the recorder of the running trace."""

    @property
    def known(self) -> Container[int]:
        """The ids of the objects whose reads are recorded."""
        ...

    def attribute(self, obj: Any, name: str, value: Any, code: types.CodeType) -> Any:
        """``obj.<name>`` was read by ``code`` and gave ``value``; what the reader gets."""
        ...

    def missing(self, obj: Any, name: str) -> None:
        """``getattr(obj, name)`` raised AttributeError."""
        ...

    def wrote(self, obj: Any, name: str) -> None:
        """The traced code set or deleted ``obj.<name>``."""
        ...


_LOCK = threading.Lock()
#: class -> (number of recorders that need its hooks, the attributes it had before)
_PATCHED: dict[type, tuple[int, dict[str, Any]]] = {}
_HOOKED = ("__getattribute__", "__getattr__", "__setattr__", "__delattr__")
_ABSENT = object()


def _original(cls: type, name: str) -> Any:
    """``cls``'s ``name`` as it resolves without any recording hook (a base class's hook, if
    one is installed, stands for what it wraps)."""
    for klass in cls.__mro__:
        found = klass.__dict__.get(name, _ABSENT)
        if found is _ABSENT:
            continue
        if klass in _PATCHED and name in _HOOKED:
            saved = _PATCHED[klass][1].get(name, _ABSENT)
            if saved is _ABSENT:  # the hook was ours: look further up
                continue
            return saved
        return found
    return _ABSENT


#: names a hook hands through at once: ``__class__`` (every failing ``isinstance`` asks a
#: hooked object for it), and nn.Module's own bookkeeping (see :data:`MODULE_INTERNALS`)
_PASSES = frozenset({"__class__"})
_MODULE_PASSES = _PASSES | MODULE_INTERNALS


def _hooks(cls: type, current: Callable[[], Listener | None]) -> dict[str, Any]:
    """The recording hooks for ``cls`` (each calls what ``cls`` resolved before)."""
    get = _original(cls, "__getattribute__")
    fallback = _original(cls, "__getattr__")
    set_ = _original(cls, "__setattr__")
    delete = _original(cls, "__delattr__")
    has_fallback = fallback is not _ABSENT

    passes = _MODULE_PASSES if issubclass(cls, torch.nn.Module) else _PASSES

    def __getattribute__(self: Any, name: str) -> Any:
        if name in passes:  # isinstance asks for __class__: cheap, and never state
            return get(self, name)
        rec = current()
        if rec is None or id(self) not in rec.known:
            return get(self, name)
        frame = sys._getframe(1)
        if _not_traced_code(frame):
            return get(self, name)
        try:
            value = get(self, name)
        except AttributeError:
            if not has_fallback:
                rec.missing(self, name)
            raise
        return rec.attribute(self, name, value, frame.f_code)

    hooks: dict[str, Any] = {"__getattribute__": __getattribute__}
    if has_fallback:

        def __getattr__(self: Any, name: str) -> Any:
            rec = current()
            if rec is None or id(self) not in rec.known:
                return fallback(self, name)
            frame = sys._getframe(1)
            if _not_traced_code(frame):
                return fallback(self, name)
            try:
                value = fallback(self, name)
            except AttributeError:
                rec.missing(self, name)
                raise
            return rec.attribute(self, name, value, frame.f_code)

        hooks["__getattr__"] = __getattr__

    def __setattr__(self: Any, name: str, value: Any) -> None:
        rec = current()
        if rec is not None and id(self) in rec.known and not _not_traced_code(sys._getframe(1)):
            rec.wrote(self, name)
        set_(self, name, value)

    def __delattr__(self: Any, name: str) -> None:
        rec = current()
        if rec is not None and id(self) in rec.known and not _not_traced_code(sys._getframe(1)):
            rec.wrote(self, name)
        delete(self, name)

    hooks["__setattr__"] = __setattr__
    hooks["__delattr__"] = __delattr__
    return hooks


#: the code of the hooks themselves (a property getter a hook runs is called from one)
_HOOK_CODES = frozenset(fn.__code__ for fn in _hooks(torch.nn.Module, lambda: None).values())


def _not_traced_code(frame: types.FrameType) -> bool:
    """Whether the read ``frame`` makes is functrans' or torch's machinery's own: code of
    theirs, or library code they called directly (``m.modules()`` from a region's key)."""
    role = role_of(frame.f_code.co_filename)
    if role == "library":
        back = frame.f_back
        while back is not None and back.f_code in _HOOK_CODES:  # a property our hook ran
            back = back.f_back
        return back is not None and role_of(back.f_code.co_filename) == "machinery"
    return role == "machinery"


def hook(cls: type, current: Callable[[], Listener | None]) -> bool:
    """Install the recording hooks on ``cls`` (or count one more user); False where the class
    refuses them."""
    with _LOCK:
        found = _PATCHED.get(cls)
        if found is not None:
            _PATCHED[cls] = (found[0] + 1, found[1])
            return True
        before = {name: cls.__dict__.get(name, _ABSENT) for name in _HOOKED}
        hooks = _hooks(cls, current)
        done: list[str] = []
        try:
            for name, fn in hooks.items():
                type.__setattr__(cls, name, fn)
                done.append(name)
        except (TypeError, AttributeError):
            _restore(cls, before, done)
            return False
        _PATCHED[cls] = (1, before)
        return True


def unhook(cls: type) -> None:
    with _LOCK:
        count, before = _PATCHED[cls]
        if count > 1:
            _PATCHED[cls] = (count - 1, before)
            return
        del _PATCHED[cls]
        _restore(cls, before, list(_HOOKED))


def _restore(cls: type, before: dict[str, Any], names: list[str]) -> None:
    for name in names:
        old = before[name]
        if old is _ABSENT:
            if name in cls.__dict__:
                type.__delattr__(cls, name)
        else:
            type.__setattr__(cls, name, old)


def class_attrs(cls: type) -> dict[str, Any]:
    """``cls``'s own attributes, as they are without recording hooks."""
    own = dict(cls.__dict__)
    found = _PATCHED.get(cls)
    if found is not None:
        for name, before in found[1].items():
            if before is _ABSENT:
                own.pop(name, None)
            else:
                own[name] = before
    return own
