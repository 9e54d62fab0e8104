"""The region machinery's one trace extension: while a joint trace runs, blocks found in
module containers and marked with :func:`~functrans.region` (:mod:`.finding`) and plain
functions called as blocks (:mod:`.functions`) are called as regions; after it, each region
call is expanded into copies of its region's nodes (:func:`~functrans._trace.regions.expand`),
or kept for ``ft.jit`` to outline (:func:`~functrans._trace.regions.deferred`). A trace whose
options turn regions off (``FUNCTRANS_REGIONS=0``, ``ft.jit(..., regions="off")``) does not
enter it.

>>> from functrans._trace.extensions import trace_extensions
>>> [e.when for e in trace_extensions() if e is REGIONS]
['regions not off']
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from ..extensions import TraceExtension, register_trace_extension
from ..options import TraceOptions
from . import expand
from .finding import finding_blocks
from .functions import repeated_functions

__all__ = ["REGIONS"]


@contextlib.contextmanager
def _regions(traced: Callable[..., Any] | None) -> Iterator[None]:
    with finding_blocks(traced), repeated_functions(traced):
        yield


def _wanted(options: TraceOptions) -> bool:
    return options.regions != "off"


REGIONS = register_trace_extension(
    TraceExtension(
        "regions",
        40,
        _regions,
        graph_pass=expand,
        doc="module-container members with a sibling of their class, ft.region marks and "
        "plain functions called repeatedly are traced once, as regions; their calls expanded "
        "after the trace (or kept for ft.jit to outline)",
        wanted=_wanted,
        when="regions not off",
    )
)
