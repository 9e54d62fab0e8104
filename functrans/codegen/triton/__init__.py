"""Triton codegen backend: fuse, lower and render ATen graphs to Triton kernels, and run them.

Stages, each a pure function of the previous one's output: :mod:`.fusion` (graph -> regions,
with :mod:`.layout` mapping values onto iteration spaces and :mod:`.schedule` ordering the
regions), :mod:`.lowering` (ATen overload -> Triton expression), :mod:`.render` (kernel ->
source text, written through an :mod:`.emitter`, with :mod:`.reduce` for reductions and
:mod:`.shifted` for concat pieces and slices), :mod:`.runtime` (source -> loaded kernel; the only
module that imports ``triton``; :mod:`.aot` compiles for GPUs), and :mod:`.backend` (the
``"triton"`` backend that runs them in order).
"""

from functrans.codegen import register_backend

from .backend import Compiled as Compiled
from .backend import TritonBackend as TritonBackend

register_backend("triton", TritonBackend())
