"""Where functrans keeps what it writes to disk, and the checks that keep it the user's own.

Every on-disk cache (native executor builds, Triton kernels, traced graphs) lives under
:func:`cache_root`: ``$FUNCTRANS_CACHE_DIR`` (read on every call), by default
``~/.cache/functrans``. These caches hold code or graphs this process will run, so they must
be this user's alone: :func:`private_dirs` creates folders readable and writable by the user
only, and :func:`untrusted` says why a path that another user owns or can write must not be
used. Core and codegen share these (codegen through :mod:`functrans.extend`).

>>> import os, tempfile
>>> from pathlib import Path
>>> os.environ["FUNCTRANS_CACHE_DIR"] = "/tmp/ft-cache"
>>> str(cache_root())
'/tmp/ft-cache'
>>> del os.environ["FUNCTRANS_CACHE_DIR"]
>>> cache_root().parts[-2:]
('.cache', 'functrans')
>>> tmp = tempfile.TemporaryDirectory()
>>> made = Path(tmp.name) / "a" / "b"
>>> private_dirs(made)
>>> oct(made.stat().st_mode & 0o777), untrusted(made)
('0o700', None)
>>> tmp.cleanup()
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from . import switches

__all__ = ["cache_root", "private_dirs", "untrusted"]


def cache_root() -> Path:
    """The root of functrans's on-disk caches: ``$FUNCTRANS_CACHE_DIR`` (read on every call),
    by default ``~/.cache/functrans``.

    >>> cache_root().name
    'functrans'
    """
    root = switches.value(switches.CACHE_DIR)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "functrans"


def private_dirs(directory: Path) -> None:
    """Create ``directory`` and any missing parents readable and writable by this user only
    (``os.makedirs``' mode reaches the last one only). Existing folders are left as they are:
    check them with :func:`untrusted`.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     private_dirs(Path(tmp) / "x")
    ...     oct((Path(tmp) / "x").stat().st_mode & 0o777)
    '0o700'
    """
    missing = []
    for d in (directory, *directory.parents):
        if d.exists():
            break
        missing.append(d)
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile
            d.mkdir(mode=0o700)


def untrusted(path: Path) -> str | None:
    """Why ``path`` must not be trusted with code this process runs (another user owns it or
    can write it), or None. On systems without POSIX owners, None.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     os.chmod(tmp, 0o777)
    ...     untrusted(Path(tmp)).endswith("is writable by other users (mode 0o777)")
    True
    """
    if not hasattr(os, "getuid"):
        return None
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    if st.st_uid != os.getuid():
        return f"{path} is owned by another user (uid {st.st_uid})"
    if st.st_mode & 0o022:
        return f"{path} is writable by other users (mode {oct(st.st_mode & 0o777)})"
    return None
