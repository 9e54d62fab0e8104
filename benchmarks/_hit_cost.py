"""What a cache hit costs when the compiled function reads state: the guards' share of a call.

A jitted call that finds its entry checks, besides its arguments, every value the entry's
trace read from outside them (:mod:`functrans._trace.reads`). This measures, per call and on
one thread, in CPU time:

- ``x * 2`` on one element (nothing read besides the argument), as ``benchmarks.runtime``'s
  overhead row: the jitted call minus a call of the entry's compiled forward;
- forward calls under ``torch.no_grad()`` of models whose forward reads configuration: a
  16-block ``benchmarks.dynamic.GPT`` and a 4-layer Hugging Face GPT-2 built from a config
  (``transformers``), as ``ft.jit(model)``, eagerly, and as
  ``torch.compile(model, backend="aot_eager")`` (Dynamo's guards: what a user would reach for
  instead), calls interleaved in rounds.

Each measurement is a fresh process (:func:`child_code`, which uses the public API and
``benchmarks.runtime.overhead`` only, so it runs in an older checkout too):
:func:`side_by_side` runs this checkout's and a baseline checkout's processes alternately, so a
change's cost is measured beside the code before it.

    python -m benchmarks.runtime --hits-only [--baseline CHECKOUT]
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

from benchmarks import _disk_first_call

#: what one child process runs (from the checkout whose code it measures)
CHILD = r"""
import gc, json, statistics, time, warnings
import torch
torch.set_num_threads(1)
import functrans as ft
from benchmarks.runtime import overhead
from benchmarks.dynamic import GPT

CALLS, ROUNDS = {calls}, {rounds}
out = {{}}
for rg in (False, True):
    out[f"x2_overhead_us_grad{{int(rg)}}"] = overhead(rg, CALLS * 20, ROUNDS)["overhead_us"]


def per_call(fns, args):
    times = {{k: [] for k in fns}}
    for r in range(ROUNDS + 1):
        for k, fn in fns.items():
            t0 = time.thread_time()
            for _ in range(CALLS):
                fn(*args)
            if r:
                times[k].append(1e6 * (time.thread_time() - t0) / CALLS)
    return {{k: statistics.median(v) for k, v in times.items()}}


def models():
    torch.manual_seed(0)
    idx = torch.randint(0, 64, (2, 8))
    yield "gpt16", GPT(layers=16).eval(), (idx, idx)
    try:
        import transformers
    except ImportError:
        return
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        n_layer=4, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
        eos_token_id=0,
    )
    yield "hf_gpt2", transformers.GPT2LMHeadModel(config).eval(), (idx,)


warnings.simplefilter("ignore")
gc.collect()
gc.disable()
with torch.no_grad():
    for name, model, args in models():
        aot = torch.compile(model, backend="aot_eager")
        fns = {{"eager": model, "jit": ft.jit(model), "aot_eager": aot}}
        for fn in fns.values():
            fn(*args); fn(*args)
        misses = fns["jit"].cache_info().misses
        for k, v in per_call(fns, args).items():
            out[f"{{name}}_{{k}}_us"] = v
        out[f"{{name}}_jit_misses"] = misses
        slots = getattr(fns["jit"]._compiled._cache, "slots", None)
        if slots is not None:  # this checkout: the reads' guard alone
            guard = slots()[0].reads
            t0 = time.thread_time()
            for _ in range(CALLS * 10):
                guard.holds()
            out[f"{{name}}_guard_us"] = 1e6 * (time.thread_time() - t0) / (CALLS * 10)
            out[f"{{name}}_reads"] = len(guard)
print("RESULT " + json.dumps(out))
"""


def child_code(calls: int, rounds: int) -> str:
    return CHILD.format(calls=calls, rounds=rounds)


def measure(checkout: Path, calls: int, rounds: int) -> dict[str, Any]:
    """One fresh process of ``checkout``'s code (the on-disk cache off: hits, not loads)."""
    env = {**os.environ, "FUNCTRANS_CACHE": "0", "OMP_NUM_THREADS": "1"}
    code = child_code(calls, rounds)
    return _disk_first_call.child_result(code, env, f"cache hits in {checkout}", cwd=checkout)


def side_by_side(
    baseline: Path | None, calls: int, rounds: int, processes: int
) -> dict[str, dict[str, float]]:
    """Medians over ``processes`` fresh processes per checkout, run alternately."""
    runs: dict[str, list[dict[str, Any]]] = {"this": [], "baseline": []}
    for _ in range(processes):
        runs["this"].append(measure(_disk_first_call.REPO, calls, rounds))
        if baseline is not None:
            runs["baseline"].append(measure(baseline, calls, rounds))
    return {
        side: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        for side, rs in runs.items()
        if rs
    }


def table(result: dict[str, dict[str, float]]) -> str:
    """Rows: each figure, for this checkout and the baseline."""
    keys = list(result["this"])
    lines = [f"{'us per call (CPU)':<28} {'this':>10} {'baseline':>10}"]
    for k in keys:
        base = result.get("baseline", {}).get(k)
        cell = "" if base is None else f"{base:>10.2f}"
        lines.append(f"{k:<28} {result['this'][k]:>10.2f} {cell}")
    return "\n".join(lines)
