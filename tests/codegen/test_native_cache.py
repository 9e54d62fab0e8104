"""The native executor's build cache (``codegen/_native_build.py``) under real processes: torn
libraries are rebuilt rather than loaded, stale locks are broken, waiting is announced, and
processes that start together build once.

Each case runs a fresh Python process against its own ``FUNCTRANS_CACHE_DIR`` and replaces only
the compiler, by a copy of this session's library (see ``SCRIPT``), so it takes seconds; the real
compiler runs through the same ``cached_build`` whenever a machine builds the library first
(``tests/codegen/test_codegen_native.py`` on a fresh clone)."""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from functrans.codegen import _native, _native_build
from functrans.extend import SwitchError

pytestmark = [
    pytest.mark.skipif(sys.platform == "win32", reason="POSIX process semantics"),
    pytest.mark.skipif(
        _native.native_module(wait=True) is None,
        reason="the native executor could not be built here",
    ),
]

STUB_TIMEOUT_S = 120  # a process that only imports torch: a hang fails this fast
WAITING = "waiting for another process building the native executor"
BREAKING = "breaking the native executor's build lock"

# calls the build the way the backend does, then runs a graph; STUB_LIBRARY swaps the compiler
# for a copy of a built library (logged in STUB_LOG, held until STUB_GO exists if set)
SCRIPT = """
import os, shutil, sys, time
import torch
import functrans as ft
from functrans.codegen import _native

stub = os.environ.get("STUB_LIBRARY")
if stub:
    def _compile(name, lib, build_dir):
        with open(os.environ["STUB_LOG"], "a") as log:
            log.write(f"{os.getpid()}\\n")
        go = os.environ.get("STUB_GO")
        while go and not os.path.exists(go):
            time.sleep(0.05)
        shutil.copy(stub, build_dir / lib.name)
        return _native._load(name, build_dir / lib.name)
    _native._compile = _compile

assert _native.native_module(wait=True) is not None, "the native executor did not load"
g = ft.trace(lambda x: (x * 2).sin())(torch.ones(3))
x = torch.arange(3.0)
print("result ok:", torch.equal(_native.native_function(g.graph_module)(x)[0], (x * 2).sin()))
"""


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A copy of this session's checked library and its checksum file."""
    _, lib = _native._library()
    assert _native_build.check(lib) is None, "native_module() left no checked library"
    d = tmp_path_factory.mktemp("good")
    for f in (lib, _native_build._sidecar(lib)):
        shutil.copy2(f, d / f.name)
    return d / lib.name


def _cache(root, good, library=True):
    """A fresh cache under ``root``; its library path (holding ``good``'s if ``library``)."""
    lib = root / "cache" / "native" / _native._library()[1].parent.name / good.name
    lib.parent.mkdir(parents=True)
    if library:
        for f in (good, _native_build._sidecar(good)):
            shutil.copy2(f, lib.parent / f.name)
    return lib


class _Run:
    """``SCRIPT`` in a subprocess against the cache holding ``lib``; output goes to files."""

    def __init__(self, lib, tag, stub=None, **env):
        self.log, self.out, self.err = (
            lib.parents[3] / f"{tag}.{s}" for s in ("log", "out", "err")
        )
        full = {k: v for k, v in os.environ.items() if k != _native_build.TIMEOUT_ENV}
        full.update(FUNCTRANS_CACHE_DIR=str(lib.parents[2]), FUNCTRANS_NATIVE="1", **env)
        if stub is not None:
            full.update(STUB_LIBRARY=str(stub), STUB_LOG=str(self.log))
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", SCRIPT],
                env=full,
                stdout=out,
                stderr=err,
                cwd=lib.parents[3],
                start_new_session=True,  # a group to kill: the process, ninja, the compiler
            )

    def stop(self):
        """End it, ninja and the compiler: SIGTERM to its group, on which ninja ends the
        compiler's own group; SIGKILL if that is not enough."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=10)

    def stderr(self):
        return self.err.read_text()

    def compiles(self):
        return self.log.read_text().split() if self.log.exists() else []

    def wait_for(self, text, timeout=STUB_TIMEOUT_S, meanwhile=lambda: None):
        deadline = time.monotonic() + timeout
        while text not in self.stderr():
            assert self.proc.poll() is None, f"exited before saying {text!r}:\n{self.stderr()}"
            assert time.monotonic() < deadline, f"never said {text!r}:\n{self.stderr()}"
            meanwhile()
            time.sleep(0.05)

    def finish(self, timeout=STUB_TIMEOUT_S):
        """Its stderr, once it has run the graph and exited cleanly within ``timeout``."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"still running after {timeout} s (hung?):\n{self.stderr()}")
        err = self.stderr()
        assert self.proc.returncode == 0, f"exit status {self.proc.returncode}:\n{err}"
        assert "result ok: True" in self.out.read_text(), err
        assert "could not be built" not in err
        return err


def _assert_clean(lib):
    """A checked library, no lock and no private build directory left."""
    assert _native_build.check(lib) is None
    assert not (lib.parent / "lock").exists()
    assert not list(lib.parent.glob(".build-*"))


def _write_lock(lib, pid, host=None, age_s=0.0):
    lock = lib.parent / "lock"
    lock.write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(), "token": "t"}))
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def _dead_pid():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# -- the compiler replaced by a copy of a built library --------------------------------------------


def test_an_empty_library_is_rebuilt(good, tmp_path):
    lib = _cache(tmp_path, good)
    lib.write_bytes(b"")  # loading it: ImportError, and no rebuild before
    run = _Run(lib, "run", stub=good)
    err = run.finish()
    assert f"rebuilding the native executor: {lib} failed its check (it holds 0 bytes" in err
    assert run.compiles() == [str(run.proc.pid)]
    _assert_clean(lib)


def test_a_lock_left_by_a_killed_build_is_broken(good, tmp_path):
    lib = _cache(tmp_path, good, library=False)
    pid = _dead_pid()
    lock = _write_lock(lib, pid)
    host = _native_build._safe(_native_build._HOST)
    leftover = lib.parent / f".build-{host}-{pid}-abc"  # the killed build's directory
    leftover.mkdir()
    run = _Run(lib, "run", stub=good)
    err = run.finish()
    assert f"{BREAKING} {lock} (pid {pid} on {socket.gethostname()} is not running)" in err
    assert WAITING not in err
    assert run.compiles() == [str(run.proc.pid)]
    _assert_clean(lib)


def test_a_lock_older_than_the_timeout_is_broken_though_its_owner_runs(good, tmp_path):
    lib = _cache(tmp_path, good, library=False)
    lock = _write_lock(lib, os.getpid())  # this test process: alive throughout
    run = _Run(lib, "run", stub=good, FUNCTRANS_NATIVE_LOCK_TIMEOUT="3")
    run.wait_for(WAITING, meanwhile=lock.touch)  # a fresh lock until it waits on it
    start = time.monotonic()
    err = run.finish()
    assert time.monotonic() - start > 2.5  # it waited out the timeout, less our last touch
    assert err.count(WAITING) == 1, err  # said once, though it looked many times
    assert f"(pid {os.getpid()} on {socket.gethostname()}, lock {lock})" in err
    assert f"{BREAKING} {lock} (held for" in err and "longer than the 3 s timeout" in err
    assert run.compiles() == [str(run.proc.pid)]
    _assert_clean(lib)


def test_a_waiting_process_loads_what_the_lock_holder_built(good, tmp_path):
    lib = _cache(tmp_path, good, library=False)
    go = tmp_path / "go"
    holder = _Run(lib, "holder", stub=good, STUB_GO=str(go))
    deadline = time.monotonic() + STUB_TIMEOUT_S
    while not holder.compiles():  # it holds the lock and is "compiling" until `go` exists
        assert holder.proc.poll() is None and time.monotonic() < deadline, holder.stderr()
        time.sleep(0.05)
    waiter = _Run(lib, "waiter", stub=good)
    waiter.wait_for(WAITING)
    assert f"(pid {holder.proc.pid} on " in waiter.stderr()
    go.touch()
    assert WAITING not in holder.finish()
    assert BREAKING not in waiter.finish()
    assert holder.compiles() == [str(holder.proc.pid)] and waiter.compiles() == []
    _assert_clean(lib)


def test_a_truncated_library_is_rebuilt_not_loaded(good, tmp_path):
    lib = _cache(tmp_path, good)
    with lib.open("r+b") as f:
        f.truncate(good.stat().st_size // 2)
    run = _Run(lib, "run", stub=good)
    err = run.finish()  # loading it would have been SIGBUS
    half, size = good.stat().st_size // 2, good.stat().st_size
    why = f"it holds {half} bytes, its checksum file says {size}"
    assert f"rebuilding the native executor: {lib} failed its check ({why})" in err
    assert run.compiles() == [str(run.proc.pid)]
    assert _native_build.check(lib) is None
    _assert_clean(lib)


# -- the pieces, in this process -----------------------------------------------------------------


def _stub(lib, compiles):
    """Arguments for cached_build whose compile is logged in ``compiles`` and writes bytes."""

    def compile(into):
        compiles.append(into)
        (into / lib.name).write_bytes(b"library")
        return "compiled"

    return {"compile": compile, "load": lambda path: path.read_bytes()}


def test_a_checked_library_loads_whatever_lock_is_held(good, tmp_path, capsys):
    lib = _cache(tmp_path, good)
    _write_lock(lib, os.getpid())  # a live builder: the library is complete, no need to wait
    compiles = []
    assert _native_build.cached_build(lib, **_stub(lib, compiles)) == good.read_bytes()
    assert compiles == [] and capsys.readouterr().err == ""
    assert (lib.parent / "lock").exists()  # not its to remove


@pytest.mark.parametrize("age_s", [3600, 0])
def test_a_lock_without_an_owner_record_is_broken_once_old(tmp_path, capsys, monkeypatch, age_s):
    monkeypatch.setenv(_native_build.TIMEOUT_ENV, "1")  # the grace for no owner: at most this
    lib = tmp_path / "lib.so"
    lock = tmp_path / "lock"
    lock.touch()  # what cpp_extension's own lock left in this directory before
    os.utime(lock, (time.time() - age_s,) * 2)
    compiles = []
    assert _native_build.cached_build(lib, **_stub(lib, compiles)) == "compiled"
    assert _native_build.cached_build(lib, **_stub(lib, compiles)) == b"library"
    assert len(compiles) == 1
    err = capsys.readouterr().err
    assert f"{BREAKING} {lock} (no owner recorded, {age_s if age_s else ''}" in err
    assert err.count(f"{WAITING} (owner unknown, lock {lock})") == (0 if age_s else 1)
    _assert_clean(lib)


def test_check_says_what_is_wrong(good, tmp_path):
    lib = _cache(tmp_path, good)
    assert _native_build.check(lib) is None
    data = lib.read_bytes()
    lib.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, one bit off
    assert _native_build.check(lib) == "its sha256 differs from its checksum file's"
    lib.write_bytes(data[:100])
    assert _native_build.check(lib) == f"it holds 100 bytes, its checksum file says {len(data)}"
    _native_build._sidecar(lib).write_text("{")
    assert _native_build.check(lib) == "its checksum file is unreadable"
    _native_build._sidecar(lib).unlink()
    assert _native_build.check(lib) == "it has no checksum file"
    lib.unlink()
    assert _native_build.check(lib) == "it is missing"


def test_lock_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(_native_build.TIMEOUT_ENV, raising=False)
    assert _native_build.lock_timeout() == _native_build.LOCK_TIMEOUT_S == 600
    monkeypatch.setenv(_native_build.TIMEOUT_ENV, "2.5")
    assert _native_build.lock_timeout() == 2.5
    for bad in ("ten", "-1", "nan"):
        monkeypatch.setenv(_native_build.TIMEOUT_ENV, bad)
        with pytest.raises(SwitchError, match="is not accepted: a number of seconds"):
            _native_build.lock_timeout()


# the cache holds code this process runs: it must be this user's alone
def test_cache_folders_are_created_private(tmp_path):
    lib = tmp_path / "root" / "native" / "abc" / "lib.so"
    _native_build.cached_build(lib, lambda into: (into / "lib.so").write_bytes(b"x"), bytes)
    for d in (lib.parent, lib.parent.parent, lib.parent.parent.parent):
        assert d.stat().st_mode & 0o777 == 0o700, d


@pytest.mark.parametrize("what", ["folder", "library"])
def test_a_cache_others_can_write_is_refused(tmp_path, what):
    lib = tmp_path / "root" / "native" / "abc" / "lib.so"
    built = []
    _native_build.cached_build(lib, lambda into: (into / "lib.so").write_bytes(b"x"), bytes)
    (lib.parent if what == "folder" else lib).chmod(0o777 if what == "folder" else 0o666)
    with pytest.raises(_native_build.NativeBuildError, match="writable by other users"):
        _native_build.cached_build(lib, lambda into: built.append(1), bytes)
    assert built == []  # nothing built or loaded from there


def test_a_refused_cache_falls_back_to_the_python_executor(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o777)
    env = {**os.environ, "FUNCTRANS_CACHE_DIR": str(root), "FUNCTRANS_NATIVE": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch, functrans as ft\nprint(ft.jit(lambda x: x.sin())(torch.zeros(2)))",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tensor([0., 0.])" in done.stdout
    assert "refusing the native build cache" in done.stderr
    assert not (root / "native").exists() or not any((root / "native").rglob("*.so"))
