"""Fingerprints of Python values and of the code a trace ran, for the on-disk trace cache.

:class:`Fingerprint` hashes a value deeply: atoms by type and value; containers item by item;
functions by their code (bytecode, constants, names, nested code), defaults, closure cells and
attributes; bound methods and ``functools.partial`` by what they bind; modules (``torch.nn``
ones included) and plain objects by their class and instance attributes (``__dict__`` and
slots); user classes by their attributes and bases, library classes by name; tensors by their
metadata only (type, shape, strides, dtype, device, ``requires_grad``: ``jit`` lifts captured
tensors to graph inputs, so their values never reach a graph it stores). Shared objects are
hashed once and referred to after, so how objects alias is part of the hash. Anything whose
state it cannot see (C objects, generators, tensor subclasses, huge structures) raises
:class:`Unhashable`: the caller then does without a disk cache, never with a partial hash.
:func:`classify` says whose code a source file holds (what :mod:`functrans._jit.disk.code_deps`
records).

>>> def scale(x, k=2.0):
...     return x * k
>>> Fingerprint().digest(scale) == Fingerprint().digest(scale)
True
>>> Fingerprint().digest([1, 2.0]) == Fingerprint().digest([1, 2])
False
"""

from __future__ import annotations

import collections
import enum
import functools
import hashlib
import logging
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

from functrans._core.context import classify
from functrans._core.pytree import plain
from functrans._trace.class_hooks import class_attrs
from functrans._trace.dict_views import DictView

__all__ = ["Fingerprint", "Unhashable", "classify", "code_digest", "code_names"]

_MAX_OBJECTS = 200_000  # objects hashed per fingerprint: beyond this, no disk cache
_MAX_DEPTH = 400
_MAX_ARRAY_BYTES = 1 << 20


class Unhashable(Exception):  # control flow: the caller skips the disk cache
    """A value whose state a fingerprint cannot see (the message says which and where)."""


_ATOMS = (type(None), bool, int, str, bytes, type(Ellipsis), type(NotImplemented))
_NAMED = (torch.dtype, torch.device, torch.layout, torch.memory_format)
_DUNDER_SKIP = frozenset(
    {
        "__dict__",
        "__weakref__",
        "__doc__",
        "__module__",
        "__qualname__",
        "__annotations__",
        "__dataclass_fields__",
        "__dataclass_params__",
        "__match_args__",
        "__slots__",
        "__orig_bases__",
        "__parameters__",
        "_abc_impl",
        "__abstractmethods__",
        "__firstlineno__",
        "__static_attributes__",
    }
)
# C types whose instances keep their state where the walk sees it (items, __dict__)
_CONTAINER_BASES = frozenset({object, dict, list, tuple, collections.OrderedDict})
_VALUE_BASES = (str, int, float, bytes)  # subclasses (TorchVersion, IntEnum...): by value
# library objects that hold no state a trace reads: named, not walked
_OPAQUE = (logging.Logger, logging.Handler, type(threading.Lock()), type(threading.RLock()))
# the same, by name (their modules are not imported here): Hugging Face's generation settings
# drive generate(), never a forward pass, and hold a hash() that differs in every process
_OPAQUE_NAMES = frozenset({"transformers.generation.configuration_utils.GenerationConfig"})


class Fingerprint:
    """A deep hash of values (see the module docstring); one instance per key, so objects
    shared between the values hashed are hashed once.

    >>> import torch
    >>> m = torch.nn.Linear(2, 2)
    >>> a = Fingerprint().digest(m)
    >>> m.train(False)
    Linear(in_features=2, out_features=2, bias=True)
    >>> a == Fingerprint().digest(m)
    False
    """

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self._parts: list[str] = []  # hashed in one update: a module tree has thousands
        self._memo: dict[int, int] = {}
        self._alive: list[Any] = []  # keeps ids unique while hashing
        self._depth = 0
        #: code objects whose closure cells were hashed (functions reached by the walk)
        self.closures: set[types.CodeType] = set()

    def digest(self, *values: Any) -> str:
        """Hash ``values`` into this fingerprint and return the hex digest so far."""
        for v in values:
            self.add(v)
        self._h.update("".join(self._parts).encode())
        self._parts.clear()
        return self._h.hexdigest()

    def add(self, obj: Any, names: Iterable[str] | None = None) -> None:
        """Hash ``obj`` (``names``: for a module reached from code, the attributes that code
        may read)."""
        self._depth += 1
        try:
            if self._depth > _MAX_DEPTH:
                raise Unhashable("values nested too deeply")
            self._add(obj, names)
        finally:
            self._depth -= 1

    def _w(self, tag: str, text: str = "") -> None:
        self._parts.append(f"{tag}:{text}\x00")

    def _simple(self, obj: Any) -> bool:
        """Hash ``obj`` as :meth:`add` would if it is an atom or an empty ``dict`` (what most of
        a module's attributes are: a block has a hundred), without its layers of calls; False
        (nothing hashed) for anything else."""
        t = type(obj)
        if t in _ATOMS or t is float:
            self._parts.append(f"{t.__name__}:{obj!r}\x00")
            return True
        if (t is dict or t is collections.OrderedDict) and not obj:
            key = id(obj)
            if key in self._memo:
                self._parts.append(f"ref:{self._memo[key]}\x00")
                return True
            self._memo[key] = len(self._memo)
            self._alive.append(obj)
            self._parts.append(f"{t.__name__}:\x00end:\x00")
            return True
        return False

    def _add(self, obj: Any, names: Iterable[str] | None) -> None:
        t = type(obj)
        if t in _ATOMS:
            self._w(t.__name__, repr(obj))
            return
        if t is float or t is complex:
            self._w(t.__name__, repr(obj))
            return
        if t in _NAMED:
            self._w(t.__name__, str(obj))
            return
        if t is torch.Size:
            self._w("size", repr(tuple(obj)))
            return
        key = id(obj)
        if key in self._memo:
            self._w("ref", str(self._memo[key]))
            return
        self._memo[key] = len(self._memo)
        self._alive.append(obj)
        if len(self._memo) > _MAX_OBJECTS:
            raise Unhashable(f"more than {_MAX_OBJECTS} objects reachable")
        self._object(obj, t, names)

    def _object(self, obj: Any, t: type, names: Iterable[str] | None) -> None:
        # how to hash a type's instances is looked up once per type: a module tree walks a
        # few types thousands of times
        _handler(t)(self, obj, t, names)

    def _items(self, items: Iterable[Any]) -> None:
        for v in items:
            self.add(v)
        self._w("end")

    def _tensor(self, t: torch.Tensor) -> None:
        if not plain(t):
            raise Unhashable(f"a tensor of type {type(t).__qualname__}")
        self._w(
            "tensor",
            repr(
                (
                    type(t).__name__,
                    tuple(t.shape),
                    t.stride() if t.layout == torch.strided else None,
                    str(t.dtype),
                    str(t.device),
                    str(t.layout),
                    t.requires_grad,
                )
            ),
        )

    def _function(self, f: types.FunctionType) -> None:
        self._w("function", f.__module__ or "")
        code = f.__code__
        self._w("code", code_digest(code))
        self.add(f.__defaults__)
        self.add(f.__kwdefaults__)
        if f.__closure__:
            self.closures.add(code)
            context = code_names(code)
            for cell in f.__closure__:
                try:
                    value = cell.cell_contents
                except ValueError:  # not bound yet
                    self._w("empty-cell")
                    continue
                self.add(value, context)
        self.add(f.__dict__)

    def _builtin(self, f: Any) -> None:
        owner = getattr(f, "__self__", None)
        self._w("builtin", f"{getattr(f, '__module__', None)}.{getattr(f, '__qualname__', '')}")
        if owner is not None and not isinstance(owner, types.ModuleType):
            self.add(owner)  # a bound C method: what it is bound to

    def _module(self, m: types.ModuleType, names: Iterable[str] | None) -> None:
        self._w("module", m.__name__)
        if classify(getattr(m, "__file__", None) or "") != "user":
            return
        attrs = vars(m)
        picked = [n for n in names if n in attrs] if names is not None else list(attrs)
        for n in sorted(set(picked)):
            if not (n.startswith("__") and n.endswith("__")):
                self._w("attr", n)
                self.add(attrs[n])

    def _class(self, c: type) -> None:
        self._w("class", _qualified(c))
        if not _user_class(c):
            return
        for base in c.__bases__:
            self.add(base)
        for k, v in class_attrs(c).items():  # as written: without a trace's reading hooks
            if k not in _DUNDER_SKIP:
                self._w("attr", k)
                self.add(v)
        self._w("end")

    def _array(self, a: Any) -> None:
        if not hasattr(a, "tobytes") or getattr(a, "dtype", None) is None:
            raise Unhashable(f"a {type(a).__qualname__}")
        if a.dtype.hasobject or a.nbytes > _MAX_ARRAY_BYTES:
            raise Unhashable(f"a numpy array of {a.nbytes} bytes or of objects")
        raw = a.tobytes()
        self._w("ndarray", f"{a.dtype}{getattr(a, 'shape', ())}{hashlib.sha256(raw).hexdigest()}")

    def _instance(self, obj: Any, t: type) -> None:
        if t is dict or t is collections.OrderedDict:  # a module has a dozen, most empty
            self._w(t.__name__)
            self._dict(obj, t is collections.OrderedDict and _hook_table(obj))
            return
        if isinstance(obj, (types.GeneratorType, types.CoroutineType, weakref.ref)):
            raise Unhashable(f"a {t.__qualname__}")
        values, unseen = _layout(t)
        if unseen is not None:
            raise Unhashable(f"a {_qualified(t)} (its state lives in C: {unseen.__qualname__})")
        for base in values:
            plain: Any = base  # the plain value (the str of a TorchVersion, ...)
            self._w(base.__name__, repr(plain(obj)))
        self._w("object")
        self.add(t)
        if isinstance(obj, dict):
            self._dict(obj, isinstance(obj, collections.OrderedDict) and _hook_table(obj))
        elif isinstance(obj, (list, tuple)):
            self._items(obj)
        attrs = getattr(obj, "__dict__", None)
        if attrs is not None:
            if not isinstance(attrs, dict):
                raise Unhashable(f"a {_qualified(t)} with a {type(attrs).__qualname__} __dict__")
            module = isinstance(obj, torch.nn.Module)
            for k, v in attrs.items():
                self._w("attr", k)
                if module and k.endswith("hooks") and isinstance(v, dict):
                    self._w("hooks")
                    self._items(v.values())
                elif not self._simple(v):
                    self.add(v)
            self._w("end")
        for name in _slots(t):
            self._w("slot", name)
            self.add(getattr(obj, name, _Missing))

    def _dict(self, d: dict[Any, Any], hooks: bool) -> None:
        for k, v in d.items():
            if not hooks:  # hook tables are keyed by a process-wide counter
                self.add(k)
            self.add(v)
        self._w("end")


class _Missing:
    """An unset slot."""


_R = TypeVar("_R")


def _per_type(f: Callable[[type], _R]) -> Callable[[type], _R]:
    """``f`` computed once per type, found by identity (not by the type's ``==``, which a
    metaclass may define: two classes equal by name are two types here)."""
    memo: dict[int, tuple[type, _R]] = {}

    def cached(t: type) -> _R:
        hit = memo.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
        if len(memo) >= 4096:
            memo.clear()
        value = memo[id(t)] = (t, f(t))
        return value[1]

    return functools.wraps(f)(cached)


_Handler = Callable[[Fingerprint, Any, type, "Iterable[str] | None"], None]


def _set(fp: Fingerprint, obj: Any, t: type) -> None:
    parts = sorted(Fingerprint().digest(v) for v in obj)  # by value, in no order
    fp._w(t.__name__, ",".join(parts))


def _enum(fp: Fingerprint, obj: Any, t: type) -> None:
    fp._w("enum", _qualified(t))
    fp._w("name", obj.name)
    fp.add(obj.value)


def _numpy(fp: Fingerprint, obj: Any, t: type) -> None:
    if hasattr(obj, "dtype"):  # an array or a scalar
        fp._array(obj)
    else:
        fp._instance(obj, t)


def _tagged(fp: Fingerprint, tag: str, *values: Any) -> None:
    fp._w(tag)
    for v in values:
        fp.add(v)


def _listed(fp: Fingerprint, tag: str, values: tuple[Any, ...]) -> None:
    fp._w(tag)
    fp._items(values)


#: handlers of exact types (:func:`_handler` tests subclasses for the rest)
_EXACT: dict[type, _Handler] = {
    types.FunctionType: lambda fp, obj, t, names: fp._function(obj),
    types.MethodType: lambda fp, obj, t, names: _tagged(fp, "method", obj.__func__, obj.__self__),
    functools.partial: lambda fp, obj, t, names: _listed(
        fp, "partial", (obj.func, obj.args, obj.keywords, obj.__dict__)
    ),
    staticmethod: lambda fp, obj, t, names: _tagged(fp, t.__name__, obj.__func__),
    classmethod: lambda fp, obj, t, names: _tagged(fp, t.__name__, obj.__func__),
    property: lambda fp, obj, t, names: _listed(fp, "property", (obj.fget, obj.fset, obj.fdel)),
    types.ModuleType: lambda fp, obj, t, names: fp._module(obj, names),
    set: lambda fp, obj, t, names: _set(fp, obj, t),
    frozenset: lambda fp, obj, t, names: _set(fp, obj, t),
    **dict.fromkeys(
        (types.BuiltinFunctionType, types.MethodWrapperType, types.WrapperDescriptorType),
        lambda fp, obj, t, names: fp._builtin(obj),
    ),
}


@_per_type
def _handler(t: type) -> _Handler:
    """How :class:`Fingerprint` hashes ``t``'s instances (every test is on the type alone)."""
    if issubclass(t, DictView):  # a dict's recording copy, while a trace reads it: the dict
        return lambda fp, obj, t, names: fp.add(obj._original, names)
    if issubclass(t, torch.Tensor):
        return lambda fp, obj, t, names: fp._tensor(obj)
    if issubclass(t, enum.Enum):
        return lambda fp, obj, t, names: _enum(fp, obj, t)
    if t in _EXACT:
        return _EXACT[t]
    if issubclass(t, type):
        return lambda fp, obj, t, names: fp._class(obj)
    if issubclass(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return lambda fp, obj, t, names: fp._w("op", str(obj))
    if issubclass(t, _OPAQUE) or _qualified(t) in _OPAQUE_NAMES:
        return lambda fp, obj, t, names: fp._w("opaque", _qualified(t))
    if t.__module__ == "numpy":
        return lambda fp, obj, t, names: _numpy(fp, obj, t)
    return lambda fp, obj, t, names: fp._instance(obj, t)


@_per_type
def _layout(t: type) -> tuple[tuple[type, ...], type | None]:
    """The plain value types among ``t``'s bases (an instance is hashed by its value as each:
    the str of a TorchVersion), and the first base whose state lives in C where the walk cannot
    see it (None if there is none)."""
    values: list[type] = []
    for base in t.__mro__:
        if base in _VALUE_BASES:
            values.append(base)
        elif base not in _CONTAINER_BASES and not base.__flags__ & _HEAPTYPE:
            return tuple(values), base
    return tuple(values), None


_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class defined in Python


def _hook_table(d: dict[Any, Any]) -> bool:
    return bool(d) and all(type(k) is int for k in d) and all(callable(v) for v in d.values())


@functools.lru_cache(maxsize=1024)
def _slots(t: type) -> tuple[str, ...]:
    out: list[str] = []
    for c in t.__mro__:
        s = c.__dict__.get("__slots__", ())
        for name in (s,) if isinstance(s, str) else s:
            if name not in ("__dict__", "__weakref__") and name not in out:
                out.append(name)
    return tuple(out)


def _qualified(c: type) -> str:
    return f"{c.__module__}.{c.__qualname__}"


def _user_class(c: type) -> bool:
    module = sys.modules.get(c.__module__)
    return classify(getattr(module, "__file__", None) or "") == "user"


@functools.lru_cache(maxsize=8192)
def code_digest(code: types.CodeType) -> str:
    """Hash of a code object: its bytecode, constants (nested code too), names, arguments,
    flags, file, first line and qualified name."""
    h = hashlib.sha256()
    parts = (
        code.co_code,
        code.co_names,
        code.co_varnames,
        code.co_freevars,
        code.co_cellvars,
        code.co_argcount,
        code.co_posonlyargcount,
        code.co_kwonlyargcount,
        code.co_flags,
        code.co_filename,
        code.co_firstlineno,
        code.co_qualname,
    )
    h.update(repr(parts).encode())
    for c in code.co_consts:
        h.update(code_digest(c).encode() if isinstance(c, types.CodeType) else _const(c))
    return h.hexdigest()


def _const(c: Any) -> bytes:
    if isinstance(c, (tuple, frozenset)):
        inner = [_const(x) for x in c]
        return (
            f"{type(c).__name__}(".encode()
            + b",".join(sorted(inner) if isinstance(c, frozenset) else inner)
            + b")"
        )
    return f"{type(c).__name__}:{c!r}".encode()


@functools.lru_cache(maxsize=8192)
def code_names(code: types.CodeType) -> frozenset[str]:
    """The names a code object (and the code nested in it) looks up: globals, attributes."""
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= code_names(c)
    return frozenset(names)
