"""First-call time against depth: what repeated regions save when a model stacks blocks.

The model is ``benchmarks.dynamic.GPT``: a nanoGPT-style model of width 64 (4 heads, dropout
0.1, tied head), ``depth`` identical blocks in an ``nn.ModuleList``, float32, batch 2 of 32
tokens. One measurement is one fresh Python process that first warms imports and first-use
caches on a 1-block model of width 32 with the same compiler (untimed), then times one first
call: building the compiled model, its forward and its backward (trace, partition, compile
and one step). Compilers, side by side in the same run:

- ``ft_regions``: ``ft.jit(model)`` with its default settings: a repeated region traced, cut
  and compiled once and called per block (:mod:`functrans._jit.outline`);
- ``ft_pasted``: the same with ``FUNCTRANS_REGIONS=unrolled`` (a region traced once and
  pasted into the step's graph per block, which is then cut and compiled whole);
- ``ft_unrolled``: the same with ``FUNCTRANS_REGIONS=0`` (every block traced inline);
- ``aot_eager``: ``torch.compile(model, backend="aot_eager")``;
- ``inductor``: ``torch.compile(model)`` (skipped with ``--no-inductor``).

functrans runs with its default settings and a cold on-disk trace cache (each process gets an
empty ``FUNCTRANS_CACHE_DIR``, the native executor's build folder linked in, so the trace is
recorded and stored as a user's first run does; ``benchmarks.runtime`` measures warm starts);
torch's compilers get an empty ``TORCHINDUCTOR_CACHE_DIR`` each (their FX-graph and autograd
caches live there), so neither side reads what an earlier process compiled.
The collector runs once before the timed call, for every compiler (as in
:mod:`benchmarks._disk_first_call`): the warm-up leaves ~100k young objects, and building a
deeper model moves the generation-1 counter further, so without it only the 16-block call paid
a 45-55 ms collection of the warm-up's objects. The call's own collections are still timed.
Each figure is the median of ``--repeats`` processes (3); the processes of one depth run
interleaved so load on a shared machine spreads over all compilers. Targets: ``ft_regions``
at 16 blocks at most 0.5x ``aot_eager``'s first call, and its 16-block first call at most 1.5x
its 2-block one.

    python -m benchmarks.compile_time [--quick] [--no-inductor] [--repeats N] [--out PATH]
        [--baseline CHECKOUT] [--model gpt|functional|resnet|qwen|titan] [--fresh]

``--baseline CHECKOUT`` adds ``ft_baseline``: ``ft.jit(model)`` as another checkout of functrans
(``git worktree add /tmp/base <commit>``) builds it, in processes interleaved with this one's,
so a change's first-call cost is measured side by side with the code before it.

``--model functional`` measures the same model written JAX-style
(:mod:`benchmarks._functional_gpt`: a block a plain function called in a loop over a list of
parameter dicts; functrans finds the repeated calls, :mod:`functrans._trace.regions.functions`).
``--model resnet``, ``--model qwen`` and ``--model titan`` measure code nobody here wrote
the model for: a BatchNorm ResNet stack, Hugging Face's Qwen2 from its config with its
defaults (``use_cache=True``: each layer fills a KV cache) and torchtitan's Llama (its layers
in an ``nn.ModuleDict``); see :data:`MODELS`.
``--fresh`` times what a user's first call costs in a new process: no warm-up, the clock
started before ``import functrans`` (torch is imported before it for every compiler;
torch.compile imports Dynamo in its first call, which is timed).

``--quick`` measures depths 1, 2 and 16 (the full run: 1, 2, 4, 8, 16, 32). Writes
``benchmarks/results/compile_time.json`` (``--out`` elsewhere).
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
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _disk_first_call, write_results

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "compile_time.json"
COMPILERS = ("ft_regions", "ft_pasted", "ft_unrolled", "aot_eager", "inductor")
#: ``FUNCTRANS_REGIONS`` per functrans configuration
REGIONS = {"ft_regions": "1", "ft_pasted": "unrolled", "ft_unrolled": "0"}
DEPTHS, QUICK_DEPTHS = (1, 2, 4, 8, 16, 32), (1, 2, 16)
VS_AOT_TARGET = 0.5  # ft_regions / aot_eager at 16 blocks
DEPTH_TARGET = 1.5  # ft_regions at 16 blocks / at 2 blocks
TIMEOUT_S = 900
#: what the ratios compare: CPU seconds of the measuring process, which other processes on a
#: shared machine distort far less than wall-clock time (Inductor's C++ compiler runs in
#: subprocesses of its own, so its figure is wall-clock, in ``s``, only)
METRIC = "cpu_s"


def _compiled(compiler: str, model: Any) -> Any:
    import torch

    if compiler.startswith("ft_"):
        import functrans as ft  # timed in a --fresh call: what a user's first call pays

        return ft.jit(model)
    if compiler == "aot_eager":
        return torch.compile(model, backend="aot_eager")
    return torch.compile(model)


#: the models measured: ``gpt`` (``benchmarks.dynamic.GPT``, blocks in an ``nn.ModuleList``),
#: ``functional`` (``benchmarks._functional_gpt``: the same math JAX-style, a block a plain
#: function called in a loop over a list of parameter dicts), ``resnet`` (the module zoo's
#: ``bn_resnet``: basic blocks of 32 channels with train-mode batch norm, images 2x8x8) and
#: ``qwen`` (HF ``Qwen2ForCausalLM`` from a config with its defaults, ``use_cache=True``
#: included: width 64, 4 heads, 2 key/value heads, vocabulary 128; the loss HF computes
#: from ``labels``) and ``titan`` (torchtitan's Llama, its debug model's settings with a
#: vocabulary of 128 and width 64: layers in an ``nn.ModuleDict``, its own cross-entropy)
MODELS = ("gpt", "functional", "resnet", "qwen", "titan")


def _model(kind: str, layers: int, small: bool) -> tuple[Any, tuple[Any, ...]]:
    """``(callable, arguments)`` of one training step's loss (``small``: the warm-up's)."""
    import torch

    if kind == "resnet":
        from benchmarks._module_zoo import bn_resnet

        zoo = bn_resnet(layers)
        assert zoo.module is not None
        _, x = zoo.make("small")
        return zoo.module, (x,)
    from benchmarks.dynamic import GPT, SEQ, VOCAB

    if kind == "qwen":
        return _qwen(layers, 32 if small else 64, SEQ)
    if kind == "titan":
        return _titan(layers, 32 if small else 64, SEQ)

    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    tgt = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    d = 32 if small else 64
    if kind == "functional":
        from benchmarks import _functional_gpt as fg

        return fg.loss, (fg.init(layers=layers, d=d), idx, tgt)
    torch.manual_seed(0)
    return GPT(layers=layers, d=d), (idx, tgt)


def _qwen(layers: int, d: int, seq: int) -> tuple[Any, tuple[Any, ...]]:
    import torch

    from benchmarks._hf_zoo import hf_qwen2_default

    torch.manual_seed(0)
    model = hf_qwen2_default(layers, hidden=d).module
    assert model is not None
    ids = torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(0))

    def loss(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, labels=ids).loss  # type: ignore[no-any-return]  # HF's output

    return loss, (ids,)


def _titan(layers: int, d: int, seq: int) -> tuple[Any, tuple[Any, ...]]:
    import torch
    import torch.nn.functional as F
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs

    args = TransformerModelArgs(dim=d, n_layers=layers, n_heads=4, vocab_size=128)
    torch.manual_seed(0)
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    ids = torch.randint(0, 128, (2, seq + 1), generator=torch.Generator().manual_seed(0))

    def loss(ids: torch.Tensor) -> torch.Tensor:
        logits = model(ids[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())

    return loss, (ids,)


def child(compiler: str, depth: int, model: str = "gpt", fresh: bool = False) -> None:
    """In a fresh process: warm up (unless ``fresh``), time one first call; print one
    ``RESULT`` JSON line. ``fresh``: nothing warmed, and the clock starts before ``import
    functrans`` (torch is imported before it for every compiler: torch.compile's own imports
    happen in its first call and are timed there)."""
    import torch

    torch.set_num_threads(1)
    start, cpu = time.perf_counter(), time.process_time()
    if not fresh:
        warm, args = _model(model, 1, small=True)
        _compiled(compiler, warm)(*args).backward()
    fn, args = _model(model, depth, small=False)
    if not fresh:
        gc.collect()  # see the module's docstring: the warm-up's young objects are not the call's
        start, cpu = time.perf_counter(), time.process_time()
    loss = _compiled(compiler, fn)(*args)
    loss.backward()
    row = {"s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu}
    print("RESULT " + json.dumps(row), flush=True)


BASELINE = "ft_baseline"  # ft_regions, built by the --baseline checkout


def _run(
    compiler: str,
    depth: int,
    baseline: Path | None = None,
    model: str = "gpt",
    fresh: bool = False,
) -> dict[str, float]:
    root = _disk_first_call.fresh_root()  # a cold on-disk trace cache
    env = {**os.environ, "FUNCTRANS_CACHE": "1", "OMP_NUM_THREADS": "1"}
    env["FUNCTRANS_CACHE_DIR"] = str(root)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")  # torch's caches cold too
    env["FUNCTRANS_REGIONS"] = REGIONS.get(compiler, "1")
    cwd = REPO
    if compiler == BASELINE:
        assert baseline is not None
        compiler, cwd = "ft_regions", baseline
    more = "" if (model, fresh) == ("gpt", False) else f", {model!r}, {fresh!r}"
    code = f"from benchmarks.compile_time import child; child({compiler!r}, {depth}{more})"
    try:
        what = f"{compiler} at depth {depth}"
        return _disk_first_call.child_result(code, env, what, TIMEOUT_S, cwd=cwd)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def measure(
    depths: tuple[int, ...],
    compilers: tuple[str, ...],
    repeats: int,
    baseline: Path | None = None,
    model: str = "gpt",
    fresh: bool = False,
) -> dict[str, Any]:
    rows: dict[str, dict[str, Any]] = {}
    for depth in depths:
        runs: dict[str, list[dict[str, float]]] = {c: [] for c in compilers}
        for _ in range(repeats):
            for c in compilers:
                runs[c].append(_run(c, depth, baseline, model, fresh))
        rows[str(depth)] = {
            c: {
                "s": statistics.median(r["s"] for r in runs[c]),
                "cpu_s": statistics.median(r["cpu_s"] for r in runs[c]),
                "runs_s": [r["s"] for r in runs[c]],
            }
            for c in compilers
        }
        print(
            f"depth {depth}: "
            + ", ".join(f"{c} {rows[str(depth)][c]['s']:.2f}s" for c in compilers)
        )
    return {"depths": rows, "ratios": _ratios(rows, compilers)}


def _ratios(rows: dict[str, dict[str, Any]], compilers: tuple[str, ...]) -> dict[str, Any]:
    """Ratios of CPU seconds (``METRIC``)."""
    out: dict[str, Any] = {"metric": METRIC}
    if "2" in rows and "16" in rows:
        out["16_vs_2"] = {c: rows["16"][c][METRIC] / rows["2"][c][METRIC] for c in compilers}
    if "aot_eager" in compilers:
        out["vs_aot_eager"] = {
            d: {c: r[c][METRIC] / r["aot_eager"][METRIC] for c in compilers if c.startswith("ft_")}
            for d, r in rows.items()
        }
    if "16" in rows:
        r16 = rows["16"]
        out["targets"] = {
            "ft_regions_vs_aot_eager_16": VS_AOT_TARGET,
            "ft_regions_16_vs_2": DEPTH_TARGET,
        }
        if "aot_eager" in compilers:
            out["met_vs_aot_eager"] = (
                r16["ft_regions"][METRIC] / r16["aot_eager"][METRIC] <= VS_AOT_TARGET
            )
        if "16_vs_2" in out:
            out["met_16_vs_2"] = out["16_vs_2"]["ft_regions"] <= DEPTH_TARGET
    return out


def format_table(result: dict[str, Any], compilers: tuple[str, ...]) -> str:
    head = f"{'depth':>5} " + " ".join(f"{c + ' wall/cpu':>22}" for c in compilers)
    head += f" {'regions/unrolled':>17} {'regions/aot_eager':>18}"
    lines = [head]
    for d, r in result["depths"].items():
        cells = " ".join(f"{r[c]['s']:>11.2f}s" for c in compilers)
        vs_off = (
            r["ft_regions"]["s"] / r["ft_unrolled"]["s"] if "ft_unrolled" in r else float("nan")
        )
        vs_aot = r["ft_regions"]["s"] / r["aot_eager"]["s"] if "aot_eager" in r else float("nan")
        lines.append(f"{d:>5} {cells} {vs_off:>17.2f} {vs_aot:>18.2f}")
    ratios = result["ratios"]
    if "16_vs_2" in ratios:
        lines.append(
            "16 vs 2 blocks: "
            + ", ".join(f"{c} {v:.2f}x" for c, v in ratios["16_vs_2"].items())
            + f" (target for ft_regions <= {DEPTH_TARGET})"
        )
    if "met_vs_aot_eager" in ratios:
        vs = ratios["vs_aot_eager"]["16"]
        lines.append(
            "vs aot_eager at 16 blocks: "
            + ", ".join(f"{c} {v:.2f}x" for c, v in vs.items())
            + f" (target for ft_regions <= {VS_AOT_TARGET})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="depths 1, 2 and 16")
    parser.add_argument("--no-inductor", action="store_true", help="skip torch.compile's default")
    parser.add_argument("--repeats", type=int, default=3, help="processes per figure (median)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--baseline", type=Path, default=None, help="another checkout, measured beside this one"
    )
    parser.add_argument("--model", choices=MODELS, default="gpt")
    parser.add_argument(
        "--fresh", action="store_true", help="no warm-up: the first call with import included"
    )
    args = parser.parse_args(argv)
    compilers = tuple(c for c in COMPILERS if not (args.no_inductor and c == "inductor"))
    if args.baseline is not None:
        compilers = (compilers[0], BASELINE, *compilers[1:])
    depths = QUICK_DEPTHS if args.quick else DEPTHS
    result = measure(depths, compilers, args.repeats, args.baseline, args.model, args.fresh)
    result["config"] = {
        "model": {
            "gpt": "benchmarks.dynamic.GPT(d=64, heads=4)",
            "functional": "benchmarks._functional_gpt (d=64, heads=4, no dropout)",
            "resnet": "benchmarks._module_zoo.bn_resnet (32 channels, images 2x8x8)",
            "qwen": "transformers.Qwen2ForCausalLM from its config (d=64, use_cache default)",
            "titan": "torchtitan.models.llama3.Transformer (d=64, 4 heads, vocab 128)",
        }[args.model],
        "fresh": args.fresh,
        "batch": [2, 32],
        "repeats": args.repeats,
        "threads": 1,
        "baseline": _describe_checkout(args.baseline),
    }
    print(format_table(result, compilers))
    write_results(args.out, RESULTS, args.quick, result)
    return 0


def _describe_checkout(path: Path | None) -> str | None:
    """``path``'s commit (None: no baseline)."""
    if path is None:
        return None
    done = subprocess.run(
        ["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return f"{path} at {done.stdout.strip() or 'an unknown commit'}"


if __name__ == "__main__":
    raise SystemExit(main())
