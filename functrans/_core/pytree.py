"""Pytree handling on top of optree: split arguments into traced tensor leaves and static leaves.

Tensor leaves become graph inputs; every other leaf (Python scalars, strings, None-free
containers' contents, ...) is *static*: baked into the traced graph and checked on every call.
Dataclasses and custom containers registered with optree (globally or in the ``"functrans"``
namespace) are understood. :class:`~functrans._core.tree_guards.Guards` re-checks cheaply that
a call flattens like an earlier one (``jit``'s cache hits).
"""

from __future__ import annotations

import functools
import importlib
import itertools
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import optree
import torch
import torch.utils._pytree as torch_pytree
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .describe import check_numpy_leaves
from .errors import TraceError, UnsupportedOpError
from .stack import current_stack, describe_stack

NAMESPACE = "functrans"

__all__ = [
    "NAMESPACE",
    "Flat",
    "TorchSpec",
    "Wrapper",
    "check_matches",
    "exact_key",
    "first_of_pair",
    "flatten",
    "flatten_leaves",
    "leaves_of",
    "plain",
    "rebuild_leaves",
    "static_value",
    "tensor_leaves",
    "unflatten",
    "unwrap_static",
    "wrap_static",
    "wrap_tree",
]


_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})


def plain(t: object) -> bool:
    """Whether ``t`` is a plain tensor or parameter, not a tensor subclass (a subclass such as
    DTensor is taken apart by :class:`Wrapper`; jit traces subclasses at static shapes and never
    lifts one as a captured tensor).

    >>> plain(torch.ones(1)), plain(torch.nn.Parameter(torch.ones(1))), plain(1.0)
    (True, True, False)
    """
    return type(t) in _PLAIN


@dataclass(frozen=True)
class Wrapper:
    """A traceable tensor subclass (``__tensor_flatten__``, e.g. DTensor) with one inner
    tensor, as static metadata: the leaf is its inner tensor, :meth:`rebuild` puts it back."""

    cls: type
    attr: str
    ctx: Any
    size: tuple[int, ...]
    stride: tuple[int, ...]
    opaque: tuple[tuple[str, Any], ...] = ()  # inner attributes that are not tensors (a mesh)

    @classmethod
    def of(cls, t: torch.Tensor) -> Wrapper | None:
        """The wrapper of ``t``, None for a plain tensor; raises for a subclass functrans
        cannot take apart (several inner tensors, or no ``__tensor_flatten__``)."""
        if plain(t) or not is_traceable_wrapper_subclass(t):
            return None
        attrs, ctx = t.__tensor_flatten__()
        tensors = [a for a in attrs if isinstance(getattr(t, a), torch.Tensor)]
        if len(tensors) != 1:
            raise UnsupportedOpError(
                f"a {type(t).__qualname__} holds {len(tensors)} inner tensors ({tensors}); "
                "functrans takes apart tensor subclasses with one inner tensor (DTensor...)"
            )
        opaque = tuple((a, getattr(t, a)) for a in attrs if a != tensors[0])
        return cls(type(t), tensors[0], ctx, tuple(t.size()), tuple(t.stride()), opaque)

    def inner(self, t: torch.Tensor) -> torch.Tensor:
        """The inner tensor of ``t`` (a subclass instance like the one this describes)."""
        found: torch.Tensor = getattr(t, self.attr)
        return found

    def rebuild(self, inner: torch.Tensor) -> torch.Tensor:
        """The subclass instance around ``inner`` (not connected to ``inner`` by autograd)."""
        rebuilt: torch.Tensor = self.cls.__tensor_unflatten__(  # type: ignore[attr-defined]  # a traceable wrapper subclass
            {self.attr: inner, **dict(self.opaque)}, self.ctx, self.size, self.stride
        )
        return rebuilt


@dataclass(frozen=True)
class Flat:
    """A flattened pytree: its spec, which leaves are tensors, and the static leaves' values."""

    spec: optree.PyTreeSpec
    is_tensor: tuple[bool, ...]
    static: tuple[Any, ...]  # value for static leaves, None placeholder for tensor leaves
    static_argnums: tuple[int, ...] = ()  # for a tree ``(args, kwargs)``: args kept opaque
    #: per tensor leaf: how to rebuild the tensor subclass (DTensor...) whose inner tensor the
    #: leaf is, or None for a plain tensor; empty when every tensor leaf is plain
    wrappers: tuple[Wrapper | None, ...] = ()

    @property
    def num_tensors(self) -> int:
        return sum(self.is_tensor)

    @functools.cached_property
    def paths(self) -> tuple[str, ...]:
        """Access paths of every leaf (``[0][1]['w']``); built only when a message needs them."""
        return tuple(a.codify("") for a in self.spec.accessors())

    @functools.cached_property
    def all_tensors(self) -> bool:
        return all(self.is_tensor)

    def tensor_paths(self) -> list[str]:
        return [p for p, t in zip(self.paths, self.is_tensor, strict=True) if t]


def wrap_tree(tree: Any, static_argnums: tuple[int, ...]) -> Any:
    """``(args, kwargs)`` with the ``static_argnums`` arguments wrapped as opaque leaves."""
    return (wrap_static(tree[0], static_argnums), tree[1]) if static_argnums else tree


# Pytree rules for third-party containers, registered the first time a tree is flattened after
# their package was imported (functrans never imports them): importing module -> our module
# whose ``register()`` adds the rules. Hugging Face's caches are generation's state.
_LAZY_RULES: dict[str, str] = {"transformers.cache_utils": "functrans._core.hf_cache"}
_pending = dict(_LAZY_RULES)


def register_lazy_rules() -> None:
    """Register the rules of every package in ``_LAZY_RULES`` imported by now (once each)."""
    for module in [m for m in _pending if m in sys.modules]:
        importlib.import_module(_pending.pop(module)).register()


def leaves_of(tree: Any) -> tuple[list[Any], optree.PyTreeSpec]:
    """optree's leaves and spec of ``tree`` (a :func:`wrap_tree` result), in our namespace."""
    if _pending:
        register_lazy_rules()
    return optree.tree_flatten(tree, namespace=NAMESPACE)


def flatten(tree: Any, *, static_argnums: tuple[int, ...] = ()) -> tuple[list[torch.Tensor], Flat]:
    """Flatten ``tree``; return its tensor leaves and a :class:`Flat` describing the rest.

    With ``static_argnums``, ``tree`` is ``(args, kwargs)`` and the listed positional arguments
    become single opaque static leaves.
    """
    return flatten_leaves(*leaves_of(wrap_tree(tree, static_argnums)), static_argnums)


def first_of_pair(flat: Flat) -> Flat:
    """The :class:`Flat` of ``a`` where ``flat`` is that of a pair ``(a, b)`` (``a``'s leaves
    come first).

    >>> import torch
    >>> _, pair = flatten(((torch.ones(1), 2), (torch.ones(1),)))
    >>> first = first_of_pair(pair)
    >>> first.is_tensor, first.static
    ((True, False), (None, 2))
    """
    spec = flat.spec.children()[0]
    n = spec.num_leaves
    wrappers = flat.wrappers[: sum(flat.is_tensor[:n])] if flat.wrappers else ()
    return Flat(spec, flat.is_tensor[:n], flat.static[:n], flat.static_argnums, wrappers)


def flatten_leaves(
    leaves: list[Any], spec: optree.PyTreeSpec, static_argnums: tuple[int, ...] = ()
) -> tuple[list[torch.Tensor], Flat]:
    """:func:`flatten` from the output of :func:`leaves_of`: the tensor leaves, and a
    :class:`Flat` holding the spec and the static leaves.

    >>> import torch
    >>> tensors, flat = flatten_leaves(*leaves_of(((torch.ones(2), 3), {})))
    >>> len(tensors), flat.is_tensor, flat.static
    (1, (True, False), (None, 3))
    """
    is_tensor = tuple([isinstance(x, _GRAPH_VALUES) for x in leaves])
    # a symbolic size is a graph value too (a plain int when the graph runs): its slot keeps
    # the SymInt, which tells check_matches to take an int there
    static = tuple(
        [
            (x if type(x) is torch.SymInt else None) if t else x
            for x, t in zip(leaves, is_tensor, strict=True)
        ]
    )
    if np.ndarray in set(map(type, static)):  # a trace would turn it into a tensor
        _refuse_numpy(static, spec)
    tensors = list(itertools.compress(leaves, is_tensor))
    wrappers: tuple[Wrapper | None, ...] = ()
    if not all(map(plain, tensors)):
        wrappers = tuple(Wrapper.of(t) for t in tensors)
        tensors = [t if w is None else w.inner(t) for t, w in zip(tensors, wrappers, strict=True)]
        if not any(wrappers):
            wrappers = ()
    return tensors, Flat(spec, is_tensor, static, static_argnums, wrappers)


def _refuse_numpy(leaves: Sequence[Any], spec: optree.PyTreeSpec) -> None:
    """:class:`InvalidArgumentError` naming the transform and the numpy leaf's place."""
    frames = current_stack()
    paths = spec.paths()

    def where(i: int) -> str:
        path = paths[i] if i < len(paths) else ()
        if len(path) >= 2 and path[0] in (0, 1):  # (args, kwargs)
            head = f"argument {path[1]}" if path[0] == 0 else f"keyword argument {path[1]!r}"
            return head + "".join(f"[{k!r}]" for k in path[2:])
        return "the value at " + ("".join(f"[{k!r}]" for k in path) or "the root")

    check_numpy_leaves(describe_stack(frames) if frames else "functrans", leaves, where)


def rebuild_leaves(flat: Flat, tensors: Sequence[Any]) -> list[Any]:
    """``tensors`` (inner tensors for subclass leaves) as the leaves the tree held: subclass
    instances rebuilt around their inner tensors."""
    if not flat.wrappers:
        return list(tensors)
    return [  # idempotent: a leaf already of the subclass stays as it is
        t if w is None or isinstance(t, w.cls) else w.rebuild(t)
        for t, w in zip(tensors, flat.wrappers, strict=True)
    ]


def unflatten(flat: Flat, tensors: Sequence[Any], *, rebuilt: bool = False) -> Any:
    """Inverse of :func:`flatten`: put ``tensors`` back between the static leaves (``rebuilt``:
    subclass leaves are already rebuilt, see :func:`rebuild_leaves`)."""
    if flat.wrappers and not rebuilt:
        tensors = rebuild_leaves(flat, tensors)
    if flat.all_tensors:
        leaves: Sequence[Any] = tensors
    else:
        it = iter(tensors)
        leaves = [next(it) if t else s for t, s in zip(flat.is_tensor, flat.static, strict=True)]
    tree = optree.tree_unflatten(flat.spec, leaves)
    return (unwrap_static(tree[0]), tree[1]) if flat.static_argnums else tree


def exact_key(flat: Flat, tensors: Sequence[torch.Tensor]) -> Any:
    """A hashable key for everything a trace of ``flat`` depends on: the spec, the statics by
    type and value (``1``, ``1.0``, ``True`` and ``-0.0`` differ; unhashable ones by ``repr``),
    and each tensor's type, dispatch keys, shape, strides, dtype, device and requires_grad."""
    statics: Any = tuple(
        (type(s), repr(s) if isinstance(s, float | complex) else s)
        for s, t in zip(flat.static, flat.is_tensor, strict=True)
        if not t
    )
    try:
        hash(statics)
    except TypeError:
        statics = tuple((k, repr(s)) for k, s in statics)
    meta = tuple(
        (type(t), t.shape, t.stride(), t.dtype, t.device, t.requires_grad, _dispatch_keys(t))
        + (() if plain(t) else (Wrapper.of(t),))  # a DTensor's placements, mesh
        for t in tensors
    )
    return (flat.spec, statics, meta, flat.wrappers)


def _dispatch_keys(t: torch.Tensor) -> int:
    return int(torch._C._dispatch_keys(t).raw_repr())


def check_matches(flat: Flat, tree: Any, what: str) -> list[torch.Tensor]:
    """Flatten ``tree``; check its structure and static values are those ``flat`` recorded."""
    if any(type(x) is torch.SymInt for x in flat.static):
        return _check_with_sizes(flat, tree, what)
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


_GRAPH_VALUES = (torch.Tensor, torch.SymInt)


def _check_with_sizes(flat: Flat, tree: Any, what: str) -> list[Any]:
    """:func:`check_matches` for a graph that also takes sizes (ints where it traced
    SymInts: the sizes a dynamic forward hands its backward)."""
    leaves, spec = leaves_of(wrap_tree(tree, flat.static_argnums))
    if spec != flat.spec:
        raise TraceError(f"{what}: the argument structure changed since tracing: {spec}")
    values = []
    for path, t0, s0, leaf in zip(flat.paths, flat.is_tensor, flat.static, leaves, strict=True):
        size = type(s0) is torch.SymInt
        ok = type(leaf) is int if size else isinstance(leaf, torch.Tensor) == t0
        if not ok:
            kind = "a size (an int)" if size else "a tensor" if t0 else repr(s0)
            raise TraceError(f"{what}: argument {path} was {kind} when traced; got {leaf!r}.")
        if t0:
            values.append(leaf)
        elif not _same_static(s0, leaf):
            raise TraceError(
                f"{what}: static argument {path} was {s0!r} when traced and is {leaf!r} now"
            )
    return values


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


def static_value(leaf: Any) -> Any:
    """A static leaf's value (an argument ``static_argnums`` names is wrapped as one leaf).

    >>> static_value(wrap_static((1, "a"), (1,))[1]), static_value(3)
    ('a', 3)
    """
    return leaf.value if isinstance(leaf, _Static) else leaf


def unwrap_static(tree: Any) -> Any:
    if isinstance(tree, tuple) and any(isinstance(a, _Static) for a in tree):
        return tuple(a.value if isinstance(a, _Static) else a for a in tree)
    return tree


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """The tensors in ``tree``, in the order functrans flattens it: ``tensor_leaves((args,
    kwargs))`` are the inputs of ``trace(f)(*args, **kwargs)``'s graph, which is what a
    backend's compiled callable takes. Containers registered with optree (globally or in the
    ``"functrans"`` namespace) are looked into; dict keys are sorted; other leaves are skipped.

    >>> import torch
    >>> from functrans.extend import tensor_leaves
    >>> params = {"w": torch.ones(2), "b": torch.zeros(2)}
    >>> [t.tolist() for t in tensor_leaves(((params, 3.0, torch.full((1,), 7.0)), {}))]
    [[0.0, 0.0], [1.0, 1.0], [7.0]]
    """
    return flatten(tree)[0]


class OutputAliases:
    """A static output leaf of ``jit(module)``: ``(output leaf, input leaf)`` pairs of the
    outputs that are objects passed in (a Hugging Face cache handed back updated), compared
    and hashed by value.

        >>> OutputAliases(((0, 2),)) == OutputAliases(((0, 2),))
        True
    """

    def __init__(self, value: tuple[tuple[int, int], ...]) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OutputAliases) and self.value == other.value

    def __hash__(self) -> int:
        return hash(self.value)

    def __repr__(self) -> str:
        return f"OutputAliases({self.value})"


class TorchSpec:
    """A torch pytree spec carried through a trace as one static output leaf (``jit(module)``
    flattens outputs with torch's pytree, which knows ``ModelOutput`` and friends).

        >>> import torch.utils._pytree as torch_pytree
        >>> TorchSpec(torch_pytree.tree_flatten((1, 2))[1]).spec.num_leaves
        2
    """

    def __init__(self, spec: torch_pytree.TreeSpec) -> None:
        self.spec = spec

    def __repr__(self) -> str:
        return f"TorchSpec({self.spec})"
