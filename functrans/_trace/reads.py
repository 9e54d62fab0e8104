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

The parts live beside this module, which holds the :class:`Recorder` and the variable that
names the running one (:func:`current`): what a read is and what it gives now
(:mod:`~functrans._trace.read_records`), whose code and which objects count
(:mod:`~functrans._trace.read_scope`), the hooks on classes
(:mod:`~functrans._trace.class_hooks`), the recording copies of dicts
(:mod:`~functrans._trace.dict_views`) and the snapshots of contents
(:mod:`~functrans._trace.snapshots`).

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

import functools
import logging
import types
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from torch.fx._lazy_graph_module import _LazyGraphModule

from .class_hooks import class_attrs, hook, unhook
from .dict_views import WHOLE, DictView, original
from .read_records import NOTHING, How, Read, Source, StandsFor, Step, is_atom, read_now, resolve
from .read_scope import (
    MODULE_INTERNALS,
    TORCH_DIR,
    can_record,
    code_reads,
    library_object,
    machinery,
    role_of,
    user_class,
)
from .session import Slot, SlotToken
from .snapshots import snapshot

#: what this module holds (Recorder, current, follow, not_reading), and what regions/ (keys,
#: finding, functions) reads here, which imports it from this module
__all__ = [
    "NOTHING",
    "How",
    "Read",
    "Recorder",
    "Source",
    "StandsFor",
    "code_reads",
    "current",
    "follow",
    "not_reading",
    "read_now",
    "snapshot",
]

#: :func:`~functrans._trace.read_scope.role_of`, by the name ``regions/functions`` imports
_role = role_of


# -- the trace's recorder --------------------------------------------------------------------

#: the recorder of the running trace (None: no reads are recorded)
_CURRENT: Slot[Recorder | None] = Slot("reads", None)
#: what :meth:`Recorder._chain` and :func:`_swap_back` find where nothing is
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


#: objects a trace reads that are not state its values depend on: the ``logging`` tree
#: (a module's ``_log = logging.getLogger(__name__)``), which every library changes as it
#: goes (guarded, a torchtune attention's ``_log`` read whole recompiled every call)
_LOGGING = (logging.Filterer, logging.Manager, logging.PlaceHolder)


# -- the recorder -----------------------------------------------------------------------------

_SEQUENCES = (list, tuple, set, frozenset)


def _user_callable(value: Any) -> bool:
    """Whether ``value`` is a function (a bound method, a ``functools.partial``) whose code is
    not functrans' or torch's machinery: a transform's own closures (``ft.grad``'s wrappers)
    hold the user's function, which the trace runs, so its reads count whoever holds it."""
    fn = value
    if issubclass(type(fn), functools.partial):
        fn = fn.func
    if issubclass(type(fn), types.MethodType):
        fn = fn.__func__
    return issubclass(type(fn), types.FunctionType) and not machinery(fn.__code__)


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
        self._token: SlotToken[Recorder | None] | None = None

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
        for put, view, before in reversed(self._slots):
            put((view, before))
        self._slots.clear()
        for cls in reversed(self._hooked):
            unhook(cls)
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
        if can_record(cls) and self._hook(cls):
            self.known[id(obj)] = source
            self._keep.append(obj)
            self._classes_of(cls, source)
            return
        attrs = getattr(obj, "__dict__", None)
        if issubclass(type(attrs), dict) and not library_object(cls):
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
        if not hook(cls, _CURRENT.get):
            return False
        self._hooked.append(cls)
        return True

    def _classes_of(self, cls: type, source: Source) -> None:
        """The user classes an object of ``cls`` (reached at ``source``) is an instance of."""
        of_type = source.then(("type", None), cls.__qualname__)
        for i, klass in enumerate(cls.__mro__):
            if user_class(klass):
                self._class(klass, of_type.then(("mro", i), klass.__qualname__))

    def _class(self, cls: type, source: Source) -> None:
        """A user class: its own attributes, as a whole; its functions' code."""
        if id(cls) in self._learned or not user_class(cls):
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
        role = role_of(code.co_filename)
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
            elif user or _user_callable(value):  # a transform's closure holds the user's f
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
                module_user = role_of(getattr(obj, "__file__", None) or "") == "user"
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
            if name == "__dict__" and not code.co_filename.startswith(TORCH_DIR):
                source = self.known[id(obj)]
                self._record(obj, How.CONTENT, None, snapshot(value, self, source), source)
            return value
        if (id(obj), name) in self._written:
            return value
        if issubclass(type(obj), torch.nn.Module) and name in MODULE_INTERNALS:
            return value
        source = self.known[id(obj)]
        how, guarded = resolve(obj, name, value)
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
        if machinery(code) or (id(view), key) in self._written:
            return value
        if not issubclass(type(value), torch.Tensor):
            self._record(view._original, How.ITEM, key, value, view._source)
        return self.learn(value, view._source.then(("item", key), f"{view._source.name}[{key!r}]"))

    def no_item(self, view: DictView, key: Any, code: types.CodeType) -> None:
        if not machinery(code) and (id(view), key) not in self._written:
            self._record(view._original, How.NO_ITEM, key, None, view._source)

    def content_of_view(self, view: DictView, code: types.CodeType) -> None:
        if machinery(code) or id(view) in self._content:
            return
        self._content.add(id(view))
        source = view._source
        self._record(
            view._original, How.CONTENT, None, snapshot(view._original, self, source), source
        )

    def wrote_item(self, view: DictView, key: Any) -> None:
        if key is WHOLE:
            self._content.add(id(view))  # rewritten whole: its content is the trace's own
            self._written.update((id(view), k) for k in dict.keys(view))
        else:
            self._written.add((id(view), key))

    def _record(self, holder: Any, how: How, key: Any, value: Any, where: Source) -> None:
        self.reads.append(Read(holder, how, key, value, where))

    def add(self, reads: Iterable[Read]) -> None:
        """Reads made elsewhere (a region reused for another block, a trace read from disk)."""
        self.reads.extend(reads)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


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
