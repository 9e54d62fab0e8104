"""Load, launch and ahead-of-time compile generated Triton kernels.

This is the only module of functrans that imports :mod:`triton`, an optional dependency
(``pip install functrans[triton]``); it imports fine without it and raises
:class:`TritonUnavailableError` on first use. The rest of the backend renders
:class:`KernelSource` text and hands it here:

- :func:`load` writes the source to an on-disk cache keyed by its sha256 and imports it once;
- a :class:`Kernel` launches on CUDA tensors through Triton's JIT, and on CPU tensors through
  Triton's interpreter -- without ``TRITON_INTERPRET=1`` and without leaving interpreter state
  behind, so one process can interpret kernels and compile them for a GPU;
- :func:`.aot.compile_for_gpu` (built on :func:`load`) compiles to PTX and cubin for a GPU this
  machine need not have.

The interpreter's work-arounds live in :mod:`._interpreter` and the ahead-of-time compile in
:mod:`.aot`; neither imports :mod:`triton`: they are handed it from here. :mod:`.aot` imports
this module, never the other way round.

>>> KernelSource("add_kernel", "...", {"in_ptr0": "*fp32", "xnumel": "i32"}, {"XBLOCK": 128})
KernelSource(name='add_kernel', ...)
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import sys
import threading
import types
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from functrans.codegen._cache import cache_root
from functrans.extend import FunctransError

from ._arguments import argument_problem
from ._interpreter import _interpreter_scope

__all__ = [
    "ENABLE_FP_FUSION",
    "Kernel",
    "KernelError",
    "KernelSource",
    "TritonUnavailableError",
    "available",
    "cache_dir",
    "load",
]

ENABLE_FP_FUSION = True
"""Let Triton fuse ``a * b + c`` into FMA, on every GPU launch and AOT compile (Triton's
default so far; passed explicitly, which also silences Triton 3.9's warning about it)."""


class TritonUnavailableError(FunctransError, ImportError):
    """Triton is not installed; ``pip install functrans[triton]``."""


class KernelError(FunctransError):
    """Triton rejected a kernel, or a kernel was launched wrongly; ``.kernel`` names it."""

    def __init__(self, kernel: str, message: str) -> None:
        super().__init__(message)
        self.kernel = kernel


def _triton() -> Any:
    try:
        import triton
        import triton.language
        import triton.runtime.interpreter
    except ImportError as e:
        raise TritonUnavailableError(
            "running or compiling generated Triton kernels needs Triton, which is not "
            f"installed ({e}); install it with: pip install functrans[triton]"
        ) from e
    return triton


def available() -> bool:
    """Whether Triton is installed, so :func:`load` and :func:`.aot.compile_for_gpu` work.

    >>> isinstance(available(), bool)
    True
    """
    try:
        _triton()
    except TritonUnavailableError:
        return False
    return True


def cache_dir() -> Path:
    """Where :func:`load` writes kernel sources: ``$FUNCTRANS_CACHE_DIR/triton``.

    ``FUNCTRANS_CACHE_DIR`` defaults to ``~/.cache/functrans``; it is read on every call.

    >>> cache_dir().name
    'triton'
    """
    return cache_root() / "triton"


@dataclass(frozen=True)
class KernelSource:
    """One generated kernel: module text plus how to call it.

    ``source`` is a whole module (``import triton``, ``import triton.language as tl`` and a
    ``@triton.jit def name(...)``, possibly after ``@triton.jit`` helpers it calls).
    ``signature`` maps every parameter that is not ``tl.constexpr`` to its Triton type
    (``"*fp32"``, ``"*bf16"``, ``"*i1"`` for bool, ``"i32"``, ``"i64"``, ``"fp32"``...);
    ``constexprs`` gives the value of every ``tl.constexpr`` parameter.

    >>> k = KernelSource("k", "...", {"x_ptr": "*fp32"}, {"XBLOCK": 64})
    >>> k.constexprs, len(k.sha256)
    ({'XBLOCK': 64}, 64)
    """

    name: str
    source: str
    signature: Mapping[str, str]
    constexprs: Mapping[str, int] = field(default_factory=dict)

    @property
    def sha256(self) -> str:
        """The cache key: sha256 of ``source`` (hex)."""
        return hashlib.sha256(self.source.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------------------------
# Loading

# Interpreting patches triton.language globally while it runs; compiling reads it. Both run
# under this lock (re-entrant: a kernel's error handling may load another).
_LOCK = threading.RLock()


@dataclass
class _Module:
    path: Path
    jit: types.ModuleType  # functions are triton JITFunctions: GPU launch and AOT compile
    interp: types.ModuleType | None = None  # a second copy, only ever interpreted
    kernels: dict[tuple[Any, ...], Kernel] = field(default_factory=dict)


_MODULES: dict[Path, _Module] = {}


def _write_source(kernel: KernelSource, path: Path) -> None:
    """Make ``path`` hold ``kernel.source``: written only if missing or different."""
    directory = path.parent
    data = kernel.source.encode("utf-8")
    try:
        if path.read_bytes() == data:
            return
    except OSError:
        pass
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, path)  # atomic: concurrent processes never import a half-written file


@contextmanager
def _jit_mode(triton: Any) -> Iterator[None]:
    """Make ``@triton.jit`` build JITFunctions even if the user set ``TRITON_INTERPRET=1``."""
    knobs = triton.knobs.runtime
    if not knobs.interpret:
        yield
        return
    with knobs.scope():
        knobs.interpret = False
        yield


def _import(path: Path, module_name: str, kernel: KernelSource, triton: Any) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        with _jit_mode(triton):
            spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise KernelError(
            kernel.name, f"generated Triton kernel {kernel.name!r} ({path}) does not import: {e!r}"
        ) from e
    return module


def _jit_function(module: types.ModuleType, kernel: KernelSource, triton: Any) -> Any:
    fn = getattr(module, kernel.name, None)
    if not isinstance(fn, triton.runtime.JITFunction):
        raise KernelError(
            kernel.name,
            f"generated source has no @triton.jit function named {kernel.name!r} "
            f"(found {type(fn).__name__}); check KernelSource.name",
        )
    return fn


def _check_parameters(kernel: KernelSource, fn: Any) -> tuple[str, ...]:
    """The non-constexpr parameter names, in order; they must be exactly ``kernel.signature``."""
    params = inspect.signature(fn.fn).parameters
    constexpr = {p.name for p in fn.params if p.is_constexpr}
    runtime = tuple(name for name in params if name not in constexpr)
    problems = []
    if set(runtime) != set(kernel.signature):
        problems.append(
            f"non-constexpr parameters {list(runtime)} but signature has {list(kernel.signature)}"
        )
    if constexpr != set(kernel.constexprs):
        problems.append(
            f"tl.constexpr parameters {sorted(constexpr)} but constexprs has "
            f"{sorted(kernel.constexprs)}"
        )
    if problems:
        raise KernelError(kernel.name, f"kernel {kernel.name!r}: " + "; ".join(problems))
    return runtime


def load(kernel: KernelSource) -> Kernel:
    """Write ``kernel.source`` to :func:`cache_dir` (keyed by its sha256) and import it.

    The same source is written and imported once per process (per cache directory), and the
    same :class:`KernelSource` returns the same :class:`Kernel`; its parameters are checked
    against ``signature`` and ``constexprs``.

    >>> import pytest, torch
    >>> _ = available() or pytest.skip("needs triton")
    >>> src = '''
    ... import triton
    ... import triton.language as tl
    ...
    ... @triton.jit
    ... def twice(in_ptr0, out_ptr0, xnumel, XBLOCK: tl.constexpr):
    ...     x = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    ...     tl.store(out_ptr0 + x, tl.load(in_ptr0 + x, mask=x < xnumel) * 2, mask=x < xnumel)
    ... '''
    >>> sig = {"in_ptr0": "*fp32", "out_ptr0": "*fp32", "xnumel": "i32"}
    >>> kernel = load(KernelSource("twice", src, sig, {"XBLOCK": 4}))
    >>> x, out = torch.arange(6.0), torch.empty(6)
    >>> kernel((2,), x, out, 6)  # CPU tensors: Triton's interpreter
    >>> out
    tensor([ 0.,  2.,  4.,  6.,  8., 10.])
    """
    triton = _triton()
    path = cache_dir() / f"{kernel.sha256}.py"
    key = (kernel.name, tuple(kernel.signature.items()), tuple(kernel.constexprs.items()))
    with _LOCK:
        entry = _MODULES.get(path)
        if entry is None:
            _write_source(kernel, path)
            module = _import(path, f"functrans_triton_{kernel.sha256[:24]}", kernel, triton)
            entry = _MODULES[path] = _Module(path, module)
        if (loaded := entry.kernels.get(key)) is None:
            fn = _jit_function(entry.jit, kernel, triton)
            params = _check_parameters(kernel, fn)
            loaded = entry.kernels[key] = Kernel(kernel, entry, fn, params)
    return loaded


# --------------------------------------------------------------------------------------------
# Launching


class Kernel:
    """A loaded kernel: ``kernel(grid, *args)`` launches it.

    ``args`` are the non-constexpr parameters in order (tensors for pointers, Python numbers
    for scalars); ``source.constexprs`` are passed for you. CUDA tensors run the compiled
    kernel on their device; CPU tensors run Triton's interpreter (so does everything when the
    user set ``TRITON_INTERPRET=1``). Tensors' dtypes and scalars' ranges are checked against
    ``source.signature``, so a kernel that passes on CPU compiles for that signature on GPU.
    """

    def __init__(
        self, source: KernelSource, module: _Module, fn: Any, params: tuple[str, ...]
    ) -> None:
        self.source = source
        self.path = module.path
        self.jit_function = fn  # the triton JITFunction, for what this class does not cover
        self._module = module
        self._params = params
        self._types = tuple(source.signature[p] for p in params)
        self._constexprs = dict(source.constexprs)
        self._interpreted: Any = None

    def __repr__(self) -> str:
        return f"Kernel({self.source.name!r}, {self.path})"

    def __call__(self, grid: tuple[int, ...], *args: torch.Tensor | int | float) -> None:
        name = self.source.name
        if len(args) != len(self._params):
            raise KernelError(
                name, f"kernel {name!r} takes {len(self._params)} arguments {list(self._params)}, "
                f"got {len(args)}",
            )  # fmt: skip
        device: torch.device | None = None
        for param, ty, arg in zip(self._params, self._types, args, strict=True):
            if (problem := argument_problem(ty, arg)) is not None:
                raise KernelError(name, f"kernel {name!r}, parameter {param!r}: got {problem}")
            if isinstance(arg, torch.Tensor):
                if device is None:
                    device = arg.device
                elif arg.device != device:
                    raise KernelError(
                        name, f"kernel {name!r}: tensors on {device} and {arg.device} ({param!r})"
                    )
        if not 1 <= len(grid) <= 3 or any(not isinstance(g, int) or g < 0 for g in grid):
            raise KernelError(name, f"kernel {name!r}: grid must be 1-3 ints >= 0, got {grid}")
        if device is not None and device.type not in ("cpu", "cuda"):
            raise KernelError(
                name, f"kernel {name!r}: tensors on {device}; Triton kernels run on CUDA (or "
                "ROCm) tensors, or in Triton's interpreter on CPU tensors",
            )  # fmt: skip
        if 0 in grid:
            return
        triton = _triton()
        if device is not None and device.type == "cuda" and not triton.knobs.runtime.interpret:
            self._launch_gpu(tuple(grid), args, device)
        else:
            self._interpret(tuple(grid), args)

    def _launch_gpu(
        self, grid: tuple[int, ...], args: tuple[Any, ...], device: torch.device
    ) -> None:
        try:
            with _LOCK, torch.cuda.device(device):  # a first launch compiles: see _LOCK
                self.jit_function[grid](
                    *args, **self._constexprs, enable_fp_fusion=ENABLE_FP_FUSION
                )
        except FunctransError:
            raise
        except Exception as e:
            raise KernelError(
                self.source.name, f"kernel {self.source.name!r} failed on {device}: {e}"
            ) from e

    def _interpret(self, grid: tuple[int, ...], args: tuple[Any, ...]) -> None:
        triton = _triton()
        import triton.language.extra.cuda.libdevice as cuda_libdevice  # patched while interpreting
        import triton.language.extra.libdevice as libdevice

        scope = _interpreter_scope(triton, libdevice, cuda_libdevice)
        with _LOCK, scope, np.errstate(all="ignore"):
            if self._interpreted is None:
                entry = self._module
                if entry.interp is None:
                    name = f"functrans_triton_interp_{self.source.sha256[:24]}"
                    entry.interp = _import(entry.path, name, self.source, triton)
                fn = _jit_function(entry.interp, self.source, triton)
                self._interpreted = triton.runtime.interpreter.InterpretedFunction(fn.fn)
            try:
                self._interpreted[grid](*args, **self._constexprs)
            except Exception as e:
                cause = e.__cause__ if isinstance(e.__cause__, Exception) else e
                raise KernelError(
                    self.source.name,
                    f"kernel {self.source.name!r} failed in Triton's interpreter: {cause!r}",
                ) from e
