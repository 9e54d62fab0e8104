"""Where code generation keeps what it builds: ``$FUNCTRANS_CACHE_DIR`` (read on every call),
by default ``~/.cache/functrans`` (:func:`functrans.extend.cache_root`, shared with the core's
caches).

>>> import os
>>> os.environ["FUNCTRANS_CACHE_DIR"] = "/tmp/ft-cache"
>>> str(cache_root())
'/tmp/ft-cache'
>>> del os.environ["FUNCTRANS_CACHE_DIR"]
>>> cache_root().parts[-2:]
('.cache', 'functrans')
"""

from __future__ import annotations

from functrans.extend import cache_root

__all__ = ["cache_root"]
