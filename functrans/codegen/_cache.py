"""Where code generation keeps what it builds: :func:`functrans.extend.cache_root`
(``$FUNCTRANS_CACHE_DIR``, by default ``~/.cache/functrans``), shared with the core's caches
and documented with them in :mod:`functrans._core.private_dir`."""

from __future__ import annotations

from functrans.extend import cache_root

__all__ = ["cache_root"]
