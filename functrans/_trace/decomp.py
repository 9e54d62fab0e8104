"""Decomposition tables: which composite ops tracing splits into smaller ATen ops.

``"core"`` is torch's core-ATen table with the corrections training needs; ``"minimal"``
rewrites only what correctness needs (batch norm's hidden buffer update), keeping composite
kernels such as ``gelu_backward`` and batch norm's own whole for backends that run ATen op by
op: a decomposition replaces a kernel only where it is as accurate as the kernel.

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

aten = torch.ops.aten


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


def _soft_margin_loss_backward(
    grad_output: torch.Tensor, self: torch.Tensor, target: torch.Tensor, reduction: int = 1
) -> torch.Tensor:
    """``soft_margin_loss_backward`` as ATen's kernel computes it: ``-target * z / (1 + z) *
    grad`` with ``z = exp(-target * self)``. Torch's decomposition computes ``sigmoid(target *
    self) - 1``, which cancels where the loss is small: at ``target * self = 15`` its float32
    gradient is 0.14 (relative) from float64, eager's 2.9e-7 (the OpInfo sweep's first
    sample). Half precisions compute in float32, as torch's decompositions do.
    """
    dtype = self.dtype
    if dtype in (torch.float16, torch.bfloat16):
        grad_output, self, target = grad_output.float(), self.float(), target.float()
    norm = 1.0 / self.numel() if reduction == 1 else 1.0  # 1: mean (0: none, 2: sum)
    z = torch.exp(-target * self)
    grad = target * z * -norm / (z + 1) * grad_output
    return grad.to(dtype)


# Torch's decompositions that are less accurate than the kernel they replace, and what
# replaces them: a compiled step's error against float64 is at most 2x eager's (the OpInfo
# sweep holds every op to it, tests/conformance).
_AS_ACCURATE_AS_THE_KERNEL: dict[Any, Callable[..., Any]] = {
    aten.soft_margin_loss_backward.default: _soft_margin_loss_backward,
}


@functools.cache
def _core_table() -> Mapping[Any, Callable[..., Any]]:
    from torch._decomp import core_aten_decompositions

    table = dict(core_aten_decompositions())
    for name in _WRONG_FOR_TRAINING:
        table.pop(getattr(torch.ops.aten, name).default, None)
    for op in _MUTATE_WITHOUT_SAYING:
        table[op] = decomposition_table_all()[op]
    table[torch.ops.aten.take.default] = _take
    table.update(_AS_ACCURATE_AS_THE_KERNEL)
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


def _batch_norm_updating_explicitly(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
) -> Any:
    """``native_batch_norm`` in training mode as ATen's functional batch norm (the same CPU
    kernel eager runs) plus the running-statistics update as explicit ``copy_`` ops, which
    functionalization turns into graph outputs; without running statistics, the op as it is
    (``NotImplemented`` tells ``make_fx`` so). In eval mode, torch's decomposition: pointwise
    ops with the running statistics, as accurate as the kernel.
    """
    if not training:
        return decomposition_table_all()[aten.native_batch_norm.default](
            input, weight, bias, running_mean, running_var, training, momentum, eps
        )
    if running_mean is None or running_var is None:
        return NotImplemented
    out, mean, invstd, new_mean, new_var = aten._native_batch_norm_legit_functional.default(
        input, weight, bias, running_mean, running_var, training, momentum, eps
    )
    running_mean.copy_(new_mean)
    running_var.copy_(new_var)
    return out, mean, invstd


def _batch_norm_backward_without_state(
    grad_out: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    save_mean: torch.Tensor | None,
    save_invstd: torch.Tensor | None,
    train: bool,
    eps: float,
    output_mask: list[bool],
) -> Any:
    """``native_batch_norm_backward`` in training mode without the running statistics, which
    the kernel does not read there (it reads the saved batch statistics): left in, the
    partition would save the pre-update buffers, which the write-back then mutates. Asked
    again about the op it emits (no statistics), it records it as it is (``NotImplemented``).
    In eval mode, torch's decomposition (pointwise, and reductions for the weight and bias).
    """
    args = (grad_out, input, weight, running_mean, running_var, save_mean, save_invstd)
    if not train:
        decomposed = decomposition_table_all()[aten.native_batch_norm_backward.default]
        return decomposed(*args, train, eps, output_mask)
    if running_mean is None and running_var is None:
        return NotImplemented
    return aten.native_batch_norm_backward.default(
        grad_out, input, weight, None, None, save_mean, save_invstd, train, eps, output_mask
    )


# "minimal" keeps batch norm's ATen kernels in training mode and rewrites only what
# correctness needs (the hidden update, the unused state); eval mode is pointwise and
# decomposes as before. Torch's decomposition of the training pair (what "core" uses, for
# code generators that fuse) is about as accurate op by op, but rounds otherwise, and over a
# deep network that adds up: through 12 conv+BN+ReLU blocks, a float32 step's gradients landed
# 0.6x-2.3x as far from float64 as eager's over 40 seeds, past the 2x a compiled step may take
# (tests/integration/test_batchnorm_numerics.py). Kept, the "aten" backend computes training
# batch norm bit for bit as eager does.
_MINIMAL: Mapping[Any, Callable[..., Any]] = {
    aten.native_batch_norm.default: _batch_norm_updating_explicitly,
    aten.native_batch_norm_backward.default: _batch_norm_backward_without_state,
}


def _minimal_table() -> Mapping[Any, Callable[..., Any]]:
    return _MINIMAL


def decomposition_table(decompositions: Decompositions) -> Mapping[Any, Callable[..., Any]]:
    """``"core"`` (core ATen), ``"minimal"`` (composite ops such as ``gelu_backward``,
    ``native_layer_norm_backward`` and training batch norm kept whole; only what correctness
    needs is rewritten), ``None``/``"none"`` (as dispatched), or a user table."""
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
