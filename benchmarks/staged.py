"""Returned intermediates on the loss's path: what a staged step costs, side by side.

A step returning an intermediate beside a loss computed from it (a Hugging Face model's
``logits`` and, with ``use_cache=True``, every layer's keys and values) is compiled in stages
so that ``retain_grad``, hooks and ``autograd.grad(loss, logits)`` work as in eager (issue 49).
For tiny Qwen2 models built from their config (labels given, so the model returns the loss
beside the logits), each variant is run in one process, interleaved, and reports:

- ``first_s``: its first call (trace, partition, compile; cache off), then ``ms``: a training
  step after warm-up (median of interleaved rounds) and ``time_ratio`` against eager's;
- ``peak_bytes`` measured by the allocator and, for ``ft.jit``, the partition's report;
- ``connected``: whether ``out.logits.retain_grad()`` then ``out.loss.backward()`` gives eager's
  gradient at the logits (None where it raises).

    python -m benchmarks.staged [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import functrans as ft
from benchmarks import write_results
from functrans.testing import measure_peak

RESULTS = Path(__file__).parent / "results" / "staged.json"


def _model(layers: int, use_cache: bool) -> Any:
    import transformers

    cfg = transformers.Qwen2Config(
        vocab_size=2048,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=use_cache,
    )
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg)


def _connected(run: Callable[..., Any], model: Any, ids: torch.Tensor, want: Any) -> Any:
    try:
        out = run(input_ids=ids, labels=ids)
        out.logits.retain_grad()
        out.loss.backward()
        got = out.logits.grad
    except Exception:
        return None
    finally:
        model.zero_grad(set_to_none=True)
    return got is not None and torch.allclose(got, want, rtol=1e-4, atol=1e-7)


def run_config(layers: int, use_cache: bool, rounds: int) -> dict[str, Any]:
    model = _model(layers, use_cache)
    ids = torch.randint(0, 2048, (4, 64))
    out = model(input_ids=ids, labels=ids)
    out.logits.retain_grad()
    out.loss.backward()
    want = out.logits.grad
    model.zero_grad(set_to_none=True)
    jitted = ft.jit(model)
    variants: dict[str, Callable[..., Any]] = {
        "eager": model,
        "ft.jit": jitted,
        "torch.compile aot_eager": torch.compile(model, backend="aot_eager"),
    }
    rows: dict[str, dict[str, Any]] = {}

    def step(run: Callable[..., Any]) -> None:
        out = run(input_ids=ids, labels=ids)  # held through the backward, as a caller does
        out.loss.backward()

    for name, run in variants.items():
        t0 = time.perf_counter()
        step(run)
        rows[name] = {"variant": name, "first_s": time.perf_counter() - t0, "times": []}
        model.zero_grad(set_to_none=True)
    for _ in range(rounds):  # interleaved: each round times every variant once
        for name, run in variants.items():
            t0 = time.perf_counter()
            step(run)
            rows[name]["times"].append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
    for name, run in variants.items():
        row = rows[name]
        row["ms"] = 1000 * statistics.median(row.pop("times"))
        row["peak_bytes"] = measure_peak(lambda run=run: step(run)).peak_bytes
        model.zero_grad(set_to_none=True)
        row["connected"] = _connected(run, model, ids, want)
    (p,) = jitted.partitions()
    rows["ft.jit"]["reported_bytes"] = p.peak_bytes
    eager = rows["eager"]
    for row in rows.values():
        row["time_ratio"] = row["ms"] / eager["ms"]
        row["peak_ratio"] = row["peak_bytes"] / eager["peak_bytes"]
    return {"model": f"hf_qwen2_{layers}l use_cache={use_cache}", "rows": list(rows.values())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, 3 rounds")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("benchmarks.staged: transformers is not installed; nothing measured")
        return 0
    torch.set_num_threads(1)
    layers, rounds = (2, 3) if args.quick else (12, 15)
    results = []
    for use_cache in (False, True):
        r = run_config(layers, use_cache, rounds)
        results.append(r)
        print(r["model"])
        for row in r["rows"]:
            shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
            print("   ", shown)
    meta = {"torch": torch.__version__, "threads": 1, "rounds": rounds}
    write_results(args.out, RESULTS, args.quick, {"meta": meta, "models": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
