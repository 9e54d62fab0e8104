"""Every ``FUNCTRANS_*`` environment variable, declared once: the switch table.

A switch is read where it is needed (on every call unless its row says otherwise, so a test or
a notebook can change it) through :func:`value`, the one place functrans reads
``os.environ``. Every switch is parsed the same way: unset, empty or blank means its default,
and a value it does not accept is an error naming the variable, the value, what it accepts and
the default. :func:`overridden` sets switches for the length of a ``with`` block (in this
thread or task only), without touching the environment; :func:`table` is the table
``docs/switches.md`` prints.

>>> value(REGIONS)
'compiled'
>>> with overridden(FUNCTRANS_REGIONS="unrolled"):
...     value(REGIONS)
'unrolled'
>>> with overridden(FUNCTRANS_CACHE_SIZE_MB="-1"):
...     value(CACHE_SIZE_MB)
Traceback (most recent call last):
...
functrans._core.switches.SwitchError: FUNCTRANS_CACHE_SIZE_MB='-1' is not accepted: a size ...
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .errors import InvalidArgumentError

__all__ = [
    "CACHE",
    "CACHE_DIR",
    "CACHE_SIZE_MB",
    "LOGS",
    "NATIVE",
    "NATIVE_LOCK_TIMEOUT",
    "REGIONS",
    "SWITCHES",
    "Switch",
    "SwitchError",
    "overridden",
    "switch_value",
    "switches_overridden",
    "table",
    "value",
]

_T = TypeVar("_T")


class SwitchError(InvalidArgumentError):
    """A ``FUNCTRANS_*`` variable holds a value it does not accept.

    >>> with overridden(FUNCTRANS_NATIVE="perhaps"):
    ...     value(NATIVE)
    Traceback (most recent call last):
    ...
    functrans._core.switches.SwitchError: FUNCTRANS_NATIVE='perhaps' is not accepted: ...
    """


@dataclass(frozen=True)
class Switch(Generic[_T]):
    """One environment variable: its name, default, parser (raises ``ValueError`` for a value
    it does not accept), what it accepts and what it does (one line each, for errors and the
    docs' table), and when it is read.

    >>> REGIONS.name, REGIONS.default, REGIONS.parse("UNROLLED".lower())
    ('FUNCTRANS_REGIONS', 'compiled', 'unrolled')
    """

    name: str
    default: _T
    parse: Callable[[str], _T]
    accepts: str
    does: str
    read: str = "on every use"
    shown_default: str | None = None

    def default_text(self) -> str:
        return self.shown_default if self.shown_default is not None else str(self.default)


_ON = frozenset({"1", "true", "on", "yes"})
_OFF = frozenset({"0", "false", "off", "no"})


def _flag(raw: str) -> bool:
    low = raw.lower()
    if low in _ON or low in _OFF:
        return low in _ON
    raise ValueError(raw)


def _nonnegative(raw: str) -> float:
    number = float(raw)  # ValueError for text
    if not number >= 0:  # also refuses nan
        raise ValueError(raw)
    return number


_REGION_MODES = {
    **dict.fromkeys(("0", "false", "off", "no"), "off"),
    **dict.fromkeys(("1", "true", "on", "yes", "compiled"), "compiled"),
    "unrolled": "unrolled",
}


def _regions(raw: str) -> str:
    return _REGION_MODES[raw.lower()]  # KeyError is a LookupError; made a ValueError below


REGIONS: Switch[str] = Switch(
    "FUNCTRANS_REGIONS",
    "compiled",
    _regions,
    "1 or compiled (the default), unrolled, or 0",
    "repeated blocks: traced, cut and compiled once (compiled), traced once and pasted into "
    "the step (unrolled), or every block traced inline (0)",
    read="when a transform is built (ft.jit: its regions= wins)",
)
LOGS: Switch[str] = Switch(
    "FUNCTRANS_LOGS",
    "",
    str,
    "comma-separated topics (+topic for DEBUG), see docs/debugging.md",
    "which functrans.* loggers print to stderr without a logging set-up of your own",
    read="at import",
    shown_default="none",
)
CACHE: Switch[bool] = Switch(
    "FUNCTRANS_CACHE",
    True,
    _flag,
    "1/true/on/yes or 0/false/off/no",
    "the on-disk trace cache on or off",
    shown_default="1",
)
CACHE_DIR: Switch[str] = Switch(
    "FUNCTRANS_CACHE_DIR",
    "",
    str,
    "a folder path (~ expanded)",
    "the root of functrans' caches (traces, the native executor's build)",
    shown_default="~/.cache/functrans",
)
CACHE_SIZE_MB: Switch[float] = Switch(
    "FUNCTRANS_CACHE_SIZE_MB",
    512.0,
    _nonnegative,
    "a size in MiB (>= 0)",
    "the size bound of the traces folder (oldest entries removed past it)",
    read="on every write",
    shown_default="512",
)
NATIVE: Switch[bool] = Switch(
    "FUNCTRANS_NATIVE",
    True,
    _flag,
    "1/true/on/yes or 0/false/off/no",
    "the C++ executor of the aten backend on or off (off: the Python executor)",
    shown_default="1",
)
NATIVE_LOCK_TIMEOUT: Switch[float] = Switch(
    "FUNCTRANS_NATIVE_LOCK_TIMEOUT",
    600.0,
    _nonnegative,
    "a number of seconds (>= 0)",
    "after how long a native build's lock left by another process counts as stale",
    shown_default="600",
)

#: every switch, by name
SWITCHES: Mapping[str, Switch[Any]] = {
    s.name: s for s in (REGIONS, LOGS, CACHE, CACHE_DIR, CACHE_SIZE_MB, NATIVE, NATIVE_LOCK_TIMEOUT)
}

_OVERRIDES: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar(
    "functrans_switch_overrides", default=types.MappingProxyType({})
)


def raw(switch: Switch[Any]) -> str | None:
    """The switch's text: an override, else the environment's (None: unset or blank)."""
    text = _OVERRIDES.get().get(switch.name)
    if text is None:
        text = os.environ.get(switch.name)
    return None if text is None or not text.strip() else text.strip()


def value(switch: Switch[_T]) -> _T:
    """The switch's value now (see the module docstring).

    >>> value(CACHE_SIZE_MB)  # unless set: the default
    512.0
    """
    text = raw(switch)
    if text is None:
        return switch.default
    try:
        return switch.parse(text)
    except (ValueError, LookupError):
        raise SwitchError(
            f"{switch.name}={text!r} is not accepted: {switch.accepts}; unset it for the "
            f"default ({switch.default_text()})"
        ) from None


@contextlib.contextmanager
def overridden(**values: str | None) -> Iterator[None]:
    """Switches set (a name to its text; None: as if unset) while the block runs, in this
    thread or task only; the environment is left as it is.

    >>> with overridden(FUNCTRANS_CACHE="0"):
    ...     value(CACHE)
    False
    """
    unknown = sorted(set(values) - set(SWITCHES))
    if unknown:
        raise SwitchError(
            f"overridden: {unknown} are not switches; the switches: {sorted(SWITCHES)}"
        )
    merged = {**_OVERRIDES.get(), **{k: "" if v is None else v for k, v in values.items()}}
    token = _OVERRIDES.set(merged)
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


#: the names :mod:`functrans.extend` gives them
switch_value, switches_overridden = value, overridden


def environment_path() -> str:
    """The process's ``PATH`` (what a compiler subprocess is run with)."""
    return os.environ.get("PATH", "")


@contextlib.contextmanager
def path_prefixed(folder: str) -> Iterator[None]:
    """``PATH`` with ``folder`` first while the block runs (a subprocess that looks a tool up,
    ``ninja`` for torch's C++ extension build, finds the venv's).

    >>> with path_prefixed("/opt/tools"):
    ...     environment_path().startswith("/opt/tools")
    True
    """
    before = environment_path()
    os.environ["PATH"] = os.pathsep.join([folder, before])
    try:
        yield
    finally:
        os.environ["PATH"] = before


def table() -> str:
    """The switches as a Markdown table (``docs/switches.md``).

    >>> print(table().splitlines()[0])
    | variable | default | accepts | what it does | read |
    """
    rows = ["| variable | default | accepts | what it does | read |", "|---|---|---|---|---|"]
    for s in SWITCHES.values():
        rows.append(f"| `{s.name}` | {s.default_text()} | {s.accepts} | {s.does} | {s.read} |")
    return "\n".join(rows)
