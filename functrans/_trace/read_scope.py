"""Which reads a trace records: whose code reads, what code loads, which objects record.

:class:`~functrans._trace.reads.Recorder` records the reads the traced function makes, not
those of functrans' own code or torch's machinery (:func:`role_of` of the file the reading code
lives in); it follows user code through the globals and closures it loads (:func:`code_reads`)
and installed packages' code one level; and it hooks the classes whose instances may hold state
(:func:`can_record`), guarding user classes' own attributes whole (:func:`user_class`).

>>> role_of(torch.__file__), role_of(__file__)
('machinery', 'machinery')
"""

from __future__ import annotations

import contextlib
import dis
import enum
import functools
import os
import sys
import types
import weakref
from collections.abc import Callable
from typing import TypeVar

import torch

from functrans._core.context import FUNCTRANS_DIR, classify

__all__ = [
    "MODULE_INTERNALS",
    "TORCH_DIR",
    "can_record",
    "code_reads",
    "library_object",
    "machinery",
    "role_of",
    "user_class",
]

TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TORCH_NN = os.path.join(TORCH_DIR, "nn", "")
_OPTREE_DIR = os.path.dirname(sys.modules["optree"].__file__ or "") + os.sep


@functools.lru_cache(maxsize=8192)
def role_of(filename: str) -> str:
    """``"machinery"`` (functrans, torch's tracing and dispatch: their reads are not the
    function's), ``"library"`` (``torch.nn``, installed packages, the standard library: read,
    followed one level) or ``"user"`` (followed through what it names)."""
    if filename.startswith((FUNCTRANS_DIR, _OPTREE_DIR)):
        return "machinery"
    if filename.startswith(TORCH_DIR):
        return "library" if filename.startswith(_TORCH_NN) else "machinery"
    kind = classify(filename)
    return "user" if kind in ("user", "unknown") else "library"


def machinery(code: types.CodeType) -> bool:
    return role_of(code.co_filename) == "machinery"


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
def can_record(cls: type) -> bool:
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
def user_class(cls: type) -> bool:
    """A class defined in user code (its attributes are guarded as a whole)."""
    module = sys.modules.get(str(getattr(cls, "__module__", "") or ""))
    filename = getattr(module, "__file__", None) or ""
    if not filename:
        return str(getattr(cls, "__module__", "")) in ("__main__",) or not module
    return role_of(filename) == "user"


#: names whose reads say nothing about a trace: nn.Module's own bookkeeping (its ``training``
#: flag and hooks are guarded by module flags; its tables are read through ``__getattr__``)
MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__) | {
    "_compiled_call_impl",
    "_call_impl",
    "_wrapped_call_impl",
    "_slow_forward",
}


def library_object(cls: type) -> bool:
    top = str(getattr(cls, "__module__", "") or "").partition(".")[0]
    return top in _NOT_STATE_PACKAGES
