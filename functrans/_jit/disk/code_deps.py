"""What a trace ran, for the on-disk trace cache: source files and the globals user code read.

:class:`Recorder` records which code objects run while a trace runs (the frames of every
torch call, and the code they reach by name), and :func:`dependencies` turns them into what a
stored trace depends on beyond its key: the content of each source file that ran (except
torch, functrans and the standard library, whose versions key the cache) and, for user code
(outside site-packages), the value of every module global its code names
(:func:`global_digest`). Recording costs a few percent of a trace (``sys.setprofile``, which
this replaced, doubled it on CPython 3.11).

>>> import math, torch, functrans as ft
>>> def f(x):
...     return x * math.pi * SCALE
>>> SCALE = 2.0
>>> with Recorder() as r:
...     _ = ft.trace(f)(torch.ones(1))
>>> r.ok and f.__code__ in r.codes
True
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import linecache
import os
import sys
import threading
import time
import types
from dataclasses import dataclass, field
from typing import Any

from functrans._core.context import classify, library_dirs

from .fingerprint import Fingerprint, Unhashable, code_names

__all__ = [
    "Deps",
    "Recorder",
    "dependencies",
    "file_digest",
    "functrans_digest",
    "global_digest",
    "modified_since",
    "process_start",
    "source_lines",
]

_FILE_DIGESTS: dict[tuple[str, int, int, int], str] = {}


def file_digest(path: str) -> str | None:
    """sha256 of a file's content (cached per process by its stat), None if unreadable. An
    installed package's file (:func:`classify` ``"site"``) is known by its size, modification
    and change times (in nanoseconds), inode and device instead, as :func:`functrans_digest`
    knows functrans' own: stricter than Python's test for stale bytecode, and a stat where
    hashing the hundred-odd files a Hugging Face model runs cost each cold and warm start
    6-9 ms. (A cache copied to another machine misses on them: never a wrong hit.)"""
    try:
        st = os.stat(path)
        if classify(path) == "site":  # ctime: no tool sets it back; dev: the same inode
            return f"stat:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}:{st.st_dev}"
        key = (path, st.st_mtime_ns, st.st_size, st.st_ino)
        found = _FILE_DIGESTS.get(key)
        if found is None:
            with open(path, "rb") as f:
                found = hashlib.sha256(f.read()).hexdigest()
            _FILE_DIGESTS[key] = found
        return found
    except OSError:
        return None


@functools.cache
def functrans_digest() -> str:
    """sha256 over the path, size and modification time (in nanoseconds) of functrans' own
    source files (core, codegen, partitioners; C++ included): how Python itself decides that a
    module's bytecode is stale, and a few stat calls where hashing the sources cost every
    process several milliseconds. An edited file changes the digest; a fresh copy of the same
    sources does too (its entries are traced again: a miss, never a wrong hit).

    >>> len(functrans_digest())
    64
    """
    h = hashlib.sha256()
    for name, size, mtime in _source_stats():
        h.update(f"{name}:{size}:{mtime}\n".encode())
    return h.hexdigest()


def _source_stats() -> list[tuple[str, int, int]]:
    """``(path relative to functrans' folder, size, mtime in ns)`` of its source files, sorted
    (a plugin folder inside functrans' is walked once)."""
    trusted, _ = library_dirs()
    roots = [d.rstrip(os.sep) for d in trusted[1:]]
    roots = [d for d in roots if not any(d.startswith(r + os.sep) for r in roots)]
    out: list[tuple[str, int, int]] = []

    def walk(folder: str, prefix: str) -> None:
        with os.scandir(folder) as entries:
            for e in entries:
                if e.is_dir(follow_symlinks=False):
                    if e.name != "__pycache__":
                        walk(e.path, f"{prefix}{e.name}/")
                elif e.name.endswith((".py", ".cpp", ".h")):
                    st = e.stat()
                    out.append((prefix + e.name, st.st_size, st.st_mtime_ns))

    for i, root in enumerate(roots):
        walk(root, f"{i}:")
    return sorted(out)


class Recorder:
    """Records the code that runs in this thread while it is entered (with its globals), as
    :func:`dependencies` needs it; :attr:`ok` is False where nothing could be recorded.

    Two sources, neither of which slows the code it watches down much (``sys.setprofile``
    would: it puts CPython 3.11's interpreter in its tracing mode, which doubled a trace):

    - *observed*: at every torch function a traced function calls (tensor methods and
      attributes, ``torch.*`` and ``torch.nn.functional`` functions: the trace's own
      ``TorchFunctionMode`` calls the watchers bound with
      :func:`functrans._trace.trace_run.watching`),
      each frame on the stack up to the one that entered the recorder; for a method (first
      argument ``self`` or ``cls``) also the class it was called on;
    - *reached* (:attr:`static`), at exit: what that code names, followed to a fixed point: a
      global or a module attribute that is a function (its code and the code nested in it),
      a class (the functions in its and its bases' namespaces that reached code names, and
      their dunder methods; properties and static and class methods included), a bound method
      or ``functools.partial`` (what it wraps). This covers
      code that ran without calling torch (a helper that computes a size or reads a flag) and
      that no frame on a torch call's stack held, when it is reached by name.

    Code that runs without calling torch and is reached neither way (through an object's
    method in an installed package that no observed frame's class or names lead to) is not
    recorded. Torch's, functrans' and the standard library's code is not followed (their
    versions are in the key).

    >>> import torch, functrans as ft
    >>> def helper():
    ...     return 2.0
    >>> def f(x):
    ...     return x * helper()
    >>> with Recorder() as r:
    ...     _ = ft.trace(f)(torch.ones(2))
    >>> r.ok, f.__code__ in r.codes, helper.__code__ in r.static
    (True, True, True)
    """

    def __init__(self) -> None:
        self.codes: dict[types.CodeType, dict[str, Any]] = {}
        self.static: set[types.CodeType] = set()
        self.ok = False
        self._classes: list[type] = []
        self._watching: contextlib.ExitStack | None = None
        self._stack: list[types.FrameType] = []
        self._index: dict[int, int] = {}

    def __enter__(self) -> Recorder:
        from functrans._trace.trace_run import watching

        codes, classes = self.codes, self._classes
        boundary = sys._getframe(1)  # the frame that entered: it and its callers are outside
        thread = threading.get_ident()
        # The chain of frames the last call walked, outermost first, and each one's position
        # (by id: the list keeps them alive, so ids are unique). A function's frame on the
        # stack now that a call walked before has had the same callers since (they have been
        # running all along), so the walk stops there: a call costs the frames entered since
        # the last one, not the depth of the stack. A generator's or coroutine's frame is no
        # stop: it may have been resumed from elsewhere since.
        stack, index = self._stack, self._index

        def watch() -> None:
            if threading.get_ident() != thread:
                return
            frame: types.FrameType | None = sys._getframe(1)
            new: list[types.FrameType] = []
            keep = 0
            while frame is not None and frame is not boundary:
                code = frame.f_code
                at = index.get(id(frame))
                if at is not None and not code.co_flags & _SUSPENDS:
                    keep = at + 1
                    break
                if code not in codes:
                    codes[code] = frame.f_globals
                    _method_class(code, frame, classes)
                new.append(frame)
                frame = frame.f_back
            for gone in stack[keep:]:
                index.pop(id(gone), None)  # a generator's frame may be there twice
            del stack[keep:]
            for f in reversed(new):
                index[id(f)] = len(stack)
                stack.append(f)

        self._watching = contextlib.ExitStack()
        self._watching.enter_context(watching(watch))
        self.ok = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._watching is not None:
            self._watching.close()
            self._watching = None
        self._stack.clear()  # the frames (and their locals) are not kept past the trace
        self._index.clear()
        if self.ok and exc[0] is None:
            _reach(self.codes, self.static, self._classes)


#: Flags of code whose frames a caller suspends and resumes (their callers change).
_SUSPENDS = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def _method_class(code: types.CodeType, frame: types.FrameType, classes: list[type]) -> None:
    """The class a method's frame runs on (``self``'s type, or ``cls``), into ``classes``."""
    if not code.co_argcount or code.co_varnames[0] not in ("self", "cls"):
        return
    obj = frame.f_locals.get(code.co_varnames[0])
    if obj is not None:
        classes.append(obj if isinstance(obj, type) else type(obj))


def _reach(
    codes: dict[types.CodeType, dict[str, Any]], static: set[types.CodeType], classes: list[type]
) -> None:
    """Add to ``codes`` (and ``static``) the code that ``codes`` and ``classes`` reach by name
    (see :class:`Recorder`), to a fixed point. Every function of a user class is followed (it
    may run without its name in any code: ``forward`` called by ``Module.__call__``, a method
    picked with ``getattr(self, "_scale_" + kind)``, and the globals it reads are
    dependencies). An installed package's class is followed by name: its functions whose
    names some code that ran or was reached uses (torch's own code included: it calls
    ``forward``), and its dunder methods (called without their name: ``len(x)``, ``x[i]``); a
    function waits until its name turns up. Following every function of such classes reached
    about 3,900 code objects in 195 files of a Hugging Face model (30 ms of each cold start),
    nearly all methods of ``PreTrainedModel`` and its mixins that nothing names; their files
    are dependencies by their stat only (their globals are not recorded)."""
    work: list[tuple[types.CodeType, dict[str, Any]]] = list(codes.items())
    seen: set[int] = set()
    named: set[str] = set()  # the names of the code reached so far
    waiting: dict[str, list[Any]] = {}  # class functions whose name no code has used yet
    function, method, partial = types.FunctionType, types.MethodType, functools.partial

    def add(code: types.CodeType, glb: dict[str, Any]) -> None:
        if code not in codes:
            codes[code] = glb
            static.add(code)
            work.append((code, glb))

    def visit(value: Any, names: frozenset[str], depth: int = 0) -> None:
        if depth > 8 or id(value) in seen:
            return
        kind = type(value)
        if kind is function:
            seen.add(id(value))
            code = value.__code__
            if classify(code.co_filename) != "trusted":
                add(code, value.__globals__)
                wrapped = value.__dict__.get("__wrapped__")
                if wrapped is not None:
                    visit(wrapped, names, depth + 1)
        elif kind is method:
            visit(value.__func__, names, depth + 1)
        elif kind is partial or isinstance(value, partial):
            visit(value.func, names, depth + 1)
        elif isinstance(value, type):
            seen.add(id(value))
            for c in value.__mro__:
                whose = _module_kind(c.__module__)
                if whose == "trusted":
                    continue
                for name, attr in list(vars(c).items()):
                    fs = _functions_of(attr)
                    if not fs:
                        continue
                    every = whose != "site" or name in named
                    if every or (name.startswith("__") and name.endswith("__")):
                        for f in fs:
                            visit(f, names, depth + 1)
                    else:
                        waiting.setdefault(name, []).extend(fs)
        elif isinstance(value, types.ModuleType):
            if classify(getattr(value, "__file__", None) or "") == "trusted":
                return
            attrs = vars(value)
            for name in names:
                if name in attrs:
                    visit(attrs[name], names, depth + 1)

    for c in classes:
        visit(c, frozenset())
    while work:
        code, glb = work.pop()
        names = _code_names(code)
        for name in names - named:  # torch's code too: Module.__call__ calls forward by name
            named.add(name)
            for f in waiting.pop(name, ()):
                visit(f, names)
        if classify(code.co_filename) == "trusted":
            continue
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                add(c, glb)
        for name in names:
            if name in glb:
                visit(glb[name], names)


@functools.lru_cache(maxsize=65536)
def _code_names(code: types.CodeType) -> frozenset[str]:
    """:func:`code_names`, once per code object (its names never change)."""
    return code_names(code)


def _module_kind(name: str) -> str:
    """:func:`classify` of the file of module ``name`` (imported)."""
    module = sys.modules.get(name)
    return classify(getattr(module, "__file__", None) or "")


_HOLDERS = (staticmethod, classmethod, property, functools.cached_property)


def _functions_of(attr: Any) -> list[Any]:
    """The functions a class attribute holds (a method, property, static or class method)."""
    if isinstance(attr, (staticmethod, classmethod)):
        return [attr.__func__]
    if isinstance(attr, property):
        return [f for f in (attr.fget, attr.fset, attr.fdel) if f is not None]
    if isinstance(attr, functools.cached_property):
        return [attr.func]
    if isinstance(attr, types.FunctionType):
        return [attr]
    return []


@dataclass
class Deps:
    """What a stored trace depends on beyond its key: file contents and global values."""

    files: dict[str, str] = field(default_factory=dict)  # path -> sha256
    lines: dict[str, str] = field(default_factory=dict)  # linecache name -> sha256
    globals: dict[tuple[str, str], str] = field(default_factory=dict)  # (module, name) -> hash

    def to_json(self) -> dict[str, Any]:
        return {
            "files": self.files,
            "lines": self.lines,
            "globals": [[m, n, d] for (m, n), d in sorted(self.globals.items())],
        }


def dependencies(recorder: Recorder, walked: set[types.CodeType], since: float) -> Deps:
    """The :class:`Deps` of a trace that ran the code ``recorder`` saw. Raises
    :class:`Unhashable` where they cannot be recorded soundly: a source file that cannot be
    read, or changed after ``since`` (the code that ran may not be what the file holds now),
    user code with closure cells the key did not hash (``walked``) and that the trace did not
    make, globals that cannot be hashed."""
    deps = Deps()
    kinds: dict[str, str | None] = {}  # per file: its kind, None where it adds nothing
    nested: set[types.CodeType] | None = None
    for code, glb in recorder.codes.items():
        filename = code.co_filename
        kind = kinds.get(filename, "")
        if kind == "":
            kind = kinds[filename] = _file_deps(filename, since, deps)
        if kind != "user":
            continue
        if nested is None:  # code made by code that ran (a lambda, a nested function)
            nested = {
                c for ran in recorder.codes for c in ran.co_consts if isinstance(c, types.CodeType)
            }
        # code reached by name: its cells are in the hash of the global that reached it
        static = code in recorder.static
        if code.co_freevars and code not in walked and code not in nested and not static:
            raise Unhashable(
                f"{code.co_qualname} ({filename}) reads closure cells of unknown origin"
            )
        by_name = _BY_NAME.intersection(code.co_names)
        if by_name:  # values looked up by a string at run time: not in the key
            raise Unhashable(
                f"{code.co_qualname} ({filename}) looks values up at run time "
                f"({', '.join(sorted(by_name))})"
            )
        _globals(code, glb, deps)
    return deps


#: Names whose use in user code that ran means it reads values the key cannot see: globals or
#: modules by a string (``globals()["V"]``, ``importlib.import_module(name).X``), the command
#: line and the environment (a value from them may differ in the next process).
_BY_NAME = frozenset(
    {"globals", "vars", "eval", "exec", "import_module", "__import__", "argv", "environ", "getenv"}
)


def _file_deps(filename: str, since: float, deps: Deps) -> str | None:
    """Record in ``deps`` the source of code from ``filename`` (its content's hash, or the
    lines linecache holds); its kind (:func:`classify`, a notebook cell's ``"user"``), None
    where its code adds nothing (trusted, or compiled from a string while tracing)."""
    kind = classify(filename)
    if kind == "trusted":
        return None
    digest = None if kind == "unknown" else file_digest(filename)
    if digest is not None:
        if modified_since(filename, since):
            raise Unhashable(f"{filename} changed after this process started")
        deps.files[filename] = digest
        return kind
    lines = source_lines(filename)
    if lines is not None:  # a notebook cell, code typed at the prompt
        deps.lines[filename] = lines
        return "user"
    if filename.startswith("<"):
        # compiled from a string while tracing (torch.fx's generated code, dataclass and
        # namedtuple methods, torch's module templates): what the code that compiled it
        # (recorded in turn) made it
        return None
    raise Unhashable(f"{filename} (which ran while tracing) cannot be read")


def source_lines(name: str) -> str | None:
    """sha256 of the source linecache holds for ``name`` (IPython registers its cells)."""
    entry = linecache.cache.get(name)
    if entry is None or len(entry) < 3 or not isinstance(entry[2], list):
        return None
    return hashlib.sha256("".join(entry[2]).encode()).hexdigest()


def _globals(code: types.CodeType, glb: dict[str, Any], deps: Deps) -> None:
    module = glb.get("__name__")
    if not isinstance(module, str) or getattr(sys.modules.get(module), "__dict__", None) is not glb:
        raise Unhashable(f"{code.co_qualname} runs with globals of no importable module")
    names = code.co_names
    for name in names:
        if name in glb:
            _global(module, name, glb[name], names, deps)


def _global(module: str, name: str, value: Any, names: tuple[str, ...], deps: Deps) -> None:
    if (module, name) in deps.globals:
        return
    deps.globals[(module, name)] = global_digest(value)
    is_user = classify(getattr(value, "__file__", None) or "") == "user"
    if isinstance(value, types.ModuleType) and is_user:  # `helpers.SCALE`: SCALE too
        attrs = vars(value)
        for attr in names:
            if attr in attrs:
                _global(value.__name__, attr, attrs[attr], names, deps)


def global_digest(value: Any) -> str:
    """The hash of a global's value as :class:`Deps` records it (a module by its name: the
    attributes code reads from it are recorded one by one)."""
    if isinstance(value, types.ModuleType):
        return f"module:{value.__name__}"
    return Fingerprint().digest(value)


def modified_since(path: str, since: float) -> bool:
    """Whether ``path`` was modified at or after ``since`` (or cannot be read)."""
    try:
        return os.stat(path).st_mtime >= since
    except OSError:
        return True


def process_start() -> float:
    """When this process started, in seconds since the epoch: from ``/proc`` (rounded down),
    or two seconds before this module was first imported where ``/proc`` cannot say."""
    return _START


def _process_start() -> float:
    now = time.time()
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return min(now, boot + ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, StopIteration):
        return now - 2.0


_START = _process_start()
