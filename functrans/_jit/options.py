"""What :func:`~functrans._jit.api.jit` was asked for: one frozen record per jitted function.

>>> Options("default", "aten", (), "auto", {}).cache_size == CACHE_SIZE
True
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from functrans._core.shapes import JitDynamic
from functrans._cut.partition import Strategy
from functrans._trace.decomp import Decompositions
from functrans._trace.options import TraceOptions

__all__ = ["CACHE_SIZE", "Options"]

#: Default number of compiled entries a jitted function keeps (least recently used out).
CACHE_SIZE = 32


@dataclass(frozen=True)
class Options:
    """What :func:`~functrans._jit.api.jit` was asked for (see its parameters); ``trace``:
    what the environment decides of its traces, read once, when the record is made (when
    ``jit`` is called), so a switch changed between two calls changes neither."""

    partition: str | Strategy
    backend: str
    static_argnums: tuple[int, ...]
    decompositions: Decompositions
    partition_options: dict[str, Any]
    cache_size: int = CACHE_SIZE
    dynamic: JitDynamic = "auto"
    trace: TraceOptions = field(default_factory=TraceOptions.read)
