"""``partition(joint, strategy, **options)``: choose a saved set with a strategy, then split.

Strategies live in the registry of :mod:`functrans.partitioners` (looked up by name at call
time, so the core never imports them) or are passed directly as callables
``(JointGraph, **options) -> saved nodes``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ._cost import flops, is_input_alias, nbytes
from ._format import format_value_type, op_name
from ._graph import SOURCE, Graph, JointGraph
from ._logs import log
from ._memory import MemoryProfile, simulate
from ._passes import no_gc
from ._split import split

__all__ = ["Partition", "SavedValue", "Strategy", "format_bytes", "get_strategy", "partition"]

#: A partition strategy: ``(joint, **options) -> the forward nodes (or names) to save``.
Strategy = Callable[..., Iterable[str | fx.Node]]


@dataclass(frozen=True)
class SavedValue:
    """One value the forward pass hands to the backward pass."""

    name: str
    op: str  # producing op, or "input" for a primal
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    nbytes: int
    is_input: bool  # a primal input or a view of one: costs no activation memory
    source: str | None  # the user's source line, where known

    @property
    def activation_bytes(self) -> int:
        return 0 if self.is_input else self.nbytes

    @classmethod
    def of(cls, node: fx.Node) -> SavedValue:
        val = node.meta.get("val")
        tensor = val if isinstance(val, torch.Tensor) else None
        return cls(
            name=node.name,
            op="input" if node.op == "placeholder" else op_name(node.target),
            shape=tuple(int(s) for s in tensor.shape) if tensor is not None else (),
            dtype=tensor.dtype if tensor is not None else None,
            nbytes=nbytes(val),
            is_input=is_input_alias(node),
            source=node.meta.get(SOURCE),
        )


@dataclass(frozen=True, eq=False)
class Partition:
    """A joint graph cut into ``forward`` and ``backward`` graphs.

    ``outs, saved = p.forward(*args)`` runs the forward pass; ``grads = p.backward(saved,
    tangents)`` the backward pass. ``saved`` describes what crosses the cut, ``recomputed`` names
    the forward ops backward runs again.
    """

    joint: JointGraph
    strategy: str
    forward: Graph
    backward: Graph
    saved: tuple[SavedValue, ...]
    recomputed: tuple[str, ...]
    recompute_flops: int

    @property
    def activation_bytes(self) -> int:
        """Saved bytes that are not primal inputs or views of them."""
        return sum(s.activation_bytes for s in self.saved)

    @property
    def memory(self) -> MemoryProfile:
        """Liveness simulation of forward then backward (see :mod:`functrans._memory`)."""
        return simulate(self.forward.fx_graph, self.backward.fx_graph)

    @property
    def peak_bytes(self) -> int:
        """Peak live bytes over forward then backward, inputs included."""
        return self.memory.peak_bytes

    @property
    def saved_bytes(self) -> int:
        """All saved bytes, inputs included."""
        return sum(s.nbytes for s in self.saved)

    def report(self) -> str:
        """A table of the saved values with totals, and the recomputed ops."""
        head = ("saved", "op", "shape", "dtype", "bytes", "input", "source")
        rows = [
            (
                s.name,
                s.op,
                format_value_type(torch.empty(s.shape, dtype=s.dtype, device="meta"))
                if s.dtype is not None
                else "-",
                str(s.dtype).replace("torch.", ""),
                str(s.nbytes),
                "yes" if s.is_input else "no",
                _short_source(s.source),
            )
            for s in self.saved
        ]
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        lines = [
            f"partition {self.strategy!r}: {len(self.saved)} saved values, "
            f"{format_bytes(self.activation_bytes)} of activations, "
            f"{len(self.recomputed)} ops recomputed ({self.recompute_flops} FLOPs)"
        ]
        for r in [head, *rows]:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
        lines.append(f"  activation bytes: {self.activation_bytes}")
        lines.append(f"  peak bytes (forward then backward): {self.peak_bytes}")
        lines.append(f"  recomputed in backward: {', '.join(self.recomputed) or '-'}")
        return "\n".join(line.rstrip() for line in lines)

    def __str__(self) -> str:
        return self.report()


def _short_source(src: str | None) -> str:
    if not src:
        return ""
    path, _, rest = src.partition(":")
    return path.rsplit("/", 1)[-1] + ":" + rest


def format_bytes(n: int) -> str:
    """``16384`` -> ``'16.0 KiB'``.

    >>> format_bytes(16384), format_bytes(12)
    ('16.0 KiB', '12 B')
    """
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def get_strategy(strategy: str | Strategy) -> tuple[str, Strategy]:
    """Resolve a strategy name (via the registry) or accept a callable as is."""
    if isinstance(strategy, str):
        registry = importlib.import_module("functrans.partitioners")
        found: Strategy = registry.get(strategy)
        return strategy, found
    if callable(strategy):
        return getattr(strategy, "__name__", type(strategy).__name__), strategy
    raise TypeError(f"strategy must be a registered name or a callable, got {strategy!r}")


def partition(joint: JointGraph, strategy: str | Strategy = "default", **options: Any) -> Partition:
    """Cut ``joint`` into forward and backward graphs with ``strategy``.

    >>> import torch, functrans as ft
    >>> jg = ft.joint(lambda x, w: torch.tanh(x @ w).sum())(torch.ones(4, 4), torch.ones(4, 4))
    >>> p = ft.partition(jg, "full_remat")
    >>> [s.name for s in p.saved], p.activation_bytes, p.recomputed
    (['primals_1', 'primals_2'], 0, ('mm', 'tanh'))
    """
    name, fn = get_strategy(strategy)
    with no_gc():
        chosen = fn(joint, **options)
        s = split(joint, chosen)
    p = Partition(
        joint=joint,
        strategy=name,
        forward=s.forward,
        backward=s.backward,
        saved=tuple(SavedValue.of(n) for n in s.saved),
        recomputed=tuple(n.name for n in s.recomputed),
        recompute_flops=sum(flops(n) for n in s.recomputed),
    )
    log(
        "partition",
        f"{name}: forward, backward, saved values",
        lambda: f"{p.forward}\n{p.backward}\n{p.report()}",
    )
    return p
