"""``saved_residuals`` / ``print_saved_residuals``: what a function keeps for backward, one line
per value, in JAX's format extended with bytes and consumers.

Bytes are counted per storage, as :class:`functrans.Partition` counts them: a value in a storage
that an earlier residual holds (a view of it, or both views of one buffer) shows 0 B and names
that residual, so the total is what backward really keeps alive.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from functrans._core.format import format_value_type, op_name
from functrans._core.graph import PATH, SOURCE
from functrans._core.shapes import Dynamic
from functrans._trace.joint import joint

from .cost import is_input_alias, storage_of
from .partition import Strategy, format_bytes, partition

__all__ = ["Residual", "print_saved_residuals", "saved_residuals"]


@dataclass(frozen=True)
class Residual:
    """One saved value: its type, bytes, where it comes from and who reads it in backward.

    ``nbytes`` is what it adds to the total: its storage's bytes, 0 for inputs and for a value
    whose storage an earlier residual holds (``shares`` then describes that residual).
    """

    type: str
    nbytes: int
    origin: str
    consumers: tuple[str, ...]
    shares: str | None = None
    #: with symbolic sizes (``dynamic=``): ``nbytes`` as a formula (``nbytes`` is its value at
    #: the example sizes)
    bytes_expr: str | None = None

    def __str__(self) -> str:
        used = f" -> used by {', '.join(self.consumers)} in backward" if self.consumers else ""
        shared = f" (shares the storage of the {self.shares})" if self.shares else ""
        size = format_bytes(self.nbytes)
        if self.bytes_expr is not None and self.nbytes:
            size = f"{self.bytes_expr} B = {size}"
        return f"{self.type} {size}{shared} {self.origin}{used}"


def _functional(
    f: Callable[..., Any] | torch.nn.Module, args: tuple[Any, ...]
) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """Lift a module's parameters and buffers to an argument so they show as inputs."""
    if not isinstance(f, torch.nn.Module):
        return f, args
    module = f
    state = {**dict(module.named_parameters()), **dict(module.named_buffers())}

    def call(params: dict[str, torch.Tensor], *inputs: Any) -> Any:
        return torch.func.functional_call(module, params, inputs)

    return call, ({k: v.detach() for k, v in state.items()}, *args)


def _origin(node: Any, where: bool = True) -> str:
    if node.op == "placeholder":
        return f"from the argument {node.meta.get(PATH, node.name)!r}"
    if is_input_alias(node):
        base, _ = storage_of(node)
        return f"view ({op_name(node.target)}) of the argument {base.meta.get(PATH, base.name)!r}"
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "functrans":
        return f"named {node.args[1]!r}"
    src = node.meta.get(SOURCE) if where else None
    at = f" from {src.rsplit('/', 1)[-1]}" if src else ""
    return f"output of {op_name(target)}{at}"


def saved_residuals(
    f: Callable[..., Any] | torch.nn.Module,
    *args: Any,
    partition: str | Strategy = "default",
    dynamic: Dynamic = False,
    **options: Any,
) -> list[Residual]:
    """The values ``f`` saves for backward under ``partition`` (functions or modules).
    ``dynamic`` traces with symbolic sizes (see :func:`functrans.trace`): bytes then show as
    formulas with their value at the example (``64*s0 B = 384 B``).

    >>> import torch, functrans as ft
    >>> for r in ft.saved_residuals(lambda x, w: torch.tanh(x @ w).sum(), torch.ones(4, 4),
    ...                             torch.ones(4, 4)):
    ...     print(r)
    f32[4, 4] 0 B from the argument 'x' -> used by permute in backward
    f32[4, 4] 0 B from the argument 'w' -> used by permute_1 in backward
    f32[4, 4] 64 B output of aten.tanh.default from ... -> used by mul in backward
    """
    from functrans._core.validate import check_callable

    check_callable("saved_residuals", "f", f)
    fn, call_args = _functional(f, args)
    jg = joint(fn, dynamic=dynamic)(*call_args)
    p = _partition_of(jg, partition, options)
    shared = p.shared_storage()
    out = []
    # backward's placeholders are the saved values, in order, then the tangents
    for s, placeholder in zip(p.saved, p.backward.placeholders(), strict=False):
        node = s.node
        if s.dtype is None:  # a size handed to backward (symbolic shapes): no memory
            continue
        users = placeholder.users
        owner = shared.get(node) if not s.is_input else None
        out.append(
            Residual(
                type=format_value_type(node.meta.get("val")),
                nbytes=0 if node in shared else s.activation_bytes,
                origin=_origin(node),
                consumers=tuple(u.name for u in users if u.op != "output"),
                shares=None
                if owner is None
                else f"{format_value_type(owner.meta.get('val'))} {_origin(owner, where=False)}",
                bytes_expr=s.bytes_expr if node not in shared and not s.is_input else None,
            )
        )
    return out


def _partition_of(jg: Any, strategy: Any, options: dict[str, Any]) -> Any:
    return partition(jg, strategy, **options)


def print_saved_residuals(
    f: Callable[..., Any] | torch.nn.Module,
    *args: Any,
    partition: str | Strategy = "default",
    dynamic: Dynamic = False,
    **options: Any,
) -> None:
    """Print :func:`saved_residuals`, one line per saved value, then the total.

    >>> import torch, functrans as ft
    >>> ft.print_saved_residuals(ft.remat(lambda x: x.sin().sin().sum()), torch.ones(8))
    f32[8] 0 B from the argument 'x' -> used by sin, cos_1 in backward
    total: 0 B saved for backward

    A value and a view of it keep one buffer alive, counted once:

    >>> ft.print_saved_residuals(lambda x: (x.exp() * x.exp().t()).sum(), torch.ones(4, 4))
    f32[4, 4] 64 B output of aten.exp.default from ... -> used by mul_1, mul_3, mul_4 in backward
    f32[4, 4] 0 B (shares the storage of the f32[4, 4] output of aten.exp.default)
        output of aten.permute.default from ... -> used by mul_2 in backward
    total: 64 B saved for backward

    With a symbolic batch, bytes are formulas in the size symbols:

    >>> ft.print_saved_residuals(lambda x: x.exp().sum(), torch.ones(6, 4), dynamic={"x": (0,)})
    f32[s0, 4] 16*s0 B = 96 B output of aten.exp.default from ... -> used by mul in backward
    total: 96 B saved for backward
    """
    residuals = saved_residuals(f, *args, partition=partition, dynamic=dynamic, **options)
    for r in residuals:
        print(r)
    print(f"total: {format_bytes(sum(r.nbytes for r in residuals))} saved for backward")
