"""Load, launch and ahead-of-time compile generated Triton kernels.

This is the only module of functrans that imports :mod:`triton`, an optional dependency
(``pip install functrans[triton]``); it imports fine without it and raises
:class:`TritonUnavailableError` on first use. The rest of the backend renders
:class:`KernelSource` text and hands it here:

- :func:`load` writes the source to an on-disk cache keyed by its sha256 and imports it once;
- a :class:`Kernel` launches on CUDA tensors through Triton's JIT, and on CPU tensors through
  Triton's interpreter -- without ``TRITON_INTERPRET=1`` and without leaving interpreter state
  behind, so one process can interpret kernels and compile them for a GPU;
- :func:`compile_for_gpu` compiles to PTX and cubin for a GPU this machine need not have.

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

from functrans._errors import FunctransError

__all__ = [
    "ENABLE_FP_FUSION",
    "CompiledArtifact",
    "Kernel",
    "KernelError",
    "KernelSource",
    "TritonUnavailableError",
    "available",
    "cache_dir",
    "compile_for_gpu",
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
    """Whether Triton is installed, so :func:`load` and :func:`compile_for_gpu` can work.

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
    root = os.environ.get("FUNCTRANS_CACHE_DIR")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "functrans"
    return base / "triton"


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


@dataclass(frozen=True)
class CompiledArtifact:
    """What :func:`compile_for_gpu` produced for ``target`` (``(backend, arch, warp_size)``).

    ``cubin`` is None when ptxas could not be found (or ``cubin=False`` asked for PTX only);
    ``cubin_missing_reason`` then says why.
    ``shared_bytes`` is the static shared memory the kernel needs.
    """

    name: str
    target: tuple[str, int, int]
    ptx: str
    cubin: bytes | None
    shared_bytes: int
    num_warps: int
    cubin_missing_reason: str | None = None


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

_TORCH_TO_TRITON = {
    torch.bool: "i1",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.int16: "i16",
    torch.uint16: "u16",
    torch.int32: "i32",
    torch.uint32: "u32",
    torch.int64: "i64",
    torch.uint64: "u64",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e5m2: "fp8e5",
}
_INT_RANGES = {
    "i1": (0, 1),
    "u1": (0, 1),
    "i8": (-(2**7), 2**7 - 1),
    "u8": (0, 2**8 - 1),
    "i16": (-(2**15), 2**15 - 1),
    "u16": (0, 2**16 - 1),
    "i32": (-(2**31), 2**31 - 1),
    "u32": (0, 2**32 - 1),
    "i64": (-(2**63), 2**63 - 1),
    "u64": (0, 2**64 - 1),
}


def _argument_problem(ty: str, arg: object) -> str | None:
    """Why ``arg`` cannot be passed for a parameter of Triton type ``ty`` (None: it can)."""
    if isinstance(arg, torch.Tensor):
        have = "*" + _TORCH_TO_TRITON.get(arg.dtype, str(arg.dtype))
        if ty in (have, "*u1" if have == "*i1" else have):
            return None
        return f"a {arg.dtype} tensor for a {ty!r} parameter"
    if ty.startswith("*"):
        return f"{type(arg).__name__} for a pointer parameter {ty!r}; pass a tensor"
    if ty in _INT_RANGES:
        lo, hi = _INT_RANGES[ty]
        if isinstance(arg, int) and lo <= arg <= hi:
            return None
        return f"{arg!r} for a {ty!r} parameter (an int in [{lo}, {hi}])"
    if ty.startswith(("fp", "bf")):
        return None if isinstance(arg, (int, float)) else f"{arg!r} for a {ty!r} parameter"
    return None


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
            if (problem := _argument_problem(ty, arg)) is not None:
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
        with _LOCK, _interpreter_scope(triton), np.errstate(all="ignore"):
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


_INTERPRETED: dict[int, tuple[Any, Any]] = {}  # id(JITFunction) -> (it, its InterpretedFunction)
_MISSING = object()


@contextmanager
def _interpreter_scope(triton: Any) -> Iterator[None]:
    """Let the interpreter run without ``TRITON_INTERPRET=1``, and undo what it leaves behind.

    Without that variable, ``@triton.jit`` helpers -- including ``tl.sigmoid``, ``tl.softmax``,
    ``tl.zeros``, ``tl.cdiv`` from Triton's standard library -- are JITFunctions, which refuse
    to be called; here calling one interprets it. Triton's interpreter patches
    ``triton.language`` for each nested call without restoring it (3.9); the snapshot taken
    here puts every patched attribute back, so later GPU compiles see the real language.
    And bfloat16 is computed by value (:func:`_bf16_by_value`), libdevice functions by numpy
    (:func:`_libdevice_by_numpy`).
    """
    tl = triton.language
    interpreter = triton.runtime.interpreter
    jit_cls = triton.runtime.JITFunction

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        hit = _INTERPRETED.get(id(self))
        if hit is None or hit[0] is not self:
            hit = _INTERPRETED[id(self)] = (self, interpreter.InterpretedFunction(self.fn))
        return hit[1](*args, **kwargs)

    import triton.language.extra.cuda.libdevice as cuda_libdevice
    import triton.language.extra.libdevice as libdevice

    modules: list[Any] = [tl, tl.core, tl.math, libdevice, cuda_libdevice]
    builder, reduce_scan = interpreter.InterpreterBuilder, interpreter.ReduceScanOpInterface
    classes: list[Any] = [tl.tensor, tl.core.tensor_descriptor_base, tl.condition, tl.dtype]
    classes += [builder, reduce_scan, jit_cls]
    saved = [(obj, dict(vars(obj))) for obj in modules + classes]
    try:
        jit_cls.__call__ = call
        _bf16_by_value(triton)
        _libdevice_by_numpy(triton, libdevice, cuda_libdevice)
        yield
    finally:
        for obj, before in saved:
            now = vars(obj)
            if not isinstance(obj, type):
                # a module: put back what was there; keep names the interpreter added (its
                # rewritten functions find their helpers there).
                now.update(before)
                continue
            if now == before:  # the usual case for triton.language's classes: a C-level check
                continue
            for key, value in before.items():
                if now.get(key, _MISSING) is not value:
                    setattr(obj, key, value)
            for key in [k for k in now if k not in before]:
                delattr(obj, key)


def _bf16_by_value(triton: Any) -> None:
    """Make Triton 3.9's interpreter compute bfloat16 by value, the way a GPU does.

    The interpreter keeps bfloat16 as raw ``uint16`` bits and (a documented limitation) runs
    arithmetic, comparisons and reductions on the bits; its fp32 -> bf16 conversion truncates
    where GPUs round to nearest even, and fp64 <-> bf16 casts the bits as integers. Here
    bf16 operands are widened to fp32 (exact), the op runs in fp32 and a bf16 result is rounded
    to nearest even once -- what ``cvt.rn.bf16.f32`` does on the GPU for element-wise ops.
    """
    tl = triton.language
    interpreter = triton.runtime.interpreter
    handle_cls = interpreter.TensorHandle
    builder, reduce_scan = interpreter.InterpreterBuilder, interpreter.ReduceScanOpInterface
    bf16, fp32 = tl.bfloat16, tl.float32

    def widen(h: Any) -> Any:
        bits = np.array(h.data, dtype=np.uint16).astype(np.uint32) << 16  # keeps 0-d shapes
        return handle_cls(bits.view(np.float32), fp32)

    def narrow(data: Any) -> Any:
        values = torch.from_numpy(np.array(data, dtype=np.float64))  # f32 -> f64 is exact
        return values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)

    def by_value(method: Any) -> Any:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            handles = [a for a in args if isinstance(a, handle_cls)]
            if not any(h.dtype.scalar == bf16 for h in handles):
                return method(self, *args, **kwargs)
            native_fp32 = any(h.dtype.scalar == fp32 for h in handles)
            wide = [widen(a) if isinstance(a, handle_cls) and a.dtype.scalar == bf16 else a
                    for a in args]  # fmt: skip
            out = method(self, *wide, **kwargs)
            if native_fp32 or out.dtype.scalar != fp32:
                return out
            data = narrow(out.data) if out.data.dtype == np.float32 else out.data
            return handle_cls(data, bf16)

        return wrapper

    def cast_impl(self: Any, src: Any, dst_type: Any, original: Any = builder.cast_impl) -> Any:
        src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
        if src_ty == bf16 and dst_ty != bf16:
            return original(self, widen(src), dst_type)
        if dst_ty == bf16 and src_ty != bf16 and not src_ty.is_fp8():
            return handle_cls(narrow(src.data), bf16)
        return original(self, src, dst_type)

    def fp_to_fp(self: Any, src: Any, dst_type: Any, rounding: Any,
                 original: Any = builder.create_fp_to_fp) -> Any:  # fmt: skip
        src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
        plain = not (src_ty.is_fp8() or dst_ty.is_fp8())
        if plain and bf16 in (src_ty, dst_ty) and rounding != interpreter._ir.ROUNDING_MODE.RTZ:
            return cast_impl(self, src, dst_type)
        return original(self, src, dst_type, rounding)

    def retype(t: Any, handle: Any) -> Any:
        ty = t.type
        ty = ty.with_element_ty(handle.dtype) if isinstance(ty, tl.block_type) else handle.dtype
        return tl.core.tensor(handle, ty)

    def apply(self: Any, input: Any, original: Any = reduce_scan.apply) -> Any:
        inputs = input if isinstance(input, tuple) else (input,)
        if not any(t.dtype == bf16 for t in inputs):
            return original(self, input)
        native_fp32 = any(t.dtype == fp32 for t in inputs)
        wide = tuple(retype(t, widen(t.handle)) if t.dtype == bf16 else t for t in inputs)
        out = original(self, wide if isinstance(input, tuple) else wide[0])
        outs = out if isinstance(out, tuple) else (out,)
        if not native_fp32:
            outs = tuple(
                retype(t, handle_cls(narrow(t.handle.data), bf16)) if t.dtype == fp32 else t
                for t in outs
            )
        return outs if isinstance(out, tuple) else outs[0]

    for name in ("binary_op", "unary_op", "ternary_op", "create_fma", "create_erf",
                 "create_rsqrt", "create_dot"):  # fmt: skip
        setattr(builder, name, by_value(getattr(builder, name)))
    builder.cast_impl = cast_impl
    builder.create_fp_to_fp = fp_to_fp
    reduce_scan.apply = apply


def _libdevice_table() -> dict[str, Any]:
    """libdevice function (``__nv_<name>``, without the f/d suffix) -> numpy equivalent."""
    import math

    import scipy.special as sp

    def round_half_away(x: Any) -> Any:
        return np.copysign(np.floor(np.abs(x) + 0.5), x)

    def rsqrt(x: Any) -> Any:
        return 1 / np.sqrt(x)

    table: dict[str, Any] = {
        "abs": np.abs, "fabs": np.abs, "acos": np.arccos, "acosh": np.arccosh,
        "asin": np.arcsin, "asinh": np.arcsinh, "atan": np.arctan, "atan2": np.arctan2,
        "atanh": np.arctanh, "cbrt": np.cbrt, "rcbrt": lambda x: 1 / np.cbrt(x),
        "ceil": np.ceil, "copysign": np.copysign, "cos": np.cos, "cosh": np.cosh,
        "cospi": lambda x: np.cos(np.pi * x), "cyl_bessel_i0": sp.i0, "cyl_bessel_i1": sp.i1,
        "erf": sp.erf, "erfc": sp.erfc, "erfcinv": sp.erfcinv, "erfinv": sp.erfinv,
        "erfcx": sp.erfcx, "exp": np.exp, "exp10": lambda x: np.power(x.dtype.type(10), x),
        "exp2": np.exp2, "expm1": np.expm1, "fdim": lambda x, y: np.maximum(x - y, 0),
        "floor": np.floor, "fma": lambda x, y, z: x * y + z, "fmod": np.fmod,
        "hypot": np.hypot, "isfinite": np.isfinite, "finite": np.isfinite, "isinf": np.isinf,
        "isnan": np.isnan, "j0": sp.j0, "j1": sp.j1, "y0": sp.y0, "y1": sp.y1,
        "ldexp": np.ldexp, "lgamma": sp.gammaln, "log": np.log, "log10": np.log10,
        "log1p": np.log1p, "log2": np.log2, "nearbyint": np.rint, "rint": np.rint,
        "llrint": np.rint, "nextafter": np.nextafter, "normcdf": sp.ndtr,
        "normcdfinv": sp.ndtri, "pow": np.power, "powi": np.power,
        "remainder": np.vectorize(math.remainder), "round": round_half_away,
        "llround": round_half_away, "rsqrt": rsqrt, "frsqrt_rn": rsqrt,
        "signbit": np.signbit, "sin": np.sin, "sinh": np.sinh,
        "sinpi": lambda x: np.sin(np.pi * x), "sqrt": np.sqrt, "tan": np.tan, "tanh": np.tanh,
        "tgamma": sp.gamma, "trunc": np.trunc, "saturate": lambda x: np.clip(x, 0, 1),
        "fdividef": np.divide, "fdiv_rn": np.divide, "ddiv_rn": np.divide,
        "fadd_rn": np.add, "dadd_rn": np.add, "fsub_rn": np.subtract, "dsub_rn": np.subtract,
        "fmul_rn": np.multiply, "dmul_rn": np.multiply, "fsqrt_rn": np.sqrt,
        "dsqrt_rn": np.sqrt, "frcp_rn": lambda x: 1 / x, "drcp_rn": lambda x: 1 / x,
        "fmaf_rn": lambda x, y, z: x * y + z, "fma_rn": lambda x, y, z: x * y + z,
    }  # fmt: skip
    return table


_LIBDEVICE: dict[str, Any] = {}  # built on first use: scipy.special imports slowly
_LIBDEVICE_BOUND: dict[str, Any] = {}  # libdevice name -> it, bound to the interpreter


def _libdevice_by_numpy(triton: Any, libdevice: Any, cuda_libdevice: Any) -> None:
    """Run libdevice calls (``libdevice.pow``, ``libdevice.tanh``...) in the interpreter.

    Triton 3.9's interpreter raises on every extern call, and ``triton.language.extra.
    libdevice`` is a stub that only GPU compilation swaps for the CUDA one. Here both modules'
    functions are bound to the interpreter and each ``__nv_*`` symbol runs its numpy/scipy
    equivalent (libdevice's own ulp errors are not reproduced).
    """
    interpreter = triton.runtime.interpreter
    handle_cls = interpreter.TensorHandle
    if not _LIBDEVICE:
        _LIBDEVICE.update(_libdevice_table())

    def extern(self: Any, lib: Any, path: Any, symbol: str, args: Any, ret: Any, pure: Any) -> Any:
        name = symbol.removeprefix("__nv_").removeprefix("fast_")
        fn = _LIBDEVICE.get(name)
        if fn is None and name[-1:] in ("f", "d"):
            fn = _LIBDEVICE.get(name[:-1])
        if fn is None:
            raise NotImplementedError(f"libdevice {symbol} has no interpreter implementation")
        ret_scalar = ret.scalar
        out = np.asarray(fn(*(a.data for a in args)))
        return handle_cls(out.astype(interpreter._get_np_dtype(ret_scalar)), ret_scalar)

    interpreter.InterpreterBuilder.create_extern_elementwise = extern
    if not _LIBDEVICE_BOUND:
        semantic = interpreter.interpreter_semantic
        for name, member in vars(cuda_libdevice).items():
            if triton.language.core.is_builtin(member):

                def bound(*args: Any, _member: Any = member, **kwargs: Any) -> Any:
                    kwargs.pop("_semantic", None)
                    return _member(*args, _semantic=semantic, **kwargs)

                _LIBDEVICE_BOUND[name] = bound
    vars(cuda_libdevice).update(_LIBDEVICE_BOUND)
    stub = vars(libdevice)
    stub.update({k: v for k, v in _LIBDEVICE_BOUND.items() if k in stub})


# --------------------------------------------------------------------------------------------
# Ahead-of-time compilation


def _ptxas_missing(triton: Any, arch: int) -> str | None:
    """Why ptxas for ``sm_<arch>`` cannot be run here (None: it can)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        get_ptxas(arch)
    except Exception as e:
        return f"ptxas for sm_{arch} not found ({e}); set TRITON_PTXAS_PATH to a CUDA ptxas"
    return None


@contextmanager
def _without_cubin_stage(triton: Any, arch: int, *, mock_ptxas: bool) -> Iterator[dict[str, Any]]:
    """Knobs (and options to compile with) that stop Triton at PTX, never running ptxas.

    ``mock_ptxas``: ptxas is missing, so also pick the PTX version Triton would ask it for.
    """
    runtime, nvidia = triton.knobs.runtime, triton.knobs.nvidia

    def hook(*args: Any) -> Any:
        if not args:  # Triton asks for a cache key: keep these out of the full builds' cache
            return "functrans-empty-cubin", "functrans-empty-cubin"
        stages = args[1]
        if "cubin" in stages:  # Triton's CompiledKernel insists on a binary: an empty one
            stages["cubin"] = lambda src, metadata: b""
        return None

    with runtime.scope(), nvidia.scope():
        runtime.add_stages_inspection_hook = hook
        if not mock_ptxas:
            yield {}
            return
        ptx_version = 84 if arch < 100 else 88
        nvidia.mock_ptx_version = f"release {ptx_version // 10}.{ptx_version % 10}"
        yield {"ptx_version": ptx_version}


_CUDA_ARCHS = frozenset({50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 88, 89, 90, 100, 101})
_CUDA_ARCHS |= {103, 110, 120, 121}


def compile_for_gpu(
    kernel: KernelSource, target: tuple[str, int, int] = ("cuda", 90, 32), *, cubin: bool = True
) -> CompiledArtifact:
    """Compile ``kernel`` to PTX and cubin for ``target`` (no GPU needed on this machine).

    ``target`` is ``("cuda", arch, warp_size)``, e.g. ``("cuda", 80, 32)`` for an A100.
    ``cubin=False`` stops at PTX (ptxas is about 40% of the time). Triton's own cache
    (``TRITON_CACHE_DIR``, default ``~/.triton/cache``) makes recompiling the same kernel for
    the same target take about a millisecond. Raises :class:`KernelError` naming the kernel
    when Triton rejects it.

    >>> import pytest
    >>> _ = available() or pytest.skip("needs triton")
    >>> src = '''
    ... import triton
    ... import triton.language as tl
    ...
    ... @triton.jit
    ... def zero(out_ptr0, XBLOCK: tl.constexpr):
    ...     tl.store(out_ptr0 + tl.arange(0, XBLOCK), tl.zeros([XBLOCK], tl.float32))
    ... '''
    >>> art = compile_for_gpu(KernelSource("zero", src, {"out_ptr0": "*fp32"}, {"XBLOCK": 64}))
    >>> ".entry zero" in art.ptx, art.target, len(art.cubin) > 0
    (True, ('cuda', 90, 32), True)
    """
    triton = _triton()
    backend, arch, warp_size = target
    if backend != "cuda" or warp_size != 32 or arch not in _CUDA_ARCHS:
        raise KernelError(
            kernel.name,
            f"compile_for_gpu({kernel.name!r}): target must be ('cuda', arch, 32) with arch one "
            f"of {sorted(_CUDA_ARCHS)}, got {target}",  # LLVM aborts the process on others
        )
    loaded = load(kernel)
    fn = loaded.jit_function
    signature = {
        p.name: "constexpr" if p.is_constexpr else kernel.signature[p.name] for p in fn.params
    }
    missing = _ptxas_missing(triton, arch)
    skipped = missing if missing is not None else None if cubin else "not requested (cubin=False)"
    gpu_target = triton.backends.compiler.GPUTarget(backend, arch, warp_size)
    options: dict[str, Any] = {"enable_fp_fusion": ENABLE_FP_FUSION}
    try:
        with _LOCK:
            source = triton.compiler.ASTSource(fn, signature, dict(kernel.constexprs))
            if skipped is None:
                compiled = triton.compile(source, target=gpu_target, options=options)
            else:
                with _without_cubin_stage(triton, arch, mock_ptxas=missing is not None) as extra:
                    compiled = triton.compile(source, target=gpu_target, options=options | extra)
    except Exception as e:
        raise KernelError(
            kernel.name,
            f"Triton rejected kernel {kernel.name!r} for {backend} sm_{arch} ({loaded.path}):\n{e}",
        ) from e
    asm = compiled.asm
    binary = asm.get("cubin") if skipped is None else None
    return CompiledArtifact(
        name=kernel.name,
        target=(backend, arch, warp_size),
        ptx=str(asm.get("ptx", "")),
        cubin=bytes(binary) if binary is not None else None,
        shared_bytes=int(compiled.metadata.shared),
        num_warps=int(compiled.metadata.num_warps),
        cubin_missing_reason=skipped,
    )
