"""``"aten"``: run the FX graph of ATen ops as it is. The oracle for every other backend."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from functrans.extend import Graph

from . import register_backend

__all__ = ["AtenBackend"]


@dataclass(frozen=True)
class AtenBackend:
    """Runs ``graph.graph_module`` on flat tensors.

    >>> import torch, functrans as ft
    >>> g = ft.trace(lambda x: x * 2)(torch.ones(2))
    >>> AtenBackend().compile(g, [torch.ones(2)])(torch.ones(2))
    [tensor([2., 2.])]
    """

    def compile(self, graph: Graph, example_inputs: Sequence[torch.Tensor]) -> Callable[..., Any]:
        module = graph.graph_module

        def run(*tensors: torch.Tensor) -> list[Any]:
            return list(module(*tensors))

        return run


register_backend("aten", AtenBackend())
