"""The registry of codegen backends, owned by the core: ``functrans.codegen`` fills it.

The core looks backends up here by name and never imports the plugin package: the registry names
the package as data and imports its public modules on first use (:mod:`functrans._core.plugins`).
The plugin package re-exports these under its own names (``register_backend``, ``get_backend``,
``names``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch

from .errors import InvalidArgumentError
from .graph import Graph
from .plugins import PluginRegistry

__all__ = [
    "BACKEND_GROUP",
    "Backend",
    "Capabilities",
    "backend_capabilities",
    "backend_names",
    "capabilities",
    "get_backend",
    "register_backend",
]

#: The entry point group installed backends are discovered in.
BACKEND_GROUP = "functrans.backends"


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do besides ``compile``, declared as its ``capabilities`` attribute
    (a class attribute, or a property where it depends on the backend's options); a backend
    that declares none gets these defaults.

    - ``decompositions``: the table ``jit(decompositions="auto")`` traces with (``"core"``:
      small ops; ``"minimal"`` keeps ATen's fused composite kernels);
    - ``dynamic``: it compiles graphs with symbolic sizes (``jit(dynamic=...)``);
    - ``hands_over``: its programs run the ops of :data:`functrans.extend.HANDOVER_OPS` by
      calling their function with the only references to the inputs
      (:func:`functrans.extend.handover_call`), so an input whose last use a compiled region
      is dies inside it.

    >>> from functrans.extend import Capabilities, backend_capabilities, get_backend
    >>> backend_capabilities(get_backend("aten"))
    Capabilities(decompositions='minimal', dynamic=True, hands_over=True)
    >>> class Plain:
    ...     def compile(self, graph, example_inputs):
    ...         return graph.graph_module
    >>> backend_capabilities(Plain())  # nothing declared: the defaults
    Capabilities(decompositions='core', dynamic=False, hands_over=False)
    """

    decompositions: str = "core"
    dynamic: bool = False
    hands_over: bool = False


def capabilities(backend: object) -> Capabilities:
    """What ``backend`` declares in its ``capabilities`` attribute (the defaults where it
    declares none); a declaration of another type is an error naming the backend.

    >>> from functrans.extend import backend_capabilities, get_backend
    >>> backend_capabilities(get_backend("triton")).dynamic  # static shapes only
    False
    """
    declared = getattr(type(backend), "capabilities", None)
    if declared is None:
        return Capabilities()
    found = backend.capabilities  # type: ignore[attr-defined]  # declared: checked above
    if not isinstance(found, Capabilities):
        raise InvalidArgumentError(
            f"backend {backend!r}: its capabilities attribute is {found!r}; declare a "
            "functrans.extend.Capabilities (or none, for the defaults)"
        )
    return found


#: the name :mod:`functrans.extend` gives it
backend_capabilities = capabilities


class Backend(Protocol):
    """Compiles a graph for the given example inputs into a flat-tensor callable (and may
    declare what else it can do, a :class:`Capabilities` as its ``capabilities`` attribute).

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
