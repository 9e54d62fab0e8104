"""Partition quality: every registered strategy vs torch's min-cut partitioner, per zoo model.

For each model of :data:`benchmarks.zoo.ZOO` the joint graph is built once; then every strategy
of ``functrans.partitioners.names()`` and torch's ``min_cut_rematerialization_partition`` cut
that same graph. Per partitioner: activation bytes, recompute FLOPs, peak bytes (the same
liveness simulation, ``functrans.extend.peak_bytes``, for both) and partition wall time (median
of ``--repeats`` runs).
Ratios ours/torch are reported for our ``min_cut`` strategy when it is registered.

    python -m benchmarks.partition_quality [--quick] [--models gpt_block,...] [--repeats N]

Writes ``benchmarks/results/partition_quality.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import functrans as ft
from benchmarks import output_path, zoo
from benchmarks._torch_ref import bad_recomputes, torch_min_cut
from functrans import partitioners

RESULTS = Path(__file__).resolve().parent / "results" / "partition_quality.json"
TORCH = "torch_min_cut"
OURS = "min_cut"
METRICS = ("activation_bytes", "recompute_flops", "peak_bytes", "time_ms")


def ratio(ours: float | None, ref: float | None) -> float | None:
    """``ours / ref``: 1.0 when both are 0, inf when only ``ref`` is, None when either is None."""
    if ours is None or ref is None:
        return None
    if ref == 0:
        return 1.0 if ours == 0 else math.inf
    return ours / ref


def measure_ours(jg: ft.JointGraph, strategy: str, repeats: int, **options: Any) -> dict[str, Any]:
    """Partition with one of our strategies ``repeats`` times after a warm-up run; metrics of
    the last run."""
    ft.partition(jg, strategy, **options)
    times, p = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        p = ft.partition(jg, strategy, **options)
        times.append(time.perf_counter() - t0)
    assert p is not None
    return {
        "activation_bytes": p.activation_bytes,
        "recompute_flops": p.recompute_flops,
        "peak_bytes": getattr(p, "peak_bytes", None),
        "time_ms": 1e3 * statistics.median(times),
        "n_saved": len(p.saved),
        "recomputed": [n.name for n in p.recomputed],
    }


def measure_torch(jg: ft.JointGraph, repeats: int) -> dict[str, Any]:
    """Torch's min-cut on the same joint graph, measured the same way (see ``_torch_ref``)."""
    torch_min_cut(jg)  # warm-up: first calls pay for imports and caches
    r = torch_min_cut(jg, repeats=repeats)
    return {
        "activation_bytes": r["activation_bytes"],
        "recompute_flops": r["recompute_flops"],
        "peak_bytes": r["peak_bytes"],
        "time_ms": 1e3 * statistics.median(r["times_s"]),
        "n_saved": len(r["saved"]),
        "recomputed": r["recomputed"],
        "unmatched_names": r["unmatched_names"],
    }


def bench_model(name: str, size: str, repeats: int) -> dict[str, Any]:
    """All partitioners on one zoo model's joint graph."""
    model = zoo.ZOO[name]()
    params, x = model.make(size)
    t0 = time.perf_counter()
    jg = ft.joint(model.fn, argnums=0)(params, x)
    joint_s = time.perf_counter() - t0
    results: dict[str, dict[str, Any]] = {}
    for strategy in partitioners.names():
        options = partitioners.examples(strategy)[0]  # e.g. memory_budget needs a budget
        label = strategy + "".join(f"({k}={v})" for k, v in options.items())
        try:
            results[label] = measure_ours(jg, strategy, repeats, **options)
        except Exception as e:  # one broken strategy must not hide the others' numbers
            print(f"WARNING: {name}: strategy {label!r} failed: {type(e).__name__}: {e}")
    results[TORCH] = measure_torch(jg, repeats)
    warnings = []
    if OURS in results:
        bad = bad_recomputes(jg, results[OURS]["recomputed"])
        if bad:
            warnings.append(f"{OURS} recomputes compute-intensive/random ops: {', '.join(bad)}")
    torch_bad = bad_recomputes(jg, results[TORCH]["recomputed"])
    for w in warnings:
        print(f"WARNING: {name}: {w}")
    ratios = None
    if OURS in results:
        ratios = {m: ratio(results[OURS][m], results[TORCH][m]) for m in METRICS}
    fwd_flops = zoo.forward_flops(model, size)
    targets = None
    if OURS in results:
        ours, ref = results[OURS], results[TORCH]
        excess = ours["recompute_flops"] - ref["recompute_flops"]
        targets = {
            "activation_bytes_le_torch": ours["activation_bytes"] <= ref["activation_bytes"],
            "recompute_excess_pct_of_forward": 100.0 * excess / max(fwd_flops, 1),
            "recompute_within_2pct": excess <= 0.02 * fwd_flops,
            "no_banned_recompute": not warnings,
        }
    return {
        "model": name,
        "size": size,
        "targets": targets,
        "joint_nodes": len(jg.fx_graph.nodes),
        "joint_ops": sum(1 for _ in jg.ops()),
        "joint_trace_s": joint_s,
        "forward_flops": fwd_flops,
        "partitioners": results,
        "ratios_min_cut_over_torch": ratios,
        "warnings": warnings,
        "torch_recomputes_compute_or_random": torch_bad,
    }


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def format_table(rows: list[dict[str, Any]]) -> str:
    """One line per (model, partitioner), then a ratio line per model when min_cut exists."""
    head = ("model", "nodes", "partitioner", "act_bytes", "recomp_flops", "peak_bytes", "ms")
    lines: list[tuple[str, ...]] = [head]
    for row in rows:
        for pname, r in row["partitioners"].items():
            lines.append(
                (
                    row["model"],
                    str(row["joint_nodes"]),
                    pname,
                    *(_fmt(r[m]) for m in METRICS),
                )
            )
        ratios = row["ratios_min_cut_over_torch"]
        if ratios is not None:
            lines.append(
                (row["model"], "", "ratio min_cut/torch", *(_fmt(ratios[m]) for m in METRICS))
            )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = []
    for i, line in enumerate(lines):
        pairs = enumerate(zip(line, widths, strict=True))
        cells = [c.ljust(w) if j < 3 else c.rjust(w) for j, (c, w) in pairs]
        out.append("  ".join(cells).rstrip())
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def format_targets(rows: list[dict[str, Any]]) -> str:
    """The issue's targets per model: bytes <= torch's, recompute within torch's + 2% of the
    forward FLOPs, no compute-intensive or random op recomputed."""
    out = ["targets (min_cut vs torch):"]
    for row in rows:
        t = row["targets"]
        if t is None:
            continue
        ok = t["activation_bytes_le_torch"] and t["recompute_within_2pct"]
        ok = ok and t["no_banned_recompute"]
        out.append(
            f"  {row['model']:<12} {'met' if ok else 'MISSED':<6} bytes<=torch: "
            f"{t['activation_bytes_le_torch']}, recompute excess "
            f"{t['recompute_excess_pct_of_forward']:+.3f}% of {row['forward_flops']} fwd FLOPs, "
            f"no banned recompute: {t['no_banned_recompute']}"
        )
    return "\n".join(out)


def _json_safe(v: Any) -> Any:
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_json_safe(x) for x in v]
    return v


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models, 1 repeat")
    parser.add_argument("--models", default="", help="comma-separated zoo names (default all)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs (default 5)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    args.out = output_path(args.out, RESULTS, args.quick)
    size = "small" if args.quick else "bench"
    repeats = args.repeats or (1 if args.quick else 5)
    names = [n for n in args.models.split(",") if n] or list(zoo.ZOO)
    missing = [n for n in zoo.HF_MODELS if n not in zoo.ZOO]
    if missing:
        print(f"note: skipping {', '.join(missing)}: transformers is not installed")
    if OURS not in partitioners.names():
        print(f"note: strategy {OURS!r} is not registered; no ratios ours/torch")
    rows = []
    t0 = time.perf_counter()
    for name in names:
        try:
            rows.append(bench_model(name, size, repeats))
        except Exception as e:
            print(f"WARNING: skipping {name}: {type(e).__name__}: {e}")
    print(format_table(rows))
    print(format_targets(rows))
    for row in rows:
        if row["torch_recomputes_compute_or_random"]:
            bad = ", ".join(row["torch_recomputes_compute_or_random"])
            print(f"note: {row['model']}: torch recomputes {bad}")
    print(f"('-' = not available; ratios are ours/torch; total {time.perf_counter() - t0:.1f} s)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"size": size, "repeats": repeats, "strategies": partitioners.names()}
    # allow_nan=False: strict JSON; infinite ratios are written as the string "inf"
    doc = _json_safe({"meta": meta, "models": rows})
    args.out.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
