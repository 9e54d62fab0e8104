"""What a trace reads from outside its arguments, recorded while it runs: the source of guards.

A compiled entry may be reused only where eager would compute the same thing, so whatever the
traced code reads besides its arguments must be guarded. Listing kinds of state (configs,
closures, class attributes, patched functions...) does not converge; here the reads themselves
are recorded while the trace runs (:class:`Recorder`), each as one :class:`Read`:

- **attributes** of the objects the function reaches (modules, configs, namespaces, plain
  objects of user classes): for the length of the trace the classes of those objects answer
  attribute reads through a recording ``__getattribute__`` installed on the class and removed
  after (the objects keep their type). A read says where the value came from (:class:`How`):
  the instance's ``__dict__`` (``model.config.output_hidden_states``), the class (a method, a
  class constant ``self.K``; a patched ``m.forward`` shows up as that name appearing in the
  instance's ``__dict__``), a module's parameter, buffer or submodule tables, anything else
  ``getattr`` answers (slots, ``__getattr__``), or nothing (a ``hasattr`` that was False);
- **items** of dicts: a dict the traced code reaches is replaced, where it is held (a closure
  cell, a module global) or where it is read from (an attribute, an item), by a recording copy
  for the trace (writes go through to the original), so ``cfg["mult"]`` is one read;
- **contents**: lists, tuples and sets, objects whose class cannot record (a
  ``types.SimpleNamespace``) and an object's ``__dict__`` read whole (``vars(cfg)``) are read as
  a whole: their content is compared, item by item (objects by identity);
- **globals and closure cells** of the code that runs: the names its bytecode loads as globals
  (and attribute chains on imported modules: ``F.gelu``, ``torch.sigmoid``,
  ``helpers.CFG``), and the cells it closes over. User code is followed through the functions
  and classes it names; an installed package's (or ``torch.nn``'s) code only one level: the
  globals of the functions user code or a recorded read reached (a forward);
- **user classes**: the attributes of a user class whose instances were read, as a whole
  (``type(self).K`` reads the class, which no instance read sees).

Tensors are never guarded by value: ``jit`` lifts the tensors a trace uses to graph inputs.
Reads made by functrans' own code and torch's machinery (tracing, dispatch, pytrees) are not
the function's and are not recorded; a value the traced code wrote before reading it is its
own, not state. Every holder remembers how it was reached from the root (:class:`Source`), so
a read can be named (``model.config.output_hidden_states``) and found again.

>>> import torch
>>> cfg = {"mult": 2.0, "unused": 1}
>>> def f(x):
...     return x * cfg["mult"]
>>> with Recorder(f) as rec:
...     _ = f(torch.ones(1))
>>> [(r.where.name, r.how.name, r.key, r.value) for r in rec.reads if r.how is How.ITEM]
[('cfg', 'ITEM', 'mult', 2.0)]
>>> type(cfg) is dict
True
"""

from __future__ import annotations

import contextlib
import contextvars
import dis
import enum
import functools
import logging
import os
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
from torch.fx._lazy_graph_module import _LazyGraphModule

from functrans._core import marks
from functrans._core.context import FUNCTRANS_DIR, classify

__all__ = [
    "ATOMS",
    "NOTHING",
    "How",
    "Read",
    "Recorder",
    "Source",
    "StandsFor",
    "Step",
    "class_attrs",
    "content_of",
    "current",
    "follow",
    "is_atom",
    "not_reading",
    "original",
    "read_now",
    "snapshot",
    "table_of",
]

#: One step of a :class:`Source`'s path: ``(kind, key)``, kinds the rows of :data:`_FOLLOW`.
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


#: objects a trace reads that are not state its values depend on: the ``logging`` tree
#: (a module's ``_log = logging.getLogger(__name__)``), which every library changes as it
#: goes (guarded, a torchtune attention's ``_log`` read whole recompiled every call)
_LOGGING = (logging.Filterer, logging.Manager, logging.PlaceHolder)


def is_atom(v: Any) -> bool:
    """Whether ``v`` is plain data compared by value (tuples and frozensets of atoms too)."""
    if issubclass(type(v), ATOMS):
        return True
    if type(v) in (tuple, frozenset, torch.Size):
        return all(is_atom(x) for x in v)
    return False


# -- following paths -------------------------------------------------------------------------

_FOLLOW: dict[str, Callable[[Any, Any], Any]] = {
    "attr": getattr,
    "item": lambda c, k: dict.__getitem__(c, k) if issubclass(type(c), DictView) else c[k],
    "closure": lambda f, i: f.__closure__[i],
    "contents": lambda cell, _: cell.cell_contents,
    "globals": lambda f, _: f.__globals__,
    "vars": lambda m, _: vars(m),
    "self": lambda m, _: m.__self__,
    "func": lambda m, _: m.__func__ if issubclass(type(m), types.MethodType) else m.func,
    "type": lambda o, _: type(o),
    "mro": lambda c, i: c.__mro__[i],
    "fget": lambda p, _: p.fget,
    "default": lambda f, i: f.__defaults__[i],
    "kwdefault": lambda f, k: f.__kwdefaults__[k],
}


def follow(root: Any, path: Iterable[Step]) -> Any:
    """The object ``path`` leads to from ``root`` (raises where it leads nowhere now)."""
    obj = root
    with not_reading():
        for kind, key in path:
            obj = original(_FOLLOW[kind](obj, key))
    return obj


# -- whose code reads ------------------------------------------------------------------------

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TORCH_NN = os.path.join(_TORCH_DIR, "nn", "")
_OPTREE_DIR = os.path.dirname(sys.modules["optree"].__file__ or "") + os.sep


@functools.lru_cache(maxsize=8192)
def _role(filename: str) -> str:
    """``"machinery"`` (functrans, torch's tracing and dispatch: their reads are not the
    function's), ``"library"`` (``torch.nn``, installed packages, the standard library: read,
    followed one level) or ``"user"`` (followed through what it names)."""
    if filename.startswith((FUNCTRANS_DIR, _OPTREE_DIR)):
        return "machinery"
    if filename.startswith(_TORCH_DIR):
        return "library" if filename.startswith(_TORCH_NN) else "machinery"
    kind = classify(filename)
    return "user" if kind in ("user", "unknown") else "library"


def _machinery(code: types.CodeType) -> bool:
    return _role(code.co_filename) == "machinery"


def _not_traced_code(frame: types.FrameType) -> bool:
    """Whether the read ``frame`` makes is functrans' or torch's machinery's own: code of
    theirs, or library code they called directly (``m.modules()`` from a region's key)."""
    role = _role(frame.f_code.co_filename)
    if role == "library":
        back = frame.f_back
        while back is not None and back.f_code in _HOOK_CODES:  # a property our hook ran
            back = back.f_back
        return back is not None and _role(back.f_code.co_filename) == "machinery"
    return role == "machinery"


_LOADS = {
    "LOAD_GLOBAL": "global",
    "LOAD_NAME": "global",
    "LOAD_DEREF": "cell",
    "LOAD_CLASSDEREF": "cell",
}


@functools.lru_cache(maxsize=8192)
def code_reads(code: types.CodeType) -> tuple[tuple[str, ...], tuple[tuple[str, ...], ...]]:
    """The global names ``code`` (and the code nested in it) loads, and the attribute chains
    it reads off globals and closure variables (``("F", "gelu")``, ``("helpers", "CFG")``;
    a chain off a closure variable starts with ``"<cell>"``).

    >>> def f(x):
    ...     return torch.nn.functional.gelu(x) * K
    >>> code_reads(f.__code__)
    (('torch', 'K'), (('torch', 'nn', 'functional', 'gelu'),))
    """
    names: dict[str, None] = {}
    chains: dict[tuple[str, ...], None] = {}
    ins = list(dis.get_instructions(code))
    for i, op in enumerate(ins):
        kind = _LOADS.get(op.opname)
        if kind is None:
            continue
        if kind == "global":
            names[op.argval] = None
        chain = [op.argval] if kind == "global" else ["<cell>", op.argval]
        for nxt in ins[i + 1 :]:
            if nxt.opname not in ("LOAD_ATTR", "LOAD_METHOD"):
                break
            chain.append(nxt.argval)
        if len(chain) > (1 if kind == "global" else 2):
            chains[tuple(chain)] = None
    for const in code.co_consts:
        if issubclass(type(const), types.CodeType):
            more_names, more_chains = code_reads(const)
            names.update(dict.fromkeys(more_names))
            chains.update(dict.fromkeys(more_chains))
    return tuple(names), tuple(chains)


# -- which objects record --------------------------------------------------------------------

_IMMUTABLE_TYPE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE: a static (C) type: its slots are fixed
_NOT_STATE = (
    torch.Tensor,
    type,
    types.ModuleType,
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    functools.partial,
    property,
    staticmethod,
    classmethod,
    types.CodeType,
    enum.Enum,
)
# packages whose objects are not model state (functrans' own, torch's machinery, numerics)
_NOT_STATE_PACKAGES = frozenset({"functrans", "torch", "optree", "sympy", "numpy", "triton"})
# standard-library classes that are configuration holders
_STDLIB_STATE = frozenset({"argparse"})


_R = TypeVar("_R")


def _per_class(f: Callable[[type], _R]) -> Callable[[type], _R]:
    """``f`` computed once per class, held weakly (fx makes a class per ``GraphModule``)."""
    memo: weakref.WeakKeyDictionary[type, _R] = weakref.WeakKeyDictionary()

    def cached(cls: type) -> _R:
        try:
            return memo[cls]
        except (KeyError, TypeError):  # TypeError: a class whose == or hash is its own
            value = f(cls)
            with contextlib.suppress(TypeError):
                memo[cls] = value
            return value

    return functools.wraps(f)(cached)


@_per_class
def _records(cls: type) -> bool:
    """Whether instances of ``cls`` can record their attribute reads (the class can take a
    recording ``__getattribute__``) and may hold state a trace reads: modules, and objects of
    user and installed packages' classes."""
    if cls.__flags__ & _IMMUTABLE_TYPE or issubclass(cls, _NOT_STATE):
        return False
    if issubclass(cls, torch.nn.Module):
        return True
    if issubclass(cls, (dict, list, tuple, set, frozenset, BaseException)):
        return False
    top = str(getattr(cls, "__module__", "") or "").partition(".")[0]
    if top in _NOT_STATE_PACKAGES:
        return False
    return top not in sys.stdlib_module_names or top in _STDLIB_STATE


@_per_class
def _user_class(cls: type) -> bool:
    """A class defined in user code (its attributes are guarded as a whole)."""
    module = sys.modules.get(str(getattr(cls, "__module__", "") or ""))
    filename = getattr(module, "__file__", None) or ""
    if not filename:
        return str(getattr(cls, "__module__", "")) in ("__main__",) or not module
    return _role(filename) == "user"


#: names whose reads say nothing about a trace: nn.Module's own bookkeeping (its ``training``
#: flag and hooks are guarded by module flags; its tables are read through ``__getattr__``)
_MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__) | {
    "_compiled_call_impl",
    "_call_impl",
    "_wrapped_call_impl",
    "_slow_forward",
}


# -- the recording hooks on classes -----------------------------------------------------------

_CURRENT: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar(
    "functrans_reads", default=None
)
_LOCK = threading.Lock()
#: class -> (number of recorders that need its hooks, the attributes it had before)
_PATCHED: dict[type, tuple[int, dict[str, Any]]] = {}
_HOOKED = ("__getattribute__", "__getattr__", "__setattr__", "__delattr__")
_ABSENT = object()


def current() -> Recorder | None:
    """The recorder of the trace running in this thread (None: no reads are recorded).

    >>> current() is None
    True
    """
    return _CURRENT.get()


def not_reading() -> Any:
    """A context in which reads are not recorded (functrans' bookkeeping inside a trace)."""
    return _Suspend()


class _Suspend:
    def __enter__(self) -> None:
        self._token = _CURRENT.set(None)

    def __exit__(self, *exc: object) -> None:
        _CURRENT.reset(self._token)


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
#: hooked object for it), and nn.Module's own bookkeeping (see :data:`_MODULE_INTERNALS`)
_PASSES = frozenset({"__class__"})
_MODULE_PASSES = _PASSES | _MODULE_INTERNALS


def _hooks(cls: type) -> dict[str, Any]:
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
        rec = _CURRENT.get()
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
            rec = _CURRENT.get()
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
        rec = _CURRENT.get()
        if rec is not None and id(self) in rec.known and not _not_traced_code(sys._getframe(1)):
            rec.wrote(self, name)
        set_(self, name, value)

    def __delattr__(self: Any, name: str) -> None:
        rec = _CURRENT.get()
        if rec is not None and id(self) in rec.known and not _not_traced_code(sys._getframe(1)):
            rec.wrote(self, name)
        delete(self, name)

    hooks["__setattr__"] = __setattr__
    hooks["__delattr__"] = __delattr__
    return hooks


#: the code of the hooks themselves (a property getter a hook runs is called from one)
_HOOK_CODES = frozenset(fn.__code__ for fn in _hooks(torch.nn.Module).values())


def _hook(cls: type) -> bool:
    """Install the recording hooks on ``cls`` (or count one more user); False where the class
    refuses them."""
    with _LOCK:
        found = _PATCHED.get(cls)
        if found is not None:
            _PATCHED[cls] = (found[0] + 1, found[1])
            return True
        before = {name: cls.__dict__.get(name, _ABSENT) for name in _HOOKED}
        hooks = _hooks(cls)
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


def _unhook(cls: type) -> None:
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


# -- recording dict copies --------------------------------------------------------------------


class DictView(dict):  # type: ignore[type-arg]  # any keys and values, as the original's
    """A recording copy of a dict, put where the dict is held for the length of a trace:
    item reads are recorded, reading it whole (iteration, ``len``, ``keys()``...) records its
    content, and writes go through to the original."""

    __slots__ = ("_original", "_rec", "_source")

    def __init__(self, original: dict[Any, Any], rec: Recorder, source: Source) -> None:
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
    def _wrote(self, key: Any = _ABSENT) -> None:
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


# -- the recorder -----------------------------------------------------------------------------

_SEQUENCES = (list, tuple, set, frozenset)


class Recorder:
    """Records what code run while it is entered reads from what ``root`` reaches (see the
    module docstring); :attr:`reads` in the order they happened. ``name``: how messages name
    the root (``""``: by the names of what it holds).

    Entering it learns the root: its closure cells, the globals its code loads, and for a
    module or object, that object (a module's whole tree of submodules at once: a
    ``ModuleList`` is iterated without attribute reads). Objects, dicts and code met later
    through recorded reads are learned when they are met, before the code that met them uses
    them."""

    def __init__(self, root: Any, name: str = "", also: Iterable[tuple[Any, str]] = ()) -> None:
        """``also``: more objects the traced code reads, with their names (the values of
        static arguments: no path from the root leads to them)."""
        self.root, self._root_name = root, name
        self._also = tuple(also)
        self.reads: list[Read] = []
        #: id -> source of every object whose attribute reads are recorded
        self.known: dict[int, Source] = {}
        self._keep: list[Any] = []  # what known ids stand for stays alive meanwhile
        self._hooked: list[type] = []
        self._views: dict[int, DictView] = {}  # by the original dict's id
        self._slots: list[tuple[Callable[[Any], None], Any, Any]] = []  # (set, view, original)
        self._learned: set[int] = set()  # functions and classes whose reads are recorded
        self._content: set[int] = set()  # holders whose content is recorded
        self._written: set[tuple[int, Any]] = set()  # (holder id, key) the trace wrote
        self._token: contextvars.Token[Recorder | None] | None = None

    # -- entering and leaving

    def __enter__(self) -> Recorder:
        self._token = _CURRENT.set(self)
        try:
            self.learn(self.root, Source((), self._root_name))
            for obj, name in self._also:
                self.learn(obj, Source(None, name))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for put, view, original in reversed(self._slots):
            put((view, original))
        self._slots.clear()
        for cls in reversed(self._hooked):
            _unhook(cls)
        self._hooked.clear()
        if self._token is not None:
            _CURRENT.reset(self._token)
            self._token = None

    def mark(self) -> int:
        """A position in :attr:`reads` (see :meth:`since`)."""
        return len(self.reads)

    def since(self, mark: int) -> list[Read]:
        """The reads recorded after ``mark``."""
        return self.reads[mark:]

    def source_of(self, obj: Any) -> Source | None:
        """How a learned object was reached (None: not learned)."""
        found = self.known.get(id(obj))
        if found is not None:
            return found
        view = self._views.get(id(obj))
        return view._source if view is not None else None

    # -- learning what is reached

    def learn(self, obj: Any, source: Source) -> Any:
        """Record what reads of ``obj`` (reached at ``source``) see from now on; the value the
        reader should get (a recording copy for a dict)."""
        if issubclass(type(obj), torch.Tensor) or is_atom(obj):
            return obj
        if issubclass(type(obj), (DictView, *_LOGGING)):
            return obj
        if type(obj) is dict:
            return self._view(obj, source)
        if issubclass(type(obj), (*_SEQUENCES, np.ndarray)):
            self._sequence(obj, source)
            return obj
        if issubclass(type(obj), types.FunctionType):
            self._function(obj, source)
        elif issubclass(type(obj), types.MethodType):
            self.learn(obj.__self__, source.then(("self", None), source.name.rpartition(".")[0]))
            self.learn(obj.__func__, source.then(("func", None), source.name))
        elif issubclass(type(obj), functools.partial):
            self.learn(obj.func, source.then(("func", None), source.name))
        elif issubclass(type(obj), type):
            self._class(obj, source)
        elif issubclass(type(obj), types.ModuleType):
            pass  # its attributes are read through the chains the code names
        elif issubclass(type(obj), torch.nn.Module):
            self._module_tree(obj, source)
        else:
            self._object(obj, source)
            wrapped = getattr(obj, "__wrapped__", None)  # functools.lru_cache, a decorator's
            if issubclass(type(wrapped), types.FunctionType):
                self.learn(wrapped, source.then(("attr", "__wrapped__"), source.name))
        return obj

    def _object(self, obj: Any, source: Source) -> None:
        if id(obj) in self.known or id(obj) in self._content:
            return
        cls = type(obj)
        if _records(cls) and self._hook(cls):
            self.known[id(obj)] = source
            self._keep.append(obj)
            self._classes_of(cls, source)
            return
        attrs = getattr(obj, "__dict__", None)
        if issubclass(type(attrs), dict) and not _library_object(cls):
            # an object that cannot record (a SimpleNamespace): its attributes, as a whole
            self._content.add(id(obj))
            self._record(obj, How.CONTENT, None, snapshot(attrs, self, source), source)

    def _module_tree(self, module: torch.nn.Module, source: Source) -> None:
        if id(module) in self.known:
            return
        stack: list[tuple[torch.nn.Module, Source]] = [(module, source)]
        while stack:
            m, where = stack.pop()
            if id(m) in self.known:
                continue
            if isinstance(m, _LazyGraphModule):  # its first call writes its forward: now
                m.real_recompile()
            if not self._hook(type(m)):
                continue
            self.known[id(m)] = where
            self._keep.append(m)
            self._classes_of(type(m), where)
            for key, child in m._modules.items():
                if child is not None:
                    stack.append((child, where.then(("attr", key), _join(where.name, key))))

    def _hook(self, cls: type) -> bool:
        if cls in self._hooked:
            return True
        if not _hook(cls):
            return False
        self._hooked.append(cls)
        return True

    def _classes_of(self, cls: type, source: Source) -> None:
        """The user classes an object of ``cls`` (reached at ``source``) is an instance of."""
        of_type = source.then(("type", None), cls.__qualname__)
        for i, klass in enumerate(cls.__mro__):
            if _user_class(klass):
                self._class(klass, of_type.then(("mro", i), klass.__qualname__))

    def _class(self, cls: type, source: Source) -> None:
        """A user class: its own attributes, as a whole; its functions' code."""
        if id(cls) in self._learned or not _user_class(cls):
            return
        self._learned.add(id(cls))
        self._keep.append(cls)
        own = class_attrs(cls)
        self._record(cls, How.CLASS_DICT, None, snapshot(own, self, source), source)
        for key, value in own.items():
            where = source.then(("attr", key), f"{source.name}.{key}")
            if issubclass(type(value), property) and value.fget is not None:
                self.learn(value.fget, where.then(("fget", None), where.name))
            elif issubclass(type(value), classmethod):
                self.learn(value.__func__, where.then(("func", None), where.name))
            elif issubclass(type(value), (types.FunctionType, staticmethod)):
                self.learn(getattr(cls, key), where)

    def _function(self, fn: types.FunctionType, source: Source) -> None:
        """The cells ``fn`` closes over and the globals its code loads (see the module
        docstring for how far code is followed)."""
        if id(fn) in self._learned:
            return
        self._learned.add(id(fn))
        self._keep.append(fn)
        code = fn.__code__
        role = _role(code.co_filename)
        root = source.path == ()
        user = role == "user" or root  # the root's closure is followed, whoever wrote it
        for i, var in enumerate(code.co_freevars):
            cell = (fn.__closure__ or ())[i]
            try:
                value = cell.cell_contents
            except ValueError:  # not bound yet
                continue
            where = source.then(("closure", i), var)
            if not issubclass(type(value), torch.Tensor):
                self._record(cell, How.CELL, None, original(value), where)
            if issubclass(type(value), types.ModuleType):  # ``helpers.SCALE``, helpers a closure's
                self._cell_chains(code, var, value, where.then(("contents", None), var), user)
            elif user:
                self._slot_learn(value, where.then(("contents", None), var), _cell_put(cell))
        if role == "machinery":
            return
        if user:  # its code and defaults, swapped wholesale (``f.__code__ = g.__code__``)
            self._record(fn, How.COMPUTED, "__code__", code, source)
            self._record(fn, How.COMPUTED, "__defaults__", fn.__defaults__, source)
            self._defaults(fn, source)
        names, chains = code_reads(code)
        namespace = fn.__globals__
        ns_name = "" if root else str(namespace.get("__name__", ""))
        ns_source = source.then(("globals", None), ns_name)
        for name in names:
            if name not in namespace:
                self._record(namespace, How.NO_GLOBAL, name, None, ns_source)
                continue
            value = namespace[name]
            if issubclass(type(value), (torch.Tensor, types.ModuleType)):
                continue  # tensors: inputs; modules: through the chains
            self._record(namespace, How.GLOBAL, name, original(value), ns_source)
            if user:
                where = ns_source.then(("item", name), _join(ns_name, name))
                self._slot_learn(value, where, _item_put(namespace, name))
        for chain in chains:
            if chain[0] != "<cell>":
                self._chain(namespace, chain, ns_source, user)

    def _defaults(self, fn: types.FunctionType, source: Source) -> None:
        """A user function's default values: a default dict is read through a recording
        copy put in its place (``def f(x, cfg=CFG)``)."""
        defaults = fn.__defaults__ or ()
        learned = tuple(
            self.learn(value, source.then(("default", i), f"{source.name}(default {i})"))
            for i, value in enumerate(defaults)
        )
        if any(a is not b for a, b in zip(learned, defaults, strict=True)):
            fn.__defaults__ = learned  # the very tuple it had is put back after
            self._slots.append((_defaults_back(fn), learned, defaults))
        kwdefaults = fn.__kwdefaults__ or {}
        for key, value in kwdefaults.items():
            where = source.then(("kwdefault", key), f"{source.name}(default {key})")
            self._slot_learn(value, where, _item_put(kwdefaults, key))

    def _cell_chains(
        self, code: types.CodeType, var: str, module: Any, source: Source, user: bool
    ) -> None:
        """The attribute chains ``code`` reads off the closure variable ``var`` (a module)."""
        for chain in code_reads(code)[1]:
            if chain[:2] == ("<cell>", var):
                self._chain({var: module}, chain[1:], source, user, held=True)

    def _chain(
        self,
        namespace: dict[str, Any],
        chain: tuple[str, ...],
        source: Source,
        user: bool,
        held: bool = False,
    ) -> None:
        """``mod.a.b`` read through a global module ``mod`` (``held``: the module is the
        value ``source`` leads to, a closure's): each attribute read off a module."""
        obj = namespace.get(chain[0], _ABSENT)
        step = ("item", chain[0])
        where = source if held else source.then(step, _join(source.name, chain[0]))
        for attr in chain[1:]:
            if not issubclass(type(obj), types.ModuleType):
                return
            attrs = vars(obj)
            mod_source = where.then(("vars", None), where.name)
            if attr not in attrs:
                self._record(attrs, How.NO_GLOBAL, attr, None, mod_source)
                return
            value = attrs[attr]
            where = mod_source.then(("item", attr), _join(where.name, attr))
            if issubclass(type(value), torch.Tensor):
                return
            if not issubclass(type(value), types.ModuleType):
                self._record(attrs, How.GLOBAL, attr, original(value), mod_source)
                module_user = _role(getattr(obj, "__file__", None) or "") == "user"
                if user and module_user:
                    self._slot_learn(value, where, _item_put(attrs, attr))
            obj = value

    def _slot_learn(self, value: Any, source: Source, put: Callable[[Any], None]) -> None:
        """Learn ``value``, held in a slot ``put`` writes: a dict is replaced there by its
        recording copy until the recorder exits."""
        learned = self.learn(value, source)
        if learned is not value:
            put(learned)
            self._slots.append((_swap_back(put), learned, value))

    def _view(self, d: dict[Any, Any], source: Source) -> DictView:
        found = self._views.get(id(d))
        if found is None:
            found = self._views[id(d)] = DictView(d, self, source)
            self._keep.append(d)
        return found

    def _sequence(self, seq: Any, source: Source) -> None:
        """A list, tuple or set: its content, and whatever objects it holds."""
        if id(seq) in self._content:
            return
        self._content.add(id(seq))
        self._keep.append(seq)
        self._record(seq, How.CONTENT, None, snapshot(seq, self, source), source)

    # -- what the hooks and views report

    def attribute(self, obj: Any, name: str, value: Any, code: types.CodeType) -> Any:
        """``obj.<name>`` was read by ``code`` and gave ``value``; what the reader gets."""
        if name.startswith("__") and name.endswith("__"):
            if name == "__dict__" and not code.co_filename.startswith(_TORCH_DIR):
                source = self.known[id(obj)]
                self._record(obj, How.CONTENT, None, snapshot(value, self, source), source)
            return value
        if (id(obj), name) in self._written:
            return value
        if issubclass(type(obj), torch.nn.Module) and name in _MODULE_INTERNALS:
            return value
        source = self.known[id(obj)]
        how, guarded = _resolve(obj, name, value)
        if how is not None and not issubclass(type(guarded), torch.Tensor):
            self._record(obj, how, name, guarded, source)
        if how is How.CLASS and issubclass(type(guarded), property):
            if guarded.fget is not None:  # its reads are recorded; its result is derived
                prop = source.then(("type", None), type(obj).__qualname__).then(
                    ("attr", name), _join(source.name, name)
                )
                self.learn(guarded.fget, prop.then(("fget", None), prop.name))
            return value
        return self.learn(value, source.then(("attr", name), _join(source.name, name)))

    def missing(self, obj: Any, name: str) -> None:
        """``getattr(obj, name)`` raised AttributeError (``hasattr`` was False)."""
        if name.startswith("__") or (id(obj), name) in self._written:
            return
        self._record(obj, How.MISSING, name, None, self.known[id(obj)])

    def wrote(self, obj: Any, name: str) -> None:
        """The traced code set or deleted ``obj.<name>``: later reads of it are its own."""
        self._written.add((id(obj), name))

    def item(self, view: DictView, key: Any, value: Any, code: types.CodeType) -> Any:
        if _machinery(code) or (id(view), key) in self._written:
            return value
        if not issubclass(type(value), torch.Tensor):
            self._record(view._original, How.ITEM, key, value, view._source)
        return self.learn(value, view._source.then(("item", key), f"{view._source.name}[{key!r}]"))

    def no_item(self, view: DictView, key: Any, code: types.CodeType) -> None:
        if not _machinery(code) and (id(view), key) not in self._written:
            self._record(view._original, How.NO_ITEM, key, None, view._source)

    def content_of_view(self, view: DictView, code: types.CodeType) -> None:
        if _machinery(code) or id(view) in self._content:
            return
        self._content.add(id(view))
        source = view._source
        self._record(
            view._original, How.CONTENT, None, snapshot(view._original, self, source), source
        )

    def wrote_item(self, view: DictView, key: Any) -> None:
        if key is _ABSENT:
            self._content.add(id(view))  # rewritten whole: its content is the trace's own
            self._written.update((id(view), k) for k in dict.keys(view))
        else:
            self._written.add((id(view), key))

    def _record(self, holder: Any, how: How, key: Any, value: Any, where: Source) -> None:
        self.reads.append(Read(holder, how, key, value, where))

    def add(self, reads: Iterable[Read]) -> None:
        """Reads made elsewhere (a region reused for another block, a trace read from disk)."""
        self.reads.extend(reads)


def original(value: Any) -> Any:
    """``value``, or the dict a recording copy stands for."""
    return value._original if issubclass(type(value), DictView) else value


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _library_object(cls: type) -> bool:
    top = str(getattr(cls, "__module__", "") or "").partition(".")[0]
    return top in _NOT_STATE_PACKAGES


def _cell_put(cell: Any) -> Callable[[Any], None]:
    def put(value: Any) -> None:
        cell.cell_contents = value

    put.cell = cell  # type: ignore[attr-defined]  # read back by _swap_back
    return put


def _item_put(namespace: dict[str, Any], key: str) -> Callable[[Any], None]:
    def put(value: Any) -> None:
        namespace[key] = value

    put.slot = (namespace, key)  # type: ignore[attr-defined]  # read back by _swap_back
    return put


def _defaults_back(fn: types.FunctionType) -> Callable[[tuple[Any, Any]], None]:
    """Put ``fn``'s own defaults tuple back, unless the traced code replaced it meanwhile."""

    def back(pair: tuple[Any, Any]) -> None:
        learned, original = pair
        if fn.__defaults__ is learned:
            fn.__defaults__ = original

    return back


def _swap_back(put: Callable[[Any], None]) -> Callable[[tuple[Any, Any]], None]:
    """Put the original back where ``put`` wrote its copy, unless the traced code rebound
    that slot meanwhile (``nonlocal cfg; cfg = {...}``: its value stands)."""
    cell = getattr(put, "cell", None)

    def back(pair: tuple[Any, Any]) -> None:
        view, original = pair
        if cell is not None:
            try:
                now = cell.cell_contents
            except ValueError:
                return
        else:
            holder, key = put.slot  # type: ignore[attr-defined]  # set by _item_put
            now = holder.get(key, _ABSENT)
        if now is view:
            put(original)

    return back


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


def _class_lookup(cls: type, name: str) -> Any:
    for klass in cls.__mro__:
        found = klass.__dict__.get(name, _ABSENT)
        if found is not _ABSENT:
            return found
    return _ABSENT


_TABLES = ("_parameters", "_buffers", "_modules")


@dataclass(frozen=True)
class StandsFor:
    """The record on a function functrans installs on a class while a trace runs: the
    function it replaces, what reads of it record."""

    original: Any


def _resolve(obj: Any, name: str, value: Any) -> tuple[How | None, Any]:
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


# -- snapshots of contents -------------------------------------------------------------------


class Same:
    """Stands for an object in a snapshot: equal to that very object only."""

    __slots__ = ("obj",)
    __array_ufunc__ = None  # numpy arrays defer to this __eq__
    __hash__ = None  # type: ignore[assignment]  # compared, never hashed

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return other is self.obj

    def __ne__(self, other: object) -> bool:
        return other is not self.obj

    def __repr__(self) -> str:
        return f"<the same {type(self.obj).__qualname__}>"


class AnyTensor:
    """Stands for a tensor in a snapshot: equal to any tensor (tensors are graph inputs)."""

    __slots__ = ()
    __hash__ = None  # type: ignore[assignment]  # compared, never hashed

    def __eq__(self, other: object) -> bool:
        return issubclass(type(other), torch.Tensor)

    def __ne__(self, other: object) -> bool:
        return not issubclass(type(other), torch.Tensor)

    def __repr__(self) -> str:
        return "<a tensor>"


ANY_TENSOR = AnyTensor()


class ArrayValue:
    """Stands for a numpy array in a snapshot: equal to an array of the same dtype, shape and
    values (a copy: the original may be changed in place)."""

    __slots__ = ("array",)
    __array_ufunc__ = None  # numpy defers to this __eq__
    __hash__ = None  # type: ignore[assignment]  # compared, never hashed

    def __init__(self, array: Any) -> None:
        self.array = np.array(array, copy=True)

    def __eq__(self, other: object) -> bool:
        a = self.array
        if not issubclass(type(other), np.ndarray):
            return False
        b: Any = other
        same_nan = a.dtype.kind in "fc"
        return bool(b.dtype == a.dtype and b.shape == a.shape and np.array_equal(b, a, same_nan))

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __repr__(self) -> str:
        return f"<an array {self.array.dtype}{list(self.array.shape)}>"


#: numpy arrays up to this size are compared by value (larger ones: by identity)
_ARRAY_BYTES = 1 << 16


def snapshot(value: Any, rec: Recorder | None = None, source: Source | None = None) -> Any:
    """A copy of ``value`` that compares equal (``snapshot == value``, the snapshot on the
    left) to a value with the same content: plain data by value, containers item by item,
    tensors as any tensor and other objects by identity. With ``rec``, the objects met are
    learned (their own reads are recorded).

    >>> cfg = {"dims": [2, 3], "act": "gelu"}
    >>> s = snapshot(cfg)
    >>> s == cfg, s == {"dims": [2, 4], "act": "gelu"}
    (True, False)
    """
    if issubclass(type(value), torch.Tensor):
        return ANY_TENSOR
    if is_atom(value):
        return value
    if issubclass(type(value), np.ndarray) and value.nbytes <= _ARRAY_BYTES:
        return ArrayValue(value)
    if type(value) is dict or issubclass(type(value), DictView):
        items = dict.items(value)
        return {k: snapshot(v, rec, _at(source, "item", k)) for k, v in items}
    if type(value) in (list, tuple):
        return type(value)(snapshot(v, rec, _at(source, "item", i)) for i, v in enumerate(value))
    if rec is not None and source is not None:
        rec.learn(value, source)
    return Same(value)


def _at(source: Source | None, kind: str, key: Any) -> Source | None:
    if source is None:
        return None
    label = f"{source.name}[{key!r}]"
    return source.then((kind, key), label)
