"""Where the running code comes from: library or user frames, and whether a trace is running.

Errors point at the user's line, the disk cache hashes the user's code, and transforms switch
to graph mode while a trace runs; all of them ask the questions answered here.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import os
import sys
import sysconfig
import traceback
from collections.abc import Callable

import optree
import torch

__all__ = [
    "LIBRARY_DIRS",
    "classify",
    "culprit",
    "functorch_active",
    "is_tracing",
    "library_dirs",
    "runs_as_written",
    "user_frame",
    "user_line",
    "user_stacklevel",
]

#: The folder of the functrans package (its plugins included, as they live inside it).
FUNCTRANS_DIR = os.path.dirname(sys.modules[__name__.partition(".")[0]].__file__ or "") + os.sep

#: Frames from these folders are the library's own, not the user's.
LIBRARY_DIRS = (
    *(os.path.dirname(m.__file__ or "") + os.sep for m in (torch, optree, contextlib)),
    FUNCTRANS_DIR,
)

_TRACING: contextvars.ContextVar[bool] = contextvars.ContextVar("functrans_tracing", default=False)


def is_tracing() -> bool:
    """True while functrans traces a function (transforms like ``remat`` switch to graph mode).

    >>> is_tracing()
    False
    """
    return _TRACING.get()


#: Whether a torch.func transform (``vmap``, ``grad``, ``jvp``...) runs around the caller:
#: torch's own check, bound once, as jit asks it on every call.
functorch_active: Callable[[], bool] = torch._C._are_functorch_transforms_active


def runs_as_written() -> bool:
    """Whether a functrans transform should run its function as written, so the transforms
    around it see the ops: under a torch.func transform (it must see every op) or inside a
    functrans trace (the outer graph records them, as a nested ``jax.jit`` inlines).

    >>> runs_as_written()
    False
    """
    return functorch_active() or _TRACING.get()


def user_frame(exc: BaseException, *, cells: bool = False) -> traceback.FrameSummary | None:
    """The innermost traceback frame of user code (not torch, optree, functrans); code from no
    file (``<string>``) counts only with ``cells`` (notebook cells, doctests), never frozen
    modules.

    >>> try:
    ...     raise ValueError("x")
    ... except ValueError as e:
    ...     user_frame(e) is None, user_frame(e, cells=True) is not None
    (True, True)
    """
    skip = (*LIBRARY_DIRS, "<frozen") if cells else (*LIBRARY_DIRS, "<")
    frames = [
        fr for fr in traceback.extract_tb(exc.__traceback__) if not fr.filename.startswith(skip)
    ]
    return frames[-1] if frames else None


def user_line(exc: BaseException, *, cells: bool = False) -> str:
    """Where :func:`user_frame` is, for an error message: `` at file:line: `code` ``, or empty.

    >>> try:
    ...     raise ValueError("x")
    ... except ValueError as e:
    ...     user_line(e), user_line(e, cells=True).startswith(" at <doctest")
    ('', True)
    """
    fr = user_frame(exc, cells=cells)
    return f" at {fr.filename}:{fr.lineno}: `{(fr.line or '').strip()}`" if fr else ""


def culprit(exc: BaseException) -> str:
    """Which ATen op needed a tensor's value, as `` (`aten.equal.default`, called by torch.cov
    in the backward pass)``; empty when the traceback does not say.

    >>> culprit(ValueError("no traceback"))
    ''
    """
    op = getattr(exc, "func", None)
    api, backward = None, False
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        backward = backward or frame.f_code.co_name == "_engine_run_backward"
        func = frame.f_locals.get("func") if frame.f_code.co_name.startswith("__torch_") else None
        if isinstance(func, torch._ops.OpOverload):
            op = op or func
        elif func is not None and not backward:
            api = api or getattr(func, "__name__", None)
        tb = tb.tb_next
    parts = [f"`{op}`"] if op is not None else []
    parts += [f"called by torch.{api}"] if api and not backward else []
    parts += ["in the backward pass"] if backward else []
    return f" ({', '.join(parts)})" if parts else ""


# -- which code is whose ----------------------------------------------------------------------


def library_dirs() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(trusted dirs: torch, functrans, the standard library; site dirs).

    >>> FUNCTRANS_DIR in library_dirs()[0]
    True
    """
    trusted = [os.path.dirname(torch.__file__)]
    for name in ("functrans", "functrans.codegen", "functrans.partitioners"):
        spec = importlib.util.find_spec(name)
        trusted.extend(spec.submodule_search_locations or () if spec else ())
    paths = sysconfig.get_paths()
    stdlib = [paths["stdlib"], paths["platstdlib"]]
    return tuple(os.path.join(d, "") for d in trusted), tuple(os.path.join(d, "") for d in stdlib)


_TRUSTED: tuple[tuple[str, ...], tuple[str, ...]] | None = None
_SITE_PARTS = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")


@functools.lru_cache(maxsize=16384)
def classify(filename: str) -> str:
    """Whose code a file holds: ``"trusted"`` (torch, functrans, the standard library: their
    versions key the cache), ``"site"`` (installed packages: known by their stat), ``"user"``
    (hashed, and the globals its code reads are recorded), or ``"unknown"`` (code from no
    file).

    >>> classify(torch.__file__), classify(__file__), classify("/home/me/train.py")
    ('trusted', 'trusted', 'user')
    """
    global _TRUSTED
    if not filename or filename.startswith("<"):
        return "unknown"
    if _TRUSTED is None:
        _TRUSTED = library_dirs()
    trusted, stdlib = _TRUSTED
    path = os.path.abspath(filename)
    if path.startswith(trusted):
        return "trusted"
    if any(part in path for part in _SITE_PARTS):
        return "site"
    if path.startswith(stdlib):
        return "trusted"
    return "user"


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a :func:`warnings.warn` issued by the caller name the
    innermost frame outside torch, functrans and the standard library: the user's line, however
    deep in functrans the warning is decided.

    >>> def warns():
    ...     return user_stacklevel()
    >>> warns()  # warns() is itself outside functrans: level 1 names its own line
    1
    """
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and classify(frame.f_code.co_filename) == "trusted":
        frame = frame.f_back
        level += 1
    return level
