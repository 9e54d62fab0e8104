"""The training step of a stack compiled once (``FUNCTRANS_REGIONS=compiled``, the default)
against the unrolled step (``FUNCTRANS_REGIONS=unrolled``) and eager: step time and peak
memory.

The model is ``benchmarks.dynamic.GPT`` (width 64, 4 heads, dropout 0.1) with ``--depth``
blocks (16), batch 2 of 32 tokens, float32, one intra-op thread. For each strategy
(``min_cut``, ``default``, ``full_remat``) one process compiles both variants from one
seed, checks that their losses and gradients are equal (``torch.equal``), then times steps
(forward, backward; medians of interleaved rounds of 10 steps) and measures each step's peak
with the allocator (:func:`functrans.testing.measure_peak`) beside the peak the partition
reports.

    python -m benchmarks.regions_step [--quick] [--depth N] [--out PATH]

``--quick``: 4 blocks, 3 rounds. Writes ``benchmarks/results/regions_step.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import functrans as ft
from benchmarks import write_results
from benchmarks.dynamic import GPT, SEQ, VOCAB
from functrans.testing import measure_peak

RESULTS = Path(__file__).resolve().parent / "results" / "regions_step.json"
STRATEGIES = ("min_cut", "default", "full_remat")
VARIANTS = {"unrolled": "unrolled", "compiled": "compiled"}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    return idx, torch.randint(0, VOCAB, (2, SEQ), generator=gen)


def measure(strategy: str, depth: int, rounds: int) -> dict[str, Any]:
    idx, tgt = _batch()
    steps: dict[str, Any] = {}
    results: dict[str, Any] = {}
    before = os.environ.get("FUNCTRANS_REGIONS")
    for name, value in VARIANTS.items():
        os.environ["FUNCTRANS_REGIONS"] = value
        torch.manual_seed(0)
        model = GPT(layers=depth)
        step = ft.jit(model, partition=strategy)
        torch.manual_seed(1)
        loss = step(idx, tgt)
        loss.backward()
        results[name] = (loss.detach(), [p.grad.clone() for p in model.parameters()])
        steps[name] = (model, step)
    if before is None:
        os.environ.pop("FUNCTRANS_REGIONS", None)
    else:
        os.environ["FUNCTRANS_REGIONS"] = before
    (a, ga), (b, gb) = results["unrolled"], results["compiled"]
    equal = bool(torch.equal(a, b)) and all(torch.equal(x, y) for x, y in zip(ga, gb, strict=True))
    torch.manual_seed(0)
    eager = GPT(layers=depth)
    steps["eager"] = (eager, eager)

    def run(name: str) -> None:
        model, fn = steps[name]
        model.zero_grad(set_to_none=True)
        fn(idx, tgt).backward()

    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name in steps:
            start = time.perf_counter()
            for _ in range(10):
                run(name)
            times[name].append((time.perf_counter() - start) / 10)
    row: dict[str, Any] = {"equal": equal}
    for name in steps:
        model, fn = steps[name]
        reported = fn.partitions()[0].peak_bytes if name != "eager" else None
        row[name] = {
            "step_ms": 1000 * statistics.median(times[name]),
            "peak_bytes": measure_peak(lambda name=name: run(name)).peak_bytes,
            "reported_peak_bytes": reported,
        }
    row["compiled_vs_unrolled"] = {
        "step": row["compiled"]["step_ms"] / row["unrolled"]["step_ms"],
        "peak": row["compiled"]["peak_bytes"] / row["unrolled"]["peak_bytes"],
    }
    return row


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"{'strategy':>10} {'variant':>9} {'step ms':>8} {'peak KiB':>9} {'reported':>9} equal"
    ]
    for strategy, row in result["strategies"].items():
        for name in ("unrolled", "compiled", "eager"):
            r = row[name]
            reported = r["reported_peak_bytes"]
            rep = "-" if reported is None else f"{reported / 1024:.0f}"
            lines.append(
                f"{strategy:>10} {name:>9} {r['step_ms']:>8.2f} {r['peak_bytes'] / 1024:>9.0f} "
                f"{rep:>9} {row['equal']}"
            )
        ratio = row["compiled_vs_unrolled"]
        lines.append(
            f"{'':>10} compiled/unrolled: step {ratio['step']:.3f}x, peak {ratio['peak']:.3f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 blocks, 3 rounds")
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    depth, rounds = (4, 3) if args.quick else (args.depth, 7)
    result: dict[str, Any] = {
        "config": {"model": "benchmarks.dynamic.GPT(d=64, heads=4)", "depth": depth},
        "strategies": {s: measure(s, depth, rounds) for s in STRATEGIES},
    }
    print(format_table(result))
    write_results(args.out, RESULTS, args.quick, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
