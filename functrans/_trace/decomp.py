"""Decomposition tables: which composite ops tracing splits into smaller ATen ops.

``"core"`` is torch's core-ATen table with the corrections training needs; ``"minimal"``
decomposes only what correctness needs (batch norm), keeping composite kernels such as
``gelu_backward`` whole for backends that run ATen op by op.

>>> import torch
>>> torch.ops.aten.gelu_backward.default in decomposition_table("minimal")
False
>>> torch.ops.aten.native_batch_norm.default in decomposition_table("minimal")
True
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["Decompositions", "decomposition_table", "decomposition_table_all"]

Decompositions = str | Mapping[Any, Callable[..., Any]] | None


# Decompositions in torch's core table that are wrong under autograd: the CPU flash-attention
# one rewrites the op into math whose second output is the attention matrix, which the
# (undecomposed) backward op then reads as its logsumexp -- silently wrong gradients
# (it was written for inference export). Attention stays one op, as a compute-intensive node.
_WRONG_FOR_TRAINING = ("_scaled_dot_product_flash_attention_for_cpu",)


# Ops whose schema does not declare the in-place update they do in training mode (batch norm's
# running statistics). Left whole, graphs would mutate buffers invisibly, also on every
# recomputation; decomposed, the update is an explicit copy_ that functionalization removes.
_MUTATE_WITHOUT_SAYING = (torch.ops.aten.native_batch_norm.default,)


def _take(self: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``take`` as one gather from the flattened input. Torch's own decomposition indexes with
    Python ``[]``, which reads a 0-dim index tensor as an int (``.item()``): untraceable.
    """
    out: torch.Tensor = torch.ops.aten.index.Tensor(self.reshape(-1), [index])
    return out


@functools.cache
def _core_table() -> Mapping[Any, Callable[..., Any]]:
    from torch._decomp import core_aten_decompositions

    table = dict(core_aten_decompositions())
    for name in _WRONG_FOR_TRAINING:
        table.pop(getattr(torch.ops.aten, name).default, None)
    for op in _MUTATE_WITHOUT_SAYING:
        table[op] = decomposition_table_all()[op]
    table[torch.ops.aten.take.default] = _take
    return table


def decomposition_table_all() -> Mapping[Any, Callable[..., Any]]:
    """Every decomposition torch registers (``torch._decomp.decomposition_table``): op
    overload -> a function computing it from smaller ATen ops. A backend picks the entries it
    wants and passes them to :func:`~functrans.extend.retrace`.

    >>> import torch
    >>> silu = decomposition_table_all()[torch.ops.aten.silu.default]
    >>> torch.allclose(silu(torch.ones(2)), torch.nn.functional.silu(torch.ones(2)))
    True
    """
    from torch._decomp import decomposition_table

    return decomposition_table


# Backward ops that take state they do not use in training (batch norm's running statistics):
# left whole, the partition saves the pre-update buffers, which the write-back then mutates.
_READ_UNUSED_STATE = (torch.ops.aten.native_batch_norm_backward.default,)


@functools.cache
def _minimal_table() -> Mapping[Any, Callable[..., Any]]:
    ops = (*_MUTATE_WITHOUT_SAYING, *_READ_UNUSED_STATE)
    return {op: decomposition_table_all()[op] for op in ops}


def decomposition_table(decompositions: Decompositions) -> Mapping[Any, Callable[..., Any]]:
    """``"core"`` (core ATen), ``"minimal"`` (composite ops such as ``gelu_backward`` or
    ``native_layer_norm_backward`` kept whole; only what correctness needs is decomposed),
    ``None``/``"none"`` (as dispatched), or a user table."""
    if decompositions == "core":
        return _core_table()
    if decompositions == "minimal":
        return _minimal_table()
    if decompositions is None or decompositions == "none":
        return {}
    if isinstance(decompositions, Mapping):
        return decompositions
    from functrans._core.errors import InvalidArgumentError

    raise InvalidArgumentError(
        "decompositions must be 'core', 'minimal', 'none', None or a mapping, "
        f"got {decompositions!r}"
    )
