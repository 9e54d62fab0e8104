"""Trace options: what a trace depends on besides its function and its inputs, in one record.

A trace's own arguments (decompositions, CSE, dynamic dimensions) are parameters of the
transform that traces (:func:`~functrans.trace`, :func:`~functrans.joint`, ``ft.jit``). What
the environment decides (today the regions mode, ``FUNCTRANS_REGIONS``) is read once, when a
transform is built, into a frozen :class:`TraceOptions`: ``ft.jit(f)`` reads it when ``jit`` is
called (its ``regions=`` overrides it), ``ft.joint(f)`` when ``joint`` is called. While the
transform traces, its record is the trace session's (:data:`OPTIONS`, a
:class:`~functrans._trace.session.Slot`), and the extensions read it there
(:func:`options`): a transform built inside another's trace (``jit``'s own joint trace) takes
the record of the one around it, and changing the environment between two calls of one
jitted function changes nothing of either call.

>>> from functrans._core.switches import overridden
>>> with overridden(FUNCTRANS_REGIONS="0"):
...     built = TraceOptions.read()  # read once, here
>>> built, options().regions
(TraceOptions(regions='off'), 'compiled')
>>> with OPTIONS.bound(built):
...     options().regions
'off'
>>> TraceOptions.read(regions="sometimes")
Traceback (most recent call last):
...
functrans._core.errors.InvalidArgumentError: regions='sometimes' is not accepted: ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast

from functrans._core import switches
from functrans._core.errors import InvalidArgumentError

from .session import Slot

__all__ = ["OPTIONS", "REGION_MODES", "RegionsMode", "TraceOptions", "options"]

#: how repeated blocks are traced: cut and compiled once (``ft.jit``; elsewhere as
#: ``"unrolled"``), traced once and pasted into the step, or every block traced inline
RegionsMode = Literal["compiled", "unrolled", "off"]
REGION_MODES: tuple[RegionsMode, ...] = ("compiled", "unrolled", "off")


@dataclass(frozen=True)
class TraceOptions:
    """What the environment decides of a trace, read once by the transform that traces.

    ``regions``: :data:`RegionsMode` (``FUNCTRANS_REGIONS``; see
    :mod:`functrans._trace.regions`)."""

    regions: RegionsMode = "compiled"

    @classmethod
    def read(cls, *, regions: str | None = None) -> TraceOptions:
        """The options the switch table gives now, with those given here over them; a value
        given that is not accepted raises :class:`~functrans.InvalidArgumentError` naming it."""
        if regions is None:
            regions = switches.value(switches.REGIONS)
        elif regions not in REGION_MODES:
            raise InvalidArgumentError(
                f"regions={regions!r} is not accepted: one of {', '.join(REGION_MODES)} "
                f"(None: FUNCTRANS_REGIONS, by default 'compiled')"
            )
        return cls(regions=cast(RegionsMode, regions))


#: the options of the running trace (None: no transform bound any)
OPTIONS: Slot[TraceOptions | None] = Slot("trace options", None)


def options() -> TraceOptions:
    """The options of the running trace; outside any, those the switch table gives now (a
    transform built here would read the same)."""
    bound = OPTIONS.get()
    return bound if bound is not None else TraceOptions.read()
