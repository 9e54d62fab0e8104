"""Distributed benchmark: FSDP-style training on 2 CPU processes (gloo), per rank.

A 4-block MLP-mixer-style stack (LayerNorm, two Linears, GELU, residual; width 256, batch 64
per rank) trained with:

- eager FSDP2 (``fully_shard`` per block and the root), and FSDP2 with each block's forward
  under ``torch.compile`` (``--no-compile`` skips it);
- FSDP2 + ``ft.distributed.jit_blocks`` with ``default``, ``min_cut`` and ``memory_budget``;
- functrans' own FSDP-style step: each weight a shard all-gathered with
  ``all_gather_tensor_autograd`` inside one ``ft.jit``'d loss, ``min_cut`` with
  ``policies.reshard_after_forward`` (the gathered weights are re-gathered in backward, as
  FSDP2 does eagerly);
- a step budget: ``ft.distributed.budget_blocks(model, step, peak_bytes=N)`` for N from above
  eager FSDP2's step peak down to the lowest bound it accepts, each rank's later steps
  measured against the plan's bound (``step_budget`` in the results).

Activation bytes: bytes of the distinct storages autograd saves during one forward (packed by
``saved_tensors_hooks``), parameters (sharded, unsharded or gathered copies FSDP frees) not
counted; for the functrans FSDP-style step, what its partition saves (gathered weights are
recomputed, so none of them). Peak: each rank's measured peak of one step above what was live
before it (``functrans.testing.measure_peak``: the CPU allocator's events, every thread's
frees counted, gloo's worker threads' too; FSDP2's unsharded parameters included; the median
of 3 steps). Step time: median forward+backward over
interleaved rounds.

    python -m benchmarks.distributed [--quick] [--no-compile] [--steps N]

Writes ``benchmarks/results/distributed.json``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import socket
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp
import torch.nn.functional as F

import functrans as ft
from benchmarks import write_results
from functrans import policies
from functrans.testing import measure_peak

RESULTS = Path(__file__).resolve().parent / "results" / "distributed.json"


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc1, self.fc2 = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Stack(torch.nn.Module):
    def __init__(self, d: int, layers: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def fsdp(model: Stack) -> Stack:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def saved_bytes(step: Callable[[], torch.Tensor], params: Callable[[], set[int]]) -> int:
    """Bytes of distinct storages autograd saves while ``step`` runs its forward, parameter
    storages (read when packing) excluded."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in params() and isinstance(t, torch.Tensor) and not hasattr(t, "to_local"):
            seen[key] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    loss.backward()
    return sum(seen.values())


def _param_storages(models: list[torch.nn.Module], extra: list[torch.Tensor]) -> set[int]:
    out = {t.untyped_storage().data_ptr() for t in extra}
    for m in models:
        for p in m.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            out.add(local.untyped_storage().data_ptr())
    return out


def worker(rank: int, world: int, port: int, opts: dict[str, Any], queue: Any) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    torch.set_num_threads(1)
    d, layers, batch = (64, 2, 16) if opts["quick"] else (256, 4, 64)
    torch.manual_seed(0)
    base = Stack(d, layers)
    x = torch.randn(batch, d, generator=torch.Generator().manual_seed(rank))
    models: dict[str, Stack] = {"eager FSDP2": fsdp(copy.deepcopy(base))}
    if opts["compile"]:
        m = fsdp(copy.deepcopy(base))
        for block in m.blocks:
            block.forward = torch.compile(block.forward)  # type: ignore[method-assign]  # patched while tracing, restored after
        models["FSDP2 + torch.compile"] = m
    for strategy, options in (("default", {}), ("min_cut", {}), ("memory_budget", {"budget": 0.3})):
        m = ft.distributed.jit_blocks(fsdp(copy.deepcopy(base)), partition=strategy, **options)
        models[f"FSDP2 + functrans {strategy}"] = m
    steps: dict[str, Callable[[], torch.Tensor]] = {
        k: (lambda m=m: m(x)) for k, m in models.items()
    }

    # functrans' own FSDP-style step: shards gathered inside the traced loss
    shards = {
        name: p.detach().chunk(world)[rank].clone().requires_grad_()
        if p.dim()
        else p.detach().clone().requires_grad_()
        for name, p in base.named_parameters()
    }
    shapes = {name: p.shape for name, p in base.named_parameters()}

    def loss(shards: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        full = {
            n: funcol.all_gather_tensor_autograd(s, 0, dist.group.WORLD).view(shapes[n])
            for n, s in shards.items()
        }
        return torch.func.functional_call(base, full, (x,))

    resharded = ft.jit(ft.remat(loss, policy=policies.reshard_after_forward), partition="min_cut")
    label = "functrans FSDP-style min_cut + reshard_after_forward"
    steps[label] = lambda: resharded(shards, x)

    eager_loss = steps["eager FSDP2"]().item()
    for name, step in steps.items():
        got = step()
        assert abs(got.item() - eager_loss) < 1e-4 * max(1.0, abs(eager_loss)), (name, got)
        got.backward()
    params = lambda: _param_storages(list(models.values()), list(shards.values()))  # noqa: E731
    activation = {name: saved_bytes(step, params) for name, step in steps.items()}
    resharded_partitions = resharded.partitions()
    activation[label] = sum(p.activation_bytes for p in resharded_partitions)
    samples: dict[str, list[int]] = {name: [] for name in steps}
    for _ in range(3):  # the median of 3: gloo's threads allocate at their own times
        for name, step in steps.items():  # every rank runs the same steps in the same order
            dist.barrier()
            samples[name].append(measure_peak(lambda step=step: step().backward()).peak_bytes)
    peak = {name: int(statistics.median(v)) for name, v in samples.items()}
    budgets = _budget_sweep(base, x, opts["rounds"])
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(opts["steps"]):
        for name, step in steps.items():
            dist.barrier()
            start = time.perf_counter()
            step().backward()
            times[name].append(time.perf_counter() - start)
    seconds = {k: statistics.median(v) for k, v in times.items()}
    base_s, base_b = seconds["eager FSDP2"], activation["eager FSDP2"]
    queue.put(
        (
            rank,
            {
                "activation_bytes": activation,
                "activation_vs_eager_fsdp2": {k: v / base_b for k, v in activation.items()},
                "peak_bytes": peak,
                "peak_vs_eager_fsdp2": {k: v / peak["eager FSDP2"] for k, v in peak.items()},
                "seconds": seconds,
                "time_vs_eager_fsdp2": {k: v / base_s for k, v in seconds.items()},
                "step_budget": budgets,
                "regathered_in_backward": sum(
                    1
                    for p in resharded_partitions
                    for n in p.recomputed
                    if "all_gather" in str(n.target)
                ),
            },
        )
    )
    dist.destroy_process_group()


def _budget_sweep(base: Stack, x: torch.Tensor, rounds: int) -> dict[str, Any]:
    """``ft.distributed.budget_blocks`` at limits from above eager FSDP2's step peak down to
    the lowest bound a refusal names, each on a fresh FSDP2 copy: the plan's bound, the cuts,
    the seconds planning took, and each rank's peak over ``rounds`` later steps, every step
    from no gradients (as after ``zero_grad()``: the sharded gradients are in the peak, as
    when budget_blocks measures); eager FSDP2 measured the same way beside them."""

    def peaks(m: Stack) -> list[int]:
        out = []
        for _ in range(rounds):
            m.zero_grad(set_to_none=True)
            dist.barrier()
            out.append(measure_peak(lambda: m(x).backward()).peak_bytes)
        return out

    def budget(m: Stack, limit: int) -> ft.distributed.StepBudget:
        return ft.distributed.budget_blocks(m, lambda: m(x).backward(), peak_bytes=limit)

    eager = peaks(fsdp(copy.deepcopy(base)))
    worst = torch.tensor(max(eager))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # every rank sweeps the same limits
    top = int(worst)
    try:
        budget(fsdp(copy.deepcopy(base)), 1)
        raise AssertionError("a 1-byte step budget was accepted")
    except ft.InvalidPartitionError as e:
        lowest = int(str(e).split("bound is ")[1].split(" ")[0])
    rows = []
    for limit in sorted({int(top * 1.05), top, (top + lowest) // 2, lowest}, reverse=True):
        m = fsdp(copy.deepcopy(base))
        start = time.perf_counter()
        try:
            b = budget(m, limit)
        except ft.InvalidPartitionError:
            rows.append({"limit": limit, "refused": True})
            continue
        seconds = time.perf_counter() - start
        got = peaks(m)
        rows.append(
            {
                "limit": limit,
                "bound": b.peak_bytes,
                "measured_max": max(got),
                "measured": got,
                "within_bound": max(got) <= b.peak_bytes,
                "cuts": b.describe(),
                "recompute_flops": b.chosen.recompute_flops,
                "plans_measured": len(b.tried),
                "planning_seconds": seconds,
            }
        )
    return {
        "eager_fsdp2_measured": eager,
        "eager_fsdp2_worst_rank": top,
        "lowest_bound": lowest,
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    opts = {
        "quick": a.quick,
        "compile": not a.no_compile,
        "steps": 3 if a.quick else a.steps,
        "rounds": 3 if a.quick else 10,
    }
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, 2, port, opts, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    out_json = {
        "world": 2,
        "backend": "gloo",
        "torch": torch.__version__,
        "ranks": [results[r] for r in range(2)],
    }
    for r in range(2):
        print(f"rank {r}")
        sweep = results[r]["step_budget"]
        print("  step budget (eager FSDP2 measured max", max(sweep["eager_fsdp2_measured"]), ")")
        for row in sweep["rows"]:
            print("   ", {k: v for k, v in row.items() if k != "measured"})
        for key in ("activation_vs_eager_fsdp2", "peak_vs_eager_fsdp2", "time_vs_eager_fsdp2"):
            print(
                " ", key, json.dumps({k: round(v, 3) for k, v in results[r][key].items()}, indent=3)
            )
    write_results(a.out, RESULTS, a.quick, out_json)


if __name__ == "__main__":
    main()
