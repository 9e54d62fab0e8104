"""Every example runs (a smoke test: each takes seconds)."""

import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(
    "script",
    sorted(p.name for p in EXAMPLES.glob("*.py") if "fsdp" not in p.name),  # torchrun: below
    ids=lambda s: s.removesuffix(".py"),
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


def test_fsdp2_example_losses_equal_eager(tmp_path):
    """The README's command: torchrun, 2 gloo processes; FSDP2 + jit_blocks losses equal eager
    FSDP2's on each rank, step by step."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            str(EXAMPLES / "fsdp2_train.py"),
            "--steps",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # the ranks share the pipe: read the records wherever they are, not line by line
    steps = re.findall(r"rank (\d) step (\d): loss eager ([\d.]+)  functrans ([\d.]+)", done.stdout)
    assert sorted((r, s) for r, s, _, _ in steps) == [
        ("0", "0"),
        ("0", "1"),
        ("1", "0"),
        ("1", "1"),
    ]
    steps = [(eager, ours) for _, _, eager, ours in steps]
    assert all(eager == ours for eager, ours in steps), done.stdout
