"""Triton codegen against Inductor on the zoo's ``min_cut`` forward and backward graphs.

Per graph: the ATen op count (what op-by-op execution launches), our Triton kernels and extern
calls (``functrans.codegen.triton``), Inductor's Triton kernel launches and extern calls for the
same graph (generated for a simulated H100, see ``benchmarks._inductor_ref``), estimated
global-memory bytes read+written for op-by-op ATen, ours and Inductor's, and how many of our
kernels run only to recompute forward values. Nothing runs on a GPU: both sides only generate
code. Targets: our kernels <= Inductor's on every graph, bytes <= 1.1x Inductor's, zero
kernels launched solely to recompute.

    python -m benchmarks.codegen [--quick]

Writes ``benchmarks/results/codegen.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import functrans as ft
from benchmarks import output_path, zoo
from benchmarks._inductor_ref import aten_bytes, inductor_kernels
from functrans.codegen.triton import TritonBackend
from functrans.extend import tensor_leaves

RESULTS = Path(__file__).resolve().parent / "results" / "codegen.json"
MODELS = ("mlp_stack", "gpt_block", "llama_block", "conv_block")
BYTES_TARGET = 1.1


def graphs(name: str, size: str) -> list[tuple[str, Any, list[Any]]]:
    """``(label, graph, example inputs)`` for the forward and backward of a min_cut partition."""
    model = zoo.ZOO[name]()
    args = model.make(size)
    p = ft.partition(ft.joint(model.fn, argnums=0)(*args), "min_cut")
    fwd_in = tensor_leaves(args)
    bwd_in = [n.meta["val"] for n in p.backward.placeholders()]
    return [(f"{name}.forward", p.forward, fwd_in), (f"{name}.backward", p.backward, bwd_in)]


def row(label: str, graph: Any, inputs: list[Any]) -> dict[str, Any]:
    ops = sum(1 for n in graph.ops() if getattr(n.target, "_schema", None) is not None)
    t0 = time.perf_counter()
    ours = TritonBackend().compile(graph, inputs)
    t1 = time.perf_counter()
    ind = inductor_kernels(graph, inputs)
    t2 = time.perf_counter()
    return {
        "graph": label,
        "aten_ops": ops,
        "ours_kernels": ours.num_kernels,
        "ours_extern": ours.num_extern_calls,
        "ours_recompute_only_kernels": ours.num_recompute_only_kernels,
        "inductor_kernels": ind.num_triton_kernels,
        "inductor_extern": ind.num_extern_calls,
        "aten_bytes": aten_bytes(graph, inputs),
        "ours_bytes": ours.bytes_moved,
        "inductor_bytes": ind.total_bytes,
        "bytes_ratio": ours.bytes_moved / max(1, ind.total_bytes),
        "kernels_target_met": ours.num_kernels <= ind.num_triton_kernels,
        "bytes_target_met": ours.bytes_moved <= BYTES_TARGET * ind.total_bytes,
        "ours_compile_s": t1 - t0,
        "inductor_codegen_s": t2 - t1,
    }


def table(rows: list[dict[str, Any]]) -> str:
    cols = [
        ("graph", "graph"),
        ("aten_ops", "aten ops"),
        ("ours_kernels", "ours k"),
        ("ours_extern", "ours ext"),
        ("inductor_kernels", "ind k"),
        ("inductor_extern", "ind ext"),
        ("aten_bytes", "aten B"),
        ("ours_bytes", "ours B"),
        ("inductor_bytes", "ind B"),
        ("bytes_ratio", "B ours/ind"),
        ("ours_recompute_only_kernels", "recompute-only"),
    ]
    head = " | ".join(h for _, h in cols)
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = [f"{r[k]:.2f}" if isinstance(r[k], float) else str(r[k]) for k, _ in cols]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, two models")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: results/)")
    args = parser.parse_args(argv)
    size = "small" if args.quick else "bench"
    models = MODELS[:2] if args.quick else MODELS
    rows = [row(*g) for name in models for g in graphs(name, size)]
    print(table(rows))
    summary = {
        "kernels_target_met": all(r["kernels_target_met"] for r in rows),
        "bytes_target_met": all(r["bytes_target_met"] for r in rows),
        "recompute_only_kernels": sum(r["ours_recompute_only_kernels"] for r in rows),
    }
    print(summary)
    out = output_path(args.out, RESULTS, args.quick)
    out.write_text(json.dumps({"meta": {"size": size}, "rows": rows, "summary": summary}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
