"""What a remat region saves and recomputes, measured the same way in eager and traced mode.

Eager (``ft.remat`` under ordinary autograd):

- **saved**: the storages the forward created (by any op, inputs excluded) that backward
  *reads*: an argument of a derivative formula's op or of a live recomputed op (below). Values
  eager selective checkpointing caches but backward never reads (a MUST_SAVE output that only
  feeds values served from the cache too) are not counted: a traced graph does not save those
  either (MUST_SAVE binds recomputation only).
- **recomputed**: ops dispatched during backward while checkpoint re-runs the region (under its
  saved-tensor hooks) whose results something that matters reads (``dead``: the others; eager
  replays the region in program order). Values served from the selective-checkpoint cache are
  not dispatched, so they are not counted; nor are views (free; a traced graph saves a view of
  an input where eager re-creates it).

Traced: ``ft.partition(ft.joint(f)(*args), strategy)``: ``saved`` (non-input storages, each
once) and ``recomputed``.

Both sides describe a saved storage by the op that allocated it and its bytes.
"""

from __future__ import annotations

import collections
import dataclasses
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import functrans as ft
from functrans._core.tags import REMAT_OP
from functrans._cut.cost import storage_of

# ops that move no data and allocate nothing new: checkpoint's own bookkeeping dispatches them
_BOOKKEEPING = frozenset({"aten.detach", "aten.alias", "aten.lift_fresh", "aten._to_copy"})


# pure renames between what eager dispatches and what a traced graph records (same values)
_RENAMED = {"aten.transpose": "aten.permute", "aten.t": "aten.permute"}


def op_key(op: Any) -> str:
    """``aten.mm`` for ``aten.mm.default`` (overloads differ between eager and core ATen);
    transposes as ``aten.permute``, which traced graphs record for them."""
    packet = getattr(op, "overloadpacket", None)
    if packet is None:
        return str(op)
    name = str(packet._qualified_op_name).replace("::", ".")
    return _RENAMED.get(name, name)


def _ptr(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


class _Producers(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch: untyped
    """Forward: the op that first returned each storage (kept alive: no address reuse)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch: untyped
        self.producer: dict[int, tuple[str, int]] = {}
        self.keep: list[torch.Tensor] = []
        self.ran: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if _counted(func):
            self.ran[op_key(func)] += 1
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0:
                self.producer.setdefault(_ptr(t), (op_key(func), t.untyped_storage().nbytes()))
                self.keep.append(t)
        return out


def _recomputing() -> bool:
    """Whether checkpoint is re-running the region: it does so under its own saved-tensor hooks,
    which derivative formulas never run under (grad mode would not do: custom ops such as
    ``checkpoint_name`` run their forward with grad mode off)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def _counted(op: Any) -> bool:
    """Recomputations that cost work: not views (a traced graph saves a view of an input for
    free where eager re-creates it) and not checkpoint's bookkeeping."""
    return not getattr(op, "is_view", False) and op_key(op) not in _BOOKKEEPING


def _sig(t: torch.Tensor) -> tuple[Any, ...]:
    return (_ptr(t), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


class _Backward(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch: untyped
    """Backward: every op with the tensors it reads and returns, and whether checkpoint was
    re-running the region (see :meth:`live`)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch: untyped
        # (op, recomputing, read signatures, result signatures)
        self.runs: list[tuple[Any, bool, list[tuple[Any, ...]], list[tuple[Any, ...]]]] = []
        self.keep: list[torch.Tensor] = []  # results stay alive: no address reuse

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        reads = [_sig(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        out = func(*args, **kwargs)
        results = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.keep += results
        self.runs.append((func, _recomputing(), reads, [_sig(t) for t in results]))
        return out

    def live(self) -> tuple[set[int], collections.Counter[str], collections.Counter[str]]:
        """Storages read by work that matters, and the recomputed ops, live and dead.

        Derivative formulas matter; a recomputed op matters if something that matters reads
        its result (a recomputed op whose result only feeds values the cache serves, or other
        dead work, is dead: eager replays the region in program order up to the last value
        backward needs)."""
        needed: set[tuple[Any, ...]] = set()
        live: collections.Counter[str] = collections.Counter()
        dead: collections.Counter[str] = collections.Counter()
        for func, recomputing, reads, results in reversed(self.runs):
            if recomputing and not any(r in needed for r in results):
                if _counted(func):
                    dead[op_key(func)] += 1
                continue
            if recomputing and _counted(func):
                live[op_key(func)] += 1
            needed.update(reads)
        return {sig[0] for sig in needed}, live, dead


@dataclass(frozen=True)
class Measured:
    """Saved storages as ``(allocating op, bytes)`` (sorted) and recomputed ops (counts)."""

    saved: tuple[tuple[str, int], ...]
    recomputed: collections.Counter[str]  # eager: the live ones (see _Backward)
    grads: tuple[torch.Tensor | None, ...]
    dead: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    forward: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)

    @property
    def saved_bytes(self) -> int:
        return sum(b for _, b in self.saved)

    @property
    def saved_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(b for _, b in self.saved))


def tangents_for(jg: ft.JointGraph, seed: int = 1) -> tuple[torch.Tensor, ...]:
    """Deterministic cotangents, one per tangent input of ``jg``."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in jg.tangents():
        val = t.meta["val"]
        out.append(torch.randn(tuple(val.shape), generator=gen, dtype=val.dtype))
    return tuple(out)


def eager(
    f: Callable[..., Any], args: Sequence[torch.Tensor], tangents: Sequence[torch.Tensor]
) -> Measured:
    """Run ``f`` forward and backward under ordinary autograd, measuring (see module doc)."""
    leaves = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
    inputs = {_ptr(a) for a in leaves}
    producers = _Producers()
    with producers:
        outs = f(*leaves)
    outs_list = [o for o in tree_leaves(outs) if isinstance(o, torch.Tensor)]
    pairs = [
        (o, t)
        for o, t in zip([o for o in outs_list if o.is_floating_point()], tangents, strict=True)
        if o.requires_grad
    ]
    backward = _Backward()
    with backward:
        grads = (
            torch.autograd.grad(
                [o for o, _ in pairs], leaves, [t for _, t in pairs], allow_unused=True
            )
            if pairs
            else (None,) * len(leaves)
        )
    read, live, dead = backward.live()
    saved = sorted(
        producers.producer[p] for p in read if p in producers.producer and p not in inputs
    )
    grads = tuple(
        torch.zeros_like(a) if g is None else g for g, a in zip(grads, leaves, strict=True)
    )
    return Measured(tuple(saved), live, tuple(grads), dead, producers.ran)


def _root_key(node: fx.Node) -> str:
    """The op that made the storage ``node`` lives in, as the user called it (a value a
    decomposition produced names the op the user wrote: silu, not its mul)."""
    root, _ = storage_of(node)
    made = root.meta.get(REMAT_OP)
    return op_key(made.op if made is not None else root.target)


def _recompute_key(node: fx.Node) -> str | None:
    """The user-level op a recomputed node counts as (None: a value inside a decomposition,
    counted with the op's output)."""
    made = node.meta.get(REMAT_OP)
    if made is None:
        return op_key(node.target)
    return op_key(made.op) if made.holds_output else None


def forward_ops(jg: ft.JointGraph) -> collections.Counter[str]:
    """The ops the forward pass of ``jg`` runs (as :attr:`Measured.forward` counts eager's)."""
    todo = [n for n in jg.forward_outputs() if isinstance(n, fx.Node)]
    seen: set[fx.Node] = set()
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return collections.Counter(
        op_key(n.target)
        for n in seen
        if n.op == "call_function" and n.target is not operator.getitem and _counted(n.target)
    )


def traced(
    p: ft.Partition, args: Sequence[torch.Tensor], tangents: Sequence[torch.Tensor]
) -> Measured:
    """The same description of a partition; gradients from running its two graphs."""
    seen: dict[str, tuple[str, int]] = {}
    for s in p.saved:
        if not s.is_input and s.storage_bytes > 0:
            seen.setdefault(s.storage, (_root_key(s.node), s.storage_bytes))
    keys = (
        _recompute_key(n)
        for n in p.recomputed
        if n.target is not operator.getitem and _counted(n.target)
    )
    recomputed = collections.Counter(k for k in keys if k is not None)
    _, saved = p.forward(*args)
    grads = p.backward(saved, tangents)
    return Measured(tuple(sorted(seen.values())), recomputed, tuple(tree_leaves(grads)))
