"""``python -m functrans explain MODULE:FUNCTION [--strategy NAME] [--budget X] [--draw PATH]``.

``FUNCTION`` (in an importable module or a ``.py`` file) takes no arguments and returns
``(fn, args)``: the function to explain and its example arguments. Prints the joint graph, the
saved-value table and the memory figures of the chosen partition.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from ._joint import joint
from ._partition import format_bytes, partition


def _load(target: str) -> Any:
    module_name, _, func_name = target.rpartition(":")
    if not module_name or not func_name:
        raise SystemExit(f"expected MODULE:FUNCTION, got {target!r}")
    if module_name.endswith(".py"):
        spec = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
        if spec is None or spec.loader is None:
            raise SystemExit(f"cannot load {module_name}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    return getattr(module, func_name)


def explain(argv: list[str] | None = None) -> int:
    """Run the ``explain`` command; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m functrans explain")
    parser.add_argument("target", help="MODULE:FUNCTION returning (fn, example_args)")
    parser.add_argument("--strategy", default="min_cut")
    parser.add_argument("--budget", type=float, default=None, help="memory_budget fraction")
    parser.add_argument("--draw", default=None, help="write a .dot/.svg/.html picture")
    args = parser.parse_args(argv)
    fn, example = _load(args.target)()
    jg = joint(fn)(*example)
    options = {} if args.budget is None else {"budget": args.budget}
    strategy = "memory_budget" if args.budget is not None else args.strategy
    p = partition(jg, strategy, **options)
    print("===== joint graph =====")
    print(jg)
    print("===== saved values =====")
    print(p.report())
    m = p.memory
    print("===== memory =====")
    print(
        f"activation bytes {format_bytes(p.activation_bytes)}; peak {format_bytes(m.peak_bytes)} "
        f"(forward {format_bytes(m.forward_peak)}, backward {format_bytes(m.backward_peak)}, "
        f"between the passes {format_bytes(m.boundary_bytes)}); recompute {p.recompute_flops} FLOPs"
    )
    if args.draw:
        from .viz import draw

        print(f"wrote {draw(p, args.draw)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "explain":
        print(__doc__)
        return 2
    return explain(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
