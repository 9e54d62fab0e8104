"""codegen/triton/runtime.py: load generated kernels, run them (interpreted on CPU), AOT-compile.

No GPU is needed: CPU tensors go through Triton's interpreter and :func:`compile_for_gpu`
only needs the ptxas that ships with Triton.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

import triton
import triton.language as tl
import triton.language.extra.cuda.libdevice as cuda_libdevice
from triton.language.extra import libdevice

from functrans._core.errors import FunctransError
from functrans.codegen.triton import aot, runtime
from functrans.codegen.triton.aot import compile_for_gpu
from functrans.codegen.triton.runtime import (
    KernelError,
    KernelSource,
    TritonUnavailableError,
    load,
)

HEADER = "import triton\nimport triton.language as tl\n\n\n"


def _source(body: str) -> str:
    return HEADER + textwrap.dedent(body).lstrip()


def _add(compute: str = "tl.float32", op: str = "+") -> str:
    return _source(f"""
        @triton.jit
        def add_kernel(in_ptr0, in_ptr1, out_ptr0, xnumel, XBLOCK: tl.constexpr):
            xoffset = tl.program_id(0) * XBLOCK
            xindex = xoffset + tl.arange(0, XBLOCK)
            xmask = xindex < xnumel
            a = tl.load(in_ptr0 + xindex, mask=xmask, other=0).to({compute})
            b = tl.load(in_ptr1 + xindex, mask=xmask, other=0).to({compute})
            tl.store(out_ptr0 + xindex, (a {op} b).to(out_ptr0.dtype.element_ty), mask=xmask)
    """)


def _add_kernel(dtype: str = "fp32", xblock: int = 128, **kw: str) -> KernelSource:
    sig = {"in_ptr0": f"*{dtype}", "in_ptr1": f"*{dtype}", "out_ptr0": f"*{dtype}", "xnumel": "i32"}
    return KernelSource("add_kernel", _add(**kw), sig, {"XBLOCK": xblock})


# Row softmax over a [rows, cols] tensor with a row stride: XBLOCK rows per program, RBLOCK >=
# cols; masked on both axes (rows and columns are ragged), computed in fp32.
SOFTMAX = _source("""
    @triton.jit
    def softmax_kernel(in_ptr0, out_ptr0, xnumel, rnumel, stride0,
                       XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
        xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:, None]
        rindex = tl.arange(0, RBLOCK)[None, :]
        mask = (xindex < xnumel) & (rindex < rnumel)
        x = tl.load(in_ptr0 + xindex * stride0 + rindex, mask=mask, other=float("-inf"))
        x = x.to(tl.float32)
        m = tl.max(x, 1)[:, None]
        e = tl.exp(x - m)
        e = tl.where(mask, e, 0.0)
        y = e / tl.sum(e, 1)[:, None]
        tl.store(out_ptr0 + xindex * rnumel + rindex, y.to(out_ptr0.dtype.element_ty), mask=mask)
""")


def _softmax_kernel(dtype: str = "fp32", xblock: int = 4, rblock: int = 128) -> KernelSource:
    sig = {
        "in_ptr0": f"*{dtype}",
        "out_ptr0": f"*{dtype}",
        "xnumel": "i32",
        "rnumel": "i32",
        "stride0": "i32",
    }
    return KernelSource("softmax_kernel", SOFTMAX, sig, {"XBLOCK": xblock, "RBLOCK": rblock})


# Calls a @triton.jit helper and @triton.jit functions of Triton's standard library
# (tl.sigmoid, tl.softmax, tl.zeros_like, tl.cdiv): JITFunctions outside TRITON_INTERPRET=1.
HELPERS = _source("""
    @triton.jit
    def _twice(x):
        return x * 2.0


    @triton.jit
    def helpers_kernel(in_ptr0, out_ptr0, XBLOCK: tl.constexpr):
        x = tl.arange(0, XBLOCK)
        a = tl.load(in_ptr0 + x)
        r = _twice(tl.sigmoid(a)) + tl.softmax(a) + tl.zeros_like(a) + tl.cdiv(7, 2)
        tl.store(out_ptr0 + x, r)
""")
HELPERS_KERNEL = KernelSource(
    "helpers_kernel", HELPERS, {"in_ptr0": "*fp32", "out_ptr0": "*fp32"}, {"XBLOCK": 64}
)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FUNCTRANS_CACHE_DIR", str(tmp_path))


def _run_add(kernel: KernelSource, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(a)
    n = a.numel()
    xblock = kernel.constexprs["XBLOCK"]
    load(kernel)(((n + xblock - 1) // xblock,), a, b, out, n)
    return out


# --- running on CPU tensors (Triton's interpreter) -------------------------------------------


def test_add_several_blocks_ragged_edge():
    a, b = torch.randn(1000), torch.randn(1000)  # 8 programs of 128, the last one masked
    torch.testing.assert_close(_run_add(_add_kernel(), a, b), a + b, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("dtype", "triton_dtype", "compute", "op"),
    [
        (torch.float32, "fp32", "tl.float32", "+"),
        (torch.float16, "fp16", "tl.float32", "+"),
        (torch.bfloat16, "bf16", "tl.float32", "+"),
        (torch.float64, "fp64", "tl.float64", "+"),
        (torch.int32, "i32", "tl.int32", "+"),
        (torch.int64, "i64", "tl.int64", "+"),
        (torch.int8, "i8", "tl.int32", "+"),
        (torch.bool, "i1", "tl.int1", "|"),
    ],
)
def test_dtypes_load_store(dtype, triton_dtype, compute, op):
    """Loads and stores in ``dtype``; half types are computed in fp32 and rounded on store."""
    gen = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        a, b = (torch.rand(300, generator=gen) < 0.5 for _ in range(2))
    elif dtype.is_floating_point:
        a, b = (torch.randn(300, generator=gen).to(dtype) * 10 for _ in range(2))
    else:
        a, b = (torch.randint(-50, 50, (300,), generator=gen).to(dtype) for _ in range(2))
    kernel = _add_kernel(triton_dtype, compute=compute, op=op)
    out = _run_add(kernel, a, b)
    assert out.dtype == dtype
    if dtype == torch.bool:
        expected = a | b
    elif dtype in (torch.float16, torch.bfloat16):
        expected = (a.float() + b.float()).to(dtype)  # one rounding, like the fp32 kernel
    else:
        expected = a + b
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("dtype", "triton_dtype", "tol"),
    [(torch.float32, "fp32", 1e-6), (torch.bfloat16, "bf16", 1e-2), (torch.float16, "fp16", 1e-3)],
)
def test_row_softmax(dtype, triton_dtype, tol):
    rows, cols = 37, 100  # 10 programs of 4 rows (the last has 1); 100 of 128 columns
    base = torch.randn(rows, cols + 3, generator=torch.Generator().manual_seed(1)).to(dtype)
    x = base[:, :cols]  # row stride cols + 3: not contiguous
    out = torch.empty(rows, cols, dtype=dtype)
    kernel = load(_softmax_kernel(triton_dtype))
    kernel(((rows + 3) // 4,), x, out, rows, cols, x.stride(0))
    expected = torch.softmax(x.float(), dim=1).to(dtype)
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


def test_bf16_store_rounds_like_torch():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(2)) * 1000
    src = _source("""
        @triton.jit
        def cast_kernel(in_ptr0, out_ptr0, xnumel, XBLOCK: tl.constexpr):
            x = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
            m = x < xnumel
            tl.store(out_ptr0 + x, tl.load(in_ptr0 + x, mask=m).to(tl.bfloat16), mask=m)
    """)
    sig = {"in_ptr0": "*fp32", "out_ptr0": "*bf16", "xnumel": "i32"}
    out = torch.empty(4096, dtype=torch.bfloat16)
    load(KernelSource("cast_kernel", src, sig, {"XBLOCK": 1024}))((4,), x, out, 4096)
    assert torch.equal(out, x.to(torch.bfloat16))


@pytest.mark.parametrize(
    ("expr", "reference"),
    [
        ("a + b", lambda a, b: a + b),
        ("a * 3", lambda a, b: a * 3),
        (
            "tl.where(a > b, a * b, tl.abs(b) - 1.5)",
            lambda a, b: torch.where(a > b, a * b, b.abs() - 1.5),
        ),
        ("tl.zeros_like(a) + tl.max(a, 0)", lambda a, b: torch.zeros_like(a) + a.max()),
        (
            "tl.zeros_like(a) + tl.min(-tl.abs(a), 0)",
            lambda a, b: torch.zeros_like(a) - a.abs().max(),
        ),
        (
            "(a.to(tl.float64) * 1.001).to(tl.bfloat16)",
            lambda a, b: (a.double() * 1.001).bfloat16(),
        ),
    ],
)
def test_bf16_is_computed_by_value(expr, reference):
    """Triton 3.9's interpreter runs bf16 ops on raw bits; the runtime computes them by value."""
    src = _source(f"""
        @triton.jit
        def bf16_kernel(in_ptr0, in_ptr1, out_ptr0, XBLOCK: tl.constexpr):
            x = tl.arange(0, XBLOCK)
            a = tl.load(in_ptr0 + x)
            b = tl.load(in_ptr1 + x)
            tl.store(out_ptr0 + x, {expr})
    """)
    sig = {"in_ptr0": "*bf16", "in_ptr1": "*bf16", "out_ptr0": "*bf16"}
    gen = torch.Generator().manual_seed(3)
    a, b = (torch.randn(256, generator=gen).bfloat16() for _ in range(2))
    out = torch.empty(256, dtype=torch.bfloat16)
    load(KernelSource("bf16_kernel", src, sig, {"XBLOCK": 256}))((1,), a, b, out)
    assert torch.equal(out, reference(a, b))


def test_helpers_and_standard_library_functions_are_interpreted():
    a = torch.randn(64)
    out = torch.empty(64)
    load(HELPERS_KERNEL)((1,), a, out)
    expected = 2 * torch.sigmoid(a) + torch.softmax(a, 0) + 4
    torch.testing.assert_close(out, expected)


LIBDEVICE = _source("""
    from triton.language.extra import libdevice


    @triton.jit
    def libdevice_kernel(in_ptr0, out_ptr0, out_ptr1, XBLOCK: tl.constexpr):
        x = tl.arange(0, XBLOCK)
        a = tl.load(in_ptr0 + x)
        r = libdevice.pow(tl.abs(a), 2.5) + libdevice.tanh(a) + libdevice.erfinv(a * 0.5)
        tl.store(out_ptr0 + x, r + libdevice.round(a * 4) + libdevice.log1p(tl.abs(a)))
        tl.store(out_ptr1 + x, libdevice.isnan(tl.log(a)).to(tl.int8))
""")
LIBDEVICE_KERNEL = KernelSource(
    "libdevice_kernel",
    LIBDEVICE,
    {"in_ptr0": "*fp32", "out_ptr0": "*fp32", "out_ptr1": "*i8"},
    {"XBLOCK": 64},
)


def test_libdevice_functions_are_interpreted():
    a = torch.linspace(-1.5, 1.5, 64)
    out, nan = torch.empty(64), torch.empty(64, dtype=torch.int8)
    load(LIBDEVICE_KERNEL)((1,), a, out, nan)
    away = torch.sign(a * 4) * torch.floor((a * 4).abs() + 0.5)  # round half away from zero
    expected = a.abs() ** 2.5 + a.tanh() + torch.erfinv(a * 0.5) + away + a.abs().log1p()
    torch.testing.assert_close(out, expected)
    assert nan.tolist() == (a < 0).to(torch.int8).tolist()
    assert ".entry libdevice_kernel(" in compile_for_gpu(LIBDEVICE_KERNEL, ("cuda", 80, 32)).ptx


def test_empty_grid_launches_nothing():
    out = torch.full((4,), 7.0)
    load(_add_kernel())((0,), torch.ones(4), torch.ones(4), out, 0)
    assert out.tolist() == [7.0] * 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
def test_cuda_launch_matches_the_interpreter(dtype):
    torch_dtype, triton_dtype = dtype
    rows, cols = 37, 100
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(4)).to(torch_dtype)
    kernel = load(_softmax_kernel(triton_dtype))
    out_cpu, out_gpu = torch.empty_like(x), torch.empty_like(x, device="cuda")
    kernel((10,), x, out_cpu, rows, cols, cols)
    kernel((10,), x.cuda(), out_gpu, rows, cols, cols)
    torch.testing.assert_close(out_gpu.cpu(), out_cpu)
    torch.testing.assert_close(out_gpu.cpu(), torch.softmax(x.float(), 1).to(torch_dtype))
    a, b = torch.randn(1000, device="cuda"), torch.randn(1000, device="cuda")
    torch.testing.assert_close(_run_add(_add_kernel(), a, b), a + b)


# --- global state ----------------------------------------------------------------------------


def _language_state() -> dict[str, object]:
    return {
        "env": os.environ.get("TRITON_INTERPRET"),
        "knob": triton.knobs.runtime.interpret,
        "tl.load": tl.load,
        "tl.core.load": tl.core.load,
        "tl.core.reduce": tl.core.reduce,
        "libdevice.pow": libdevice.pow,
        "cuda libdevice.pow": cuda_libdevice.pow,
        "tl.math.exp": tl.math.exp,
        "tl.reduce": tl.reduce,
        "tl.core.range": tl.core.range,
        "tensor.__bool__": tl.tensor.__dict__.get("__bool__"),
        "tensor.__index__": tl.tensor.__dict__.get("__index__"),
        "dtype.to_ir": tl.dtype.to_ir,
        "JITFunction.__call__": triton.runtime.JITFunction.__call__,
    }


def test_interpreter_leaves_no_global_state_and_gpu_compiles_still_work():
    before = _language_state()
    a = torch.randn(64)
    load(HELPERS_KERNEL)((1,), a, torch.empty(64))
    load(LIBDEVICE_KERNEL)((1,), a, torch.empty(64), torch.empty(64, dtype=torch.int8))
    assert _language_state() == before
    # the module GPU launches use is not the one the interpreter rewrote
    assert "interpreter_builder" not in load(HELPERS_KERNEL).jit_function.fn.__globals__
    # the same kernel, and the standard library it calls, still compile for a GPU ...
    assert ".entry helpers_kernel" in compile_for_gpu(HELPERS_KERNEL, ("cuda", 80, 32)).ptx
    # ... and interpret again afterwards
    out = torch.empty(64)
    load(HELPERS_KERNEL)((1,), a, out)
    torch.testing.assert_close(out, 2 * torch.sigmoid(a) + torch.softmax(a, 0) + 4)
    assert _language_state() == before


def test_failed_interpretation_restores_state_too():
    before = _language_state()
    src = _source("""
        @triton.jit
        def oob_kernel(in_ptr0, XBLOCK: tl.constexpr):
            tl.static_assert(XBLOCK < 0, "deliberate")
    """)
    with pytest.raises(KernelError, match="oob_kernel"):
        load(KernelSource("oob_kernel", src, {"in_ptr0": "*fp32"}, {"XBLOCK": 4}))(
            (1,), torch.ones(1)
        )
    assert _language_state() == before


def test_user_set_triton_interpret(monkeypatch):
    """TRITON_INTERPRET=1 in the environment does not stop AOT compilation."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernel = _add_kernel(xblock=64)
    a, b = torch.randn(100), torch.randn(100)
    torch.testing.assert_close(_run_add(kernel, a, b), a + b)
    assert isinstance(load(kernel).jit_function, triton.runtime.JITFunction)
    assert ".entry add_kernel" in compile_for_gpu(kernel, ("cuda", 80, 32)).ptx
    assert os.environ["TRITON_INTERPRET"] == "1"


# --- the disk cache --------------------------------------------------------------------------


def test_disk_cache_is_keyed_by_source(tmp_path, monkeypatch):
    kernel = _add_kernel()
    first = load(kernel)
    path = tmp_path / "triton" / f"{kernel.sha256}.py"
    assert first.path == path and path.read_text() == kernel.source
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))  # any rewrite would change this

    again = load(kernel)
    assert again.jit_function is first.jit_function  # imported once per process
    monkeypatch.setattr(runtime, "_MODULES", {})  # as if in a new process
    fresh = load(kernel)
    assert fresh.jit_function is not first.jit_function
    assert path.stat().st_mtime_ns == 1_000_000_000  # found on disk, not rewritten

    same_text_other_constexprs = load(_add_kernel(xblock=64))
    assert same_text_other_constexprs.path == path

    other = load(_add_kernel(compute="tl.float64"))
    assert other.path != path and other.path.parent == path.parent
    assert sorted(p.name for p in path.parent.iterdir()) == sorted(
        [path.name, other.path.name]
    )  # no temporary files left behind


def test_corrupt_cache_file_is_rewritten(tmp_path):
    kernel = _add_kernel()
    path = tmp_path / "triton" / f"{kernel.sha256}.py"
    path.parent.mkdir(parents=True)
    path.write_text("garbage")
    a, b = torch.randn(10), torch.randn(10)
    torch.testing.assert_close(_run_add(kernel, a, b), a + b)
    assert path.read_text() == kernel.source


# --- ahead-of-time compilation ---------------------------------------------------------------


@pytest.mark.parametrize(("arch", "ptx_target"), [(90, "sm_90a"), (80, "sm_80")])
@pytest.mark.parametrize("make", [_add_kernel, _softmax_kernel])
def test_compile_for_gpu(make, arch, ptx_target):
    kernel = make("bf16")
    art = compile_for_gpu(kernel, ("cuda", arch, 32))
    assert art.name == kernel.name and art.target == ("cuda", arch, 32)
    assert f".entry {kernel.name}(" in art.ptx
    assert f".target {ptx_target}" in art.ptx
    assert art.cubin is not None and art.cubin[:4] == b"\x7fELF"
    assert art.cubin_missing_reason is None
    assert art.num_warps == 4


def test_compile_without_ptxas_gives_ptx_and_says_why(monkeypatch):
    monkeypatch.setattr(aot, "_ptxas_missing", lambda triton, arch: "no ptxas (test)")
    art = compile_for_gpu(_add_kernel(), ("cuda", 86, 32))  # an arch no other test compiles
    assert ".entry add_kernel(" in art.ptx and ".target sm_86" in art.ptx
    assert art.cubin is None and art.cubin_missing_reason == "no ptxas (test)"


def test_compile_ptx_only():
    art = compile_for_gpu(_softmax_kernel(), ("cuda", 90, 32), cubin=False)
    assert ".entry softmax_kernel(" in art.ptx and art.cubin is None
    assert art.cubin_missing_reason == "not requested (cubin=False)"
    full = compile_for_gpu(_softmax_kernel(), ("cuda", 90, 32))  # not served from the PTX-only
    assert full.cubin and full.ptx == art.ptx  # build's cache entry; the same PTX


def test_compile_error_names_the_kernel():
    src = _source("""
        @triton.jit
        def broken_kernel(out_ptr0, XBLOCK: tl.constexpr):
            tl.store(out_ptr0 + tl.arange(0, XBLOCK), undefined_name)
    """)
    kernel = KernelSource("broken_kernel", src, {"out_ptr0": "*fp32"}, {"XBLOCK": 16})
    with pytest.raises(FunctransError, match=r"Triton rejected kernel 'broken_kernel'") as info:
        compile_for_gpu(kernel)
    assert info.value.kernel == "broken_kernel" and "undefined_name" in str(info.value)
    with pytest.raises(KernelError, match=r"'broken_kernel' failed in Triton's interpreter"):
        load(kernel)((1,), torch.empty(16))


def test_unknown_target_is_rejected_before_llvm_can_abort():
    with pytest.raises(KernelError, match="target must be"):
        compile_for_gpu(_add_kernel(), ("cuda", 81, 32))  # LLVM would abort the process
    with pytest.raises(KernelError, match="target must be"):
        compile_for_gpu(_add_kernel(), ("hip", 90, 64))


def test_non_power_of_two_block_is_rejected():
    with pytest.raises(KernelError, match="add_kernel"):
        compile_for_gpu(_add_kernel(xblock=100))


# --- misuse ----------------------------------------------------------------------------------


def test_signature_must_match_the_parameters():
    kernel = KernelSource("add_kernel", _add(), {"in_ptr0": "*fp32"}, {"XBLOCK": 128})
    with pytest.raises(KernelError, match="non-constexpr parameters"):
        load(kernel)
    with pytest.raises(KernelError, match=r"tl\.constexpr parameters"):
        load(KernelSource("add_kernel", _add(), _add_kernel().signature, {}))
    with pytest.raises(KernelError, match=r"no @triton\.jit function named 'nope'"):
        load(KernelSource("nope", _add(), {}, {}))
    with pytest.raises(KernelError, match="does not import"):
        load(KernelSource("k", "def k(:\n", {}, {}))


def test_arguments_are_checked_against_the_signature():
    kernel = load(_add_kernel())
    a = torch.ones(4)
    with pytest.raises(KernelError, match="takes 4 arguments"):
        kernel((1,), a, a, a)
    with pytest.raises(KernelError, match=r"'in_ptr1': got a torch.float64 tensor for a '\*fp32'"):
        kernel((1,), a, a.double(), a, 4)
    with pytest.raises(KernelError, match=r"'xnumel': got 4294967296 for a 'i32'"):
        kernel((1,), a, a, a, 2**32)
    with pytest.raises(KernelError, match="tensors on meta"):
        kernel((1,), *(torch.ones(4, device="meta") for _ in range(3)), 4)
    with pytest.raises(KernelError, match="grid"):
        kernel((1, 1, 1, 1), a, a, a, 4)


def test_triton_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)
    assert not runtime.available()
    with pytest.raises(TritonUnavailableError, match=r"pip install functrans\[triton\]"):
        load(_add_kernel())


def test_functrans_imports_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import functrans, functrans.codegen\n"
        "from functrans.codegen.triton import runtime\n"
        "assert not runtime.available()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
