"""Benchmarks for functrans: a model zoo and partition quality/speed comparisons with torch.

Run them as modules from the repository root, e.g. ``python -m benchmarks.partition_quality``.
"""

import os as _os
from pathlib import Path as _Path

# Benchmarks time first calls (tracing included): the on-disk trace cache would turn repeated
# ones into disk hits. ``benchmarks.runtime`` measures the cache itself in fresh processes.
_os.environ.setdefault("FUNCTRANS_CACHE", "0")


def output_path(requested: _Path | None, committed: _Path, quick: bool) -> _Path:
    """Where a benchmark writes its JSON: ``--out`` if given; a full run refreshes the
    committed figures in ``benchmarks/results/``; a ``--quick`` smoke run writes to a temporary
    folder so it never overwrites them."""
    if requested is not None:
        return requested
    if not quick:
        return committed
    import tempfile

    return _Path(tempfile.mkdtemp()) / committed.name


def write_results(requested: _Path | None, committed: _Path, quick: bool, results: object) -> _Path:
    """Write ``results`` as JSON where :func:`output_path` says; return the path."""
    import json

    out = output_path(requested, committed, quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print("wrote", out)
    return out
