"""The remat policies behind the public :mod:`functrans.policies` (see its docstring).

Remat policies: per-op decisions of what a ``remat`` region saves for backward.

A policy (:class:`PolicyFn`) is a callable ``(op, *args, **kwargs) -> Policy | bool`` called
for every ATen op in the region (``True`` means save: ``Policy.MUST_SAVE``; ``False`` means
recompute: ``Policy.MUST_RECOMPUTE``). torch's ``CheckpointPolicy`` values and plain lists of ops
are accepted wherever a policy is (:data:`PolicyLike`). The built-ins carry JAX's names and
meanings. ``Policy.MUST_OFFLOAD`` saves a value in host memory instead of on the device (never
recomputed; copied out once after the forward, back in each backward that needs it):
:func:`save_and_offload_only_these_names` and :func:`offload_dot_with_no_batch_dims` answer it,
and so does torch's ``CheckpointPolicy.MUST_CPU_OFFLOAD``.

>>> import torch
>>> from functrans import policies
>>> aten = torch.ops.aten
>>> policies.dots_saveable(aten.mm.default), policies.dots_saveable(aten.sin.default)
(True, False)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from functrans._core.errors import FunctransError
from functrans._core.ops import COLLECTIVE_NAMESPACES, COMPUTE_INTENSIVE
from functrans._core.tags import Policy, PolicyFn, PolicyLike
from functrans._core.validate import describe

__all__ = [
    "InvalidPolicyError",
    "Policy",
    "PolicyFn",
    "PolicyLike",
    "convention",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "everything_saveable",
    "normalize",
    "nothing_saveable",
    "offload_dot_with_no_batch_dims",
    "reshard_after_forward",
    "save_and_offload_only_these_names",
    "save_any_names_but_these",
    "save_from_both_policies",
    "save_only_these_names",
    "save_ops",
]

aten = torch.ops.aten


def _name_op() -> Any:
    from functrans._trace import names as _names  # registers the functrans::checkpoint_name op

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


def offload_dot_with_no_batch_dims(
    offload_src: str = "device", offload_dst: str = "pinned_host"
) -> PolicyFn:
    """Offload (``MUST_OFFLOAD``) the outputs :func:`dots_with_no_batch_dims_saveable` saves;
    recompute everything else (JAX's policy of the same name: the large weight products of a
    transformer go to host memory, the rest is recomputed from them). ``offload_src`` and
    ``offload_dst`` are JAX's memory kinds; only device to host is supported.

    >>> import torch
    >>> policy = offload_dot_with_no_batch_dims()
    >>> policy(torch.ops.aten.mm.default).name, policy(torch.ops.aten.sin.default).name
    ('MUST_OFFLOAD', 'MUST_RECOMPUTE')
    """
    _check_offload("offload_dot_with_no_batch_dims", offload_src, offload_dst)

    def policy(op: Any, *args: Any, **kwargs: Any) -> Policy:
        # the products the saving policy keeps are the ones worth a copy rather than a rerun
        if dots_with_no_batch_dims_saveable(op, *args, **kwargs):
            return Policy.MUST_OFFLOAD
        return Policy.MUST_RECOMPUTE

    return policy


def save_only_these_names(*names: str) -> PolicyFn:
    """Save exactly the values named with ``checkpoint_name`` in ``names``."""
    wanted = _name_args("save_only_these_names", names)

    def policy(op: Any, *args: Any, **kwargs: Any) -> bool:
        return op is _name_op() and args[1] in wanted

    return policy


def save_and_offload_only_these_names(
    *,
    names_which_can_be_saved: Iterable[str] = (),
    names_which_can_be_offloaded: Iterable[str] = (),
    offload_src: str = "device",
    offload_dst: str = "pinned_host",
) -> PolicyFn:
    """Save the values named (``checkpoint_name``) in ``names_which_can_be_saved`` on the
    device, keep those named in ``names_which_can_be_offloaded`` in host memory
    (``MUST_OFFLOAD``), recompute everything else (JAX's policy of the same name). A name in
    both lists, a bare string for a list, or memory kinds other than device to host are refused.

    >>> import torch, functrans as ft
    >>> policy = save_and_offload_only_these_names(
    ...     names_which_can_be_saved=["q"], names_which_can_be_offloaded=["h"]
    ... )
    >>> name, x = NAME_OP(), torch.ones(2)
    >>> [policy(name, x, n).name for n in ("q", "h", "other")]
    ['MUST_SAVE', 'MUST_OFFLOAD', 'MUST_RECOMPUTE']
    >>> save_and_offload_only_these_names(
    ...     names_which_can_be_saved=["h"], names_which_can_be_offloaded=["h"]
    ... )
    Traceback (most recent call last):
    ...
    functrans.policies.InvalidPolicyError: save_and_offload_only_these_names: 'h' is in both ...
    """
    where = "save_and_offload_only_these_names"
    saved = _names(where, "names_which_can_be_saved", names_which_can_be_saved)
    offloaded = _names(where, "names_which_can_be_offloaded", names_which_can_be_offloaded)
    both = sorted(saved & offloaded)
    if both:
        raise InvalidPolicyError(
            f"{where}: {', '.join(map(repr, both))} {'is' if len(both) == 1 else 'are'} in both "
            f"names_which_can_be_saved={sorted(saved)} and names_which_can_be_offloaded="
            f"{sorted(offloaded)}; a name is either saved on the device or offloaded to host "
            "memory: list it in one of them"
        )
    _check_offload(where, offload_src, offload_dst)

    def policy(op: Any, *args: Any, **kwargs: Any) -> Policy:
        if op is _name_op() and args[1] in saved:
            return Policy.MUST_SAVE
        if op is _name_op() and args[1] in offloaded:
            return Policy.MUST_OFFLOAD
        return Policy.MUST_RECOMPUTE  # neither kept nor offloaded unless named in a list

    return policy


def _names(where: str, argument: str, names: Any) -> frozenset[str]:
    """The names of a name list, or raise naming ``argument`` (a bare string is one name
    spelled as a list of letters: refused, not split)."""
    if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
        hint = f" (one name: {argument}=[{names!r}])" if isinstance(names, str) else ""
        raise InvalidPolicyError(
            f"{where}: {argument}={describe(names)} is not accepted; {argument} must be a list, "
            f"tuple or set of the names (str) given to checkpoint_name{hint}"
        )
    names = tuple(names)
    for i, name in enumerate(names):
        if not isinstance(name, str):
            raise InvalidPolicyError(
                f"{where}: element {i} of {argument} is {describe(name)}, not a name; "
                f"{argument} must hold the names (str) given to checkpoint_name"
            )
    return frozenset(names)


def _name_args(where: str, names: tuple[Any, ...]) -> frozenset[str]:
    """``*names`` of ``where``, each a str (a list passed as one argument is refused with the
    spelling that works)."""
    for i, name in enumerate(names):
        if not isinstance(name, str):
            hint = (
                f"; pass the names as separate arguments: {where}(*{name!r})"
                if isinstance(name, (list, tuple, set, frozenset))
                else ""
            )
            raise InvalidPolicyError(
                f"{where}: argument {i} is {describe(name)}, not a name; {where} takes the "
                f"names (str) given to checkpoint_name{hint}"
            )
    return frozenset(names)


#: JAX's memory kinds that offloading moves between: device memory to (pinned) host memory.
_OFFLOAD_SRC, _OFFLOAD_DST = ("device",), ("pinned_host",)


def _check_offload(where: str, src: Any, dst: Any) -> None:
    """Raise unless ``src``/``dst`` name the one direction functrans offloads in. How the copy
    is made (pinned or not, which stream) is the :class:`~functrans.extend.Transfer`'s choice."""
    for argument, value, accepted in (
        ("offload_src", src, _OFFLOAD_SRC),
        ("offload_dst", dst, _OFFLOAD_DST),
    ):
        if not (isinstance(value, str) and value in accepted):
            raise InvalidPolicyError(
                f"{where}: {argument}={describe(value)} is not accepted; {argument} must be "
                f"{' or '.join(map(repr, accepted))} (functrans offloads saved values from "
                "device memory to host memory; functrans.extend.use_transfer changes how "
                "they are copied)"
            )


def save_any_names_but_these(*names: str) -> PolicyFn:
    """Save every named value except those in ``names``."""
    unwanted = _name_args("save_any_names_but_these", names)

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


#: strongest saving first: where two policies differ, the combination takes the earlier answer
#: (MUST_OFFLOAD guarantees the value is kept, a preference does not: it ranks above PREFER_SAVE)
_SAVE_ORDER = [
    Policy.MUST_SAVE,
    Policy.MUST_OFFLOAD,
    Policy.PREFER_SAVE,
    Policy.PREFER_RECOMPUTE,
    Policy.MUST_RECOMPUTE,
]


def _from_torch(value: Any) -> Policy | None:
    """torch's ``CheckpointPolicy`` as a :class:`Policy`. ``MUST_CPU_OFFLOAD`` and
    ``PREFER_CPU_OFFLOAD`` are honoured: ``MUST_OFFLOAD``, the value kept in host memory (torch's
    eager selective checkpointing silently recomputes them instead).

    >>> from torch.utils.checkpoint import CheckpointPolicy
    >>> _from_torch(CheckpointPolicy.PREFER_CPU_OFFLOAD)
    <Policy.MUST_OFFLOAD: 'must_offload'>
    """
    from torch.utils.checkpoint import CheckpointPolicy

    if isinstance(value, CheckpointPolicy):
        return {
            CheckpointPolicy.MUST_SAVE: Policy.MUST_SAVE,
            CheckpointPolicy.PREFER_SAVE: Policy.PREFER_SAVE,
            CheckpointPolicy.MUST_RECOMPUTE: Policy.MUST_RECOMPUTE,
            CheckpointPolicy.PREFER_RECOMPUTE: Policy.PREFER_RECOMPUTE,
            # no PREFER_OFFLOAD: no strategy trades offloading against saving yet
            CheckpointPolicy.MUST_CPU_OFFLOAD: Policy.MUST_OFFLOAD,
            CheckpointPolicy.PREFER_CPU_OFFLOAD: Policy.MUST_OFFLOAD,
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
#: the functions that make a policy (a policy's name here, or one of them passed uncalled, is
#: refused with a hint to call it)
_FACTORY_FNS = (
    save_only_these_names,
    save_any_names_but_these,
    save_and_offload_only_these_names,
    offload_dot_with_no_batch_dims,
    save_ops,
    save_from_both_policies,
)
_FACTORIES = frozenset(f.__name__ for f in _FACTORY_FNS)


def _is_factory(policy: object) -> bool:
    return any(policy is f for f in _FACTORY_FNS)


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
    if _is_factory(policy):
        name = policy.__name__
        return InvalidPolicyError(
            f"policy=functrans.policies.{name} makes a policy, it is not one: pass "
            f"functrans.policies.{name}(...), the policy it makes; {_ACCEPTED}"
        )
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
    if isinstance(policy, (str, bytes, Mapping)) or _is_factory(policy):
        raise _refuse(policy)
    if isinstance(policy, Iterable) and not callable(policy):
        ops = tuple(policy)
        _check_ops(ops, f"element {{i}} of the policy {type(policy).__name__}")
        policy = save_ops(*ops)
    if not callable(policy):
        raise _refuse(policy)
    fn = policy
    if convention(policy) == "torch":
        ctx = _torch_context()

        def from_torch(op: Any, *args: Any, **kwargs: Any) -> Policy:
            return decision(fn(ctx, op, *args, **kwargs), op)

        return from_torch

    def normalized(op: Any, *args: Any, **kwargs: Any) -> Policy:
        return decision(fn(op, *args, **kwargs), op)

    return normalized


#: first parameter names of torch's selective-checkpoint policies, ``(ctx, op, ...)``
_CTX_NAMES = frozenset({"ctx", "context", "_ctx", "checkpoint_ctx"})
#: names of the op parameter
_OP_NAMES = frozenset({"op", "func", "fn", "prim", "primitive", "target", "operator", "aten_op"})


def convention(policy: Callable[..., Any]) -> str:
    """Which calling convention a policy callable follows, read off its signature:
    ``"torch"`` for torch's ``policy_fn(ctx, op, *args, **kwargs)`` (torch's selective
    checkpointing, torchtitan, torchtune), ``"jax"`` for ``policy(op, *args, **kwargs)`` (JAX's
    ``jax.checkpoint`` policies, functrans' own). A first parameter named ``ctx`` (or a second
    named ``op``/``func``) means torch's; one named ``op``/``func``/``prim``, a single
    positional parameter, or only ``*args`` (a catch-all such as ``lambda *_, **__: True``),
    JAX's. Anything else is ambiguous and refused by name: a policy that read a context as the
    op would silently decide wrong for every op.

    >>> convention(lambda ctx, op, *args, **kwargs: True)
    'torch'
    >>> convention(lambda op, *args, **kwargs: True)
    'jax'
    >>> convention(lambda *_, **__: True)  # a catch-all: torch's always name ctx first
    'jax'
    >>> convention(lambda a, b, *rest: True)
    Traceback (most recent call last):
    ...
    functrans.policies.InvalidPolicyError: remat policy <lambda> takes (a, b, *rest): ...
    """
    try:
        sig = inspect.signature(policy)
    except (TypeError, ValueError):
        sig = None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in sig.parameters.values() if p.kind in kinds] if sig else []
    if names and names[0] in _CTX_NAMES:
        return "torch"
    if names and names[0] in _OP_NAMES:
        return "jax"
    if len(names) >= 2 and names[1] in _OP_NAMES:
        return "torch"
    if len(names) == 1:
        return "jax"
    if not names and sig and _takes_varargs(sig):
        # (*args, **kwargs): torch's policies always name ctx first, so a catch-all is JAX's
        # (its RematTest.test_remat_basic passes policy=lambda *_, **__: True)
        return "jax"
    shown = f"({', '.join(str(p) for p in sig.parameters.values())})" if sig else "(unknown)"
    raise InvalidPolicyError(
        f"remat policy {getattr(policy, '__name__', type(policy).__name__)} takes {shown}: "
        "it is not clear whether it follows torch's convention policy_fn(ctx, op, *args, "
        "**kwargs) or JAX's policy(op, *args, **kwargs); name its first parameter ctx "
        "(torch's) or op (JAX's)"
    )


def _takes_varargs(sig: inspect.Signature) -> bool:
    return any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in sig.parameters.values())


def _torch_context() -> Any:
    """The context a torch-convention policy gets: torch's own ``SelectiveCheckpointContext``
    (``is_recompute`` False: functrans asks each op once, when it first runs)."""
    from torch.utils.checkpoint import SelectiveCheckpointContext

    return SelectiveCheckpointContext(is_recompute=False)
