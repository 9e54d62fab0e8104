"""Cold vs warm first call in a fresh process: what the on-disk trace cache saves a restart.

Each measurement runs in its own Python process with its own ``FUNCTRANS_CACHE_DIR`` (the
native executor's build folder linked in from the real cache root, so no process rebuilds it).
The process first warms imports and first-use caches on a small model with the disk cache off
(untimed: a restarted script pays them whatever the cache holds), then times one model from
``ft.jit(fn)`` through the first forward and backward:

- ``off``: the disk cache off (what a first call cost before it);
- ``cold``: the cache on, its traces folder empty (a miss: the trace runs, recorded, and is
  stored);
- ``warm``: the cache as the cold process left it (a hit: the graph is read back).

Target: warm at most a quarter of cold.
"""

from __future__ import annotations

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
TARGET = 0.25  # warm / cold
TIMEOUT_S = 600


def child(name: str, threads: int) -> None:
    """In a fresh process: warm up, then time one first call of zoo model ``name``; print
    one JSON line."""
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
    model = zoo.ZOO[name]()
    params, x = model.make("bench")
    for t in tensor_leaves(((params,), {})):
        t.requires_grad_(t.is_floating_point())
    gc.collect()
    start = time.perf_counter()
    f = ft.jit(model.fn)
    f(params, x).backward()
    seconds = time.perf_counter() - start
    info = f.cache_info()
    row = {"s": seconds, "disk_hits": info.disk_hits, "trace_s": info.trace_s}
    print("RESULT " + json.dumps(row), flush=True)


def _run(name: str, root: Path, mode: str, threads: int) -> dict[str, Any]:
    env = {**os.environ, "FUNCTRANS_CACHE_DIR": str(root), "FUNCTRANS_CACHE": mode}
    code = f"from benchmarks._disk_first_call import child; child({name!r}, {threads})"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{name} ({mode}): {done.stderr[-3000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    result: dict[str, Any] = json.loads(line[len("RESULT ") :])
    return result


def _root() -> Path:
    """A fresh cache root, private, with the real native build folder linked in."""
    from functrans.extend import cache_root

    root = Path(tempfile.mkdtemp(prefix="ft-disk-bench-"))
    native = cache_root() / "native"
    if native.is_dir():
        (root / "native").symlink_to(native, target_is_directory=True)
    return root


def fresh_first_calls(names: list[str], repeats: int, threads: int) -> list[dict[str, Any]]:
    """One row per model: medians over ``repeats`` of off, cold and warm first calls."""
    rows = []
    for name in names:
        root = _root()
        runs: dict[str, list[dict[str, Any]]] = {"off": [], "cold": [], "warm": []}
        try:
            for _ in range(repeats):
                shutil.rmtree(root / "traces", ignore_errors=True)
                runs["off"].append(_run(name, root, "0", threads))
                runs["cold"].append(_run(name, root, "1", threads))
                runs["warm"].append(_run(name, root, "1", threads))
        finally:
            shutil.rmtree(root, ignore_errors=True)
        row: dict[str, Any] = {"model": name}
        for kind, results in runs.items():
            row[f"{kind}_s"] = statistics.median(r["s"] for r in results)
            row[f"{kind}_trace_s"] = statistics.median(r["trace_s"] for r in results)
        row["warm_disk_hits"] = min(r["disk_hits"] for r in runs["warm"])
        row["cold_disk_hits"] = max(r["disk_hits"] for r in runs["cold"])
        row["ratio"] = row["warm_s"] / row["cold_s"]
        row["target_met"] = row["ratio"] <= TARGET and row["warm_disk_hits"] >= 1
        rows.append(row)
        print(f"  {name}: cold {row['cold_s']:.3f} s, warm {row['warm_s']:.3f} s", flush=True)
    return rows
