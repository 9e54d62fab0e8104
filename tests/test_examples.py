"""Every example runs (a smoke test: each takes seconds)."""

import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize(
    "script", sorted(p.name for p in EXAMPLES.glob("*.py")), ids=lambda s: s.removesuffix(".py")
)
def test_example_runs(script, tmp_path):
    args = [str(tmp_path / "pareto.png")] if script == "memory_budget_pareto.py" else []
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip()
