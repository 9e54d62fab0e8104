"""Trace extensions: what parts of functrans add to every trace, declared and ordered.

A trace (:func:`functrans._trace.trace.trace`, ``joint``, ``jit``'s) is ``make_fx`` over the
user's function plus what other parts of functrans need while it runs: lazy graph modules,
``torch.compile``-d code traced as written, blocks found and traced once (regions), plain
functions called as blocks, ``torch.utils.checkpoint`` calls made remat regions. Each is a
:class:`TraceExtension` registered here by name, with an order (lower is entered first, outer)
whether the trace's options want it (:class:`~functrans._trace.options.TraceOptions`; the
regions extension is off under ``FUNCTRANS_REGIONS=0``), and what it adds: a context entered
around the traced body (also around a region traced on its own) and a pass over the raw graph
after it. The trace reads :func:`active` and nothing else; ``python -m functrans explain
--trace`` prints them.

>>> from functrans._trace.extensions import trace_extensions
>>> import functrans  # its modules register theirs when imported
>>> [e.name for e in trace_extensions()][:2]
['lazy graph modules', 'torch.compile-d code as written']
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from functrans._core.errors import InvalidArgumentError

from .options import TraceOptions, options

__all__ = [
    "TraceExtension",
    "active",
    "describe",
    "register_trace_extension",
    "trace_extensions",
    "unregister_trace_extension",
]

#: a context around a traced body, called with the function traced (None: a region traced on
#: its own)
TraceContext = Callable[[Callable[..., Any] | None], contextlib.AbstractContextManager[Any]]


@dataclass(frozen=True)
class TraceExtension:
    """What one part of functrans adds to every trace: a ``context`` entered around the
    traced body (and around a region's own trace) and a ``graph_pass`` over the raw graph,
    run before the input-mutation check and functionalization; ``order`` places it among the
    others (lower: entered first); ``wanted`` says whether a trace with those options uses it
    (None: every trace), and ``when`` says so in words for ``explain --trace``."""

    name: str
    order: int
    context: TraceContext | None = None
    graph_pass: Callable[[fx.GraphModule], fx.GraphModule] | None = None
    doc: str = ""
    wanted: Callable[[TraceOptions], bool] | None = None
    when: str = "always"


_REGISTERED: dict[str, TraceExtension] = {}


def register_trace_extension(extension: TraceExtension) -> TraceExtension:
    """Add ``extension`` to every trace from now on; returns it. A second registration under
    the same name replaces the first only if it declares the same order (a module imported
    again); otherwise :class:`~functrans.InvalidArgumentError`.

    >>> from functrans._trace.extensions import TraceExtension, register_trace_extension
    >>> ext = register_trace_extension(TraceExtension("a doctest's", 1000, doc="nothing"))
    >>> unregister_trace_extension(ext.name) is ext
    True
    """
    before = _REGISTERED.get(extension.name)
    if before is not None and before.order != extension.order:
        raise InvalidArgumentError(
            f"register_trace_extension: {extension.name!r} is registered already at order "
            f"{before.order}, not {extension.order}; pick another name"
        )
    _REGISTERED[extension.name] = extension
    return extension


def unregister_trace_extension(name: str) -> TraceExtension | None:
    """Remove the extension registered as ``name`` from later traces; returns it (None:
    none was)."""
    return _REGISTERED.pop(name, None)


def trace_extensions() -> tuple[TraceExtension, ...]:
    """The registered extensions, in the order a trace enters them."""
    return tuple(sorted(_REGISTERED.values(), key=lambda e: (e.order, e.name)))


def active(given: TraceOptions | None = None) -> tuple[TraceExtension, ...]:
    """The extensions a trace with options ``given`` (the running trace's where None) enters,
    in order.

    >>> from functrans._trace.options import TraceOptions
    >>> import functrans
    >>> on = {e.name for e in active(TraceOptions(regions="compiled"))}
    >>> sorted(on - {e.name for e in active(TraceOptions(regions="off"))})
    ['regions']
    """
    opts = options() if given is None else given
    return tuple(e for e in trace_extensions() if e.wanted is None or e.wanted(opts))


def describe() -> str:
    """One line per extension: order, name, what it adds, when, who declared it."""
    lines = []
    for e in trace_extensions():
        adds = ", ".join(
            what for what, has in (("context", e.context), ("pass", e.graph_pass)) if has
        )
        owner = getattr(e.context or e.graph_pass, "__module__", "?")
        lines.append(f"{e.order:>4}  {e.name:<34} {adds:<14} {e.when:<18} {owner}: {e.doc}")
    return "\n".join(lines)
