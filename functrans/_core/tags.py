"""Remat policy tags on graph nodes: what a ``remat`` policy decided for an op.

Traced ``remat`` regions tag their nodes under ``node.meta["functrans.remat"]``; every partition
strategy reads the tag through :func:`policy_of`. MUST_* decisions are hard constraints,
PREFER_* are preferences for strategies that optimize.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy  # torch imports it anyway

__all__ = [
    "REMAT",
    "REMAT_OP",
    "SAVE_TAGS",
    "Policy",
    "PolicyFn",
    "PolicyLike",
    "RematOp",
    "policy_of",
]

REMAT = "functrans.remat"
#: On a node a traced remat region recorded: :class:`RematOp`, the op the user's code called
#: (before decompositions split it; the one the policy was asked about) that made the node.
REMAT_OP = "functrans.remat_op"


@dataclass(frozen=True)
class RematOp:
    """The user-level op behind a traced node: ``holds_output`` is False for a value inside the
    op's decomposition (``sigmoid`` inside ``silu``), True for the op's own output."""

    op: Any
    holds_output: bool


class Policy(enum.Enum):
    """A per-op save/recompute/offload decision (torch's CheckpointPolicy's choices).

    ``MUST_OFFLOAD`` (torch's ``MUST_CPU_OFFLOAD``, JAX's ``Offloadable``) saves the value like
    ``MUST_SAVE`` (never recomputed) but keeps it in host memory between forward and backward:
    copied out after its last forward use, copied back before its first backward use.

    >>> from functrans.extend import Policy
    >>> [p.name for p in Policy]
    ['MUST_SAVE', 'PREFER_SAVE', 'MUST_RECOMPUTE', 'PREFER_RECOMPUTE', 'MUST_OFFLOAD']
    """

    MUST_SAVE = "must_save"
    PREFER_SAVE = "prefer_save"
    MUST_RECOMPUTE = "must_recompute"
    PREFER_RECOMPUTE = "prefer_recompute"
    MUST_OFFLOAD = "must_offload"


#: The decisions that save an op's output rather than recompute it (``MUST_OFFLOAD``: saved in
#: host memory); eager remat caches these outputs, and a traced view tagged with one follows
#: its base's decision.
SAVE_TAGS = (Policy.MUST_SAVE, Policy.PREFER_SAVE, Policy.MUST_OFFLOAD)


class PolicyFn(Protocol):
    """A remat policy: called with every ATen op a region runs and the op's arguments (real
    tensors in eager mode, FakeTensors when traced), it answers whether to save the op's output:
    a :class:`Policy`, a bool (``True``: ``MUST_SAVE``, ``False``: ``MUST_RECOMPUTE``) or a
    torch ``CheckpointPolicy``.

    >>> import torch
    >>> def dots(op: object, *args: object, **kwargs: object) -> bool:
    ...     return op is torch.ops.aten.mm.default
    >>> policy: PolicyFn = dots
    >>> policy(torch.ops.aten.mm.default, torch.ones(2, 2), torch.ones(2, 2))
    True
    """

    def __call__(
        self, op: Any, /, *args: Any, **kwargs: Any
    ) -> Policy | bool | CheckpointPolicy: ...


#: What ``remat(policy=...)`` accepts: a :class:`PolicyFn`; one decision for every op (a
#: :class:`Policy` or torch ``CheckpointPolicy``); ops (``OpOverload`` or ``OpOverloadPacket``)
#: whose outputs to save; or None, which saves nothing.
PolicyLike: TypeAlias = PolicyFn | Policy | CheckpointPolicy | Iterable[Any] | None


def policy_of(node: fx.Node) -> Policy | None:
    """The policy tag on ``node``, or None outside any remat region.

    >>> import torch, functrans as ft
    >>> from functrans import policies
    >>> f = ft.remat(lambda x, w: torch.tanh(x @ w).sum(), policy=policies.dots_saveable)
    >>> jg = ft.joint(f)(torch.ones(2, 2), torch.ones(2, 2))
    >>> {n.name: policy_of(n) for n in jg.ops() if policy_of(n) is not None}
    {'mm': <Policy.MUST_SAVE: 'must_save'>, 'tanh': <Policy.MUST_RECOMPUTE: 'must_recompute'>}
    """
    tag = node.meta.get(REMAT)
    return tag if isinstance(tag, Policy) else None
