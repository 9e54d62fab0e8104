"""``remat(f, policy)``: selective activation checkpointing in eager PyTorch and in traces.

- Traced (inside ``trace``/``joint``/``grad``/``vjp``): ``f`` runs inline and every ATen op it
  records is tagged with the policy's decision (``node.meta["functrans.remat"]``); partition
  strategies honor the tags. Inner ``remat`` regions keep their own tags.
- Eager (ordinary autograd): ``f`` runs under torch's non-reentrant checkpoint (saved-tensor
  hooks at the autograd layer: RNG state restored, recomputation stopped early once everything
  backward needs is produced) with our dispatch modes at the op layer: forward keeps only the
  outputs the policy saves, keyed by (op, call index); recomputation serves them back. The
  same policy object decides in both modes.
"""

from __future__ import annotations

import functools
import operator
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from . import policies
from ._module_view import ModuleView
from ._pytree import NAMESPACE
from ._tags import REMAT, Policy
from ._trace import is_tracing

__all__ = ["RematModule", "remat"]


class _Cache:
    """Outputs the policy saved during forward, keyed by (op, call index)."""

    def __init__(self) -> None:
        self.store: dict[tuple[Any, int], Any] = {}


class _Record(TorchDispatchMode):  # type: ignore[no-untyped-call,misc]
    """Forward: run every op, ask the policy, keep the outputs it saves."""

    def __init__(self, decide: Callable[..., Policy], cache: _Cache) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.decide, self.cache = decide, cache
        self.calls: dict[Any, int] = defaultdict(int)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        key = (func, self.calls[func])
        self.calls[func] += 1
        if self.decide(func, *args, **kwargs) in _SAVES:
            self.cache.store[key] = tree_map(_detach, out)
        return out


class _Replay(TorchDispatchMode):  # type: ignore[no-untyped-call,misc]
    """Recompute: serve saved outputs, run the rest. Entries are kept (not popped), so a
    second backward with ``retain_graph=True`` recomputes correctly."""

    def __init__(self, cache: _Cache) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.cache = cache
        self.calls: dict[Any, int] = defaultdict(int)

    def __enter__(self) -> _Replay:
        self.calls.clear()  # every recomputation replays the region from its first op
        return super().__enter__()  # type: ignore[no-untyped-call,no-any-return]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        key = (func, self.calls[func])
        self.calls[func] += 1
        if key in self.cache.store:
            return self.cache.store[key]
        return func(*args, **(kwargs or {}))


_SAVES = (Policy.MUST_SAVE, Policy.PREFER_SAVE)
_SAVE_NOTHING = policies.normalize(policies.nothing_saveable)


def _detach(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


def _eager(f: Callable[..., Any], decide: Callable[..., Policy], args: Any, kwargs: Any) -> Any:
    """torch's non-reentrant checkpoint (saved-tensor hooks, RNG replay, early stop) with our
    caching modes at the op layer."""
    if not torch.is_grad_enabled():
        return f(*args, **kwargs)
    from torch.utils.checkpoint import checkpoint

    if decide is _SAVE_NOTHING:  # no op-layer modes needed: plain checkpointing
        return checkpoint(f, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    def contexts() -> tuple[_Record, _Replay]:
        cache = _Cache()
        return _Record(decide, cache), _Replay(cache)

    return checkpoint(
        f, *args, use_reentrant=False, context_fn=contexts, preserve_rng_state=True, **kwargs
    )


def _traced(f: Callable[..., Any], decide: Callable[..., Policy], args: Any, kwargs: Any) -> Any:
    mode = get_proxy_mode()
    if mode is None:  # evaluating shapes only: nothing to tag
        return f(*args, **kwargs)
    graph: fx.Graph = mode.tracer.graph
    last = graph._root.prev  # the node before the region (the root sentinel if none)
    out = f(*args, **kwargs)
    # the region's outputs belong to the code around it (as in JAX and torch's checkpoint):
    # whether they are saved is decided outside, so they stay untagged
    outputs = {_node_of(t, mode) for t in optree.tree_leaves(out, namespace=NAMESPACE)}
    node = last.next
    while node is not graph._root:
        if REMAT not in node.meta and node not in outputs:
            tag = _decision(node, decide)
            if tag is not None:
                node.meta[REMAT] = tag
        node = node.next
    return out


def _node_of(t: Any, mode: Any) -> fx.Node | None:
    if not isinstance(t, torch.Tensor):
        return None
    slot = get_proxy_slot(t, mode.tracer, None)
    proxy = getattr(slot, "proxy", None)
    return proxy.node if proxy is not None else None


def _decision(node: fx.Node, decide: Callable[..., Policy]) -> Policy | None:
    """The policy's answer for an op node; a getitem takes its multi-output op's answer."""
    target = node.target
    if node.op != "call_function":
        return None
    if target is operator.getitem and isinstance(node.args[0], fx.Node):
        return node.args[0].meta.get(REMAT)  # type: ignore[no-any-return]
    if not isinstance(target, torch._ops.OpOverload):
        return None
    a, k = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    return decide(target, *a, **k)


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
    decide = (
        _SAVE_NOTHING if policy in (None, policies.nothing_saveable) else policies.normalize(policy)
    )

    @functools.wraps(f)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if is_tracing():
            return _traced(f, decide, args, kwargs)
        return _eager(f, decide, args, kwargs)

    wrapped.__functrans_remat__ = decide  # type: ignore[attr-defined]
    return wrapped


class RematModule(ModuleView):
    """``remat(module)``: the module's forward, rematerialized. Otherwise it is the module (a
    :class:`~functrans._module_view.ModuleView`): same ``state_dict`` keys, parameter names and
    attributes, so checkpoints load between remat'd and plain models."""

    _derived = ("_call",)

    def __init__(self, module: torch.nn.Module, *, policy: Any = None) -> None:
        super().__init__(module)
        self.__dict__["_policy"] = policy
        self._derive()

    def _derive(self) -> None:
        module = self._wrapped
        call = remat(lambda *a, **k: module(*a, **k), policy=self.__dict__["_policy"])
        self.__dict__["_call"] = call

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__["_call"](*args, **kwargs)
