"""``remat(f, policy)``: selective activation checkpointing in eager PyTorch and in traces.

- Traced (inside ``trace``/``joint``/``grad``/``vjp``): ``f`` runs inline and every ATen op it
  records is tagged with the policy's decision (``node.meta["functrans.remat"]``); partition
  strategies honor the tags. Inner ``remat`` regions keep their own tags.
- Eager (ordinary autograd): ``f`` runs under torch's non-reentrant checkpoint with a selective
  policy: forward keeps only the outputs the policy saves (cached by op and call index),
  backward re-runs the region (RNG state restored, stopping early once everything is
  produced) and serves the cached outputs. The same policy object decides in both modes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from . import policies
from ._tags import REMAT, Policy
from ._trace import is_tracing

__all__ = ["RematModule", "remat"]


def _torch_policy(decide: Callable[..., Policy]) -> Callable[..., Any]:
    from torch.utils.checkpoint import CheckpointPolicy

    table = {
        Policy.MUST_SAVE: CheckpointPolicy.MUST_SAVE,
        Policy.PREFER_SAVE: CheckpointPolicy.PREFER_SAVE,
        Policy.MUST_RECOMPUTE: CheckpointPolicy.MUST_RECOMPUTE,
        Policy.PREFER_RECOMPUTE: CheckpointPolicy.PREFER_RECOMPUTE,
    }

    def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return table[decide(op, *args, **kwargs)]

    return policy_fn


def _eager(f: Callable[..., Any], decide: Callable[..., Policy], args: Any, kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return f(*args, **kwargs)
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    context_fn = functools.partial(create_selective_checkpoint_contexts, _torch_policy(decide))
    return checkpoint(
        f, *args, use_reentrant=False, context_fn=context_fn, preserve_rng_state=True, **kwargs
    )


def _traced(f: Callable[..., Any], decide: Callable[..., Policy], args: Any, kwargs: Any) -> Any:
    mode = get_proxy_mode()
    if mode is None:  # evaluating shapes only: nothing to tag
        return f(*args, **kwargs)
    graph: fx.Graph = mode.tracer.graph
    last = graph._root.prev  # the node before the region (the root sentinel if none)
    out = f(*args, **kwargs)
    node = last.next
    while node is not graph._root:
        target = node.target
        if (
            node.op == "call_function"
            and isinstance(target, torch._ops.OpOverload)
            and REMAT not in node.meta
        ):
            a, k = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
            node.meta[REMAT] = decide(target, *a, **k)
        node = node.next
    return out


def remat(
    f: Any = None,
    *,
    policy: Any = None,
    prevent_cse: bool = True,
    static_argnums: Sequence[int] = (),
) -> Any:
    """Rematerialize ``f`` in backward, saving only what ``policy`` says (JAX's ``checkpoint``).

    ``policy=None`` saves nothing inside but the region's inputs. Usable as ``@remat``,
    ``@remat(policy=...)``, ``remat(f, policy=...)`` and on ``nn.Module`` instances.
    ``prevent_cse`` and ``static_argnums`` are accepted for JAX compatibility: functrans graphs
    are never CSE'd across regions, and non-tensor arguments are passed through unchanged.

    >>> import torch, functrans as ft
    >>> from functrans import policies
    >>> f = ft.remat(lambda x, w: torch.tanh(x @ w).sum(), policy=policies.dots_saveable)
    >>> p = ft.partition(ft.joint(f)(torch.ones(4, 4), torch.ones(4, 4)), "default")
    >>> sorted(s.name for s in p.saved)
    ['mm', 'primals_1', 'primals_2']
    """
    if f is None:
        return functools.partial(
            remat, policy=policy, prevent_cse=prevent_cse, static_argnums=static_argnums
        )
    if isinstance(f, torch.nn.Module):
        return RematModule(f, policy=policy)
    decide = policies.normalize(policy)

    @functools.wraps(f)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if is_tracing():
            return _traced(f, decide, args, kwargs)
        return _eager(f, decide, args, kwargs)

    wrapped.__functrans_remat__ = decide  # type: ignore[attr-defined]
    return wrapped


class RematModule(torch.nn.Module):
    """``remat(module)``: the module's forward, rematerialized; parameters stay the module's."""

    def __init__(self, module: torch.nn.Module, *, policy: Any = None) -> None:
        super().__init__()
        self.module = module
        self._call = remat(lambda *a, **k: self.module(*a, **k), policy=policy)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)
