"""``"aten"``: run the FX graph of ATen ops as it is. The oracle for every other backend."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from functrans.extend import Graph

from . import register_backend
from ._fastcall import use_fast_calls

__all__ = ["AtenBackend"]


@dataclass(frozen=True)
class AtenBackend:
    """Runs ``graph.graph_module`` on flat tensors, calling common ops through torch's fast
    Python bindings (``fast_calls``; see :mod:`functrans.codegen._fastcall`).

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
        module = use_fast_calls(graph.graph_module) if self.fast_calls else graph.graph_module

        def run(*tensors: torch.Tensor) -> list[Any]:
            return list(module(*tensors))

        return run


register_backend("aten", AtenBackend())
