"""What TorchInductor would generate for a functrans ATen graph on a GPU: kernels and bytes.

The reference a Triton backend is compared with. ``inductor_kernels(graph, example_inputs)``
lowers the graph through Inductor exactly as :mod:`functrans.codegen.inductor` does
(``make_fx`` under Inductor's decomposition table, then ``compile_fx_inner``) and reads what
Inductor generated: the number of Triton kernel launches, the calls Inductor leaves to ATen /
cuBLAS / cuDNN ("extern" kernels: ``mm``, ``bmm``, ``addmm``, ``convolution`` and fallbacks),
the global-memory bytes they move, and the generated source. ``aten_bytes`` is the op-by-op
estimate of running the same graph in eager ATen, for comparison.

How Triton code comes out of a CPU-only machine (torch 2.13.0+cpu, triton 3.9.0, no GPU):

- ``device="cuda"`` (the default) simulates a CUDA device. The graph is traced on fake CUDA
  tensors (``FakeTensor(mode, meta_tensor, torch.device("cuda", 0))``; a CPU build of torch
  creates those without CUDA), ``device=`` arguments of factory ops in the graph are moved to
  ``cuda``, and the few device queries Inductor makes are answered for an H100 (sm90, 132 SMs):
  ``CudaInterface.get_device_properties``/``get_compute_capability``,
  ``torch.cuda.get_device_properties``/``get_device_capability`` and
  ``torch._inductor.scheduler.has_triton`` (which is False without a CUDA device, and makes
  ``Scheduler.create_backend`` raise ``TritonMissing``); ``Tensor.copy_``, whose Python
  binding takes a CUDA device guard even on fake tensors, is routed to ``aten.copy_``.
  Inductor then makes every decision it makes for CUDA: its GPU-only decompositions (e.g.
  ``prims.prepare_softmax_online``), split reductions, mix-order reductions, extern
  ``mm``/``bmm``/``addmm`` (``max_autotune`` is off, as by default).
- ``device="cpu"`` keeps the CPU tensors and sets ``torch._inductor.config.cpu_backend =
  "triton"``: Triton kernels, but chosen by Inductor's CPU heuristics (no online softmax, no
  split reductions), so its counts differ somewhat from a GPU's.

In both modes nothing is compiled or run: ``GraphLowering.compile_to_module`` is replaced by
a stand-in that only generates the code (as ``torch._inductor.utils.get_code`` does), which is
what makes the CUDA simulation safe. Triton itself is never asked for a driver (it has none
here: ``triton.runtime.driver`` raises "0 active drivers ([]). There should only be one." from
``torch.utils._triton.triton_backend``), because the one call Inductor's Triton codegen makes
to it, ``torch.utils._triton.triton_hash_with_backend`` (a cache key written into
``inductor_meta["backend_hash"]``), is patched to return a constant. Inductor's caches are
disabled (``force_disable_caches``) so the code is generated every time.

Bytes. Per Triton kernel launch, Inductor's own estimate ``kernel_num_gb`` (written into
``inductor_meta`` when ``config.benchmark_kernel`` is set, by
``SIMDKernel.estimate_kernel_num_bytes``): the bytes of every buffer the kernel takes, each
once, an in-place (``in_out_ptr``) buffer twice (read and written), sliced buffers by the
slices read. Per extern call, the scheduler's
``get_read_write_buffers_sizes()``: bytes of the buffers it reads plus those it writes.
``total_bytes`` is the sum of both.
"""

from __future__ import annotations

import contextlib
import re
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
import torch.fx as fx

from functrans.codegen.inductor import decompose_for_inductor
from functrans.extend import Graph, OpClass, nbytes, op_class, read_bytes

__all__ = [
    "SIMULATED_GPU",
    "InductorReport",
    "aten_bytes",
    "inductor_kernels",
    "main",
    "zoo_reports",
]

#: The device properties the CUDA simulation reports (an H100 SXM).
SIMULATED_GPU = types.SimpleNamespace(
    name="NVIDIA H100 (simulated)",
    major=9,
    minor=0,
    multi_processor_count=132,
    total_memory=80 * 2**30,
    regs_per_multiprocessor=65536,
    max_threads_per_multi_processor=2048,
    max_threads_per_block=1024,
    warp_size=32,
    shared_memory_per_block_optin=232448,
    L2_cache_size=50 * 2**20,
)

#: Ops that only reinterpret their input without a copy (besides schema views and getitem).
_FREE_OPS = {torch.ops.aten._unsafe_view.default, torch.ops.aten.alias.default}


@dataclass(frozen=True)
class InductorReport:
    """What Inductor generated for one graph (see the module docstring).

    ``triton_launches`` and ``extern_calls`` are ``(kernel, bytes)`` pairs in launch order;
    ``source`` is the generated wrapper module (Triton kernels embedded in it).
    """

    device: str
    triton_launches: tuple[tuple[str, int], ...]
    extern_calls: tuple[tuple[str, int], ...]
    source: str = field(repr=False)

    @property
    def num_triton_kernels(self) -> int:
        """Triton kernel launches (a kernel launched twice counts twice)."""
        return len(self.triton_launches)

    @property
    def num_distinct_triton_kernels(self) -> int:
        """Distinct Triton kernels Inductor defined."""
        return len({name for name, _ in self.triton_launches})

    @property
    def num_extern_calls(self) -> int:
        """Calls left to ATen / cuBLAS / cuDNN (``extern_kernels.mm``, fallback ops, ...)."""
        return len(self.extern_calls)

    @property
    def triton_bytes(self) -> int:
        return sum(b for _, b in self.triton_launches)

    @property
    def extern_bytes(self) -> int:
        return sum(b for _, b in self.extern_calls)

    @property
    def total_bytes(self) -> int:
        """Estimated global-memory bytes read plus written by all launches."""
        return self.triton_bytes + self.extern_bytes

    def summary(self) -> dict[str, int]:
        return {
            "triton_kernels": self.num_triton_kernels,
            "distinct_triton_kernels": self.num_distinct_triton_kernels,
            "extern_calls": self.num_extern_calls,
            "triton_bytes": self.triton_bytes,
            "extern_bytes": self.extern_bytes,
            "total_bytes": self.total_bytes,
        }


def _module(graph: Graph | fx.GraphModule) -> fx.GraphModule:
    return graph.graph_module if isinstance(graph, Graph) else graph


def _to_cuda(module: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``module`` whose factory ops (``full``, ``arange``, ...) make CUDA tensors."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in module.graph.nodes:
        new = graph.node_copy(node, lambda n: env[n])
        device = new.kwargs.get("device")
        if isinstance(device, (str, torch.device)) and torch.device(device).type == "cpu":
            new.kwargs = {**new.kwargs, "device": torch.device("cuda", 0)}
        env[node] = new
    return fx.GraphModule(module, graph)


def _fake_inputs(example_inputs: Sequence[Any], device: torch.device) -> list[Any]:
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mode = FakeTensorMode()
    out: list[Any] = []
    for t in example_inputs:
        if not isinstance(t, torch.Tensor):
            out.append(t)
            continue
        meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        out.append(FakeTensor(mode, meta, device))
    return out


def _clear_device_caches() -> None:
    """Forget device properties Inductor cached (simulated ones must not outlive the patch)."""
    from torch._inductor import utils
    from torch._inductor.runtime.hints import DeviceProperties

    cached = [DeviceProperties.create, utils.is_big_gpu]
    cached += [getattr(utils, n) for n in ("get_device_tflops", "get_gpu_dram_gbps")]
    for fn in cached:
        clear = getattr(fn, "cache_clear", None)
        if clear is not None:
            clear()


@contextlib.contextmanager
def _simulated_cuda() -> Iterator[None]:
    from torch._dynamo.device_interface import CudaInterface

    props = staticmethod(lambda device=None: SIMULATED_GPU)
    cc = staticmethod(lambda device=None: 10 * SIMULATED_GPU.major + SIMULATED_GPU.minor)
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(CudaInterface, "get_device_properties", props))
        stack.enter_context(mock.patch.object(CudaInterface, "get_compute_capability", cc))
        stack.enter_context(
            mock.patch.object(torch.cuda, "get_device_properties", lambda d=None: SIMULATED_GPU)
        )
        stack.enter_context(
            mock.patch.object(
                torch.cuda,
                "get_device_capability",
                lambda d=None: (SIMULATED_GPU.major, SIMULATED_GPU.minor),
            )
        )
        stack.enter_context(mock.patch("torch._inductor.scheduler.has_triton", lambda: True))
        # The ``Tensor.copy_`` binding takes a CUDA device guard (none exists in a CPU build:
        # "PyTorch is not linked with support for cuda devices"), even on fake tensors;
        # Inductor's reinplace pass calls it to check shapes. The op itself has no guard.
        stack.enter_context(mock.patch.object(torch.Tensor, "copy_", _guardless_copy))
        stack.callback(_clear_device_caches)
        _clear_device_caches()
        yield


def _guardless_copy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> Any:
    return torch.ops.aten.copy_.default(self, src, non_blocking)


@dataclass
class _Captured:
    source: str = ""
    extern: list[tuple[str, int]] = field(default_factory=list)


def _extern_name(snode: Any) -> str:
    node = snode.node
    for attr in ("python_kernel_name", "op_overload"):
        name = getattr(node, attr, None)
        if name:
            return str(name)
    return type(node).__name__


@contextlib.contextmanager
def _capture_codegen(captured: _Captured) -> Iterator[None]:
    """Replace ``GraphLowering.compile_to_module`` by code generation only (no compile)."""
    from torch._inductor import ir
    from torch._inductor.graph import GraphLowering

    def codegen_only(self: GraphLowering) -> Any:
        wrapper, kernels = self.codegen()
        captured.source = wrapper.value + (kernels.value if kernels else "")
        for snode in self.scheduler.nodes:
            if snode.is_extern() and not isinstance(snode.node, ir.MultiOutput):
                captured.extern.append((_extern_name(snode), snode.get_read_write_buffers_sizes()))

        class NotCompiled:
            def call(self, *args: Any, **kwargs: Any) -> None:
                raise RuntimeError("inductor_kernels only generates code")

        return NotCompiled()

    with mock.patch.object(GraphLowering, "compile_to_module", codegen_only):
        yield


_KERNEL_DEF = re.compile(r"^(\w+) = async_compile\.triton\('\w+', '''(.*?)'''", re.M | re.S)
_NUM_GB = re.compile(r"'kernel_num_gb': ([0-9.eE+-]+)")
_LAUNCH = re.compile(r"^\s+(\w+)\.run\(", re.M)
_QUOTED = re.compile(r"'''.*?'''", re.S)


def _triton_launches(source: str) -> list[tuple[str, int]]:
    num_bytes: dict[str, int] = {}
    for name, body in _KERNEL_DEF.findall(source):
        m = _NUM_GB.search(body)
        num_bytes[name] = round(float(m.group(1)) * 1e9) if m else 0
    wrapper = _QUOTED.sub("''", source)  # the kernels' own benchmark harnesses launch too
    return [(name, num_bytes[name]) for name in _LAUNCH.findall(wrapper) if name in num_bytes]


def _placeholder_values(module: fx.GraphModule) -> list[Any]:
    vals = [n.meta.get("val") for n in module.graph.nodes if n.op == "placeholder"]
    if any(v is None for v in vals):
        raise ValueError("a placeholder has no meta['val']: pass example_inputs")
    return vals


def inductor_kernels(
    graph: Graph | fx.GraphModule,
    example_inputs: Sequence[Any] | None = None,
    *,
    device: str = "cuda",
) -> InductorReport:
    """What Inductor generates for ``graph`` on ``device`` ("cuda": simulated, see the module
    docstring; "cpu": ``cpu_backend="triton"``). Only shapes, strides and dtypes of
    ``example_inputs`` matter (real, fake or meta tensors); None takes them from the
    placeholders' ``meta["val"]``."""
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx_inner

    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', not {device!r}")
    module = _module(graph)
    if example_inputs is None:
        example_inputs = _placeholder_values(module)
    captured = _Captured()
    with contextlib.ExitStack() as stack:
        stack.enter_context(config.patch(benchmark_kernel=True, force_disable_caches=True))
        stack.enter_context(
            mock.patch.object(torch.utils._triton, "triton_hash_with_backend", lambda: "X")
        )
        if device == "cuda":
            stack.enter_context(_simulated_cuda())
            module = _to_cuda(module)
            inputs = _fake_inputs(example_inputs, torch.device("cuda", 0))
        else:
            stack.enter_context(config.patch(cpu_backend="triton"))
            inputs = _fake_inputs(example_inputs, torch.device("cpu"))
        stack.enter_context(_capture_codegen(captured))
        decomposed = decompose_for_inductor(module, inputs)
        compile_fx_inner(decomposed, inputs)
    return InductorReport(
        device=device,
        triton_launches=tuple(_triton_launches(captured.source)),
        extern_calls=tuple(captured.extern),
        source=captured.source,
    )


def _values(module: fx.GraphModule, example_inputs: Sequence[Any]) -> dict[fx.Node, Any]:
    """``meta["val"]`` of every node; where one is missing, shapes from running on fakes."""
    vals = {n: n.meta.get("val") for n in module.graph.nodes if n.op != "output"}
    if all(v is not None for v in vals.values()):
        return vals
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(module, mode).propagate(*example_inputs)
    return {n: n.meta.get("val") for n in module.graph.nodes if n.op != "output"}


def aten_bytes(graph: Graph | fx.GraphModule, example_inputs: Sequence[Any] = ()) -> int:
    """Op-by-op global-memory estimate of running ``graph`` in eager ATen.

    Every op that is not a view (schema views, ``getitem``, ``_unsafe_view``, ``alias`` are
    free) reads each distinct tensor input once (broadcast dimensions once) and writes its
    outputs. Shapes come from the nodes' ``meta["val"]``, or from ``example_inputs`` where a
    node has none.
    """
    module = _module(graph)
    vals = _values(module, example_inputs)
    total = 0
    for node in module.graph.nodes:
        if node.op != "call_function" or node.target in _FREE_OPS:
            continue
        if op_class(node) is OpClass.VIEW:
            continue
        inputs = {n: None for n in node.all_input_nodes}
        total += sum(read_bytes(vals.get(n)) for n in inputs)
        total += nbytes(vals.get(node))
    return total


def zoo_reports(
    models: Sequence[str] = ("mlp_stack", "gpt_block", "llama_block", "conv_block"),
    *,
    size: str = "small",
    strategy: str = "min_cut",
    device: str = "cuda",
) -> list[dict[str, Any]]:
    """One row per zoo model and phase ("forward"/"backward" of its ``strategy`` partition):
    :meth:`InductorReport.summary` plus ``aten_bytes`` and the graph's op count."""
    import functrans as ft
    from benchmarks.zoo import ZOO

    rows: list[dict[str, Any]] = []
    for name in models:
        model = ZOO[name]()
        params, x = model.make(size)
        part = ft.partition(ft.joint(model.fn, argnums=0)(params, x), strategy)
        for phase, g in (("forward", part.forward), ("backward", part.backward)):
            report = inductor_kernels(g, device=device)
            rows.append(
                {
                    "model": name,
                    "phase": phase,
                    "aten_ops": sum(1 for _ in g.ops()),
                    **report.summary(),
                    "aten_bytes": aten_bytes(g),
                }
            )
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m benchmarks._inductor_ref [--device cuda|cpu] [--size small|bench]``:
    print :func:`zoo_reports` as a Markdown table."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--size", default="small")
    args = parser.parse_args(argv)
    rows = zoo_reports(size=args.size, device=args.device)
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row[k]) for k in keys) + " |")


if __name__ == "__main__":
    main()
