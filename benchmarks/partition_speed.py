"""Partition speed: our ``min_cut`` vs torch's min-cut partitioner on MLP stacks of growing depth.

For stacks of 8, 32, 128 and 512 Linear-GELU-Linear-LayerNorm blocks (``--max-blocks`` caps
them), the joint graph is built once and both partitioners cut that same graph (partition time
only, median of N runs, N smaller for deeper stacks; torch gets a deep copy per run, untimed).
If ``min_cut`` is not registered yet, our ``default`` strategy stands in (and the output says
so).

End to end, first call: ours is ``ft.joint`` + ``ft.partition(.., strategy)`` then one forward
and one backward run of the partition; torch's is ``aot_function(fn, nop, nop,
partition_fn=min_cut_rematerialization_partition)`` called once on parameters that require
grad, then ``.backward()`` on the loss. Both columns include the backward pass; torch's time to
the forward's return is reported too (``torch_fwd_s``: tracing, partitioning and compiling
happen there).

    python -m benchmarks.partition_speed [--quick] [--max-blocks N]

Writes ``benchmarks/results/partition_speed.json``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import optree
import torch
import torch.fx as fx
from torch._functorch._aot_autograd.utils import make_boxed_func
from torch._functorch.aot_autograd import aot_function
from torch._functorch.partitioners import min_cut_rematerialization_partition

import functrans as ft
from benchmarks import output_path, zoo
from functrans import partitioners

RESULTS = Path(__file__).resolve().parent / "results" / "partition_speed.json"
BLOCKS = (8, 32, 128, 512)
OURS = "min_cut"


def runs_for(n_blocks: int, quick: bool) -> int:
    """Timed repeats: fewer for deeper stacks."""
    if quick:
        return 1 if n_blocks > 32 else 3
    return {8: 9, 32: 7, 128: 3}.get(n_blocks, 1)


def median_s(fn: Callable[[], Any], runs: int) -> tuple[float, list[float]]:
    """Median wall time of ``runs`` calls of ``fn`` (and every time)."""
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def torch_partition_s(jg: ft.JointGraph, runs: int) -> tuple[float, list[float]]:
    """Median time of torch's min-cut on deep copies of ``jg``'s module (copying untimed)."""
    times = []
    for _ in range(runs):
        gm = copy.deepcopy(jg.graph_module)
        t0 = time.perf_counter()
        min_cut_rematerialization_partition(gm, None, num_fwd_outputs=jg.num_outputs)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def _nop(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
    """A compiler that runs the graph as is (boxed, as AOTAutograd prefers)."""
    return make_boxed_func(gm)


def ours_first_call(model: zoo.Model, params: Any, x: Any, strategy: str) -> dict[str, float]:
    """Seconds for joint + partition (``build_s``) and through one forward+backward run."""
    gc.collect()
    t0 = time.perf_counter()
    jg = ft.joint(model.fn, argnums=0)(params, x)
    p = ft.partition(jg, strategy)
    build = time.perf_counter() - t0
    _, saved = p.forward(params, x)
    p.backward(saved, (torch.ones(()),))
    return {"build_s": build, "total_s": time.perf_counter() - t0}


def torch_first_call(model: zoo.Model, params: Any, x: Any) -> dict[str, float]:
    """Seconds until a fresh ``aot_function``'s first forward returns, and through backward."""
    leaves: Any = optree.tree_map(lambda t: t.detach().requires_grad_(), params)
    gc.collect()
    t0 = time.perf_counter()
    compiled = aot_function(
        model.fn,
        fw_compiler=_nop,
        bw_compiler=_nop,
        partition_fn=min_cut_rematerialization_partition,
    )
    loss = compiled(leaves, x)
    fwd = time.perf_counter() - t0
    loss.backward()
    return {"fwd_s": fwd, "total_s": time.perf_counter() - t0}


def bench_depth(n_blocks: int, strategy: str, quick: bool) -> dict[str, Any]:
    """Partition times and first-call times for one stack depth."""
    model = zoo.mlp_stack(n_blocks)
    params, x = model.make("bench")
    t0 = time.perf_counter()
    jg = ft.joint(model.fn, argnums=0)(params, x)
    joint_s = time.perf_counter() - t0
    runs = runs_for(n_blocks, quick)
    ours_s, ours_all = median_s(lambda: ft.partition(jg, strategy), runs)
    torch_s, torch_all = torch_partition_s(jg, runs)
    ours_e2e = ours_first_call(model, params, x, strategy)
    torch_e2e = torch_first_call(model, params, x)
    return {
        "n_blocks": n_blocks,
        "joint_nodes": len(jg.fx_graph.nodes),
        "joint_s": joint_s,
        "runs": runs,
        "ours_partition_s": ours_s,
        "torch_partition_s": torch_s,
        "partition_ratio": ours_s / torch_s,
        "ours_partition_all_s": ours_all,
        "torch_partition_all_s": torch_all,
        "ours_build_s": ours_e2e["build_s"],
        "ours_first_call_s": ours_e2e["total_s"],
        "torch_fwd_s": torch_e2e["fwd_s"],
        "torch_first_call_s": torch_e2e["total_s"],
        "first_call_ratio": ours_e2e["total_s"] / torch_e2e["total_s"],
    }


def format_table(rows: list[dict[str, Any]], strategy: str) -> str:
    """Partition time and first-call time per depth, ours vs torch."""
    cols = (
        ("blocks", "n_blocks", "{}"),
        ("nodes", "joint_nodes", "{}"),
        ("runs", "runs", "{}"),
        (f"{strategy}_ms", "ours_partition_s", "ms"),
        ("torch_ms", "torch_partition_s", "ms"),
        ("ratio", "partition_ratio", "{:.2f}"),
        ("ours_build_s", "ours_build_s", "{:.2f}"),
        ("ours_1st_s", "ours_first_call_s", "{:.2f}"),
        ("torch_fwd_s", "torch_fwd_s", "{:.2f}"),
        ("torch_1st_s", "torch_first_call_s", "{:.2f}"),
        ("ratio_1st", "first_call_ratio", "{:.2f}"),
    )

    def cell(fmt: str, v: Any) -> str:
        return f"{1e3 * v:.1f}" if fmt == "ms" else fmt.format(v)

    lines = [[c[0] for c in cols]] + [[cell(f, r[k]) for _, k, f in cols] for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(cols))]
    out = ["  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="depths up to 32, fewer runs")
    parser.add_argument("--max-blocks", type=int, default=None, help="deepest stack to run")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    args.out = output_path(args.out, RESULTS, args.quick)
    cap = args.max_blocks if args.max_blocks is not None else (32 if args.quick else max(BLOCKS))
    depths = [n for n in BLOCKS if n <= cap]
    strategy = OURS if OURS in partitioners.names() else "default"
    if strategy != OURS:
        print(f"note: strategy {OURS!r} is not registered; timing 'default' in its place")
    # warm-up (untimed): imports and first-use caches of both sides
    warm = zoo.mlp_stack(1)
    wp, wx = warm.make("small")
    ours_first_call(warm, wp, wx, strategy)
    torch_first_call(warm, wp, wx)
    rows = []
    for n in depths:
        rows.append(bench_depth(n, strategy, args.quick))
        print(f"  {n} blocks done ({rows[-1]['joint_nodes']} joint nodes)", flush=True)
    print(format_table(rows, strategy))
    print(
        "partition: time to cut the same joint graph (median of `runs`); 1st: first call end "
        "to end, forward and backward included (ours: joint + partition + run; torch: "
        "aot_function with nop compilers); ours_build: joint + partition only; torch_fwd: "
        "torch's first call until forward returns"
    )
    by_n = {r["n_blocks"]: r for r in rows}
    scale = None
    if 512 in by_n and 32 in by_n:
        scale = by_n[512]["ours_partition_s"] / by_n[32]["ours_partition_s"]
        torch_scale = by_n[512]["torch_partition_s"] / by_n[32]["torch_partition_s"]
        print(f"{strategy}: 512-block / 32-block partition time = {scale:.1f}x (16x the nodes)")
        print(f"torch min-cut: 512-block / 32-block partition time = {torch_scale:.1f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"strategy": strategy, "quick": args.quick, "scale_512_over_32": scale}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
