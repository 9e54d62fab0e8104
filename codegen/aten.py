"""``"aten"``: run the FX graph of ATen ops as it is. The oracle for every other backend."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from functrans.extend import Graph

from . import register_backend
from ._fastcall import copy_module, use_fast_calls
from ._peephole import cancel_transposes
from ._pycode import flat_function

__all__ = ["AtenBackend"]


@dataclass(frozen=True)
class AtenBackend:
    """Runs the graph's ATen ops as they are, one after the other.

    ``fast_calls``: common ops go through torch's fast Python bindings
    (:mod:`functrans.codegen._fastcall`) and the graph runs as one flat function
    (:mod:`functrans.codegen._pycode`); False runs ``graph.graph_module`` itself. The results
    are the same bit for bit; only the per-op overhead differs.

    >>> import torch, functrans as ft
    >>> g = ft.trace(lambda x: x * 2)(torch.ones(2))
    >>> AtenBackend().compile(g, [torch.ones(2)])(torch.ones(2))
    [tensor([2., 2.])]
    """

    fast_calls: bool = True
    #: ``jit(decompositions="auto")`` traces with this table: ATen's fused composite kernels
    #: (``gelu_backward``, ``native_layer_norm_backward``) beat their decompositions run op by op
    decompositions: str = "minimal"

    def compile(self, graph: Graph, example_inputs: Sequence[torch.Tensor]) -> Callable[..., Any]:
        if self.fast_calls:
            return flat_function(use_fast_calls(cancel_transposes(copy_module(graph.graph_module))))
        module = graph.graph_module

        def run(*tensors: torch.Tensor) -> list[Any]:
            return list(module(*tensors))

        return run


register_backend("aten", AtenBackend())
