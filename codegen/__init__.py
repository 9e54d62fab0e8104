"""Code generation backends: turn a functrans :class:`~functrans.Graph` into a callable.

A backend has ``compile(graph, example_inputs) -> callable`` taking and returning flat tensors.
``"aten"`` runs the FX graph as it is (the reference every other backend is checked against);
``"inductor"`` compiles it with TorchInductor (the performance reference).
Register your own with :func:`register_backend`:

>>> from functrans import codegen
>>> {'aten', 'inductor', 'triton'} <= set(codegen.names())
True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from functrans.extend import Graph, Registry

__all__ = ["Backend", "get_backend", "names", "register_backend"]


class Backend(Protocol):
    """Compiles a graph for the given example inputs into a flat-tensor callable."""

    def compile(
        self, graph: Graph, example_inputs: Sequence[torch.Tensor]
    ) -> Callable[..., Any]: ...


_BACKENDS: Registry[Backend] = Registry("codegen backend")


def register_backend(name: str, backend: Backend, *, replace: bool = False) -> Backend:
    """Register ``backend`` under ``name``; returns it."""
    return _BACKENDS.register(name, backend, replace=replace)


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``; unknown names list the registered ones."""
    return _BACKENDS.get(name)


def names() -> list[str]:
    """Names of the registered backends."""
    return _BACKENDS.names()


from . import aten as aten  # noqa: E402  (registers itself)
from . import inductor as inductor  # noqa: E402  (registers itself)
from . import triton as triton  # noqa: E402  (registers itself)
