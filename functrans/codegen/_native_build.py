"""A build cache that survives killed builds, torn files and concurrent processes.

:func:`cached_build` keeps one compiled library per directory of the cache. A library is used
only after it passes a check against the size and sha256 recorded beside it (``<lib>.sha256``),
so a truncated or empty file (a full disk, a killed copy) is rebuilt rather than loaded, which
could kill the process with SIGBUS. A build runs in a private directory and its library is
renamed into place, then its checksum: a reader sees a whole library or none.

The cache holds code this process runs, so it must be this user's alone: folders are created
readable and writable by the user only, and a library, checksum or folder that another user
owns or can write is refused (:class:`NativeBuildError`; the backend then warns and runs its
Python executor).

Builds take a lock (``<dir>/lock``, holding the owner's pid, host and a token) so that processes
starting together build once. A lock whose owner is no longer running, or older than
:func:`lock_timeout` (``$FUNCTRANS_NATIVE_LOCK_TIMEOUT`` seconds, by default
:data:`LOCK_TIMEOUT_S`), is broken; a process waiting on a live one says so on stderr, once.
The lock only saves work: builders never share files, so two builds at once (a broken lock
whose owner was alive after all) both succeed.

>>> tmp = tempfile.TemporaryDirectory()
>>> lib = Path(tmp.name) / "native" / "digest" / "lib.so"  # <cache root>/native/<digest>/
>>> def compile(into):
...     (into / "lib.so").write_bytes(b"built")
...     return "fresh"
>>> cached_build(lib, compile, load=lambda path: path.read_bytes())
'fresh'
>>> cached_build(lib, compile, load=lambda path: path.read_bytes())
b'built'
>>> check(lib) is None
True
>>> tmp.cleanup()
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from functrans.extend import SWITCHES, FunctransError, switch_value, untrusted
from functrans.extend import private_dirs as _private_dirs

__all__ = [
    "LOCK_TIMEOUT_S",
    "NativeBuildError",
    "cached_build",
    "check",
    "lock_timeout",
    "untrusted",
]

T = TypeVar("T")

LOCK_TIMEOUT_S = 600.0
"""A build lock older than this many seconds is broken, whoever holds it (a hung build)."""
TIMEOUT_ENV = "FUNCTRANS_NATIVE_LOCK_TIMEOUT"
POLL_S = 0.5
"""How often a process waiting on another's build looks at the lock again."""
_UNREADABLE_GRACE_S = 10.0  # a lock without an owner record (mid-write, or an older layout)
_HOST = socket.gethostname()
_PRIVATE = ".build-"  # prefix of private build directories: .build-<host>-<pid>-<random>


class NativeBuildError(FunctransError):
    """The native executor's build cache is misconfigured or a build left no library."""


def lock_timeout() -> float:
    """Seconds after which a build lock counts as stale: ``$FUNCTRANS_NATIVE_LOCK_TIMEOUT``
    (read on every call), by default :data:`LOCK_TIMEOUT_S`.

    >>> lock_timeout() == LOCK_TIMEOUT_S or "FUNCTRANS_NATIVE_LOCK_TIMEOUT" in os.environ
    True
    """
    timeout: float = switch_value(SWITCHES[TIMEOUT_ENV])
    return timeout


def cached_build(lib: Path, compile: Callable[[Path], T], load: Callable[[Path], T]) -> T:
    """``load(lib)`` if ``lib`` passes :func:`check`; otherwise, under the directory's lock,
    ``compile(tmp)`` in a fresh private directory ``tmp`` (which must leave ``tmp / lib.name``
    there), publish that library as ``lib`` and return what ``compile`` returned."""
    prepare(lib)
    if check(lib) is None:
        return load(lib)
    with _lock(lib.parent / "lock"):
        problem = check(lib)
        if problem is None:  # another process built it while this one waited
            return load(lib)
        if lib.exists():
            _say(f"rebuilding the native executor: {lib} failed its check ({problem})")
        _discard(lib)
        _reap(lib.parent)
        tmp = Path(
            tempfile.mkdtemp(prefix=f"{_PRIVATE}{_safe(_HOST)}-{os.getpid()}-", dir=lib.parent)
        )
        try:
            result = compile(tmp)
            built = tmp / lib.name
            if not built.is_file():
                raise NativeBuildError(f"the build in {tmp} left no {lib.name}")
            _publish(built, lib)
            return result
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def prepare(lib: Path) -> None:
    """``lib``'s folders made (this user's alone), or an error where the cache is not this
    user's (:func:`_refuse_untrusted`): what a build, here or in the background, first needs."""
    _private_dirs(lib.parent)
    _refuse_untrusted(lib)


def _refuse_untrusted(lib: Path) -> None:
    """The library, its checksum and the directories down to it (its folder, ``native`` and
    the cache root) must be this user's alone: another user who can write there could make
    this process load their code."""
    for path in (lib, _sidecar(lib), lib.parent, lib.parent.parent, lib.parent.parent.parent):
        reason = untrusted(path)
        if reason is not None:
            raise NativeBuildError(
                f"refusing the native build cache: {reason}. Point FUNCTRANS_CACHE_DIR at a "
                "directory only you can write (functrans creates its own folders that way)"
            )


def check(lib: Path) -> str | None:
    """None when ``lib`` holds what its checksum file records; else what is wrong with it."""
    try:
        record = json.loads(_sidecar(lib).read_text())
        size, digest = int(record["size"]), str(record["sha256"])
    except FileNotFoundError:
        return "it has no checksum file" if lib.exists() else "it is missing"
    except (OSError, ValueError, KeyError, TypeError):
        return "its checksum file is unreadable"
    try:
        actual = lib.stat().st_size
    except FileNotFoundError:
        return "it is missing"
    if actual != size:
        return f"it holds {actual} bytes, its checksum file says {size}"
    if _sha256(lib) != digest:
        return "its sha256 differs from its checksum file's"
    return None


def _sidecar(lib: Path) -> Path:
    return lib.with_name(f"{lib.name}.sha256")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _publish(built: Path, lib: Path) -> None:
    """Rename ``built`` onto ``lib``, then write its checksum file the same way."""
    record = json.dumps({"size": built.stat().st_size, "sha256": _sha256(built)})
    _fsync(built)
    os.replace(built, lib)
    pending = built.with_name(_sidecar(lib).name)
    pending.write_text(record)
    _fsync(pending)
    os.replace(pending, _sidecar(lib))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _discard(lib: Path) -> None:
    _sidecar(lib).unlink(missing_ok=True)  # the checksum first: never a record without a file
    lib.unlink(missing_ok=True)


def _reap(directory: Path) -> None:
    """Remove private build directories left by dead processes of this host."""
    for d in directory.glob(f"{_PRIVATE}*"):
        host, pid, _random = [*d.name[len(_PRIVATE) :].split("-"), "", ""][:3]
        if host == _safe(_HOST) and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def _safe(host: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", host) or "host"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host may be running (True when it cannot be told)."""
    if pid == os.getpid():
        return False  # not this process: it holds no lock it is asking about
    if os.name == "nt" or pid <= 0:  # on Windows os.kill(pid, 0) would terminate it
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it runs, as another user
        return True
    return True


def _say(message: str) -> None:
    print(f"functrans: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    token = _acquire(path)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if _owner(path).get("token") == token:  # not a lock that replaced a broken one
                path.unlink()


def _acquire(path: Path) -> str:
    token = uuid.uuid4().hex
    me = {"pid": os.getpid(), "host": _HOST, "token": token}
    timeout, waited = lock_timeout(), False
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            pass
        else:
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(me, f)
            except BaseException:  # a full disk: leave no ownerless lock behind
                path.unlink(missing_ok=True)
                raise
            return token
        try:
            owner, age = _owner(path), max(0.0, time.time() - path.stat().st_mtime)
        except FileNotFoundError:
            continue  # released meanwhile
        stale = _stale(owner, age, timeout)
        if stale is not None:
            _say(f"breaking the native executor's build lock {path} ({stale})")
            with contextlib.suppress(OSError):
                if _owner(path) == owner:  # still the lock just judged
                    path.unlink()
            continue
        if not waited:
            who = f"pid {owner['pid']} on {owner['host']}" if owner else "owner unknown"
            _say(
                f"waiting for another process building the native executor ({who}, lock "
                f"{path}); a lock older than {timeout:g} s is taken as stale ({TIMEOUT_ENV})"
            )
            waited = True
        time.sleep(POLL_S)


def _owner(path: Path) -> dict[str, Any]:
    """The lock's owner record, or {} when the file holds none (FileNotFoundError if gone)."""
    try:
        record = json.loads(path.read_text())
    except ValueError:
        return {}
    ok = isinstance(record, dict) and isinstance(record.get("pid"), int)
    return record if ok and isinstance(record.get("host"), str) else {}


def _stale(owner: dict[str, Any], age: float, timeout: float) -> str | None:
    """Why a lock of this owner and age is stale, or None while it may still be held."""
    if not owner:
        grace = min(timeout, _UNREADABLE_GRACE_S)
        return f"no owner recorded, {age:.0f} s old" if age > grace else None
    if age > timeout:
        return f"held for {age:.0f} s, longer than the {timeout:g} s timeout, {TIMEOUT_ENV}"
    if owner["host"] == _HOST and not _alive(owner["pid"]):
        return f"pid {owner['pid']} on {owner['host']} is not running"
    return None
