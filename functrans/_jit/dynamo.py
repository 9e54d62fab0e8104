"""``dynamo_backend``: use functrans' partitioners and codegen under ``torch.compile``.

Dynamo captures each graph (code with graph breaks gets several) and hands it to the backend;
every captured graph then goes through ``jit``: trace to core ATen, joint, partition, compile.
A graph dynamo captured with symbolic sizes (``torch.compile(dynamic=True)``, or after its
automatic dynamic kicks in) is compiled once by ``jit`` with the same dimensions symbolic.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from functrans._cut.partition import Strategy

from .api import jit
from .cache import CacheInfo
from .jitted import Jitted

__all__ = ["dynamo_backend"]


def dynamo_backend(
    *, partition: str | Strategy = "min_cut", backend: str = "aten", **partition_options: Any
) -> Callable[[torch.fx.GraphModule, Sequence[Any]], Callable[..., Any]]:
    """A ``torch.compile`` backend: ``torch.compile(model, backend=ft.dynamo_backend())``.

    >>> import torch, functrans as ft
    >>> f = torch.compile(lambda x: x.sin() * 2, backend=ft.dynamo_backend(), dynamic=False)
    >>> f(torch.zeros(2))
    tensor([0., 0.])
    """

    def compile_graph(
        gm: torch.fx.GraphModule, example_inputs: Sequence[Any]
    ) -> Callable[..., Any]:
        if all(isinstance(a, torch.Tensor) for a in example_inputs):
            compiled: Callable[..., Any] = jit(
                lambda *args: gm(*args), partition=partition, backend=backend, **partition_options
            )
            return compiled
        sizes = _size_sources(gm, example_inputs)
        if sizes is None:
            warnings.warn(
                "functrans.dynamo_backend: this graph takes inputs that are neither tensors "
                "nor sizes of its tensor inputs; running it as captured. Pass dynamic=False "
                "to torch.compile to specialize them.",
                stacklevel=2,
            )
            return gm.forward
        return _dynamic_graph(gm, example_inputs, sizes, partition, backend, partition_options)

    return compile_graph


def _size_sources(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any]
) -> dict[int, tuple[int, int]] | None:
    """For a graph dynamo captured with symbolic sizes: each SymInt input -> (the index of a
    tensor input, its dimension) of that size; None where some input is neither."""
    vals = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    found: dict[int, tuple[int, int]] = {}
    for i, a in enumerate(example_inputs):
        if isinstance(a, torch.Tensor):
            continue
        if not isinstance(a, torch.SymInt):
            return None
        expr = a.node.expr
        where = [
            (j, d)
            for j, v in enumerate(vals)
            if isinstance(v, torch.Tensor)
            for d, size in enumerate(v.shape)
            if isinstance(size, torch.SymInt) and size.node.expr == expr
        ]
        if not where:
            return None
        found[i] = where[0]
    return found


def _dynamic_graph(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    sizes: dict[int, tuple[int, int]],
    partition: str | Strategy,
    backend: str,
    options: dict[str, Any],
) -> Callable[..., Any]:
    """A graph with symbolic sizes, compiled by ``jit(dynamic=...)``: its size inputs are read
    from its tensor inputs inside the traced function (so they are symbols of the trace, not
    static values), and the tensor dimensions dynamo left symbolic are symbolic in ours.
    Python floats dynamo turned into 0-d tensors only to read back (``eps.item()``: a
    LayerNorm's eps, a dropout's p) are passed as numbers: static values of our trace."""
    vals = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    gm, numbers = _numbers_as_values(gm)
    given = [i for i, a in enumerate(example_inputs) if i not in sizes]  # what jit is passed
    at = {j: k for k, j in enumerate(given)}
    dims: dict[str, tuple[int, ...]] = {}
    for k, j in enumerate(given):
        symbolic = tuple(
            d for d, s in enumerate(getattr(vals[j], "shape", ())) if isinstance(s, torch.SymInt)
        )
        if symbolic and j not in numbers:
            dims[f"values[{k}]"] = symbolic

    def graph(*values: Any) -> Any:
        args: list[Any] = [None] * len(example_inputs)
        for j, k in at.items():
            args[j] = values[k]
        for i, (j, d) in sizes.items():
            args[i] = values[at[j]].shape[d]
        return gm(*args)

    compiled = jit(graph, partition=partition, backend=backend, dynamic=dims, **options)

    return _DynamoEntry(compiled, tuple(given), frozenset(numbers))


def _numbers_as_values(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, set[int]]:
    """``gm`` taking Python numbers for its 0-d tensor inputs that it only reads with
    ``.item()``, and their input positions."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    numbers = {
        i
        for i, n in enumerate(placeholders)
        if isinstance(v := n.meta.get("example_value"), torch.Tensor)
        and v.dim() == 0
        and n.users
        and all(u.op == "call_method" and u.target == "item" for u in n.users)
    }
    if not numbers:
        return gm, numbers
    graph = copy.deepcopy(gm.graph)
    for i, n in enumerate(n for n in graph.nodes if n.op == "placeholder"):
        if i in numbers:
            for item in list(n.users):
                item.replace_all_uses_with(n)
                graph.erase_node(item)
    return torch.fx.GraphModule(gm, graph), numbers


@dataclass(frozen=True)
class _DynamoEntry:
    """What the backend hands Dynamo for a graph: the jitted graph called with Dynamo's
    arguments (those it reads, Python numbers for the 0-d tensors it only reads with
    ``.item()``); :meth:`cache_info` is the jitted graph's."""

    compiled: Jitted[..., Any]
    given: tuple[int, ...]
    numbers: frozenset[int]

    def __call__(self, *args: Any) -> Any:
        return self.compiled(
            *[args[j].item() if j in self.numbers else args[j] for j in self.given]
        )

    def cache_info(self) -> CacheInfo:
        """The jitted graph's cache figures."""
        return self.compiled.cache_info()
