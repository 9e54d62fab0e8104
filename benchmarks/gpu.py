"""GPU step time and peak memory: eager, ``torch.compile`` and ``functrans.jit`` with Triton;
and offload (GPU-only figures): ``memory_budget`` at ``full_remat``'s bytes, save/recompute only
vs with ``offload=Offload()`` (copies to pinned host memory on a side stream).

For each zoo stack (the 8-block MLP, a 4-block GPT stack and a 4-block Llama stack, float32,
``size="bench"`` scaled up by ``--scale``), one fwd+bwd training step
(``fn(params, x).backward()``) is timed for eager PyTorch, ``torch.compile(fn)`` (Inductor,
default options) and ``functrans.jit(fn, partition="min_cut", backend="triton")``: warm-up
steps first (compilation included), then the median of ``--steps`` steps, each bracketed by
``torch.cuda.synchronize()``. The offload pair is ``functrans.jit(fn,
partition="memory_budget", budget=0.0)`` with and without ``offload=Offload()`` (aten backend:
the copies are custom ops the Triton backend leaves to ATen anyway). Peak memory is
``torch.cuda.max_memory_allocated()`` during one step, above what was allocated before it.
Gradients of every compiled variant are checked against eager first. Ratios are against
eager. Then the comparison of :mod:`benchmarks.peak_memory` (per-block checkpoint, torch
selective checkpointing, ``torch.compile``, torch's memory-budget knob, ``ft.jit`` strategies
and ``peak_bytes`` limits) with the peaks from the CUDA allocator, under ``peak_memory``.

    python -m benchmarks.gpu [--steps N] [--scale K] [--device cuda|cpu]

Without a CUDA device it prints why and exits 0. ``--device cpu`` is a smoke run of the same
code on the CPU (Triton interpreted, ``torch.compile`` left out, tiny sizes): it checks the
script, not the speed. Writes ``benchmarks/results/gpu.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch.utils._pytree import tree_leaves, tree_map

import functrans as ft
from benchmarks import output_path, peak_memory, remat, zoo

RESULTS = Path(__file__).resolve().parent / "results" / "gpu.json"
Fn = Callable[..., torch.Tensor]


def models(size: str) -> list[tuple[str, Fn, Any, Any]]:
    """``(name, fn, params, x)`` for the benchmark stacks, on the CPU."""
    out: list[tuple[str, Fn, Any, Any]] = []
    mlp = zoo.mlp_stack(8)
    params, x = mlp.make(size)
    out.append((mlp.name, mlp.fn, params, x))
    for name, block in remat.BLOCKS.items():
        model = zoo.ZOO[name]()
        made = [model.make(size, torch.float32, seed) for seed in range(remat.N_BLOCKS)]
        stack = f"{name.removesuffix('_block')}_stack_{remat.N_BLOCKS}"
        out.append((stack, remat.stack(block), [p for p, _ in made], made[0][1]))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(fn: Fn, params: Any, x: Any) -> None:
    for t in tree_leaves(params):
        t.grad = None
    fn(params, x).backward()  # type: ignore[no-untyped-call]  # the zoo's model functions are unannotated


def measure(fn: Fn, params: Any, x: Any, steps: int, device: torch.device) -> dict[str, float]:
    """Median step ms (after warm-up) and peak bytes of one step above the baseline."""
    for _ in range(3):
        _step(fn, params, x)
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        _step(fn, params, x)
        _sync(device)
        times.append(time.perf_counter() - t0)
    peak = 0.0
    if device.type == "cuda":
        for t in tree_leaves(params):
            t.grad = None
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        _step(fn, params, x)
        _sync(device)
        peak = float(torch.cuda.max_memory_allocated(device) - base)
    return {"ms": 1e3 * statistics.median(times), "peak_bytes": peak}


def grads(fn: Fn, params: Any, x: Any) -> list[torch.Tensor]:
    _step(fn, params, x)
    return [t.grad.detach().clone() for t in tree_leaves(params) if t.grad is not None]


def run_model(
    name: str, fn: Fn, params: Any, x: Any, steps: int, device: torch.device
) -> dict[str, Any]:
    params = tree_map(lambda t: t.to(device).requires_grad_(True), params)
    x = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, x)
    variants: dict[str, Fn] = {"eager": fn}
    if device.type == "cuda":
        variants["torch_compile"] = torch.compile(fn)
    variants["functrans_triton"] = ft.jit(fn, partition="min_cut", backend="triton")
    variants["functrans_budget0"] = ft.jit(fn, partition="memory_budget", budget=0.0)
    variants["functrans_budget0_offload"] = ft.jit(
        fn, partition="memory_budget", budget=0.0, offload=ft.Offload()
    )
    ref = grads(fn, params, x)
    row: dict[str, Any] = {"model": name}
    for v, f in variants.items():
        try:  # one variant failing (a compiler error, ...) must not lose the others' figures
            for a, b in zip(grads(f, params, x), ref, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4, msg=f"{name}/{v} grads")
            m = measure(f, params, x, steps, device)
        except Exception as e:  # recorded in the JSON, then the next variant
            if v == "eager":
                raise
            row[f"{v}_error"] = f"{type(e).__name__}: {e}"[:500]
            print(f"benchmarks.gpu: {name}/{v} failed: {row[f'{v}_error']}", flush=True)
            continue
        row[f"{v}_ms"], row[f"{v}_peak_bytes"] = m["ms"], m["peak_bytes"]
    for v in variants:
        if f"{v}_ms" not in row:
            continue
        row[f"{v}_time_ratio"] = row[f"{v}_ms"] / row["eager_ms"]
        if row["eager_peak_bytes"]:
            row[f"{v}_memory_ratio"] = row[f"{v}_peak_bytes"] / row["eager_peak_bytes"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: results/)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks.gpu: no CUDA device here; nothing measured (run it on a GPU machine)")
        return 0
    device = torch.device(args.device)
    smoke = device.type == "cpu"
    if smoke:
        torch.set_num_threads(1)  # a smoke run shares the machine; idle-spinning threads don't help
    size, steps = ("small", 2) if smoke else ("bench", args.steps)
    t0 = time.perf_counter()
    out = output_path(args.out, RESULTS, smoke)
    rows: list[dict[str, Any]] = []
    for m in models(size):  # the JSON is rewritten after each model: a timeout keeps the rest
        rows.append(run_model(*m, steps, device))
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()})
        meta = {
            "device": torch.cuda.get_device_name(device) if not smoke else "cpu (smoke run)",
            "torch": torch.__version__,
            "steps": steps,
            "size": size,
            "seconds": time.perf_counter() - t0,
        }
        out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    # the peak-memory comparison of benchmarks.peak_memory, from the CUDA allocator
    peaks = []
    names = ["gpt_stack_4", "llama_stack_4"] if smoke else list(peak_memory.MODELS)
    for name in names:
        if name.startswith("hf_") and not zoo.has_transformers():
            continue
        peaks.append(
            peak_memory.run_model(
                peak_memory.MODELS[name](), size, 2 if smoke else 10, device, smoke
            )
        )
        peak_memory.print_model(peaks[-1])
        meta["seconds"] = time.perf_counter() - t0
        out.write_text(json.dumps({"meta": meta, "rows": rows, "peak_memory": peaks}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
