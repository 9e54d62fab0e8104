"""Hugging Face ``Cache`` objects (``DynamicCache``, ``StaticCache``, ...) as pytrees.

A cache is a list of layer objects; a layer holds its key and value tensors (and, for some
layers, a length tensor) as attributes. Both are registered with optree in functrans'
namespace: the tensors an object holds are its children (so they are graph inputs and
outputs, computed on every call), everything else (``is_initialized``, the device, a sliding
window's size) is the node's metadata, compared as a static value. Registration happens the
first time functrans flattens a tree after ``transformers.cache_utils`` was imported; functrans
never imports transformers itself.

Metadata that changes every step (``DynamicSlidingWindowLayer.cumulative_length``, a Python
int) is static, so such a layer compiles again per step; ``DynamicLayer`` (the default of
Llama, GPT-2 and most decoders) holds only tensors that grow, which ``dynamic="auto"`` turns
into one entry with a symbolic sequence length.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from typing import Any

import optree
import torch

__all__ = ["MODULE", "register", "register_type"]

#: the module whose import makes the registration worth doing
MODULE = "transformers.cache_utils"

_REGISTERED: set[type] = set()


class _Meta:
    """A node's non-tensor attributes, in their order: compared by value, hashed by name
    (values such as a layer's dicts of flags are not hashable)."""

    __slots__ = ("items",)

    def __init__(self, items: tuple[tuple[str, Any], ...]) -> None:
        self.items = items

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Meta) or len(self.items) != len(other.items):
            return False
        for (k0, v0), (k1, v1) in zip(self.items, other.items, strict=True):
            if k0 != k1 or type(v0) is not type(v1):
                return False
            try:
                if not bool(v0 == v1):
                    return False
            except Exception:  # a value with no boolean equality: the same object only
                if v0 is not v1:
                    return False
        return True

    def __hash__(self) -> int:
        return hash(tuple(k for k, _ in self.items))

    def __repr__(self) -> str:
        return "{" + ", ".join(f"{k}={v!r}" for k, v in self.items) + "}"


def _is_child(value: Any) -> bool:
    """Whether an attribute is a subtree: a tensor, a registered object, or a list or tuple
    of them (a cache's ``layers``; a quantized layer's ``(data, scale)``)."""
    if isinstance(value, torch.Tensor) or type(value) in _REGISTERED:
        return True
    if type(value) in (list, tuple) and value:
        return all(_is_child(v) for v in value)
    return False


def _flatten(obj: Any) -> tuple[list[Any], tuple[tuple[str, ...], _Meta], tuple[str, ...]]:
    names: list[str] = []
    children: list[Any] = []
    rest: list[tuple[str, Any]] = []
    for name, value in vars(obj).items():
        if _is_child(value):
            names.append(name)
            children.append(value)
        else:  # a copy: the spec must not change when the object does
            rest.append((name, _copied(value)))
    order = tuple(vars(obj))
    return children, (order, _Meta((("names", tuple(names)), *rest))), tuple(names)


def _copied(value: Any) -> Any:
    return copy.copy(value) if type(value) in (list, dict, set) else value


def _unflatten_for(cls: type) -> Any:
    def unflatten(meta: tuple[tuple[str, ...], _Meta], children: Any) -> Any:
        order, info = meta
        (_, names), *rest = info.items
        values = {k: _copied(v) for k, v in rest}  # each object its own lists and dicts
        values.update(zip(names, children, strict=True))
        obj: Any = object.__new__(cls)
        obj.__dict__.update({k: values[k] for k in order})
        return obj

    return unflatten


def _subclasses(root: type) -> Iterator[type]:
    stack = [root]
    while stack:
        cls = stack.pop()
        yield cls
        stack.extend(cls.__subclasses__())


def register_type(cls: type) -> bool:
    """Register one cache or cache-layer class (a subclass defined after :func:`register`);
    False where it already was."""
    if cls in _REGISTERED:
        return False
    _REGISTERED.add(cls)
    optree.register_pytree_node(
        cls,
        _flatten,
        _unflatten_for(cls),
        namespace="functrans",
    )
    return True


def register() -> None:
    """Register every ``Cache`` and cache-layer class transformers has defined so far."""
    cache_utils = sys.modules[MODULE]
    roots = [
        getattr(cache_utils, name)
        for name in ("CacheLayerMixin", "LinearAttentionCacheLayerMixin", "DummyLayer", "Cache")
        if hasattr(cache_utils, name)
    ]
    for root in roots:  # layers first: a cache's ``layers`` list is a child once they are
        for cls in _subclasses(root):
            register_type(cls)


def is_cache_object(obj: Any) -> bool:
    """Whether ``obj`` is a transformers cache or cache layer (transformers imported)."""
    cache_utils = sys.modules.get(MODULE)
    if cache_utils is None:
        return False
    roots = tuple(
        getattr(cache_utils, name)
        for name in ("CacheLayerMixin", "LinearAttentionCacheLayerMixin", "DummyLayer", "Cache")
        if hasattr(cache_utils, name)
    )
    return isinstance(obj, roots)


def writable(cache: Any) -> Any:
    """``cache`` with clones of the tensors its layers update in place (``StaticCache``'s
    fixed-size buffers, written with ``index_copy_``; transformers marks such layers
    ``is_compileable``): a traced function may not write to its inputs, so the writes land
    on the clones, which the jitted call returns and hands back to the caller's object.
    Layers that grow by concatenation (``DynamicLayer``) are shared as they are."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list) or not any(_in_place(layer) for layer in layers):
        return cache
    copied = copy.copy(cache)
    copied.layers = [_cloned(layer) if _in_place(layer) else layer for layer in layers]
    return copied


def _in_place(layer: Any) -> bool:
    return getattr(layer, "is_compileable", False) is not False


def _cloned(layer: Any) -> Any:
    new = copy.copy(layer)
    for name, value in vars(layer).items():
        if isinstance(value, torch.Tensor):
            setattr(new, name, value.clone())
    return new
