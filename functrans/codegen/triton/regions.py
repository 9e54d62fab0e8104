"""The pieces a graph is cut into (:mod:`.fusion`) and run in (:mod:`.schedule`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.fx as fx

from .layout import FDims

__all__ = [
    "Access",
    "Extern",
    "Kernel",
    "Plan",
    "Region",
    "SliceParams",
    "View",
    "is_slice",
    "is_view_op",
    "slice_params",
]


@dataclass(frozen=True)
class Access:
    """Where a value lives: ``root`` 's buffer at element ``offset`` with ``strides``."""

    root: fx.Node
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]


@dataclass(eq=False)
class Kernel:
    """Nodes computed by one Triton kernel over ``space`` (reducing ``rdims``).

    A kernel is its own identity (compared and hashed as an object, not by its fields, which
    fusion still edits): the schedule and the backend key their tables on it.
    """

    nodes: list[fx.Node]
    space: tuple[int, ...] = ()
    rdims: frozenset[int] = frozenset()
    fdims: dict[fx.Node, FDims] = field(default_factory=dict)
    stores: list[fx.Node] = field(default_factory=list)  # values other regions read


@dataclass(frozen=True)
class Extern:
    """One node run as its ATen op."""

    node: fx.Node


@dataclass(frozen=True)
class View:
    """A view run as its (free) torch op, because an extern or the output needs the tensor."""

    node: fx.Node


Region = Kernel | Extern | View


@dataclass(frozen=True)
class Plan:
    """The regions in execution order, and how every materialized value is addressed."""

    regions: list[Region]
    access: dict[fx.Node, Access]
    inline: frozenset[fx.Node] = frozenset()  # index-only values: computed where read


def is_view_op(node: fx.Node) -> bool:
    """Whether ``node`` 's op returns an alias of its input (a view, per its schema)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or len(schema.returns) != 1:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


class SliceParams(NamedTuple):
    """A forward-stepping slice: along ``dim``, every ``step`` th element from ``start``."""

    dim: int
    start: int
    step: int


def slice_params(n: fx.Node) -> SliceParams | None:
    """What a forward-stepping ``slice.Tensor`` keeps (start clamped into its input's dim), or
    None for anything else.

    >>> import torch, functrans as ft
    >>> g = ft.trace(lambda x: x[:, 1::2])(torch.ones(2, 6))
    >>> slice_params(list(g.ops())[-1])
    SliceParams(dim=1, start=1, step=2)
    """
    if n.target is not torch.ops.aten.slice.Tensor or not isinstance(n.args[0], fx.Node):
        return None
    args: list[Any] = [*n.args, *[None] * 5][1:5]
    rank = n.args[0].meta["val"].dim()
    dim = int(args[0] or 0) % max(rank, 1)
    size = int(n.args[0].meta["val"].shape[dim])
    start, step = int(args[1] or 0), int(args[3] if args[3] is not None else 1)
    start = min(max(start + size if start < 0 else start, 0), size)
    return SliceParams(dim, start, step) if step >= 1 else None


def is_slice(n: fx.Node) -> bool:
    """A forward-stepping ``slice`` keeping more than one element of its dim: read inside a
    kernel at a shifted index when inline (one element has no index to shift)."""
    params = slice_params(n)
    return params is not None and int(n.meta["val"].shape[params.dim]) > 1
