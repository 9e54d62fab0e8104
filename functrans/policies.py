"""Remat policies: per-op decisions of what a ``remat`` region saves for backward.

A policy (:class:`PolicyFn`) is a callable ``(op, *args, **kwargs) -> Policy | bool`` called
for every ATen op in the region (``True`` means save: ``Policy.MUST_SAVE``; ``False`` means
recompute: ``Policy.MUST_RECOMPUTE``). torch's ``CheckpointPolicy`` values and plain lists of ops
are accepted wherever a policy is (:data:`PolicyLike`). The built-ins carry JAX's names and
meanings.

>>> import torch
>>> from functrans import policies
>>> aten = torch.ops.aten
>>> policies.dots_saveable(aten.mm.default), policies.dots_saveable(aten.sin.default)
(True, False)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ._cost import COLLECTIVE_NAMESPACES, COMPUTE_INTENSIVE
from ._errors import FunctransError
from ._tags import Policy, PolicyFn, PolicyLike

__all__ = [
    "InvalidPolicyError",
    "Policy",
    "PolicyFn",
    "PolicyLike",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "everything_saveable",
    "normalize",
    "nothing_saveable",
    "reshard_after_forward",
    "save_any_names_but_these",
    "save_from_both_policies",
    "save_only_these_names",
    "save_ops",
]

aten = torch.ops.aten


def _name_op() -> Any:
    from . import _names  # registers the functrans::checkpoint_name op

    return _names.checkpoint_name_op()


def NAME_OP() -> Any:
    """The op ``checkpoint_name`` records: ``functrans.checkpoint_name(x, name)``."""
    return _name_op()


def _packet(op: Any) -> Any:
    return getattr(op, "overloadpacket", op)


def everything_saveable(op: Any, *args: Any, **kwargs: Any) -> bool:
    """Save every value the region computes (no recomputation)."""
    return True


def nothing_saveable(op: Any, *args: Any, **kwargs: Any) -> bool:
    """Save nothing inside the region: backward recomputes it from the region's inputs."""
    return False


def dots_saveable(op: Any, *args: Any, **kwargs: Any) -> bool:
    """Save the outputs of matmuls, convolutions and attention; recompute everything else."""
    return _packet(op) in COMPUTE_INTENSIVE


_NO_BATCH_DOTS = frozenset({aten.mm, aten.addmm, aten.convolution})

#: Batched matmuls -> (position, name) of an operand whose leading dimension is the batch.
#: ``baddbmm``'s ``self`` only broadcasts: its ``batch1`` says how many products there are.
_BATCH_OPERAND: dict[Any, tuple[int, str]] = {aten.bmm: (0, "self"), aten.baddbmm: (1, "batch1")}


def _operand(args: tuple[Any, ...], kwargs: dict[str, Any], where: tuple[int, str]) -> Any:
    index, name = where
    return args[index] if len(args) > index else kwargs.get(name)


def _batch_of_one(t: Any) -> bool:
    """A batched-matmul operand whose batch dimensions are all of size one: one product."""
    return isinstance(t, torch.Tensor) and all(d == 1 for d in t.shape[:-2])


def dots_with_no_batch_dims_saveable(op: Any, *args: Any, **kwargs: Any) -> bool:
    """Save matmuls without batch dimensions and convolutions; not batched matmuls/attention.

    Batch dimensions are judged by what the op computes, not by which op carries it: ``einsum``
    (and ``matmul`` on leading dimensions of size one) lowers a plain 2-D product to ``bmm``
    with a batch of one, which is saved like ``x @ w`` (``mm``).

    >>> import torch
    >>> aten = torch.ops.aten
    >>> a, b = torch.ones(1, 2, 3), torch.ones(1, 3, 4)
    >>> dots_with_no_batch_dims_saveable(aten.bmm.default, a, b)  # einsum('ij,jk->ik')
    True
    >>> dots_with_no_batch_dims_saveable(aten.bmm.default, a.expand(5, 2, 3), b.expand(5, 3, 4))
    False
    """
    packet = _packet(op)
    if packet in _NO_BATCH_DOTS:
        return True
    where = _BATCH_OPERAND.get(packet)
    return where is not None and _batch_of_one(_operand(args, kwargs, where))


def save_only_these_names(*names: str) -> PolicyFn:
    """Save exactly the values named with ``checkpoint_name`` in ``names``."""
    wanted = frozenset(names)

    def policy(op: Any, *args: Any, **kwargs: Any) -> bool:
        return op is _name_op() and args[1] in wanted

    return policy


def save_any_names_but_these(*names: str) -> PolicyFn:
    """Save every named value except those in ``names``."""
    unwanted = frozenset(names)

    def policy(op: Any, *args: Any, **kwargs: Any) -> bool:
        return op is _name_op() and args[1] not in unwanted

    return policy


def _is_all_gather(op: Any) -> bool:
    packet = _packet(op)
    name = getattr(packet, "_qualified_op_name", str(packet))
    return name.split("::")[0] in COLLECTIVE_NAMESPACES and "all_gather" in name


def reshard_after_forward(op: Any, *args: Any, **kwargs: Any) -> Policy:
    """Re-gather weights in backward instead of keeping them (what FSDP's
    ``reshard_after_forward=True`` does eagerly): every all-gather is ``MUST_RECOMPUTE``, and
    with it its wait and the views and casts after it; everything else ``PREFER_SAVE`` (the
    strategy decides). Collectives are otherwise never recomputed.

    >>> import torch
    >>> gather = torch.ops._c10d_functional.all_gather_into_tensor.default
    >>> reshard_after_forward(gather).name, reshard_after_forward(torch.ops.aten.mm.default).name
    ('MUST_RECOMPUTE', 'PREFER_SAVE')
    """
    return Policy.MUST_RECOMPUTE if _is_all_gather(op) else Policy.PREFER_SAVE


def save_ops(*ops: Any) -> PolicyFn:
    """Save the outputs of these ops (OpOverloads or OpOverloadPackets); anything else is
    refused here, with its position.

    >>> import torch
    >>> policy = save_ops(torch.ops.aten.mm)
    >>> policy(torch.ops.aten.mm.default), policy(torch.ops.aten.sin.default)
    (True, False)
    """
    _check_ops(ops, "argument {i} of save_ops")
    wanted = frozenset(ops) | frozenset(_packet(o) for o in ops)

    def policy(op: Any, *args: Any, **kwargs: Any) -> bool:
        return op in wanted or _packet(op) in wanted

    return policy


def save_from_both_policies(a: PolicyLike, b: PolicyLike) -> PolicyFn:
    """Save what either policy saves."""
    fa, fb = normalize(a), normalize(b)

    def policy(op: Any, *args: Any, **kwargs: Any) -> Policy:
        pa, pb = fa(op, *args, **kwargs), fb(op, *args, **kwargs)
        return min(pa, pb, key=_SAVE_ORDER.index)

    return policy


_SAVE_ORDER = [Policy.MUST_SAVE, Policy.PREFER_SAVE, Policy.PREFER_RECOMPUTE, Policy.MUST_RECOMPUTE]


def _from_torch(value: Any) -> Policy | None:
    from torch.utils.checkpoint import CheckpointPolicy

    if isinstance(value, CheckpointPolicy):
        return {
            CheckpointPolicy.MUST_SAVE: Policy.MUST_SAVE,
            CheckpointPolicy.PREFER_SAVE: Policy.PREFER_SAVE,
            CheckpointPolicy.MUST_RECOMPUTE: Policy.MUST_RECOMPUTE,
            CheckpointPolicy.PREFER_RECOMPUTE: Policy.PREFER_RECOMPUTE,
        }.get(value)
    return None


def decision(value: Any, op: Any) -> Policy:
    """Turn a policy's answer into a :class:`Policy`, or raise naming the op and the value."""
    if isinstance(value, Policy):
        return value
    if isinstance(value, bool):
        return Policy.MUST_SAVE if value else Policy.MUST_RECOMPUTE
    converted = _from_torch(value)
    if converted is not None:
        return converted
    hint = " (does the policy miss a `return` on some path?)" if value is None else ""
    raise InvalidPolicyError(
        f"remat policy returned {value!r} for op {op}{hint}; a policy must return a "
        "functrans.policies.Policy, a bool (True = save) or a torch CheckpointPolicy"
    )


class InvalidPolicyError(FunctransError, ValueError):
    """A remat policy answered something that is not a save/recompute decision.

    (Not a TypeError: Python would swallow one raised inside ``x @ w`` and report
    "unsupported operand types" instead.)
    """


_OP_TYPES = (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)

_ACCEPTED = (
    "a remat policy is a callable (op, *args, **kwargs) -> Policy | bool | CheckpointPolicy "
    "(e.g. functrans.policies.dots_saveable, or one made by save_only_these_names(...)), "
    "a Policy or torch CheckpointPolicy for every op, a list, tuple or set of ops whose outputs "
    "to save (OpOverloads such as torch.ops.aten.mm.default, or OpOverloadPackets such as "
    "torch.ops.aten.mm), or None (save nothing)"
)


def _check_ops(ops: Iterable[Any], where: str) -> None:
    """Raise naming the first element of ``ops`` that is not an op, and its position."""
    for i, op in enumerate(ops):
        if not isinstance(op, _OP_TYPES):
            raise InvalidPolicyError(
                f"{where.format(i=i)} is {op!r} ({type(op).__name__}), not an op; {_ACCEPTED}"
            )


_BUILT_INS = frozenset(
    {"everything_saveable", "nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable"}
)
_FACTORIES = frozenset(
    {"save_only_these_names", "save_any_names_but_these", "save_ops", "save_from_both_policies"}
)


def _refuse(policy: Any) -> InvalidPolicyError:
    what = f"policy={policy!r} ({type(policy).__name__})"
    if isinstance(policy, str):
        if policy in _BUILT_INS:
            return InvalidPolicyError(
                f"{what} is a name, not a policy: pass functrans.policies.{policy} itself; "
                f"{_ACCEPTED}"
            )
        if policy in _FACTORIES:
            return InvalidPolicyError(
                f"{what} is a name, not a policy: pass functrans.policies.{policy}(...), "
                f"the policy it makes; {_ACCEPTED}"
            )
        return InvalidPolicyError(f"{what} is a string, not a policy; {_ACCEPTED}")
    if isinstance(policy, Mapping):
        return InvalidPolicyError(f"{what} is a {type(policy).__name__}; {_ACCEPTED}")
    return InvalidPolicyError(f"{what} is not a remat policy; {_ACCEPTED}")


def normalize(policy: PolicyLike) -> Callable[..., Policy]:
    """Accept a policy callable, a ``CheckpointPolicy`` for every op, or a list of ops to save;
    return a callable that always answers with a :class:`Policy`. Anything else (a list holding
    a non-op, a policy's name as a string, a dict) raises :class:`InvalidPolicyError` here,
    naming the bad element and what is accepted.

    >>> import torch
    >>> normalize([torch.ops.aten.mm.default])(torch.ops.aten.mm.default)
    <Policy.MUST_SAVE: 'must_save'>
    >>> normalize([2])
    Traceback (most recent call last):
    ...
    functrans.policies.InvalidPolicyError: element 0 of the policy list is 2 (int), not an op; ...
    """
    if policy is None:
        policy = nothing_saveable
    if _from_torch(policy) is not None or isinstance(policy, Policy):
        fixed = decision(policy, "*")
        return lambda op, *a, **k: fixed
    if isinstance(policy, (str, bytes, Mapping)):
        raise _refuse(policy)
    if isinstance(policy, Iterable) and not callable(policy):
        ops = tuple(policy)
        _check_ops(ops, f"element {{i}} of the policy {type(policy).__name__}")
        policy = save_ops(*ops)
    if not callable(policy):
        raise _refuse(policy)
    fn = policy

    def normalized(op: Any, *args: Any, **kwargs: Any) -> Policy:
        return decision(fn(op, *args, **kwargs), op)

    return normalized
