"""What a first partition imports: scipy.optimize (0.4 s) only where an ILP is solved.

Every built-in strategy's module is loaded at the first ``ft.partition`` (the registry loads
them by name), so a heavy import at a strategy module's top is paid by every process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_MIN_CUT_ONLY = """
import sys
import torch, functrans as ft
jg = ft.joint(lambda x, w: torch.tanh(x @ w).sum())(torch.ones(4, 4), torch.ones(4, 4))
ft.partition(jg, "min_cut")
assert "scipy.optimize" not in sys.modules
ft.partition(jg, "memory_budget", budget=0.5)
assert "scipy.optimize" in sys.modules
print("ok")
"""


def test_min_cut_does_not_import_scipy_optimize() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _MIN_CUT_ONLY],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "FUNCTRANS_CACHE": "0"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"
