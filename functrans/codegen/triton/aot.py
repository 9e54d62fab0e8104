"""Ahead-of-time compilation of generated Triton kernels for a GPU this machine need not have.

:func:`compile_for_gpu` loads a :class:`~.runtime.KernelSource` through :func:`.runtime.load`
and compiles its JITFunction to PTX and cubin for a ``("cuda", arch, 32)`` target. ptxas may
be missing (or the cubin not wanted): Triton is then stopped after PTX
(:func:`_without_cubin_stage`) and :class:`CompiledArtifact` says why there is no cubin.

Like every module of functrans but :mod:`.runtime`, this one does not import :mod:`triton`: it
gets the module from ``runtime._triton()``. It builds on :mod:`.runtime`, which does not import
it back.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from . import runtime
from .runtime import KernelSource

__all__ = ["CompiledArtifact", "compile_for_gpu"]


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


def _ptxas_missing(triton: Any, arch: int) -> str | None:
    """Why ptxas for ``sm_<arch>`` cannot be run here (None: it can)."""
    try:
        triton.backends.nvidia.compiler.get_ptxas(arch)
    except Exception as e:
        return f"ptxas for sm_{arch} not found ({e}); set TRITON_PTXAS_PATH to a CUDA ptxas"
    return None


@contextmanager
def _without_cubin_stage(triton: Any, arch: int, *, mock_ptxas: bool) -> Iterator[dict[str, Any]]:
    """Knobs (and options to compile with) that stop Triton at PTX, never running ptxas.

    ``mock_ptxas``: ptxas is missing, so also pick the PTX version Triton would ask it for.
    """
    knobs, nvidia = triton.knobs.runtime, triton.knobs.nvidia

    def hook(*args: Any) -> Any:
        if not args:  # Triton asks for a cache key: keep these out of the full builds' cache
            return "functrans-empty-cubin", "functrans-empty-cubin"
        stages = args[1]
        if "cubin" in stages:  # Triton's CompiledKernel insists on a binary: an empty one
            stages["cubin"] = lambda src, metadata: b""
        return None

    with knobs.scope(), nvidia.scope():
        knobs.add_stages_inspection_hook = hook
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
    the same target take about a millisecond. Raises :class:`~.runtime.KernelError` naming the
    kernel when Triton rejects it.

    >>> import pytest
    >>> from functrans.codegen.triton.runtime import available
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
    triton = runtime._triton()
    backend, arch, warp_size = target
    if backend != "cuda" or warp_size != 32 or arch not in _CUDA_ARCHS:
        raise runtime.KernelError(
            kernel.name,
            f"compile_for_gpu({kernel.name!r}): target must be ('cuda', arch, 32) with arch one "
            f"of {sorted(_CUDA_ARCHS)}, got {target}",  # LLVM aborts the process on others
        )
    loaded = runtime.load(kernel)
    fn = loaded.jit_function
    signature = {
        p.name: "constexpr" if p.is_constexpr else kernel.signature[p.name] for p in fn.params
    }
    missing = _ptxas_missing(triton, arch)
    skipped = missing if missing is not None else None if cubin else "not requested (cubin=False)"
    gpu_target = triton.backends.compiler.GPUTarget(backend, arch, warp_size)
    options: dict[str, Any] = {"enable_fp_fusion": runtime.ENABLE_FP_FUSION}
    try:
        with runtime._LOCK:
            source = triton.compiler.ASTSource(fn, signature, dict(kernel.constexprs))
            if skipped is None:
                compiled = triton.compile(source, target=gpu_target, options=options)
            else:
                with _without_cubin_stage(triton, arch, mock_ptxas=missing is not None) as extra:
                    compiled = triton.compile(source, target=gpu_target, options=options | extra)
    except Exception as e:
        raise runtime.KernelError(
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
