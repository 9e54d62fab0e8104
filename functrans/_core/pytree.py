"""Pytree handling on top of optree: split arguments into traced tensor leaves and static leaves.

Tensor leaves become graph inputs; every other leaf (Python scalars, strings, None-free
containers' contents, ...) is *static*: baked into the traced graph and checked on every call.
Dataclasses and custom containers registered with optree (globally or in the ``"functrans"``
namespace) are understood. :class:`Guards` re-checks cheaply that a call flattens like an
earlier one (``jit``'s cache hits).
"""

from __future__ import annotations

import enum
import functools
import importlib
import itertools
import operator
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

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
    "Guards",
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


# Cache guards. A cache hit must be as exact as comparing ``flatten``'s spec, statics and tensor
# metadata, but cheaper: plain containers are walked in Python (optree's C++ flatten, which
# builds a spec, costs about twice as much), static leaves by identity (equal ints and strings
# by value; mutable ones not at all) and tensors in one C++ call. Anything these checks cannot
# vouch for falls back to the caller's exact path.
_V = TypeVar("_V")
_Node = Any  # None (a leaf), or (dict, ((key, node), ...)), (list | tuple, (node, ...)),
# (None, ()) for None, (optree, spec) for a subtree optree flattens


class Guards(Generic[_V]):
    """Values stored by how a tree flattened: its containers, its static leaves (the same
    objects, or equal ints and strings), and each tensor's Python type, dispatch keys
    (conjugate, negative, sparse, ...), dtype, device, ``requires_grad``, sizes and strides,
    checked in one call by torch's C++ ``TensorGuards``. :meth:`find` returns a value only
    where all match (and ``extra``). Readers need no lock; :meth:`add` replaces lists rather
    than mutating them."""

    def __init__(self) -> None:
        # (layout, [(extra, guard, value), ...]): tuples, destructured on every jitted call
        self._by_layout: list[tuple[_Node, list[tuple[Any, _Guard, _V]]]] = []

    def find(
        self, tree: Any, extra: Any, valid: Callable[[_V], bool] | None = None
    ) -> tuple[_V, tuple[torch.Tensor, ...]] | None:
        """The value whose guard ``tree`` passes (and ``valid``, where given), and its tensor
        leaves in the value's order."""
        for layout, guards in self._by_layout:
            leaves: list[Any] = []
            if _walk(layout, tree, leaves):
                for x, guard, value in guards:
                    tensors = guard.check(leaves) if x == extra else None
                    if tensors is not None and (valid is None or valid(value)):
                        return value, tensors
        return None

    def add(
        self,
        tree: Any,
        leaves: list[Any],
        order: Sequence[int],
        extra: Any,
        v: _V,
        shape: Any = None,
    ) -> None:
        """Store ``v`` for trees like ``tree`` (``leaves``: its :func:`leaves_of`; ``order``:
        the tensor leaves' positions, in the order :meth:`find` returns them). Does nothing
        where the checks cannot describe ``tree``; call it with the writers' lock held."""
        layout, guard = _layout(tree, leaves), _Guard.make(leaves, order, shape)
        if layout is None or guard is None:
            return
        old = next((g for lay, g in self._by_layout if lay == layout), None)
        rest = [(lay, g) for lay, g in self._by_layout if g is not old]
        self._by_layout = [*rest, (layout, [*(old or []), (extra, guard, v)])]

    def remove(self, v: _V) -> None:
        """Forget ``v`` (an evicted entry); call it with the writers' lock held."""
        kept = [
            (lay, [(x, guard, value) for x, guard, value in gs if value is not v])
            for lay, gs in self._by_layout
        ]
        self._by_layout = [(lay, gs) for lay, gs in kept if gs]


class _Guard:
    def __init__(self, leaves: Sequence[Any], order: Sequence[int], checker: Any) -> None:
        static_at = [i for i, x in enumerate(leaves) if not isinstance(x, torch.Tensor)]
        self._tensors_at, self._static_at = _picker(order), _picker(static_at)
        self._statics = self._static_at(leaves)
        self._checker = checker

    @classmethod
    def make(cls, leaves: Sequence[Any], order: Sequence[int], shape: Any = None) -> _Guard | None:
        """``shape``: a dynamic entry's :class:`~functrans._core.shapes.ShapeGuard` (symbolic
        sizes and strides are not compared; its expression is checked instead)."""
        if _TENSOR_GUARDS is None:
            return None
        tensors = [leaves[i] for i in order]
        if not all(map(plain, tensors)):
            return None  # tensor subclasses (DTensor...): the exact path takes them apart
        if any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors):
            return None  # torch unwraps dead functorch wrappers on every call
        if not all(_by_identity(x) for x in leaves if not isinstance(x, torch.Tensor)):
            return None  # a mutable static (a set, ...): compared by value every call
        sizes = None if shape is None else [list(s) for s in shape.sizes]
        strides = None if shape is None else [list(s) for s in shape.strides]
        try:  # the keyword arguments are required: without them, its constructor crashes
            checker = _TENSOR_GUARDS(
                *tensors, dynamic_dims_sizes=sizes, dynamic_dims_strides=strides
            )
        except Exception:
            return None
        if shape is not None:
            checker = _WithExpression(checker, shape.check_expr)
        return cls(leaves, order, checker) if checker.check(*tensors) else None

    def check(self, leaves: Sequence[Any]) -> tuple[torch.Tensor, ...] | None:
        if self._statics and not all(map(_same, self._static_at(leaves), self._statics)):
            return None
        tensors = self._tensors_at(leaves)
        return tensors if self._checker.check(*tensors) else None


class _WithExpression:
    """TensorGuards of a dynamic entry plus its symbolic-size guard expression."""

    def __init__(self, tensor_guards: Any, expression: Callable[[Sequence[Any]], bool]) -> None:
        self._tensors, self._expression = tensor_guards, expression

    def check(self, *tensors: torch.Tensor) -> bool:
        return bool(self._tensors.check(*tensors)) and self._expression(tensors)


def _tensor_guards() -> Any:
    try:
        from torch._C._dynamo.guards import TensorGuards
    except ImportError:  # pragma: no cover - a torch build without dynamo's C++ guards
        return None
    return TensorGuards


_TENSOR_GUARDS = _tensor_guards()


_IMMUTABLE = (int, float, complex, bool, str, bytes, torch.dtype, torch.device, torch.Size)


def _by_identity(x: Any) -> bool:
    """Whether the same object means the same static value: immutable, or compared by
    identity anyway (plain objects, functions; ``static_argnums`` values hash by ``id``)."""
    kind = type(x)
    if kind in _IMMUTABLE or kind is _Static or isinstance(x, enum.Enum):
        return True
    eq: Any = kind.__eq__
    hash_: Any = kind.__hash__
    return eq is object.__eq__ and hash_ is object.__hash__


def _same(a: Any, b: Any) -> bool:
    """Whether static leaves are interchangeable: the same object, equal ints or strings, or
    ``static_argnums`` wrappers of the same object."""
    if a is b:
        return True
    kind = type(a)
    if kind is not type(b):
        return False
    return a.value is b.value if kind is _Static else kind in (int, str, bytes) and a == b


def _picker(at: Sequence[int]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """``leaves -> tuple(leaves[i] for i in at)``, in C where ``itemgetter`` returns a tuple."""
    if len(at) >= 2:
        return operator.itemgetter(*at)
    return lambda leaves: tuple(leaves[i] for i in at)


def _layout(tree: Any, leaves: list[Any]) -> _Node | None:
    """``tree``'s containers, if walking them finds exactly optree's ``leaves``."""
    try:
        node = _node(tree)
    except TypeError:  # a dict key that is not a str: its order is optree's business
        return None
    got: list[Any] = []
    same = _walk(node, tree, got) and len(got) == len(leaves)
    return node if same and all(map(operator.is_, got, leaves)) else None


def _node(o: Any) -> _Node:
    kind = type(o)
    if kind is dict:
        if not all(type(k) is str for k in o):
            raise TypeError("dict keys")
        return (dict, tuple((k, _node(o[k])) for k in sorted(o)))  # optree's order
    if kind is list or kind is tuple:
        return (kind, tuple(_node(v) for v in o))
    if o is None:
        return (None, ())
    spec = optree.tree_structure(o, namespace=NAMESPACE)
    return None if spec.is_leaf() else (optree, spec)


_MISSING = object()


def _walk(node: _Node, o: Any, out: list[Any]) -> bool:
    """Append ``o``'s leaves to ``out`` if ``o`` has the containers ``node`` describes."""
    if node is None:
        out.append(o)
        return True
    kind, kids = node
    if kind is dict:
        if type(o) is not dict or len(o) != len(kids):
            return False
        for key, child in kids:
            v = o.get(key, _MISSING)
            if child is None and v is not _MISSING:
                out.append(v)
            elif v is _MISSING or not _walk(child, v, out):
                return False
        return True
    if kind is list or kind is tuple:
        if type(o) is not kind or len(o) != len(kids):
            return False
        for child, v in zip(kids, o, strict=True):
            if child is None:
                out.append(v)
            elif not _walk(child, v, out):
                return False
        return True
    if kind is None:
        return o is None
    leaves, spec = optree.tree_flatten(o, namespace=NAMESPACE)
    out.extend(leaves)
    return bool(spec == kids)


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
