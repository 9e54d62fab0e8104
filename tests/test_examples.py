"""Every example runs (a smoke test: each takes seconds)."""

import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


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
    steps = [
        line.split(": loss eager ")[1].split("  functrans ")
        for line in done.stdout.splitlines()
        if ": loss eager " in line
    ]
    assert len(steps) == 4  # 2 ranks x 2 steps
    assert all(eager == ours for eager, ours in steps), done.stdout
