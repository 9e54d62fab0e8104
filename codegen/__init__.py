"""Code generation backends: turn a functrans :class:`~functrans.Graph` into a callable.

A backend has ``compile(graph, example_inputs) -> callable`` taking and returning flat tensors.
``"aten"`` runs the FX graph as it is (the reference every other backend is checked against);
``"inductor"`` compiles it with TorchInductor (the performance reference).
Register your own with :func:`register_backend`:

>>> from functrans import codegen
>>> {'aten', 'inductor', 'triton'} <= set(codegen.names())
True

The registry fills itself on first use (importing this package loads no backend): every public
module of this package (each registers its backend), then the installed plugins, the entry points
of group ``functrans.backends``. An entry point names a backend object (anything with
``compile``), registered under the entry point's name, or a module that registers its own::

    [project.entry-points."functrans.backends"]
    my_backend = "my_package.backend:BACKEND"
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import torch

from functrans.extend import Graph, InvalidArgumentError, PluginRegistry

__all__ = ["GROUP", "Backend", "get_backend", "names", "register_backend"]

#: The entry point group installed backends are discovered in.
GROUP = "functrans.backends"


class Backend(Protocol):
    """Compiles a graph for the given example inputs into a flat-tensor callable."""

    def compile(
        self, graph: Graph, example_inputs: Sequence[torch.Tensor]
    ) -> Callable[..., Any]: ...


def _adopt(name: str, obj: object) -> object:
    """Register what an entry point names: a backend object."""
    if isinstance(obj, type) or not callable(getattr(obj, "compile", None)):
        raise InvalidArgumentError(
            f"a {GROUP} entry point must name a backend object (with compile(graph, "
            f"example_inputs) -> callable; an instance, not a class) or a module that calls "
            f"functrans.codegen.register_backend; got {obj!r}"
        )
    return register_backend(name, cast(Backend, obj))  # checked above: it has compile


_BACKENDS: PluginRegistry[Backend] = PluginRegistry(
    "codegen backend", package=__name__, group=GROUP, adopt=_adopt
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


def names() -> list[str]:
    """Names of the registered backends.

    >>> from functrans import codegen
    >>> "aten" in codegen.names()
    True
    """
    return _BACKENDS.names()
