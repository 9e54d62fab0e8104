"""Pytree handling on top of optree: split arguments into traced tensor leaves and static leaves.

Tensor leaves become graph inputs; every other leaf (Python scalars, strings, None-free
containers' contents, ...) is *static*: baked into the traced graph and checked on every call.
Dataclasses and custom containers registered with optree (globally or in the ``"functrans"``
namespace) are understood.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch

from ._errors import TraceError

NAMESPACE = "functrans"

__all__ = [
    "NAMESPACE",
    "Flat",
    "check_matches",
    "flatten",
    "unflatten",
    "unwrap_static",
    "wrap_static",
]


@dataclass(frozen=True)
class Flat:
    """A flattened pytree: its spec, which leaves are tensors, and the static leaves' values."""

    spec: optree.PyTreeSpec
    is_tensor: tuple[bool, ...]
    static: tuple[Any, ...]  # value for static leaves, None placeholder for tensor leaves
    static_argnums: tuple[int, ...] = ()  # for a tree ``(args, kwargs)``: args kept opaque

    @property
    def num_tensors(self) -> int:
        return sum(self.is_tensor)

    @functools.cached_property
    def paths(self) -> tuple[str, ...]:
        """Access paths of every leaf (``[0][1]['w']``); built only when a message needs them."""
        return tuple(a.codify("") for a in self.spec.accessors())

    def tensor_paths(self) -> list[str]:
        return [p for p, t in zip(self.paths, self.is_tensor, strict=True) if t]


def flatten(tree: Any, *, static_argnums: tuple[int, ...] = ()) -> tuple[list[torch.Tensor], Flat]:
    """Flatten ``tree``; return its tensor leaves and a :class:`Flat` describing the rest.

    With ``static_argnums``, ``tree`` is ``(args, kwargs)`` and the listed positional arguments
    become single opaque static leaves.
    """
    if static_argnums:
        tree = (wrap_static(tree[0], static_argnums), tree[1])
    leaves, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
    is_tensor = tuple(isinstance(x, torch.Tensor) for x in leaves)
    static = tuple(None if t else x for x, t in zip(leaves, is_tensor, strict=True))
    tensors = [x for x, t in zip(leaves, is_tensor, strict=True) if t]
    return tensors, Flat(spec, is_tensor, static, static_argnums)


def unflatten(flat: Flat, tensors: Sequence[Any]) -> Any:
    """Inverse of :func:`flatten`: put ``tensors`` back between the static leaves."""
    it = iter(tensors)
    leaves = [next(it) if t else s for t, s in zip(flat.is_tensor, flat.static, strict=True)]
    tree = optree.tree_unflatten(flat.spec, leaves)
    return (unwrap_static(tree[0]), tree[1]) if flat.static_argnums else tree


def check_matches(flat: Flat, tree: Any, what: str) -> list[torch.Tensor]:
    """Flatten ``tree``; check its structure and static values are those ``flat`` recorded."""
    tensors, got = flatten(tree, static_argnums=flat.static_argnums)
    if got.spec != flat.spec:
        raise TraceError(
            f"{what}: the argument structure changed since tracing.\n"
            f"  traced with: {flat.spec}\n  called with: {got.spec}\n"
            "Trace again for new structures."
        )
    for path, t0, t1, s0, s1 in zip(
        flat.paths, flat.is_tensor, got.is_tensor, flat.static, got.static, strict=True
    ):
        if t0 != t1:
            kind = "a tensor" if t0 else f"the static value {s0!r}"
            raise TraceError(f"{what}: argument {path} was {kind} when traced; got {s1!r}.")
        if not t0 and not _same_static(s0, s1):
            raise TraceError(
                f"{what}: static argument {path} was {s0!r} when traced and is {s1!r} now; static "
                "values are baked into the graph, so trace again for the new value."
            )
    return tensors


def _same_static(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b) or (a != a and b != b)  # NaN equals NaN here
    except Exception:
        return a is b


class _Static:
    """Wraps an argument listed in ``static_argnums`` so it flattens to one static leaf."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Static):
            return NotImplemented
        a, b = self.value, other.value
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return (
                isinstance(a, torch.Tensor)
                and isinstance(b, torch.Tensor)
                and a.shape == b.shape
                and a.dtype == b.dtype
                and bool(torch.equal(a, b))
            )
        return bool(a == b)

    def __hash__(self) -> int:
        return id(self.value)

    def __repr__(self) -> str:
        return f"static({self.value!r})"


def wrap_static(args: Sequence[Any], static_argnums: Sequence[int]) -> tuple[Any, ...]:
    """Mark the positional arguments listed in ``static_argnums`` as opaque static leaves."""
    n = len(args)
    for i in static_argnums:
        if not -n <= i < n:
            raise TraceError(
                f"static_argnums={tuple(static_argnums)} names argument {i}, "
                f"but the function was called with {n} positional arguments"
            )
    picked = {i % n for i in static_argnums}
    return tuple(_Static(a) if i in picked else a for i, a in enumerate(args))


def unwrap_static(tree: Any) -> Any:
    if isinstance(tree, tuple) and any(isinstance(a, _Static) for a in tree):
        return tuple(a.value if isinstance(a, _Static) else a for a in tree)
    return tree
