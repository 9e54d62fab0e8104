"""Plugin discovery: registries that fill themselves on first use.

A :class:`PluginRegistry` is a :class:`~functrans.extend.Registry` that, the first time it is
asked for something (a lookup, a listing, a membership test), imports

1. the built-in plugins: every public module (name not starting with ``_``) of its package, found
   with :mod:`pkgutil`, each of which registers itself (``register(...)`` at its bottom); this
   works from a source checkout and needs no hand-kept list;
2. the installed plugins: the entry points of its group (``functrans.partitioners``,
   ``functrans.backends``). An entry point names either a module, which registers what it
   provides when imported, or an object, which is registered under the entry point's name.

Importing the package imports no plugin. A plugin that fails to load does not break the others:
discovery warns (:class:`PluginWarning`) naming the entry point, and looking its name up raises
:class:`PluginError` with the cause.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import pkgutil
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterable
from enum import Enum
from typing import TypeVar

from .errors import FunctransError
from .name_registry import Registry

__all__ = ["PluginError", "PluginRegistry", "PluginWarning"]

T = TypeVar("T")

#: How a registry registers an object an entry point names: ``adopt(name, obj)``; raises a
#: :class:`FunctransError` (naming what is accepted) for an object it cannot take.
Adopt = Callable[[str, object], object]


class _State(Enum):
    NEW = "new"  # nothing discovered yet
    LOADING = "loading"  # discovering (plugins' own register calls land here)
    LOADED = "loaded"


class PluginError(FunctransError):
    """An installed plugin that could not be loaded or registered; the message names its entry
    point (group, name, target and distribution) and the cause.

    >>> from functrans.extend import PluginError, FunctransError
    >>> issubclass(PluginError, FunctransError)
    True
    """


class PluginWarning(UserWarning):
    """Issued once, when a registry is first used, for each plugin that failed to load.

    >>> from functrans.extend import PluginWarning
    >>> issubclass(PluginWarning, UserWarning)
    True
    """


def describe_entry_point(ep: importlib.metadata.EntryPoint) -> str:
    """``entry point 'name = target' in group 'group' of distribution 'dist'``.

    >>> from importlib.metadata import EntryPoint
    >>> describe_entry_point(EntryPoint("mine", "my_pkg:strategy", "functrans.partitioners"))
    "entry point 'mine = my_pkg:strategy' in group 'functrans.partitioners'"
    """
    dist = getattr(ep, "dist", None)
    where = f" of distribution {dist.name!r}" if dist is not None else ""
    return f"entry point '{ep.name} = {ep.value}' in group {ep.group!r}{where}"


class PluginRegistry(Registry[T]):
    """A :class:`Registry` that loads its package's public modules and its entry point group's
    plugins the first time it is used (see :mod:`functrans._core.plugins`).

    >>> from functrans.extend import PluginRegistry
    >>> numbers: PluginRegistry[int] = PluginRegistry(
    ...     "number", package="json", group="example.numbers", adopt=lambda name, obj: obj
    ... )
    >>> numbers.register("one", 1)  # registering does not discover
    1
    >>> numbers.names()  # the first lookup does: json's public modules, no entry points
    ['one']
    """

    def __init__(
        self,
        kind: str,
        *,
        package: str,
        group: str,
        adopt: Adopt,
        key: Callable[[T], object] = lambda obj: obj,
    ) -> None:
        super().__init__(kind)
        self.package = package
        self.group = group
        self._adopt = adopt
        self._key = key  # registering an object with the same key again is not a clash
        self._broken: dict[str, PluginError] = {}
        self._state = _State.NEW
        self._lock = threading.RLock()

    def register(
        self, name: str, obj: T, *, aliases: Iterable[str] = (), replace: bool = False
    ) -> T:
        """Register ``obj`` as ``name`` and ``aliases``; a name taken by another object needs
        ``replace=True``. Registering does not discover (built-in modules register while they
        are imported): what is registered before the first lookup takes precedence over what
        discovery then finds, which is skipped with a :class:`PluginWarning`."""
        aliases = tuple(aliases)
        taken = [k for k in (name, *aliases) if self._clashes(k, obj)]
        if taken and not replace and self._state is _State.LOADING:
            self._warn(
                f"{self.kind} {name!r} found by discovery is not registered: {taken} already "
                "registered before discovery ran (that registration takes precedence)"
            )
            return obj
        self._broken.pop(name, None)
        return super().register(name, obj, aliases=aliases, replace=replace or not taken)

    def _clashes(self, name: str, obj: T) -> bool:
        """Whether ``name`` holds another object than ``obj`` (without discovering)."""
        return super().__contains__(name) and self._key(super().get(name)) is not self._key(obj)

    # every lookup discovers first --------------------------------------------------------------

    def get(self, name: str) -> T:
        """The object registered as ``name``; a plugin that failed to load raises its
        :class:`PluginError`, an unknown name lists the registered ones."""
        self.discover()
        if name in self._broken and not super().__contains__(name):
            raise self._broken[name]
        return super().get(name)

    def names(self, *, aliases: bool = False) -> list[str]:
        """Registered names (plugins that failed to load are left out), sorted."""
        self.discover()
        return super().names(aliases=aliases)

    def __contains__(self, name: object) -> bool:
        self.discover()
        return super().__contains__(name)

    def broken(self) -> dict[str, PluginError]:
        """Plugins that failed to load, by entry point name, with their errors."""
        self.discover()
        return dict(self._broken)

    # discovery ----------------------------------------------------------------------------------

    def discover(self) -> None:
        """Load the built-in modules and the entry points, once (later calls return at once;
        calls made while loading, such as a plugin's own ``register``, do not recurse)."""
        if self._state is _State.LOADED:
            return
        with self._lock:
            if self._state is not _State.NEW:
                return
            self._state = _State.LOADING
            try:
                self._load_builtins()
                for ep in _entry_points(self.group):
                    self._load_entry_point(ep)
            except BaseException:
                self._state = _State.NEW
                raise
            self._state = _State.LOADED

    def _load_builtins(self) -> None:
        package = sys.modules.get(self.package) or importlib.import_module(self.package)
        for info in pkgutil.iter_modules(getattr(package, "__path__", [])):
            if not info.name.startswith("_"):
                importlib.import_module(f"{self.package}.{info.name}")

    def _load_entry_point(self, ep: importlib.metadata.EntryPoint) -> None:
        where = describe_entry_point(ep)
        if super().__contains__(ep.name):
            self._warn(
                f"{self.kind} plugin {ep.name!r} ({where}) is ignored: {ep.name!r} is "
                "already registered (by functrans or an earlier plugin)"
            )
            return
        try:
            obj = ep.load()
            if not isinstance(obj, types.ModuleType):  # a module registered itself on import
                self._adopt(ep.name, obj)
        except Exception as e:
            error = PluginError(
                f"the {self.kind} plugin {ep.name!r} ({where}) could not be loaded: "
                f"{type(e).__name__}: {e}. Fix or uninstall the distribution that provides it."
            )
            error.__cause__ = e
            self._broken[ep.name] = error
            self._warn(str(error))

    def _warn(self, message: str) -> None:
        # stacklevel: the caller of partitioners.names(), codegen.get_backend() and the like
        warnings.warn(message, PluginWarning, stacklevel=5)


def _entry_points(group: str) -> list[importlib.metadata.EntryPoint]:
    """The group's entry points, each (name, target) once even if found on two path entries."""
    seen: set[tuple[str, str]] = set()
    out = []
    for ep in importlib.metadata.entry_points(group=group):
        if (ep.name, ep.value) not in seen:
            seen.add((ep.name, ep.value))
            out.append(ep)
    return sorted(out, key=lambda ep: ep.name)
