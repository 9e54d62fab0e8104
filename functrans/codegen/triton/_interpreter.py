"""Work-arounds that let Triton 3.9's interpreter run generated kernels the way a GPU would.

:class:`~.runtime.Kernel` interprets kernels on CPU tensors inside :func:`_interpreter_scope`,
which patches Triton for the duration of one launch and then puts everything back:

- without ``TRITON_INTERPRET=1``, ``@triton.jit`` helpers (Triton's own ``tl.sigmoid``,
  ``tl.cdiv``...) are JITFunctions that refuse to be called from interpreted code; the scope
  interprets them instead, and undoes the patches the interpreter leaves on ``triton.language``
  so a later GPU compile in the same process sees the real language;
- the interpreter computes bfloat16 on raw bits and truncates fp32 -> bf16
  (:func:`_bf16_by_value` computes it by value and rounds to nearest even, like a GPU);
- the interpreter raises on every libdevice call (:func:`_libdevice_by_numpy` runs them with
  numpy/scipy).

Like every module of functrans but :mod:`.runtime`, this one does not import :mod:`triton`: it
is handed the module (and the libdevice modules it patches) by :mod:`.runtime`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

_INTERPRETED: dict[int, tuple[Any, Any]] = {}  # id(JITFunction) -> (it, its InterpretedFunction)
_MISSING = object()


@contextmanager
def _interpreter_scope(triton: Any, libdevice: Any, cuda_libdevice: Any) -> Iterator[None]:
    """Let the interpreter run without ``TRITON_INTERPRET=1``, and undo what it leaves behind.

    Without that variable, ``@triton.jit`` helpers -- including ``tl.sigmoid``, ``tl.softmax``,
    ``tl.zeros``, ``tl.cdiv`` from Triton's standard library -- are JITFunctions, which refuse
    to be called; here calling one interprets it. Triton's interpreter patches
    ``triton.language`` for each nested call without restoring it (3.9); the snapshot taken
    here puts every patched attribute back, so later GPU compiles see the real language.
    And bfloat16 is computed by value (:func:`_bf16_by_value`), libdevice functions by numpy
    (:func:`_libdevice_by_numpy`). ``libdevice`` and ``cuda_libdevice`` are
    ``triton.language.extra.libdevice`` (a stub) and ``triton.language.extra.cuda.libdevice``.
    """
    tl = triton.language
    interpreter = triton.runtime.interpreter
    jit_cls = triton.runtime.JITFunction

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        hit = _INTERPRETED.get(id(self))
        if hit is None or hit[0] is not self:
            hit = _INTERPRETED[id(self)] = (self, interpreter.InterpretedFunction(self.fn))
        return hit[1](*args, **kwargs)

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
