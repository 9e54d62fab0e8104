"""``python -m functrans explain FILE.py:FUNCTION [--strategy NAME] [--budget X] [--offload GB/S]
[--draw PATH] [--html PATH [--compare NAME,NAME]]`` (or ``MODULE:FUNCTION``).

``FUNCTION`` (in a ``.py`` file or an importable module) takes no arguments and returns
``(fn, args)``: the function to explain and its example arguments. Prints the joint graph, the
saved-value table and the memory figures of the chosen partition. ``--html`` also writes a
self-contained HTML report of it (:func:`functrans.viz.report`: the cut, the saved values, the
memory timeline), with ``--compare`` beside the partitions of the other strategies named.
``--offload`` plans with ``memory_budget`` (at ``--budget``, default 0.0) and offload at that
many GB/s each way (``inf``: free copies). A bad target or option exits with status 2 and a
one-line message. ``python -m functrans explain --trace`` lists what every trace enters and
runs besides ``make_fx`` (:mod:`functrans._trace.extensions`), in order.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from ._core.errors import FunctransError
from ._core.graph import JointGraph
from ._cut.offload import Offload
from ._cut.partition import Partition, format_bytes, partition
from ._trace.joint import joint


def _load(target: str) -> Any:
    module_name, _, func_name = target.rpartition(":")
    if not module_name or not func_name:
        raise _Usage(f"expected FILE.py:FUNCTION or MODULE:FUNCTION, got {target!r}")
    if module_name.endswith(".py"):
        if not Path(module_name).is_file():
            raise _Usage(f"{module_name} is not a file")
        spec = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
        if spec is None or spec.loader is None:
            raise _Usage(f"cannot load {module_name}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise _Usage(f"cannot import {module_name!r}: {e}") from None
    if not hasattr(module, func_name):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise _Usage(f"{module_name} has no {func_name!r}; its functions: {', '.join(found)}")
    return getattr(module, func_name)


class _Usage(Exception):
    """A bad target or option: one line on stderr, exit status 2."""


def explain(argv: list[str] | None = None) -> int:
    """Run the ``explain`` command; returns the exit code."""
    if argv is not None and list(argv) == ["--trace"]:
        from ._trace.extensions import describe

        print(describe())
        return 0
    parser = argparse.ArgumentParser(prog="python -m functrans explain")
    parser.add_argument(
        "target", help="FILE.py:FUNCTION or MODULE:FUNCTION returning (fn, example_args)"
    )
    parser.add_argument("--strategy", default="min_cut")
    parser.add_argument("--budget", type=float, default=None, help="memory_budget fraction")
    parser.add_argument(
        "--offload",
        type=float,
        default=None,
        metavar="GB/S",
        help="memory_budget with offload at this many GB/s each way (inf: free copies)",
    )
    parser.add_argument("--draw", default=None, help="write a .dot/.svg/.html picture")
    parser.add_argument("--html", default=None, help="write a self-contained HTML report")
    parser.add_argument(
        "--compare", default="", help="with --html: more strategies to report, comma-separated"
    )
    args = parser.parse_args(argv)
    if args.compare and not args.html:
        parser.error("--compare needs --html PATH (it adds partitions to the HTML report)")
    if args.html:
        from .viz._report import check_path

        check_path(args.html, (".html", ".htm"), "explain --html")  # fail before the work
    try:
        fn, example = _load(args.target)()
        jg = joint(fn)(*example)
        strategy, options = _strategy(args)
        p = partition(jg, strategy, **options)
    except (_Usage, FunctransError) as e:
        parser.error(str(e))
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
        try:
            _write_html(jg, p, args.html, args.compare, args.target)
        except FunctransError as e:
            parser.error(str(e))
    return 0


def _strategy(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """The strategy and options ``--strategy``, ``--budget`` and ``--offload`` ask for."""
    if args.offload is not None:
        offload = Offload(bandwidth=args.offload * 1e9)
        return "memory_budget", {"budget": args.budget or 0.0, "offload": offload}
    if args.budget is not None:
        return "memory_budget", {"budget": args.budget}
    return args.strategy, {}


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
