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

from functrans.extend import BACKEND_GROUP as GROUP
from functrans.extend import Backend as Backend
from functrans.extend import backend_names as names
from functrans.extend import get_backend as get_backend
from functrans.extend import register_backend as register_backend

__all__ = ["GROUP", "Backend", "get_backend", "names", "register_backend"]
