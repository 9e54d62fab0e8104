"""The public property suite in a user's project: a test file in a fresh directory, no
conftest, hypothesis' default deadline, run as a user runs it (issue 52: the first, cold
example of ``register_partitioner_tests("min_cut")`` took 0.7 s and failed the 200 ms
default deadline as flaky)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

USER_TEST = """
from hypothesis import settings
settings.register_profile("few", max_examples=3)  # the default deadline (200 ms) stays
settings.load_profile("few")
from functrans.testing import register_backend_tests, register_partitioner_tests
test_min_cut = register_partitioner_tests("min_cut")
test_aten = register_backend_tests("aten")
"""


def test_the_suite_passes_in_a_project_with_no_conftest(tmp_path: Path) -> None:
    (tmp_path / "test_mine.py").write_text(USER_TEST)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYPOTHESIS")}
    env["FUNCTRANS_CACHE"] = "0"  # cold: every example traces
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_mine.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "2 passed" in done.stdout
