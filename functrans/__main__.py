"""``python -m functrans explain MODULE:FUNCTION [--strategy NAME] [--budget X] [--draw PATH]
[--html PATH [--compare NAME,NAME]]``.

``FUNCTION`` (in an importable module or a ``.py`` file) takes no arguments and returns
``(fn, args)``: the function to explain and its example arguments. Prints the joint graph, the
saved-value table and the memory figures of the chosen partition. ``--html`` also writes a
self-contained HTML report of it (:func:`functrans.viz.report`: the cut, the saved values, the
memory timeline), with ``--compare`` beside the partitions of the other strategies named.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from ._graph import JointGraph
from ._joint import joint
from ._partition import Partition, format_bytes, partition


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
    parser.add_argument("--html", default=None, help="write a self-contained HTML report")
    parser.add_argument(
        "--compare", default="", help="with --html: more strategies to report, comma-separated"
    )
    args = parser.parse_args(argv)
    if args.compare and not args.html:
        parser.error("--compare needs --html PATH (it adds partitions to the HTML report)")
    if args.html:
        from ._report import check_path

        check_path(args.html, (".html", ".htm"), "explain --html")  # fail before the work
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
    if args.html:
        _write_html(jg, p, args.html, args.compare, args.target)
    return 0


def _write_html(jg: JointGraph, p: Partition, path: str, compare: str, target: str) -> None:
    """The report of ``p`` and of the strategies in ``compare``, labelled by strategy."""
    from .viz import report

    items = {p.strategy: p}
    for name in (n.strip() for n in compare.split(",")):
        if name and name not in items:
            items[name] = partition(jg, name)
    print(f"wrote {report(items, path, title=f'functrans explain {target}')}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "explain":
        print(__doc__)
        return 2
    return explain(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
