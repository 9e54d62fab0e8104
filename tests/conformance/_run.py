"""The full OpInfo sweep on worker processes, its JSON report, and a command line:

    python tests/conformance/_run.py [OP ...] [--max-samples N] [--workers 2] [--out FILE]

``make conformance`` runs it through pytest (``test_full_sweep``) and rewrites
``opinfo_status.json``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from _sweep import BACKEND, BOUND, FLOOR, NATIVE, RANK, op_key, run_op, select_ops, strategies

import functrans as ft


def _init_worker() -> None:
    torch.set_num_threads(1)


def _run_key(job: tuple[str, int | None]) -> tuple[str, dict[str, Any]]:
    key, max_samples = job
    (op,) = select_ops([key])
    return key, run_op(op, max_samples)


def sweep(
    keys: Sequence[str] | None = None,
    max_samples: int | None = None,
    workers: int = 2,
    progress: Callable[[str, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run every selected op (on ``workers`` spawned processes); the status report as a dict."""
    keys = [op_key(op) for op in select_ops(keys)]
    jobs = [(k, max_samples) for k in keys]
    start = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        stream: Iterator[tuple[str, dict[str, Any]]]
        if workers > 1:
            ctx = multiprocessing.get_context("spawn")
            pool = stack.enter_context(ctx.Pool(workers, _init_worker, maxtasksperchild=50))
            stream = pool.imap_unordered(_run_key, jobs)
        else:
            _init_worker()
            stream = map(_run_key, jobs)
        for key, res in stream:
            results[key] = res
            if progress:
                progress(key, res)
    return report(results, max_samples, time.perf_counter() - start, workers)


def report(
    results: dict[str, dict[str, Any]], max_samples: int | None, seconds: float, workers: int
) -> dict[str, Any]:
    totals = {s: sum(1 for r in results.values() if r["status"] == s) for s in RANK}
    checked = len(results) - totals["skipped"]
    errors = [r["error"] for r in results.values() if "error" in r]
    return {
        "meta": {
            "torch": torch.__version__,
            "functrans": ft.__version__,
            "dtype": "float32, against a float64 reference (a float64 re-run of a mismatch "
            "tells lost precision or rounding from different math)",
            "numerics": "error = max|x - x64| / max|x64| per float output and grad, x64 from "
            "eager autograd in float64 on the same inputs and cotangents; an op's 'error' is "
            "its worst checked result's (functrans) next to eager float32's on the same "
            f"sample; wrong where functrans' exceeds {BOUND:g}x eager's + {FLOOR:.2g}. Random "
            "samples (float64 draws other numbers) and integer results are compared with "
            "eager float32 under one generator state.",
            "device": "cpu",
            "selection": "op_db entries with supports_autograd and float32 forward+backward on CPU",
            "samples_per_op": "all" if max_samples is None else f"first {max_samples}",
            "strategies": [f"{n} {o}" if o else n for n, o in strategies()],
            "backends": ["aten (every strategy)"]
            + (["aten native executor (min_cut; bit for bit vs the FX graphs)"] if NATIVE else [])
            + (["triton (min_cut; kernels interpreted on CPU)"] if BACKEND is not None else []),
            "seconds": round(seconds, 1),
            "workers": workers,
        },
        "totals": {"ops": len(results), **totals},
        "pass_rate": round(totals["passed"] / checked, 4) if checked else 0.0,
        "pass_rate_note": "passed / (ops - skipped): skipped ops cannot be compared with eager",
        "pass_rate_of_all_ops": round(totals["passed"] / len(results), 4) if results else 0.0,
        "numerics": {
            "ops_measured": len(errors),
            "functrans_above_eager": sum(1 for e in errors if e["functrans"] > e["eager"]),
            "functrans_above_2x_eager": sum(1 for e in errors if e["functrans"] > 2 * e["eager"]),
        },
        # per-op seconds stay out: the committed file changes only when a status does
        "ops": {
            k: {f: v for f, v in r.items() if f != "seconds"} for k, r in sorted(results.items())
        },
    }


def main(argv: Sequence[str] | None = None) -> None:
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ops", nargs="*", help="op keys (name or name.variant); default: all")
    parser.add_argument("--out", help="write the JSON report here")
    parser.add_argument("--max-samples", type=int, default=None)
    parser.add_argument("--workers", type=int, default=2)
    ns = parser.parse_args(argv)

    def show(key: str, res: dict[str, Any]) -> None:
        reason = res.get("reason", "")
        err = res.get("error")
        numbers = f"{err['functrans']:8.1e} vs eager {err['eager']:8.1e}" if err else " " * 25
        line = f"{res['status']:12} {res['seconds']:6.1f}s {numbers} {key}: {reason}"
        print(line[:400], flush=True)

    rep = sweep(ns.ops or None, ns.max_samples, ns.workers, show)
    print(json.dumps({"totals": rep["totals"], "pass_rate": rep["pass_rate"]}))
    if ns.out:
        with open(ns.out, "w") as fh:
            json.dump(rep, fh, indent=1)
            fh.write("\n")


if __name__ == "__main__":
    main()
