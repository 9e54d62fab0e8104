"""Checks of user input at the entry points: strategies, their options, what a strategy returned.

Every error names the argument or option, shows the value and says what is accepted. Strategy
authors get :func:`check_names`, :func:`check_option`, :func:`check_number` and
:func:`parse_options` from :mod:`functrans.extend`, so their options fail the same way ours do.
What torch.func itself raises about a transform's arguments is named in
:mod:`functrans._core.torch_func_errors`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import math
import numbers
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, TypeVar

import torch.fx as fx

from .describe import _REPR, check_numpy_leaves, describe
from .dtypes import differentiable
from .errors import InvalidArgumentError, InvalidPartitionError

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

#: What a strategy must return, for messages.
RETURNS = "an iterable of forward nodes (torch.fx.Node) or node names (str) to save"


def check_option(where: str, name: str, value: object, ok: bool, accepted: str) -> None:
    """Raise :class:`InvalidArgumentError` for ``name=value`` unless ``ok``.

    >>> check_option("my_strategy", "mode", "fast", False, "'exact' or 'greedy'")
    Traceback (most recent call last):
    ...
    functrans._core.errors.InvalidArgumentError: my_strategy: mode='fast' (str) is not accepted; ...
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
    functrans._core.errors.InvalidArgumentError: memory_budget: max_bytes=-1 (int) ... int >= 0 ...
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
    functrans._core.errors.InvalidArgumentError: my_strategy: unknown option dept=3 (did you mean
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
    functrans._core.errors.InvalidArgumentError: min_cut: unknown option recompute_view=False ...
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


# -- the public transforms' own arguments ---------------------------------------------------


def check_callable(where: str, name: str, value: object) -> None:
    """Raise :class:`InvalidArgumentError` unless ``value`` is callable.

    >>> check_callable("grad", "f", None)
    Traceback (most recent call last):
    ...
    functrans._core.errors.InvalidArgumentError: grad: f=None is not accepted; f must be a ...
    """
    check_option(where, name, value, callable(value), "a callable (a function or a module)")


def check_bool(where: str, name: str, value: object) -> None:
    """Raise :class:`InvalidArgumentError` unless ``value`` is ``True`` or ``False``.

    >>> check_bool("remat", "prevent_cse", "yes")
    Traceback (most recent call last):
    ...
    functrans._core.errors.InvalidArgumentError: remat: prevent_cse='yes' (str) is not accepted; ...
    """
    check_option(where, name, value, isinstance(value, bool), "True or False")


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_argnums(where: str, argnums: object, *, name: str = "argnums") -> tuple[int, ...]:
    """``argnums`` as a tuple, or :class:`InvalidArgumentError` unless it is an int or a
    non-empty sequence of distinct ints (the range is checked against the call's arguments by
    :func:`check_argnums_range`).

    >>> check_argnums("grad", (0, 1))
    (0, 1)
    >>> check_argnums("grad", 1.5)
    Traceback (most recent call last):
    ...
    functrans._core.errors.InvalidArgumentError: grad: argnums=1.5 (float) is not accepted; ...
    """
    accepted = "an int or a non-empty tuple of distinct ints (argument positions)"
    if _is_index(argnums):
        return (argnums,)  # type: ignore[return-value]  # an int, checked above
    ok = isinstance(argnums, (tuple, list)) and bool(argnums)
    nums: tuple[Any, ...] = tuple(argnums) if ok else ()  # type: ignore[arg-type]  # a tuple or list, checked
    ok = ok and all(_is_index(i) for i in nums) and len(set(nums)) == len(nums)
    check_option(where, name, argnums, ok, accepted)
    return nums


def check_argnums_range(where: str, argnums: object, nargs: int, *, name: str = "argnums") -> None:
    """Raise :class:`InvalidArgumentError` if ``argnums`` names an argument the call lacks."""
    nums = check_argnums(where, argnums, name=name)
    for i in nums:
        if not -nargs <= i < nargs:
            raise InvalidArgumentError(
                f"{where}: {name}={argnums!r} names argument {i}, but the function was called "
                f"with {nargs} positional argument{'' if nargs == 1 else 's'}; {name} must be "
                f"in range({-nargs}, {nargs}) (negative counts from the end)"
            )
    if len({i % nargs for i in nums}) != len(nums):
        raise InvalidArgumentError(f"{where}: {name}={argnums!r} names an argument twice")


def check_static_argnums(where: str, value: object) -> tuple[int, ...]:
    """``static_argnums`` as a tuple, or :class:`InvalidArgumentError` unless it is an int or a
    sequence of ints.

    >>> check_static_argnums("jit", [1]), check_static_argnums("jit", 0)
    ((1,), (0,))
    >>> check_static_argnums("remat", "x")
    Traceback (most recent call last):
    ...
    functrans._core.errors.InvalidArgumentError: remat: static_argnums='x' (str) is not ...
    """
    if _is_index(value):
        return (value,)  # type: ignore[return-value]  # an int, checked above
    ok = isinstance(value, (tuple, list, range)) and all(_is_index(i) for i in value)
    check_option(where, "static_argnums", value, ok, "an int or a sequence of ints")
    return tuple(value)  # type: ignore[arg-type]  # a sequence, checked above


def check_static_range(where: str, static_argnums: tuple[int, ...], nargs: int) -> None:
    """Raise :class:`InvalidArgumentError` if ``static_argnums`` names a missing argument (at
    the call: where the signature settles it, :func:`check_static_signature` did when the
    transform was made)."""
    for i in static_argnums:
        if not -nargs <= i < nargs:
            raise InvalidArgumentError(
                f"{where}: static_argnums={static_argnums!r} names argument {i}, but the "
                f"function was called with {nargs} positional argument"
                f"{'' if nargs == 1 else 's'}"
            )


def positional_parameters(f: Callable[..., Any]) -> tuple[str, list[str] | None] | None:
    """``(name, positional parameter names)`` of ``f`` (of a module: its ``forward``'s), with
    None for the names where it takes ``*args`` (any position exists); None where its signature
    cannot be read (a builtin such as ``torch.sin``).

    >>> positional_parameters(lambda x, y=1, *, z: x)
    ('<lambda>', ['x', 'y'])
    >>> positional_parameters(print)[1] is None, positional_parameters(max)
    (True, None)
    """
    import torch

    fn = f.forward if isinstance(f, torch.nn.Module) else f
    name = f"{type(f).__name__}.forward" if fn is not f else _name(f)
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a text signature
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return name, None
    return name, [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _name(f: object) -> str:
    inner = f.func if isinstance(f, functools.partial) else f
    qualname = getattr(inner, "__qualname__", None)  # a name for the message, not a capability
    return qualname.rsplit(".", 1)[-1] if isinstance(qualname, str) else type(inner).__name__


def check_static_signature(
    where: str, f: Callable[..., Any], static_argnums: tuple[int, ...]
) -> bool:
    """Check, when a transform is made, that every index of ``static_argnums`` names one of
    ``f``'s positional parameters (negative ones count from the end, as in JAX); return whether
    the signature settled it. Where it cannot be read, or ``f`` takes ``*args``, it returns
    False: only the call can tell (:func:`check_static_range`).

    >>> def f(x, n):
    ...     return x * n
    >>> check_static_signature("jit", f, (1,)), check_static_signature("jit", f, (-2,))
    (True, True)
    >>> check_static_signature("jit", f, (2,))
    Traceback (most recent call last):
    ...
    functrans._core.errors.InvalidArgumentError: jit: static_argnums=(2,) names argument 2, but
    f(x, n) takes 2 positional parameters; static_argnums must be in range(-2, 2) (negative ...
    """
    found = positional_parameters(f)
    if found is None:
        return False
    name, params = found
    if params is None:  # *args: any position may exist
        return False
    n = len(params)
    for i in static_argnums:
        if not -n <= i < n:
            accepted = (
                f"static_argnums must be in range({-n}, {n}) (negative counts from the end)"
                if n
                else "static_argnums must be empty"
            )
            raise InvalidArgumentError(
                f"{where}: static_argnums={static_argnums!r} names argument {i}, but "
                f"{name}({', '.join(params)}) takes {_count(n, 'positional parameter')}; "
                f"{accepted}"
            )
    return True


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}" if n else f"no {what}s"


def check_static_values(
    where: str, f: Callable[..., Any], args: tuple[Any, ...], static_argnums: tuple[int, ...]
) -> None:
    """Raise :class:`InvalidArgumentError`, naming the argument, for a tensor passed at a
    position ``static_argnums`` marks static: a static argument is a Python value the function
    is specialized on (compared by ``==``), not an input to differentiate or to re-read.
    Positions the call does not reach are :func:`check_static_range`'s.

    >>> import torch
    >>> check_static_values("remat", lambda x, n: x * n, (torch.ones(2), 3), (1,))
    >>> check_static_values("remat", lambda x, n: x * n, (torch.ones(2), torch.ones(2)), (1,))
    Traceback (most recent call last):
    ...
    functrans._core.errors.InvalidArgumentError: remat: argument 1 (n) is a tensor (float32[2]),
    but ...
    """
    import optree
    import torch

    from .pytree import NAMESPACE

    nargs = len(args)
    for i in static_argnums:
        if not -nargs <= i < nargs:
            continue
        leaves = optree.tree_leaves(args[i], namespace=NAMESPACE)
        tensor = next((t for t in leaves if isinstance(t, torch.Tensor)), None)
        if tensor is None:
            continue
        found = positional_parameters(f)
        names = found[1] if found is not None else None
        j = i % nargs
        label = (
            f"argument {j} ({names[j]})"
            if names is not None and j < len(names)
            else (f"argument {j}")
        )
        holds = "is" if tensor is args[i] else "holds"
        raise InvalidArgumentError(
            f"{where}: {label} {holds} a tensor ({_short_type(tensor)}), but "
            f"static_argnums={static_argnums!r} marks it static; a static argument must be a "
            "Python value the function is specialized on (an int, a tuple, a string...). Pass "
            f"the tensor as an ordinary argument (drop {i} from static_argnums), or a Python "
            "value (t.item(), t.tolist())"
        )


def _short_type(t: Any) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def check_instance(where: str, name: str, value: object, kind: type, accepted: str) -> None:
    """Raise :class:`InvalidArgumentError` unless ``value`` is a ``kind``.

    >>> import functrans as ft
    >>> check_instance("partition", "joint", None, ft.JointGraph, "a JointGraph (ft.joint(f)(...))")
    Traceback (most recent call last):
    ...
    functrans._core.errors.InvalidArgumentError: partition: joint=None is not accepted; joint ...
    """
    check_option(where, name, value, isinstance(value, kind), accepted)


#: What ``joint`` arguments accept, for messages.
JOINT = "a JointGraph, as ft.joint(f)(*args) returns"


def check_joint(where: str, value: object) -> None:
    """Raise :class:`InvalidArgumentError` unless ``value`` is a :class:`JointGraph`."""
    from .graph import JointGraph

    if isinstance(value, JointGraph):
        return
    hint = " (this is a forward-only Graph: build it with ft.joint, not ft.trace)"
    from .graph import Graph

    extra = hint if isinstance(value, Graph) else ""
    raise InvalidArgumentError(
        f"{where}: joint={describe(value)} is not accepted; joint must be {JOINT}{extra}"
    )


def _short_tensor(t: Any) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} on {t.device}"


def check_like(where: str, what: str, value: object, like: Any) -> None:
    """Raise :class:`InvalidArgumentError` unless ``value`` is a tensor with ``like``'s shape,
    dtype and device (a cotangent for an output, a tangent for a primal)."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise InvalidArgumentError(
            f"{where}: {what} is {describe(value)}; it must be a tensor like {_short_tensor(like)}"
        )
    if value.shape != like.shape or value.dtype != like.dtype or value.device != like.device:
        raise InvalidArgumentError(
            f"{where}: {what} is {_short_tensor(value)}; it must match {_short_tensor(like)} "
            "(same shape, dtype and device)"
        )


def check_tree_like(
    where: str, what: str, given: Any, like: Any, like_what: str
) -> list[tuple[str, Any, Any]]:
    """``(path, given leaf, like leaf)`` for each leaf of ``like``, or
    :class:`InvalidArgumentError` if ``given`` has another pytree structure (None is a leaf)."""
    import optree

    from .pytree import NAMESPACE

    paths, like_leaves, like_spec = optree.tree_flatten_with_path(
        like, none_is_leaf=True, namespace=NAMESPACE
    )
    given_leaves, given_spec = optree.tree_flatten(given, none_is_leaf=True, namespace=NAMESPACE)
    if given_spec != like_spec:
        raise InvalidArgumentError(
            f"{where}: {what} must have the structure of {like_what} {like_spec} "
            f"({len(like_leaves)} leaves); got {describe(given)} with structure {given_spec}"
        )
    return [
        ("".join(f"[{k!r}]" for k in p), g, w)
        for p, g, w in zip(paths, given_leaves, like_leaves, strict=True)
    ]


def check_cotangents(where: str, cotangents: Any, outs: Any) -> list[Any]:
    """The cotangents of the differentiable (floating-point or complex) tensor outputs, in order, or
    :class:`InvalidArgumentError` naming the first one that does not match its output (wrong
    structure, count, shape, dtype or device). Other outputs' cotangents are not read."""
    pairs = check_tree_like(where, "cotangents", cotangents, outs, "the outputs")
    chosen = []
    for path, given, out in pairs:
        if differentiable(out):
            check_like(where, f"cotangent{path or ''} (for output{path})", given, out)
            chosen.append(given)
    return chosen


def check_dims(where: str, name: str, dims: object) -> None:
    """Raise :class:`InvalidArgumentError` unless every leaf of ``dims`` (``vmap``'s
    ``in_dims``/``out_dims``) is an int or None."""
    import optree

    from .pytree import NAMESPACE

    accepted = "an int, None, or a tuple (pytree prefix of the arguments) of ints and Nones"
    check_option(where, name, dims, not isinstance(dims, (str, bytes)), accepted)
    tree: Any = dims  # any pytree
    leaves: list[Any] = optree.tree_leaves(tree, none_is_leaf=True, namespace=NAMESPACE)
    for leaf in leaves:
        if leaf is not None and not _is_index(leaf):
            raise InvalidArgumentError(
                f"{where}: {name}={describe(dims)} holds {describe(leaf)}; {name} must be "
                f"{accepted}"
            )


def check_primals(where: str, primals: tuple[Any, ...]) -> None:
    """Raise :class:`InvalidArgumentError` unless every leaf of ``primals`` is a floating-point
    (or complex) tensor, as forward mode needs."""
    import optree
    import torch

    from .pytree import NAMESPACE

    for i, p in enumerate(primals):
        paths, leaves, _ = optree.tree_flatten_with_path(p, none_is_leaf=True, namespace=NAMESPACE)
        for path, leaf in zip(paths, leaves, strict=True):
            what = f"primals[{i}]" + "".join(f"[{k!r}]" for k in path)
            if not isinstance(leaf, torch.Tensor):
                check_numpy_leaves(where, [leaf], what)
                raise InvalidArgumentError(
                    f"{where}: {what} is {describe(leaf)}; primals must be floating-point tensors"
                )
            if not differentiable(leaf):
                raise InvalidArgumentError(
                    f"{where}: {what} is a {leaf.dtype} tensor; primals must be floating-point "
                    "tensors (forward mode has no tangent for integers)"
                )


def check_tangents(where: str, tangents: tuple[Any, ...], primals: tuple[Any, ...]) -> None:
    """Raise :class:`InvalidArgumentError` unless ``tangents`` has one tensor per primal leaf,
    each with that primal's shape, dtype and device."""
    if len(tangents) != len(primals):
        raise InvalidArgumentError(
            f"{where}: got {len(tangents)} tangents for {len(primals)} primals; pass one tangent "
            "per primal, with its structure, shape and dtype"
        )
    for i, (t, p) in enumerate(zip(tangents, primals, strict=True)):
        for path, given, like in check_tree_like(where, f"tangents[{i}]", t, p, f"primals[{i}]"):
            check_like(where, f"tangents[{i}]{path}", given, like)


def check_saved(where: str, saved: object) -> None:
    """Raise :class:`InvalidArgumentError` unless ``saved`` is an iterable (not a string) of
    forward nodes or node names."""
    if isinstance(saved, (str, bytes)):
        raise InvalidArgumentError(
            f"{where}: saved={describe(saved)} is a string; saved must be {RETURNS}, e.g. "
            f"[{saved!r}]"
        )
    if not isinstance(saved, Iterable):
        raise InvalidArgumentError(
            f"{where}: saved={describe(saved)} is not accepted; saved must be {RETURNS}"
        )
    if isinstance(saved, Collection):
        for item in saved:
            if not isinstance(item, (str, fx.Node)):
                raise InvalidArgumentError(
                    f"{where}: saved holds {describe(item)}, neither a node nor a node name; "
                    f"saved must be {RETURNS}"
                )
