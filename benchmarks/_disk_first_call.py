"""Cache off, cold and warm first call in a fresh process: what the on-disk trace cache costs
a first start and saves a restart.

Each measurement runs in its own Python process with its own ``FUNCTRANS_CACHE_DIR`` (the
native executor's build folder linked in from the real cache root, so no process rebuilds it).
The process first warms imports and first-use caches on a small model with the disk cache off
(untimed: a restarted script pays them whatever the cache holds), then times one model from
``ft.jit(fn)`` through the first forward and backward:

- ``off``: ``FUNCTRANS_CACHE=0`` (what a first call costs without the cache);
- ``cold``: the cache on, its traces folder empty (a miss: the trace runs, recorded, and is
  stored);
- ``warm``: the cache as the cold process left it (a hit: the stored entry is read back).

Each repeat runs off, cold and warm one after the other (interleaved, so a loaded machine
slows all three alike); figures are medians over repeats and both ratios are against
cache-off. Targets: cold at most :data:`COLD_TARGET` x off, warm at most :data:`WARM_TARGET` x
off, on wall-clock time (what a user waits for). The ratios of the process's CPU seconds
(``*_cpu_ratio``) are reported beside them: nothing here waits on anything but the CPU (one
intra-op thread, the store written without fsync), so a CPU ratio far from the wall-clock one
says the machine, not functrans, moved the figure.

    python -m benchmarks._disk_first_call [--models mlp_stack hf_llama] [--repeats 3]
        [--profile DIR]

``--profile DIR`` also writes a cProfile of each timed first call, in its fresh process, to
``DIR/<model>-<mode>-<repeat>.prof`` (read with ``python -m pstats``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
COLD_TARGET = 1.15  # cold / off
WARM_TARGET = 0.35  # warm / off
TIMEOUT_S = 600
MODES = {"off": "0", "cold": "1", "warm": "1"}


def child(name: str, threads: int, profile: str | None = None) -> None:
    """In a fresh process: warm up, then time one first call of zoo model ``name`` (profiled
    into the file ``profile`` where given); print one JSON line."""
    import torch

    torch.set_num_threads(threads)
    import functrans as ft
    from benchmarks import zoo
    from functrans.extend import tensor_leaves

    mode = os.environ["FUNCTRANS_CACHE"]
    os.environ["FUNCTRANS_CACHE"] = "0"
    warm = zoo.mlp_stack(1)
    wp, wx = warm.make("small")
    for t in tensor_leaves(((wp,), {})):
        t.requires_grad_(True)
    ft.jit(warm.fn)(wp, wx).backward()
    os.environ["FUNCTRANS_CACHE"] = mode
    model = (zoo.ZOO | zoo.FAMILIES)[name]()
    params, x = model.make("bench")
    for t in tensor_leaves(((params,), {})):
        t.requires_grad_(t.is_floating_point())
    gc.collect()

    def first() -> Any:
        f = ft.jit(model.fn)
        f(params, x).backward()
        return f

    if profile is None:
        start, cpu = time.perf_counter(), time.process_time()
        f = first()
        seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    else:
        import cProfile

        prof = cProfile.Profile()
        start, cpu = time.perf_counter(), time.process_time()
        f = prof.runcall(first)
        seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu
        prof.dump_stats(profile)
    info = f.cache_info()
    row = {"s": seconds, "cpu_s": cpu_s, "disk_hits": info.disk_hits, "trace_s": info.trace_s}
    row |= {"partition_s": info.partition_s, "compile_s": info.compile_s}
    print("RESULT " + json.dumps(row), flush=True)


def _run(
    name: str, root: Path, mode: str, threads: int, profile: Path | None = None
) -> dict[str, Any]:
    env = {**os.environ, "FUNCTRANS_CACHE_DIR": str(root), "FUNCTRANS_CACHE": MODES[mode]}
    prof = None if profile is None else str(profile)
    code = f"from benchmarks._disk_first_call import child; child({name!r}, {threads}, {prof!r})"
    return child_result(code, env, f"{name} ({mode})")


def child_result(
    code: str, env: dict[str, str], what: str, timeout: float = TIMEOUT_S, cwd: Path = REPO
) -> dict[str, Any]:
    """Run ``code`` in a fresh Python process (the repository root its working directory, or
    ``cwd``: another checkout, whose ``functrans`` and ``benchmarks`` it then imports) and
    return the JSON of its last ``RESULT`` line; a failed child raises, naming ``what``."""
    if cwd != REPO:
        env = {**env, "PYTHONPATH": str(cwd)}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{what}: {done.stderr[-3000:]}")
    return dict(json.loads(lines[-1][len("RESULT ") :]))


def fresh_root() -> Path:
    """A fresh cache root, private, with the real native build folder linked in."""
    from functrans.extend import cache_root

    root = Path(tempfile.mkdtemp(prefix="ft-disk-bench-"))
    native = cache_root() / "native"
    if native.is_dir():
        (root / "native").symlink_to(native, target_is_directory=True)
    return root


def fresh_first_calls(
    names: list[str], repeats: int, threads: int, profile: Path | None = None
) -> list[dict[str, Any]]:
    """One row per model: medians over ``repeats`` of off, cold and warm first calls, and
    cold and warm against off."""
    rows = []
    for name in names:
        root = fresh_root()
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
        try:
            for i in range(repeats):
                shutil.rmtree(root / "traces", ignore_errors=True)
                for mode in MODES:
                    prof = None if profile is None else profile / f"{name}-{mode}-{i}.prof"
                    runs[mode].append(_run(name, root, mode, threads, prof))
        finally:
            shutil.rmtree(root, ignore_errors=True)
        row: dict[str, Any] = {"model": name}
        for kind, results in runs.items():
            row[f"{kind}_s"] = statistics.median(r["s"] for r in results)
            row[f"{kind}_cpu_s"] = statistics.median(r["cpu_s"] for r in results)
            row[f"{kind}_trace_s"] = statistics.median(r["trace_s"] for r in results)
            row[f"{kind}_partition_s"] = statistics.median(r["partition_s"] for r in results)
        row["warm_disk_hits"] = min(r["disk_hits"] for r in runs["warm"])
        row["cold_disk_hits"] = max(r["disk_hits"] for r in runs["cold"])
        row["cold_ratio"] = row["cold_s"] / row["off_s"]
        row["warm_ratio"] = row["warm_s"] / row["off_s"]
        row["cold_cpu_ratio"] = row["cold_cpu_s"] / row["off_cpu_s"]
        row["warm_cpu_ratio"] = row["warm_cpu_s"] / row["off_cpu_s"]
        row["target_met"] = (
            row["cold_ratio"] <= COLD_TARGET
            and row["warm_ratio"] <= WARM_TARGET
            and row["warm_disk_hits"] >= 1
            and row["cold_disk_hits"] == 0
        )
        rows.append(row)
        print(
            f"  {name}: off {row['off_s']:.3f} s, cold {row['cold_s']:.3f} s "
            f"({row['cold_ratio']:.2f}x), warm {row['warm_s']:.3f} s ({row['warm_ratio']:.2f}x); "
            f"CPU: off {row['off_cpu_s']:.3f} s, cold {row['cold_cpu_ratio']:.2f}x, "
            f"warm {row['warm_cpu_ratio']:.2f}x",
            flush=True,
        )
    return rows


COLUMNS = {"model": "model", "off_s": "off_s", "cold_s": "cold_s", "warm_s": "warm_s"}
COLUMNS |= {"off trace": "off_trace_s", "cold trace": "cold_trace_s"}
COLUMNS |= {"warm load": "warm_trace_s", "warm partition": "warm_partition_s"}
COLUMNS |= {"cold/off": "cold_ratio", "warm/off": "warm_ratio"}
COLUMNS |= {"cold/off cpu": "cold_cpu_ratio", "warm/off cpu": "warm_cpu_ratio"}
COLUMNS[f"target <={COLD_TARGET}, <={WARM_TARGET}"] = "target_met"


def _table(rows: list[dict[str, Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, bool):
            return "met" if v else "MISSED"
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    body = [[cell(r[k]) for k in COLUMNS.values()] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(COLUMNS)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(COLUMNS, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(b, widths, strict=True)) for b in body]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Measure the models named, print the table (and write JSON with ``--out``)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp_stack", "hf_llama", "hf_gpt2"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", type=Path, default=None, help="folder for cProfile dumps")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON")
    args = parser.parse_args(argv)
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    rows = fresh_first_calls(args.models, args.repeats, args.threads, args.profile)
    print(_table(rows))
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
