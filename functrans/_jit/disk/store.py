"""On-disk cache of traced graphs across processes: a restart skips tracing.

``jit`` calls :func:`traced` around each trace (``trace`` for inference entries, ``joint`` for
training entries); partitioning and compiling run again on whatever graph comes back (they are
cheap next to tracing). Entries live in ``<cache root>/traces/<key>-<dependencies>.json``
(:func:`~functrans._core.private_dir.cache_root`, ``$FUNCTRANS_CACHE_DIR``); ``FUNCTRANS_CACHE=0``
turns the cache off and ``FUNCTRANS_CACHE_SIZE_MB`` bounds it (512 by default; the least
recently used entries go first).

**Soundness.** A trace is a deterministic function of (a) the code that runs, (b) the values
that code reads, (c) the inputs' metadata and (d) torch's global state. An entry is used only
when all four are what they were when it was traced:

- The *key* (computed before tracing) hashes: the Python, torch and functrans versions (and
  functrans' own source files; a trace is ATen ops, whatever backend compiles it, so no
  backend's version is in it); torch flags a trace reads (SDPA backends, matmul precision,
  global module hooks); the global state ``jit`` guards (grad and inference mode, autocast,
  default dtype, deterministic algorithms, module training flags); the options that reach the
  trace (decompositions as resolved, ``static_argnums``, and any option this module does not know
  to be trace-free); the call's structure, static values and each tensor's type, shape, strides,
  dtype, device, ``requires_grad``, dispatch keys and aliasing; and the function itself, deeply
  (:class:`~functrans._jit.disk.fingerprint.Fingerprint`): its bytecode, defaults, closure cells and
  everything reachable from them (module attributes such as ``n_head`` or a dropout ``p``, plain
  objects, containers, user classes), tensors by metadata only (captured tensors are graph
  inputs, never baked-in values: a graph holding a tensor constant other than a literal is
  stored as a path to that tensor, read again on load).
- The *dependencies* (recorded while tracing, checked on load): every source file whose code
  ran, except torch's, functrans' and the standard library's (their versions are in the key):
  user code by content hash, installed packages' files by size, modification and change
  times, inode and device (stricter than Python's test for stale bytecode); and for user
  code (outside site-packages), the
  value of every module global its code names (``SCALE`` set from argparse, a helper in
  another file, ``cfg.n_layer`` read through a module). A file modified after this process
  started, code from no file, or user code with closure cells that are neither in the key nor
  made during the trace means the entry is not stored.
- A trace with symbolic sizes (``dynamic=``) is keyed without the sizes of its symbolic
  dimensions and stored with the guards its trace recorded, checked on load and restored as
  the loaded graph's guards (:mod:`functrans._jit.disk.shapes`).
- Anything that cannot be hashed (C objects, tensor subclasses, a generator, sizes that depend
  on tensor values, a graph node the JSON format cannot hold) means no disk cache for that
  call: never a guess.

Not covered, by design: the state of installed packages beyond their files (a global of
``transformers`` changed at run time), of C extensions other than torch, environment variables,
files and randomness the traced code reads, builtins replaced at run time, and functions that
rebind module globals they read while being traced. A partition strategy, its options and the
backend are not part of the key: they do not change the traced graph, and they run again on
every load (a different strategy on a hit partitions the same graph its own way).

**Safety.** Entries are JSON (:mod:`functrans._jit.disk.graph_json`), never pickles; ops are looked
up by name in ``torch.ops``, types among modules already imported. Folders are created private to
the user (0700); a folder or entry another user owns or can write is refused, with a warning,
once.
Writes go to a temporary file renamed into place. Every entry begins with a line holding the
sha256 of the rest, checked before anything is parsed: a changed byte anywhere (a digit that
keeps the JSON valid, ``mul(tanh, 2)`` become ``3``) makes the entry a miss, deleted and
rewritten, never a wrong result. Entries this cache writes carry an HMAC instead, under a
key kept in the cache root (``.trace-seal-key``, readable by its owner only): it also says
that the entry's values are those its trace computed, so a static graph's ``meta["val"]``
are made from the stored metadata on load (a few ms per thousand nodes). An entry with a
plain checksum (written some other way) has its values derived again on fake tensors and
compared. An entry that cannot be read or rebuilt as stored is ignored and rewritten too.

>>> import os, tempfile, torch, functrans as ft
>>> saved = dict(os.environ)
>>> os.environ.update(FUNCTRANS_CACHE="1", FUNCTRANS_CACHE_DIR=tempfile.mkdtemp())
>>> os.environ["FUNCTRANS_NATIVE"] = "0"  # a fresh cache root: no native executor build
>>> def f(x):
...     return x.sin() * 2
>>> _ = ft.jit(f)(torch.ones(2))  # traced, and stored
>>> g = ft.jit(f)  # as in a new process: a new jit of the same function
>>> _ = g(torch.ones(2)); g.cache_info().disk_hits
1
>>> os.environ.clear(); os.environ.update(saved)
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from functrans._core import switches
from functrans._core.errors import FunctransError
from functrans._core.graph import JointGraph
from functrans._core.logs import log
from functrans._core.private_dir import cache_root, private_dirs, untrusted
from functrans._trace import reads
from functrans._trace.regions.graph import REGIONS

from . import graph_json as graph_json
from . import key as disk_key
from . import reads_json, region_json
from . import shapes as disk_shapes
from .code_deps import (
    Recorder,
    dependencies,
    file_digest,
    global_digest,
    modified_since,
    process_start,
    source_lines,
)
from .fingerprint import Fingerprint, Unhashable
from .key import FORMAT, DiskKey

__all__ = ["DiskCacheError", "DiskCacheWarning", "DiskKey", "enabled", "max_bytes", "traced"]

_G = TypeVar("_G")

SWITCH_ENV = "FUNCTRANS_CACHE"
SIZE_ENV = "FUNCTRANS_CACHE_SIZE_MB"
SIZE_MB = 512.0
"""The default bound on the traces folder, in MiB (``$FUNCTRANS_CACHE_SIZE_MB``)."""
FOLDER = "traces"


class DiskCacheError(FunctransError):
    """The on-disk trace cache is misconfigured (its environment variables)."""


class DiskCacheWarning(UserWarning):
    """The on-disk trace cache refused a folder or entry (another user can write it)."""


def enabled() -> bool:
    """Whether the disk cache is on: ``$FUNCTRANS_CACHE`` (read on every call; see
    :mod:`functrans._core.switches`) unset or ``1``/``true``/``on``/``yes``;
    ``0``/``false``/``off``/``no`` turn it off.

    >>> enabled() == (os.environ.get("FUNCTRANS_CACHE", "1") not in ("0", "false", "off", "no"))
    True
    """
    return switches.value(switches.CACHE)


def max_bytes() -> int:
    """The size bound of the traces folder: ``$FUNCTRANS_CACHE_SIZE_MB`` MiB (read on every
    write), by default :data:`SIZE_MB`.

    >>> max_bytes() == int(SIZE_MB * 2**20) or SIZE_ENV in os.environ
    True
    """
    return int(switches.value(switches.CACHE_SIZE_MB) * 2**20)


def traced(key: DiskKey, make: Callable[[], _G]) -> tuple[_G, bool]:
    """The graph ``make()`` returns, from disk when a sound key finds it there, and whether
    it came from disk. A miss traces (recording what the trace ran) and stores the graph."""
    if not enabled():
        return make(), False
    folder = _folder()
    if folder is None:
        return make(), False
    fingerprint = Fingerprint()
    try:
        digest = disk_key.digest(key, fingerprint)
    except (Unhashable, graph_json.NotStorable) as e:
        _say(key, f"no disk cache: {e}")
        return make(), False
    watching = reads.current()  # what the trace reads, guarded by the caller (jit)
    for path in _candidates(folder, digest):
        found = _load(path, digest, key, watching)
        if found is not None:
            return found, True
    if not key.store:
        return make(), False
    mark = watching.mark() if watching is not None else 0
    with Recorder() as recorder:
        g = make()
    if recorder.ok:
        read = watching.since(mark) if watching is not None else None
        _store(folder, digest, key, g, recorder, fingerprint, read)
    return g, False


@dataclass(frozen=True)
class WritesHint:
    """What an earlier process learnt, by tracing, of the call a key names: the inputs it
    writes in place (by position) and the paths to captured tensors it writes, lifted to
    inputs then. Its graph is stored under the key that names them (:attr:`DiskKey.writes`,
    the lifted tensors among the inputs): a call looked up without them would trace once
    only to learn them. A hint is never trusted for a value: copying an input the call does
    not write writes back what it holds, a lifted tensor the call does not write is an input
    it reads, and a write the hint misses is found by the trace as before."""

    writes: tuple[int, ...] = ()
    lifted: tuple[Any, ...] = ()  # paths' steps, as JSON gives them back (lists)


def writes_hint(key: DiskKey) -> WritesHint:
    """The :class:`WritesHint` an earlier process left for ``key`` (empty: none)."""
    path = _hint_path(key)
    if path is None:
        return WritesHint()
    try:
        doc = json.loads(path.read_text())
        writes, lifted = doc.get("writes", []), doc.get("lifted", [])
    except (OSError, ValueError, AttributeError):
        return WritesHint()
    if not isinstance(writes, list) or not all(type(i) is int and i >= 0 for i in writes):
        writes = []
    if not isinstance(lifted, list):
        lifted = []
    _say(key, f"hint {path.name}: writes {writes}, lifts {len(lifted)} captured tensors")
    return WritesHint(tuple(writes), tuple(lifted))


def remember_writes(
    key: DiskKey, writes: tuple[int, ...] = (), lifted: tuple[Any, ...] = ()
) -> None:
    """Record for later processes that ``key``'s call writes the inputs ``writes`` and the
    captured tensors at the paths ``lifted`` (their steps)."""
    path = _hint_path(key)
    if path is None or not key.store:
        return
    try:
        text = json.dumps({"writes": list(writes), "lifted": [list(s) for s in lifted]})
    except (TypeError, ValueError):  # a step JSON cannot hold: no hint
        return
    with contextlib.suppress(OSError):
        _write(path, text)


def _hint_path(key: DiskKey) -> Path | None:
    if not enabled() or key.writes:
        return None
    folder = _folder()
    if folder is None:
        return None
    try:
        return folder / f"{disk_key.digest(key, Fingerprint())}.writes.json"
    except (Unhashable, graph_json.NotStorable):
        return None


def _say(key: DiskKey, message: str) -> None:
    name = getattr(key.fn, "__qualname__", type(key.fn).__name__)
    log("disk", f"jit({name}) {key.kind}", lambda: message)


# -- the folder --------------------------------------------------------------------------------

_warned: set[str] = set()


def _refuse(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(
            f"functrans: refusing the on-disk trace cache: {reason}. Point FUNCTRANS_CACHE_DIR at "
            "a directory only you can write (functrans creates its own folders that way), or "
            "set FUNCTRANS_CACHE=0",
            DiskCacheWarning,
            stacklevel=2,
        )


def _folder() -> Path | None:
    """The traces folder, created private; None where it is refused or cannot be made."""
    root = cache_root()
    folder = root / FOLDER
    try:
        private_dirs(folder)
    except OSError as e:
        why = f"cannot create {folder}: {e}"
        log("disk", "no disk cache", lambda: why)
        return None
    for path in (root, folder):
        reason = untrusted(path)
        if reason is not None:
            _refuse(reason)
            return None
    return folder


# -- loading -----------------------------------------------------------------------------------

#: Entries kept per key (one per set of dependencies: a global that alternates between values
#: keeps an entry for each), the most recently used first.
PER_KEY = 8


def _candidates(folder: Path, digest: str) -> list[Path]:
    """The entries stored under ``digest``, most recently used first."""
    found = []
    prefix = f"{digest}-"
    for e in os.scandir(folder):
        if e.name.startswith(prefix) and e.name.endswith(".json"):
            with contextlib.suppress(FileNotFoundError):
                found.append((e.stat().st_mtime, e.path))
    return [Path(p) for _, p in sorted(found, reverse=True)]


def _load(path: Path, digest: str, key: DiskKey, watching: reads.Recorder | None) -> Any:
    """The graph stored at ``path`` if it is there, valid and its dependencies hold, and
    what its trace read still reads the same (then handed to ``watching``, which guards the
    entry with them)."""
    reason = untrusted(path)
    if reason is not None:
        _refuse(reason)
        return None
    try:
        raw = path.read_bytes()
    except OSError as e:  # evicted meanwhile, ...
        _say(key, f"miss: {path} cannot be read ({e})")
        return None
    try:
        text, signed = _checked(raw, _seal_key(path.parent))
        doc = json.loads(text)
        if doc["format"] != FORMAT or doc["key"] != digest or doc["kind"] != key.kind:
            raise graph_json.CorruptEntry("an entry of another format or key")
        stale = _stale(doc["deps"])
        if stale is not None:
            _say(key, f"miss: {stale}")
            return None
        read = reads_json.load(doc["reads"], key.fn)
        if read is None:
            _say(key, f"miss: {path.name} read state that changed since (or leads nowhere)")
            return None
        if key.dims is None:
            g: Any = graph_json.load(doc["graph"], key.fn, verify=not signed)
            if "regions" in doc:
                g.attach(REGIONS, tuple(region_json.load(doc["regions"], verify=not signed)))
        else:
            g = disk_shapes.load(doc, key)
            if g is None:
                _say(key, f"miss: {path.name} was traced under conditions these sizes fail")
                return None
    except Exception as e:  # whatever the entry holds, a bad one is a miss, then rewritten
        _say(key, f"ignoring the invalid entry {path}: {type(e).__name__}: {e}")
        with contextlib.suppress(OSError):  # ours (checked above): the rewrite replaces it
            path.unlink()
        return None
    _touch(path)
    _say(key, f"hit: {path.name}")
    if watching is not None:
        watching.add(read)
    return g


def _sealed(text: str) -> str:
    """``text`` behind a line holding its sha256: any damage to the stored bytes (or to what
    they say they are: the key and kind are inside) is found before the entry is used."""
    return hashlib.sha256(text.encode()).hexdigest() + "\n" + text


def _signed(text: str, key: bytes) -> str:
    """``text`` behind a line holding its HMAC under this cache folder's key: as
    :func:`_sealed`, and it says :func:`_store` wrote it (from a trace, its values as traced),
    so a load need not derive them again."""
    return _SIGNED + hmac.new(key, text.encode(), "sha256").hexdigest() + "\n" + text


_SIGNED = "hmac-sha256:"


def _checked(raw: bytes, key: bytes | None) -> tuple[str, bool]:
    """The entry's JSON text if its first line matches it (else :class:`CorruptEntry`), and
    whether it is signed with ``key`` (:func:`_signed`) rather than only checksummed."""
    head, newline, body = raw.partition(b"\n")
    if newline and key is not None and head.startswith(_SIGNED.encode()):
        want = hmac.new(key, body, "sha256").hexdigest().encode()
        if hmac.compare_digest(head[len(_SIGNED) :], want):
            return body.decode(), True
    if not newline or hashlib.sha256(body).hexdigest().encode() != head:
        raise graph_json.CorruptEntry("its checksum does not match its contents")
    return body.decode(), False


KEY_FILE = ".trace-seal-key"  # in the cache root, beside the traces folder
_KEYS: dict[Path, bytes | None] = {}


def _seal_key(folder: Path) -> bytes | None:
    """This traces folder's signing key (32 random bytes in a file only this user can read,
    made on first use); None where it cannot be read or made, or another user could write it
    (entries are then checksummed only, and verified on load)."""
    if folder in _KEYS:
        return _KEYS[folder]
    path = folder.parent / KEY_FILE
    key: bytes | None = None
    try:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            if untrusted(path) is None and path.stat().st_mode & 0o077 == 0:
                key = path.read_bytes()
        else:
            made = secrets.token_bytes(32)
            with os.fdopen(fd, "wb") as f:
                f.write(made)
            key = made
    except OSError:
        key = None
    if key is not None and len(key) != 32:
        key = None
    _KEYS[folder] = key
    return key


def _stale(deps: dict[str, Any]) -> str | None:
    """What changed since the entry was stored, or None."""
    since = process_start()
    for filename, digest in deps["files"].items():
        if modified_since(filename, since):
            return f"{filename} changed after this process started (or is gone)"
        if file_digest(filename) != digest:
            return f"{filename} changed"
    for name, digest in deps["lines"].items():
        if source_lines(name) != digest:
            return f"the source of {name} changed (or is not loaded)"
    for module, name, digest in deps["globals"]:
        m = sys.modules.get(module)
        if m is None:
            return f"module {module} is not imported"
        attrs = vars(m)
        if name not in attrs:
            return f"{module}.{name} is not defined"
        try:
            now = global_digest(attrs[name])
        except Unhashable as e:
            return f"{module}.{name} cannot be hashed now ({e})"
        if now != digest:
            return f"{module}.{name} changed"
    return None


def _touch(path: Path) -> None:
    with contextlib.suppress(OSError):  # evicted meanwhile
        os.utime(path)


# -- storing -----------------------------------------------------------------------------------


def _store(
    folder: Path,
    digest: str,
    key: DiskKey,
    g: Any,
    recorder: Recorder,
    fp: Fingerprint,
    read: list[reads.Read] | None,
) -> None:
    """Store ``g``, traced from ``key`` with the code ``recorder`` saw run, and the reads the
    trace made (``read``; None: no one was recording them, and none are stored)."""
    try:
        deps = dependencies(recorder, fp.closures, process_start()).to_json()
        entry: dict[str, Any] = {"format": FORMAT, "key": digest, "kind": key.kind}
        entry["created"], entry["deps"] = time.time(), deps
        entry["reads"] = reads_json.dump(read or [])
        entry["graph"] = graph_json.dump(g, key.fn, symbolic=key.dims is not None)
        regions = g.attached(REGIONS) if isinstance(g, JointGraph) else ()
        if regions:  # a joint trace that kept its region ops
            entry["regions"] = region_json.dump(list(regions))
        # a symbolic trace per set of guards: each branch of an `if` on a size is an entry
        which_doc: Any = deps
        if key.dims is not None:
            entry["shape"] = disk_shapes.shape_doc(g)
            which_doc = [deps, entry["shape"]]
        which = hashlib.sha256(json.dumps(which_doc, sort_keys=True).encode()).hexdigest()[:16]
        path = folder / f"{digest}-{which}.json"
        text = json.dumps(entry, separators=(",", ":"))
        graph_json.check_round_trip(json.loads(text)["graph"], g)
        if "regions" in entry:
            region_json.check_round_trip(entry["regions"], list(regions))
    except (Unhashable, graph_json.NotStorable) as e:
        _say(key, f"not stored: {e}")
        return
    try:
        key_bytes = _seal_key(folder)
        _write(path, _sealed(text) if key_bytes is None else _signed(text, key_bytes))
        for old in _candidates(folder, digest)[PER_KEY:]:
            old.unlink(missing_ok=True)
        _evict(folder, max_bytes())
    except OSError as e:
        _say(key, f"not stored: {e}")
        return
    _say(key, f"stored {path.name} ({len(text)} bytes)")


def _write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically: a private temporary file renamed into place."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


_TMP_AGE_S = 3600.0  # a temporary file older than this was left by a killed process


def _evict(folder: Path, limit: int) -> None:
    """Remove the least recently used entries until the folder holds at most ``limit`` bytes."""
    entries = []
    now = time.time()
    for e in os.scandir(folder):
        try:
            st = e.stat()
        except FileNotFoundError:
            continue
        if e.name.startswith(".tmp-"):
            if now - st.st_mtime > _TMP_AGE_S:
                Path(e.path).unlink(missing_ok=True)
            continue
        if e.name.endswith(".json"):
            entries.append((st.st_mtime, st.st_size, e.path))
    total = sum(size for _, size, _ in entries)
    for _, size, p in sorted(entries):
        if total <= limit:
            break
        Path(p).unlink(missing_ok=True)
        total -= size
