"""Remat policy tags on graph nodes: what a ``remat`` policy decided for an op.

Traced ``remat`` regions tag their nodes under ``node.meta["functrans.remat"]``; every partition
strategy reads the tag through :func:`policy_of`. MUST_* decisions are hard constraints,
PREFER_* are preferences for strategies that optimize.
"""

from __future__ import annotations

import enum

import torch.fx as fx

__all__ = ["REMAT", "Policy", "policy_of"]

REMAT = "functrans.remat"


class Policy(enum.Enum):
    """A per-op save/recompute decision (the same four choices as torch's CheckpointPolicy)."""

    MUST_SAVE = "must_save"
    PREFER_SAVE = "prefer_save"
    MUST_RECOMPUTE = "must_recompute"
    PREFER_RECOMPUTE = "prefer_recompute"


def policy_of(node: fx.Node) -> Policy | None:
    """The policy tag on ``node``, or None outside any remat region."""
    tag = node.meta.get(REMAT)
    return tag if isinstance(tag, Policy) else None
