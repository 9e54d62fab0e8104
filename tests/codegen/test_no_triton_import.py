"""functrans imports and inspects triton only for the Triton backend.

torch itself imports triton when it is installed (FakeTensorMode imports torch._dynamo, whose
utils call ``has_triton_package()``; aot_autograd imports inductor's ``triton_compat``), so a
trace in a process with triton installed loads it whatever functrans does. What functrans
controls is checked here: its own import, and its disk key, never touch triton."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import functrans as ft

_IMPORT_ONLY = """
import sys
import functrans as ft
import functrans.policies, functrans.extend
assert 'triton' not in sys.modules, sorted(m for m in sys.modules if m.startswith('triton'))
from functrans._core.flop_formulas import flop_registry
import torch
assert torch.ops.aten.mm in flop_registry
print('ok')
"""


def test_import_functrans_does_not_import_triton() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_ONLY],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"


_STEP_WITHOUT_TRITON = """
import sys
sys.modules['triton'] = None  # triton not importable: as where it is not installed
import torch, functrans as ft
f = ft.jit(lambda x, w: torch.tanh(x @ w).sum())
w = torch.randn(4, 5, requires_grad=True)
f(torch.randn(3, 4), w).backward()
g = ft.grad(lambda w: torch.tanh(w).sum())(w)
p = ft.partition(ft.joint(lambda w: torch.tanh(w).sum())(w), 'min_cut')
assert w.grad is not None and g.shape == w.shape
print('ok')
"""


def test_jit_grad_partition_run_without_triton(tmp_path: Path) -> None:
    env = {
        "PATH": "/usr/bin:/bin",
        "FUNCTRANS_CACHE": "1",
        "FUNCTRANS_CACHE_DIR": str(tmp_path),
        "FUNCTRANS_NATIVE": "0",
    }
    done = subprocess.run(
        [sys.executable, "-c", _STEP_WITHOUT_TRITON],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"


def test_disk_key_does_not_read_triton_metadata(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("FUNCTRANS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FUNCTRANS_CACHE", "1")
    monkeypatch.setenv("FUNCTRANS_NATIVE", "0")
    from functrans._jit.disk import key as _disk_key

    monkeypatch.setattr(_disk_key, "_ENVIRONMENT", None)  # computed again, seen by the spy
    asked: list[str] = []
    real = importlib.metadata.version

    def spy(name: str) -> str:
        asked.append(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", spy)

    def loss(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x).sum()

    x = torch.randn(3, requires_grad=True)
    ft.jit(loss)(x).backward()
    assert asked, "the disk key was not computed: the spy saw no version lookup"
    assert "triton" not in asked
