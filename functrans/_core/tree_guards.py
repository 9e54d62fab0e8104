"""Cache guards: a cheap re-check that a call's tree flattens like an earlier one.

:class:`Guards` stores values (``jit``'s cache entries) by how a tree flattened: its
containers, its static leaves and each tensor's metadata, and finds the value a later call
matches without flattening it with optree (see :mod:`functrans._core.pytree`): a ``jit``
call's guarded path.

>>> import torch
>>> from functrans._core.pytree import leaves_of
>>> g: Guards[str] = Guards()
>>> tree = ({"x": torch.ones(2)}, 3)
>>> g.add(tree, leaves_of(tree)[0], [0], None, "entry")
>>> g.find(({"x": torch.zeros(2)}, 3), None)[0], g.find(({"x": torch.zeros(3)}, 3), None)
('entry', None)
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import optree
import torch

from .pytree import NAMESPACE, _Static, plain

__all__ = ["Guards"]

# A cache hit must be as exact as comparing ``flatten``'s spec, statics and tensor
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
