"""Where code generation keeps what it builds: ``$FUNCTRANS_CACHE_DIR`` (read on every call),
by default ``~/.cache/functrans``.

>>> import os
>>> os.environ["FUNCTRANS_CACHE_DIR"] = "/tmp/ft-cache"
>>> str(cache_root())
'/tmp/ft-cache'
>>> del os.environ["FUNCTRANS_CACHE_DIR"]
>>> cache_root().parts[-2:]
('.cache', 'functrans')
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root"]


def cache_root() -> Path:
    """The root of functrans's on-disk caches."""
    root = os.environ.get("FUNCTRANS_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "functrans"
