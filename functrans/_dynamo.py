"""``dynamo_backend``: use functrans' partitioners and codegen under ``torch.compile``.

Dynamo captures each graph (code with graph breaks gets several) and hands it to the backend;
every captured graph then goes through ``jit``: trace to core ATen, joint, partition, compile.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._jit_api import jit
from ._partition import Strategy

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
        if not all(isinstance(a, torch.Tensor) for a in example_inputs):
            warnings.warn(
                "functrans.dynamo_backend: this graph has symbolic (dynamic) sizes, which "
                "functrans graphs do not support yet; running it as captured. Pass "
                "dynamic=False to torch.compile to specialize shapes.",
                stacklevel=2,
            )
            return gm.forward
        compiled: Callable[..., Any] = jit(
            lambda *args: gm(*args), partition=partition, backend=backend, **partition_options
        )
        return compiled

    return compile_graph
