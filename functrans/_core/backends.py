"""The registry of codegen backends, owned by the core: ``functrans.codegen`` fills it.

The core looks backends up here by name and never imports the plugin package: the registry names
the package as data and imports its public modules on first use (:mod:`functrans._core.plugins`).
The plugin package re-exports these under its own names (``register_backend``, ``get_backend``,
``names``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import torch

from .errors import InvalidArgumentError
from .graph import Graph
from .plugins import PluginRegistry

__all__ = ["BACKEND_GROUP", "Backend", "backend_names", "get_backend", "register_backend"]

#: The entry point group installed backends are discovered in.
BACKEND_GROUP = "functrans.backends"


class Backend(Protocol):
    """Compiles a graph for the given example inputs into a flat-tensor callable.

    >>> import torch, functrans as ft
    >>> from functrans.extend import Backend, get_backend
    >>> aten: Backend = get_backend("aten")
    >>> g = ft.trace(lambda x: x.sin())(torch.zeros(2))
    >>> aten.compile(g, [torch.zeros(2)])(torch.zeros(2))
    [tensor([0., 0.])]
    """

    def compile(
        self, graph: Graph, example_inputs: Sequence[torch.Tensor]
    ) -> Callable[..., Any]: ...


def _adopt(name: str, obj: object) -> object:
    """Register what an entry point names: a backend object."""
    if isinstance(obj, type) or not callable(getattr(obj, "compile", None)):
        raise InvalidArgumentError(
            f"a {BACKEND_GROUP} entry point must name a backend object (with compile(graph, "
            f"example_inputs) -> callable; an instance, not a class) or a module that calls "
            f"functrans.codegen.register_backend; got {obj!r}"
        )
    return register_backend(name, cast(Backend, obj))  # checked above: it has compile


_BACKENDS: PluginRegistry[Backend] = PluginRegistry(
    "codegen backend", package="functrans.codegen", group=BACKEND_GROUP, adopt=_adopt
)


def register_backend(name: str, backend: Backend, *, replace: bool = False) -> Backend:
    """Register ``backend`` under ``name``; returns it.

    >>> from functrans import codegen
    >>> class Eager:
    ...     def compile(self, graph, example_inputs):
    ...         return graph.graph_module
    >>> _ = codegen.register_backend("eager_fx", Eager(), replace=True)
    >>> "eager_fx" in codegen.names()
    True
    """
    return _BACKENDS.register(name, backend, replace=replace)


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``; unknown names list the registered ones.

    >>> from functrans import codegen
    >>> type(codegen.get_backend("aten")).__name__
    'AtenBackend'
    """
    return _BACKENDS.get(name)


def backend_names() -> list[str]:
    """Names of the registered backends.

    >>> from functrans import codegen
    >>> "aten" in codegen.names()
    True
    """
    return _BACKENDS.names()
