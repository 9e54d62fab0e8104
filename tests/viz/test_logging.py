"""Logs go through the standard library (issue 52: they were prints that no ``logging``
setup could route, filter, capture or silence), and long work says what it is doing."""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import pytest
import torch

import functrans as ft
from functrans._core.logs import counted, slow


def test_stage_logs_reach_caplog_without_functrans_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="functrans.partition")
    ft.partition(ft.joint(lambda x: x.sin().sum())(torch.ones(3)), "min_cut")
    records = [r for r in caplog.records if r.name == "functrans.partition"]
    assert records and "partition 'min_cut'" in records[0].getMessage()


def test_a_silenced_stage_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    ft.set_logs("partition")
    try:
        logging.getLogger("functrans.partition").setLevel(logging.WARNING)  # the user's say
        caplog.set_level(logging.DEBUG, logger="functrans.joint")
        ft.partition(ft.joint(lambda x: x.sin().sum())(torch.ones(3)), "min_cut")
        assert not [r for r in caplog.records if r.name == "functrans.partition"]
    finally:
        ft.set_logs()


def test_long_work_says_what_it_is_doing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="functrans.progress")
    with slow(lambda: "planning a budget", after=0.05):
        time.sleep(0.3)
    with slow(lambda: "quick work", after=30):
        pass
    messages = [r.getMessage() for r in caplog.records if r.name == "functrans.progress"]
    assert len(messages) == 2
    assert messages[0].startswith("planning a budget (") and "so far" in messages[0]
    assert messages[1].startswith("planning a budget: done in")


def test_a_long_sweep_says_how_far_it_is(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 52: ``ft.pareto`` solved an ILP per point in silence."""
    caplog.set_level(logging.INFO, logger="functrans.progress")
    with counted("pareto: points", 4, every=0.05) as step:
        for _ in range(4):
            time.sleep(0.06)
            step()
    messages = [r.getMessage() for r in caplog.records if r.name == "functrans.progress"]
    assert messages[0].startswith("pareto: points: 1 of 4 (") and "so far" in messages[0]
    assert messages[-1].startswith("pareto: points: 4 of 4, done in")
    caplog.clear()
    jg = ft.joint(lambda x: torch.tanh(x).exp().sum())(torch.ones(8))
    ft.pareto(jg, points=3)  # quick: says nothing
    assert not [r for r in caplog.records if r.name == "functrans.progress"]


def test_progress_prints_on_its_own_where_logging_is_not_configured() -> None:
    code = (
        "import time\n"
        "from functrans._core.logs import counted, slow\n"
        "with slow(lambda: 'building something', after=0.05):\n"
        "    time.sleep(0.3)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "functrans: building something (" in done.stderr
    assert "functrans: building something: done in" in done.stderr
