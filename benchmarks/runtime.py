"""Runtime of ``ft.jit``: steady-state training steps, first call, and per-call overhead.

1. Steady state: the median fwd+bwd step (``loss = fn(params, x); loss.backward()``) of the
   zoo's 8-block MLP stack and of a stack of 4 GPT blocks (separate parameters per block, built
   as ``benchmarks.remat`` builds its stacks), float32, ``size="bench"``, for eager,
   ``ft.jit(fn, partition="min_cut")`` (aten backend), ``ft.jit(fn, partition="default")``
   (no recompute), ``min_cut`` on the aten backend's Python executor instead of its native one
   (``jit_python``) and ``torch.compile(fn, backend="aot_eager")``. Warm-up rounds (the first,
   compiling call included) are untimed; then steps run interleaved, each round running every
   variant once in a freshly shuffled order (seeded: a fixed order favours some variants by
   what ran just before them), gradients set to None before each step, the garbage collector
   off. Steps are timed in the calling thread's CPU time (``time.thread_time``; torch runs one
   intra-op thread and CPU autograd runs on the calling thread), so other processes on a
   shared machine do not distort the ratios. Gradients of every compiled variant are checked
   against eager first. The whole measurement runs in ``--processes`` fresh processes (3) and
   each figure is the median over them: all variants of one process run a few percent fast
   or slow together. Target: jit within 1.05x of eager.
2. First call (trace + partition + compile + one forward and backward): a fresh ``ft.jit`` vs
   a fresh ``aot_function(fn, nop, nop, partition_fn=min_cut_rematerialization_partition)`` on
   the same inputs, each on a freshly built function object (median over repeats, the two
   alternating). Both sides are warmed up once on a small model first (imports, first-use
   caches). Target: ours faster.
3. Cache off, cold and warm first call in a fresh process (``benchmarks/_disk_first_call.py``):
   one process per measurement, timing ``ft.jit(fn)`` through the first forward and backward
   with the on-disk trace cache off, empty (cold) and filled by the previous process (warm),
   after an untimed warm-up of imports on another model, interleaved per repeat. Targets, both
   against cache-off: cold <= 1.15x, warm <= 0.35x.
4. Per-call overhead on a cache hit: ``lambda x: x * 2`` on a 1-element tensor, called through
   ``ft.jit`` vs through the cached entry's compiled forward (``entry.forward(x)``), with
   ``requires_grad`` False and True (no backward). Overhead = (jit - direct) / calls. Target:
   <= 30 us.
5. Cache hits of functions that read state (:mod:`benchmarks._hit_cost`): the overhead above
   and forward calls of a 16-block GPT and a 4-layer Hugging Face GPT-2 as ``ft.jit``, eager and
   ``torch.compile(backend="aot_eager")``, with the guard of the reads alone, in fresh
   processes; with ``--baseline CHECKOUT`` (another checkout of functrans, ``git worktree add
   /tmp/base <commit>``) its processes alternate with this one's, side by side.

    python -m benchmarks.runtime [--quick] [--threads N] [--processes N] [--profile]
        [--baseline CHECKOUT] [--hits-only]

``--profile`` adds a wall-clock attribution of the jit step (graphs alone, flattening, no
decompositions, no recompute) and cProfile listings of jit's first call and steady steps.
Writes ``benchmarks/results/runtime.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import multiprocessing
import pstats
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.fx as fx
from torch._functorch._aot_autograd.utils import make_boxed_func  # = aot_autograd.make_boxed_func
from torch._functorch.aot_autograd import aot_function
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.utils._pytree import tree_leaves

import functrans as ft
from benchmarks import _disk_first_call, _hit_cost, output_path, remat, zoo
from functrans import codegen
from functrans.codegen.aten import AtenBackend
from functrans.extend import tensor_leaves

RESULTS = Path(__file__).resolve().parent / "results" / "runtime.json"
STEP_TARGET = 1.05  # jit step / eager step
OVERHEAD_TARGET_US = 30.0
VARIANTS = ("eager", "jit", "jit_default", "jit_python", "aot_eager")
# min_cut on the "aten" backend's Python executor: what the native executor saves
codegen.register_backend("aten-python", AtenBackend(executor="python"), replace=True)
Fn = Callable[..., torch.Tensor]
Case = tuple[str, Callable[[], Fn], Any, torch.Tensor]  # name, fresh-fn factory, params, x


def cases(size: str = "bench") -> list[Case]:
    """The two benchmark models: ``(name, fresh-function factory, params, x)``."""
    mlp = zoo.mlp_stack(8)
    mlp_params, mlp_x = mlp.make(size)
    gpt = zoo.gpt_block()
    made = [gpt.make(size, torch.float32, seed) for seed in range(remat.N_BLOCKS)]
    gpt_params, gpt_x = [p for p, _ in made], made[0][1]
    out: list[Case] = [
        (mlp.name, lambda: zoo.mlp_stack(8).fn, mlp_params, mlp_x),
        (f"gpt_stack_{remat.N_BLOCKS}", lambda: remat.stack(remat.gpt_block), gpt_params, gpt_x),
    ]
    for _, _, params, _ in out:
        for t in tree_leaves(params):
            t.requires_grad_(True)
    return out


def _zero(params: Any) -> None:
    for t in tree_leaves(params):
        t.grad = None


def _grads(fn: Fn, params: Any, x: torch.Tensor) -> list[torch.Tensor]:
    _zero(params)
    fn(params, x).backward()  # type: ignore[no-untyped-call]  # the zoo's model functions are unannotated
    return [t.grad.clone() for t in tree_leaves(params) if t.grad is not None]


def _nop(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
    """A compiler that runs the graph as it is (boxed, as AOTAutograd wants)."""
    return make_boxed_func(gm)


def interleaved(
    variants: dict[str, Fn], params: Any, x: torch.Tensor, steps: int, warmup: int
) -> dict[str, float]:
    """Median ms of a fwd+bwd step per variant; rounds run every variant once, in a shuffled
    order, the first ``warmup`` rounds untimed, gradients reset before each step, gc off."""
    times: dict[str, list[float]] = {v: [] for v in variants}
    order, rng = list(variants), random.Random(0)
    gc.collect()
    gc.disable()
    try:
        for r in range(-warmup, steps):
            rng.shuffle(order)
            for v in order:
                fn = variants[v]
                _zero(params)
                t0 = time.thread_time()
                fn(params, x).backward()  # type: ignore[no-untyped-call]  # the zoo's model functions are unannotated
                if r >= 0:
                    times[v].append(time.thread_time() - t0)
    finally:
        gc.enable()
    return {v: 1e3 * statistics.median(ts) for v, ts in times.items()}


def steady_state(case: Case, steps: int, warmup: int) -> dict[str, Any]:
    """Median fwd+bwd step time of eager, jit and aot_eager, interleaved step by step."""
    name, factory, params, x = case
    fn = factory()
    variants: dict[str, Fn] = {
        "eager": fn,
        "jit": ft.jit(fn, partition="min_cut"),
        "jit_default": ft.jit(fn, partition="default"),
        "jit_python": ft.jit(fn, partition="min_cut", backend="aten-python"),
        "aot_eager": torch.compile(fn, backend="aot_eager"),
    }
    ref = _grads(fn, params, x)
    for v in VARIANTS[1:]:  # compiles too; a wrong gradient makes the timing meaningless
        got = _grads(variants[v], params, x)
        assert len(got) == len(ref), f"{name}/{v}: {len(got)} gradients, eager has {len(ref)}"
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"{name}/{v} grads")
    ms = interleaved(variants, params, x, steps, warmup)
    info = variants["jit"].cache_info()  # type: ignore[attr-defined]  # variants are plain callables; this one is a Jitted
    return {
        "model": name,
        "steps": steps,
        **{f"{v}_ms": ms[v] for v in VARIANTS},
        "jit_ratio": ms["jit"] / ms["eager"],
        "jit_default_ratio": ms["jit_default"] / ms["eager"],
        "jit_python_ratio": ms["jit_python"] / ms["eager"],
        "aot_eager_ratio": ms["aot_eager"] / ms["eager"],
        "jit_misses": info.misses,
        "target_met": ms["jit"] <= STEP_TARGET * ms["eager"],
    }


RATIOS = ("jit_ratio", "jit_default_ratio", "jit_python_ratio", "aot_eager_ratio")


def _steady_in_process(index: int, steps: int, warmup: int, threads: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    return steady_state(cases()[index], steps, warmup)


def steady_state_runs(
    index: int, steps: int, warmup: int, processes: int, threads: int
) -> dict[str, Any]:
    """:func:`steady_state` of case ``index`` in ``processes`` fresh processes, one after the
    other: step times move by a few percent from one process to the next, for every variant at
    once (memory placement, not the variant), so each figure is the median over processes and
    each ratio the median of the per-process ratios; ``jit_ratio_runs`` keeps them all."""
    runs = []
    for _ in range(processes):
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            runs.append(pool.submit(_steady_in_process, index, steps, warmup, threads).result())
    out: dict[str, Any] = {"model": runs[0]["model"], "steps": steps, "processes": processes}
    for key in [f"{v}_ms" for v in VARIANTS] + list(RATIOS):
        out[key] = statistics.median(r[key] for r in runs)
    out["jit_ratio_runs"] = [r["jit_ratio"] for r in runs]
    out["jit_misses"] = max(r["jit_misses"] for r in runs)
    out["target_met"] = out["jit_ratio"] <= STEP_TARGET
    return out


def ours_first_call(fn: Fn, params: Any, x: torch.Tensor) -> dict[str, float]:
    """Seconds of a fresh ``ft.jit``'s first forward+backward, and its stage times."""
    _zero(params)
    gc.collect()
    t0 = time.perf_counter()
    jitted = ft.jit(fn, partition="min_cut")
    loss = jitted(params, x)
    fwd = time.perf_counter() - t0
    loss.backward()
    total = time.perf_counter() - t0
    info = jitted.cache_info()
    stages = {k: getattr(info, k) for k in ("trace_s", "partition_s", "compile_s")}
    return {"total_s": total, "fwd_s": fwd, **stages}


def torch_first_call(fn: Fn, params: Any, x: torch.Tensor) -> dict[str, float]:
    """Seconds of a fresh ``aot_function`` (nop compilers, torch's min-cut) forward+backward."""
    _zero(params)
    gc.collect()
    t0 = time.perf_counter()
    compiled = aot_function(
        fn, fw_compiler=_nop, bw_compiler=_nop, partition_fn=min_cut_rematerialization_partition
    )
    loss = compiled(params, x)
    fwd = time.perf_counter() - t0
    loss.backward()
    return {"total_s": time.perf_counter() - t0, "fwd_s": fwd}


def first_call(case: Case, repeats: int) -> dict[str, Any]:
    """Median first-call time, ours vs torch's, alternating who goes first, fresh fns each."""
    name, factory, params, x = case
    ours: list[dict[str, float]] = []
    theirs: list[dict[str, float]] = []
    sides = [(ours, ours_first_call), (theirs, torch_first_call)]
    for r in range(repeats):
        for rows, run in sides[r % 2 :] + sides[: r % 2]:
            rows.append(run(factory(), params, x))

    def med(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(row[key] for row in rows)

    ours_s, torch_s = med(ours, "total_s"), med(theirs, "total_s")
    return {
        "model": name,
        "repeats": repeats,
        "ours_s": ours_s,
        **{f"ours_{k}": med(ours, k) for k in ("fwd_s", "trace_s", "partition_s", "compile_s")},
        "torch_s": torch_s,
        "torch_fwd_s": med(theirs, "fwd_s"),
        "ratio": ours_s / torch_s,
        "target_met": ours_s < torch_s,
    }


def _loop_s(fn: Callable[[torch.Tensor], Any], x: torch.Tensor, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return time.perf_counter() - t0


def overhead(requires_grad: bool, calls: int, repeats: int) -> dict[str, Any]:
    """Per-call cost (us) of ``ft.jit`` on a cache hit vs the cached compiled forward (and
    plain eager, for context); median over ``repeats`` interleaved loops of ``calls``."""

    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    x = torch.ones(1, requires_grad=requires_grad)
    jitted = ft.jit(double)
    jitted(x)  # compile
    entry = jitted._cache.slots()[0].entry
    fns: dict[str, Callable[..., Any]] = {"jit": jitted, "direct": entry.forward, "eager": double}
    us: dict[str, list[float]] = {k: [] for k in fns}
    gc.collect()
    gc.disable()
    try:
        for r in range(-1, repeats):  # one warm-up round
            for k, fn in fns.items():
                t = _loop_s(fn, x, calls)
                if r >= 0:
                    us[k].append(1e6 * t / calls)
    finally:
        gc.enable()
    med = {k: statistics.median(v) for k, v in us.items()}
    over = med["jit"] - med["direct"]
    return {
        "requires_grad": requires_grad,
        "calls": calls,
        "repeats": repeats,
        **{f"{k}_us": v for k, v in med.items()},
        "overhead_us": over,
        "target_met": over <= OVERHEAD_TARGET_US,
    }


def _table(rows: list[dict[str, Any]], cols: dict[str, str] | None = None) -> str:
    """Columns ``{header: key}`` (default: every key), floats to 3 decimals, ``target_met`` as
    met/MISSED; the first column left-aligned, the others right-aligned."""
    cols = cols or {k: k for k in rows[0]}

    def cell(key: str, v: Any) -> str:
        if key == "target_met":
            return "met" if v else "MISSED"
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    lines = [list(cols)] + [[cell(k, r[k]) for k in cols.values()] for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(cols))]
    out = [
        "  ".join(c.rjust(widths[i]) if i else c.ljust(widths[i]) for i, c in enumerate(line))
        for line in lines
    ]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def _median_ms(fn: Callable[[], Any], runs: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def attribution(case: Case, steps: int) -> dict[str, Any]:
    """Where a jit step's time goes, by wall clock: the compiled forward and backward graphs
    run alone (no grad), the argument flattening alone, and jit steps with no decompositions
    and with the ``default`` (no recompute) strategy, all against eager."""
    name, factory, params, x = case
    fn = factory()
    jitted = ft.jit(fn, partition="min_cut")
    variants: dict[str, Fn] = {"eager": fn, "jit": jitted}
    variants["jit_nodecomp"] = ft.jit(fn, partition="min_cut", decompositions=None)
    variants["jit_default"] = ft.jit(fn, partition="default")
    ms = interleaved(variants, params, x, steps, warmup=3)
    slot = jitted._cache.slots()[0]
    entry, order = slot.entry, slot.order
    tensors = tensor_leaves(((params, x), {}))
    ordered = [tensors[i] for i in order]
    with torch.no_grad():
        saved = entry.forward(*ordered)[len(entry.out_meta) :]
        fwd_ms = _median_ms(lambda: entry.forward(*ordered), steps)
        bwd_ms = _median_ms(lambda: entry.backward([*saved, torch.ones(())]), steps)
    p = entry.partition

    def n_ops(g: Any) -> int:
        return sum(n.op == "call_function" for n in g.graph_module.graph.nodes)

    return {
        "model": name,
        **{f"{v}_ms": t for v, t in ms.items()},
        "fwd_graph_ms": fwd_ms,
        "bwd_graph_ms": bwd_ms,
        "flatten_ms": _median_ms(lambda: tensor_leaves(((params, x), {})), steps),
        "fwd_ops": n_ops(p.forward),
        "bwd_ops": n_ops(p.backward),
    }


def profile(label: str, fn: Callable[[], Any], sort: str, top: int = 15) -> str:
    """cProfile ``fn()``; the ``top`` entries by ``sort``, under a ``label`` header."""
    prof = cProfile.Profile()
    prof.runcall(fn)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats(sort).print_stats(top)
    return f"=== profile: {label} ===\n{buf.getvalue()}"


def run_profiles(all_cases: list[Case], steps: int) -> str:
    """Attribution table, then cProfile listings of jit first calls and steady-state steps."""
    rows = [attribution(c, steps) for c in all_cases]
    out = ["jit step attribution, ms (graphs run alone under no_grad)", _table(rows)]
    for name, factory, params, x in all_cases:
        jitted = ft.jit(factory(), partition="min_cut")

        def first(f: Fn = jitted, p: Any = params, xx: torch.Tensor = x) -> None:
            _zero(p)
            f(p, xx).backward()  # type: ignore[no-untyped-call]  # the zoo's model functions are unannotated

        def steps_(f: Fn = jitted, p: Any = params, xx: torch.Tensor = x) -> None:
            for _ in range(steps):
                first(f, p, xx)

        out.append(profile(f"{name} first call", first, "cumulative", 30))
        out.append(profile(f"{name} {steps} steady-state steps", steps_, "tottime"))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Run the three benchmarks, print their tables, write the JSON."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, repeats and calls")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--steps", type=int, default=None, help="timed rounds (default 300)")
    parser.add_argument("--profile", action="store_true", help="print cProfile listings")
    parser.add_argument(
        "--processes", type=int, default=3, help="fresh processes per steady-state case"
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--baseline", type=Path, default=None, help="another checkout, its cache hits beside ours"
    )
    parser.add_argument(
        "--hits-only", action="store_true", help="only the cache hits of 5 (JSON to --out)"
    )
    args = parser.parse_args(argv)
    if args.hits_only:
        hits = _hit_cost.side_by_side(args.baseline, 20 if args.quick else 100, 5, args.processes)
        print(_hit_cost.table(hits))
        if args.out is not None:
            doc = {**hits, "baseline_checkout": str(args.baseline or "")}
            args.out.write_text(json.dumps(doc, indent=1) + "\n")
        return 0
    args.out = output_path(args.out, RESULTS, args.quick)
    # one thread: these ops are too small to gain from more, and spinning OpenMP workers on a
    # loaded machine turn millisecond steps into much longer ones
    torch.set_num_threads(args.threads)
    steps = args.steps or (20 if args.quick else 300)
    first_repeats = 1 if args.quick else 5
    calls, call_repeats = (2_000, 3) if args.quick else (10_000, 5)
    t_start = time.perf_counter()
    all_cases = cases()

    # warm both first-call paths (imports, dispatcher and decomposition caches), untimed
    warm = zoo.mlp_stack(1)
    wp, wx = warm.make("small")
    for t in tree_leaves(wp):
        t.requires_grad_(True)
    ours_first_call(warm.fn, wp, wx)
    torch_first_call(warm.fn, wp, wx)

    firsts = [first_call(c, first_repeats) for c in all_cases]
    print(f"first call (trace + partition + compile + fwd + bwd), median of {first_repeats}")
    first_cols = {"model": "model", "ours_s": "ours_s", "trace": "ours_trace_s"}
    first_cols |= {"partition": "ours_partition_s", "compile": "ours_compile_s"}
    first_cols |= {"torch_s": "torch_s", "torch_fwd": "torch_fwd_s", "ours/torch": "ratio"}
    first_cols["target <1"] = "target_met"
    print(_table(firsts, first_cols), end="\n\n", flush=True)

    names = ["gpt_block", "mlp_stack"] if args.quick else ["gpt_block", "mlp_stack", "llama_block"]
    if not args.quick and zoo.has_transformers():
        names += ["hf_llama", "hf_gpt2"]
    print("cache off, cold and warm first call in a fresh process (on-disk trace cache)")
    fresh = _disk_first_call.fresh_first_calls(names, 1 if args.quick else 3, args.threads)
    print(_table(fresh, _disk_first_call.COLUMNS), end="\n\n", flush=True)

    n_proc = 1 if args.quick else args.processes
    steady = [steady_state_runs(i, steps, 3, n_proc, args.threads) for i in range(len(all_cases))]
    print(
        f"steady-state fwd+bwd step, ms (median of {steps}, interleaved, {args.threads} thread; "
        f"medians over {n_proc} processes)"
    )
    step_cols = {"model": "model", **{v: f"{v}_ms" for v in VARIANTS}}
    step_cols |= {"jit/eager": "jit_ratio", "default/eager": "jit_default_ratio"}
    step_cols |= {"python/eager": "jit_python_ratio", "aot/eager": "aot_eager_ratio"}
    step_cols[f"target <={STEP_TARGET}"] = "target_met"
    print(_table(steady, step_cols), end="\n\n", flush=True)

    overheads = [overhead(rg, calls, call_repeats) for rg in (False, True)]
    print(f"cache-hit call of `x * 2` on 1 element, us/call (median of {call_repeats} x {calls})")
    over_cols = {"requires_grad": "requires_grad"}
    over_cols |= {k: f"{k}_us" for k in ("jit", "direct", "eager", "overhead")}
    over_cols[f"target <={OVERHEAD_TARGET_US:g}"] = "target_met"
    print(_table(overheads, over_cols), end="\n\n")
    hit_processes = 1 if args.quick else args.processes
    hits = _hit_cost.side_by_side(args.baseline, 20 if args.quick else 100, 5, hit_processes)
    print("cache hits of functions that read state (fresh processes; benchmarks._hit_cost)")
    print(_hit_cost.table(hits), end="\n\n")
    print(f"total {time.perf_counter() - t_start:.1f} s")

    if args.profile:
        print(run_profiles(all_cases, min(steps, 100)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"quick": args.quick, "threads": torch.get_num_threads(), "torch": torch.__version__}
    doc = {"meta": meta, "first_call": firsts, "steady_state": steady, "overhead": overheads}
    doc["fresh_process_first_call"] = fresh
    doc["guarded_hits"] = {**hits, "baseline_checkout": str(args.baseline or "")}
    args.out.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
