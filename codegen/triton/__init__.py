"""Triton codegen backend: fuse, lower and render ATen graphs to Triton kernels, and run them.

Stages, each a pure function of the previous one's output: :mod:`.fusion` (graph -> regions),
:mod:`.lowering` (ATen overload -> Triton expression), :mod:`.render` (region -> source text),
:mod:`.runtime` (source -> loaded kernel; the only module that imports ``triton``), and
:mod:`.backend` (the ``"triton"`` backend that runs them in order).
"""

from .. import register_backend
from .backend import Compiled as Compiled
from .backend import TritonBackend as TritonBackend

register_backend("triton", TritonBackend())
