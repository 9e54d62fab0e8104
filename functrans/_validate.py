"""Checks of user input at the entry points: strategies, their options, what a strategy returned.

Every error names the argument or option, shows the value and says what is accepted. Strategy
authors get :func:`check_names`, :func:`check_option`, :func:`check_number` and
:func:`parse_options` from :mod:`functrans.extend`, so their options fail the same way ours do.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import numbers
import reprlib
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, TypeVar

import torch.fx as fx

from ._errors import InvalidArgumentError, InvalidPartitionError

__all__ = [
    "check_call",
    "check_names",
    "check_number",
    "check_option",
    "describe",
    "parse_options",
    "saved_items",
]

_Options = TypeVar("_Options")

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60

#: What a strategy must return, for messages.
RETURNS = "an iterable of forward nodes (torch.fx.Node) or node names (str) to save"


def describe(value: object) -> str:
    """A short repr of ``value`` and its type, for messages.

    >>> describe("x"), describe(float("nan")), describe(None)
    ("'x' (str)", 'nan (float)', 'None')
    """
    return "None" if value is None else f"{_REPR.repr(value)} ({type(value).__name__})"


def check_option(where: str, name: str, value: object, ok: bool, accepted: str) -> None:
    """Raise :class:`InvalidArgumentError` for ``name=value`` unless ``ok``.

    >>> check_option("my_strategy", "mode", "fast", False, "'exact' or 'greedy'")
    Traceback (most recent call last):
    ...
    functrans._errors.InvalidArgumentError: my_strategy: mode='fast' (str) is not accepted; ...
    """
    if not ok:
        raise InvalidArgumentError(
            f"{where}: {name}={describe(value)} is not accepted; {name} must be {accepted}"
        )


def check_number(
    where: str,
    name: str,
    value: object,
    *,
    at_least: float | None = None,
    above: float | None = None,
    integer: bool = False,
    allow_inf: bool = False,
    meaning: str = "",
) -> None:
    """Check that ``value`` is a number (an int with ``integer``; never a bool, never NaN;
    infinite only with ``allow_inf``) ``>= at_least`` and ``> above``.

    >>> check_number("memory_budget", "max_bytes", -1, at_least=0, integer=True, meaning="bytes")
    Traceback (most recent call last):
    ...
    functrans._errors.InvalidArgumentError: memory_budget: max_bytes=-1 (int) ... int >= 0 (bytes)
    """
    kind = "an int" if integer else "a number" if allow_inf else "a finite number"
    bound = f" >= {at_least:g}" if at_least is not None else ""
    bound += f" > {above:g}" if above is not None else ""
    ok = _in_range(value, integer, allow_inf, at_least, above)
    check_option(where, name, value, ok, kind + bound + (f" ({meaning})" if meaning else ""))


def parse_options(
    options_type: Callable[..., _Options],
    where: str,
    options: Mapping[str, object],
    *,
    hints: Mapping[str, str] | None = None,
) -> _Options:
    """Build a strategy's options dataclass from the keywords ``partition`` passed, rejecting
    unknown names first (listing the dataclass's fields); the dataclass checks the values.

    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True)
    ... class Opts:
    ...     depth: int = 2
    >>> parse_options(Opts, "my_strategy", {"depth": 3})
    Opts(depth=3)
    >>> parse_options(Opts, "my_strategy", {"dept": 3})
    Traceback (most recent call last):
    ...
    functrans._errors.InvalidArgumentError: my_strategy: unknown option dept=3 (did you mean
    depth?); accepted options: depth
    """
    accepted = [f.name for f in dataclasses.fields(options_type)]  # type: ignore[arg-type]  # a dataclass type, checked by fields()
    check_names(where, options, accepted, hints=hints)
    return options_type(**options)


def _in_range(
    value: object, integer: bool, allow_inf: bool, at_least: float | None, above: float | None
) -> bool:
    if isinstance(value, bool) or not isinstance(
        value, numbers.Integral if integer else numbers.Real
    ):
        return False
    if not integer and (math.isnan(value) or (math.isinf(value) and not allow_inf)):
        return False
    # not NaN here, so "not <" is ">=": numbers.Real declares only < and <= (typeshed)
    return (at_least is None or not value < at_least) and (above is None or not value <= above)


def check_names(
    where: str,
    options: Mapping[str, object],
    accepted: Collection[str],
    *,
    hints: Mapping[str, str] | None = None,
) -> None:
    """Reject option names not in ``accepted``, listing the accepted ones (and the closest
    match, for a misspelling); ``hints`` explains why a known-elsewhere name is refused here.

    >>> check_names("min_cut", {"recompute_view": False}, ["recompute_views", "ban_reductions"])
    Traceback (most recent call last):
    ...
    functrans._errors.InvalidArgumentError: min_cut: unknown option recompute_view=False (did you
    mean recompute_views?); accepted options: recompute_views, ban_reductions
    """
    for key, value in options.items():
        if key in accepted:
            continue
        close = difflib.get_close_matches(key, list(accepted), n=1)
        hint = (hints or {}).get(key) or (f"did you mean {close[0]}?" if close else "")
        listed = f"accepted options: {', '.join(accepted)}" if accepted else "it takes no options"
        raise InvalidArgumentError(
            f"{where}: unknown option {key}={_REPR.repr(value)}{f' ({hint})' if hint else ''}; "
            + listed
        )


def check_call(name: str, fn: Callable[..., Any], options: Mapping[str, object]) -> None:
    """Raise :class:`InvalidArgumentError` if strategy ``fn`` cannot be called as
    ``fn(joint, **options)``, before it runs (so a TypeError from inside it stays its own)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have none: let the call decide
        return
    try:
        sig.bind(None, **options)
    except TypeError as e:
        params = list(sig.parameters.values())
        joint = next(
            (p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)), None
        )
        accepted = [
            p.name
            for p in params
            if p.kind is p.KEYWORD_ONLY or (p.kind is p.POSITIONAL_OR_KEYWORD and p is not joint)
        ]
        if any(p.kind is p.VAR_KEYWORD for p in params) or all(k in accepted for k in options):
            given = "".join(f", {k}=..." for k in options)
            raise InvalidArgumentError(
                f"partition strategy {name!r} cannot be called as {name}(joint{given}): {e}"
            ) from None
        check_names(f"partition strategy {name!r}", options, accepted)


def saved_items(name: str, chosen: object) -> list[str | fx.Node]:
    """What strategy ``name`` returned, as a list, or :class:`InvalidPartitionError` saying what
    it returned instead of :data:`RETURNS`."""
    what = f"partition strategy {name!r} returned"
    if chosen is None:
        raise InvalidPartitionError(
            f"{what} None; a strategy must return {RETURNS} (is its return statement missing?)"
        )
    if isinstance(chosen, (str, bytes)):
        raise InvalidPartitionError(
            f"{what} the string {chosen!r}; a strategy must return {RETURNS}, e.g. [{chosen!r}]"
        )
    if not isinstance(chosen, Iterable):
        raise InvalidPartitionError(
            f"{what} {describe(chosen)}, which is not iterable; a strategy must return {RETURNS}"
        )
    items = list(chosen)
    for i, item in enumerate(items):
        if not isinstance(item, (str, fx.Node)):
            raise InvalidPartitionError(
                f"{what} {_REPR.repr(items)}: item {i} is {describe(item)}, neither a node nor a "
                f"node name; a strategy must return {RETURNS}"
            )
    return items
