"""The training step of a BatchNorm ResNet: ``ft.jit`` against eager and ``aot_eager``.

The model is the module zoo's ``bn_resnet`` (basic blocks of 32 channels, train-mode
``BatchNorm2d`` whose running statistics every step updates; 16 blocks by default), at the
zoo's "small" size (images 2x8x8, what ``benchmarks.compile_time --model resnet`` compiles)
or "bench" (8x32x32). One process builds each variant from one seed: eager, ``ft.jit`` with
its default strategy (``min_cut``) and with ``default`` (save what eager saves), and
``torch.compile(backend="aot_eager")``; after 3 warm-up steps it times rounds of 20 steps
(forward, backward), the variants interleaved, in CPU seconds of this process on one thread,
and reports medians and each variant's ratio to eager. Run it in another checkout (``cd
CHECKOUT && python -m benchmarks.bn_step``) for a before/after; the ratios are what compare.

    python -m benchmarks.bn_step [--quick] [--size small|bench] [--blocks N] [--out PATH]

``--quick``: 4 blocks, 3 rounds, written to a temporary folder. Writes
``benchmarks/results/bn_step.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import functrans as ft
from benchmarks import write_results
from benchmarks._module_zoo import bn_resnet

RESULTS = Path(__file__).resolve().parent / "results" / "bn_step.json"
STEPS = 20  # steps per timed round


def _variants(blocks: int, size: str) -> tuple[dict[str, Callable[[], None]], torch.Tensor]:
    """One step function per variant, each over its own copy of the model (one seed)."""
    made: dict[str, Callable[[], None]] = {}
    x: Any = None
    wraps: dict[str, Callable[[torch.nn.Module], Any]] = {
        "eager": lambda m: m,
        "ft.jit min_cut": ft.jit,
        "ft.jit default": lambda m: ft.jit(m, partition="default"),
        "aot_eager": lambda m: torch.compile(m, backend="aot_eager"),
    }
    for name, wrap in wraps.items():
        torch.manual_seed(0)
        zoo = bn_resnet(blocks)
        _, x = zoo.make(size)
        module = zoo.module
        assert module is not None
        made[name] = _step(wrap(module), list(module.parameters()), x)
    return made, x


def _step(fn: Any, params: list[torch.Tensor], x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        for p in params:
            p.grad = None
        fn(x).backward()

    return step


def measure(blocks: int, size: str, rounds: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    steps, _ = _variants(blocks, size)
    for step in steps.values():
        for _ in range(3):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.process_time()
            for _ in range(STEPS):
                step()
            times[name].append((time.process_time() - start) / STEPS)
    median = {name: statistics.median(t) for name, t in times.items()}
    return {
        "step_s": median,
        "vs_eager": {name: median[name] / median["eager"] for name in median},
        "rounds_s": times,
        "config": {"blocks": blocks, "size": size, "rounds": rounds, "steps": STEPS},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 blocks, 3 rounds")
    parser.add_argument("--size", choices=("small", "bench"), default="small")
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    blocks, rounds = (4, 3) if args.quick else (args.blocks, args.rounds)
    result = measure(blocks, args.size, rounds)
    for name, s in result["step_s"].items():
        print(f"{name:16s} {s * 1e3:8.3f} ms  {result['vs_eager'][name]:.3f}x eager")
    write_results(args.out, RESULTS, args.quick, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
