"""``"inductor"``: hand the graph to TorchInductor, the reference a Triton backend is measured by.

A functrans graph is already what AOTAutograd hands Inductor: a flat ATen graph whose output is
a tuple (or list) of tensors. So the backend skips ``torch.compile`` (Dynamo) and AOTAutograd
and calls Inductor's per-graph entry, ``torch._inductor.compile_fx.compile_fx_inner``, itself.
One step of AOTAutograd's is still needed: Inductor lowers only graphs traced with its own
decomposition table (``torch._inductor.decomposition.select_decomp_table()``); given
``aten._softmax`` or ``aten.native_layer_norm`` as they stand it fails with "both a fallback
and a decomp for same op". The graph is therefore re-traced once with ``make_fx`` under that
table, on fake tensors shaped like ``example_inputs``, before ``compile_fx_inner`` compiles it.

The compiled callable is specialised to the shapes, strides and dtypes of ``example_inputs``
(Inductor's wrapper asserts them). On this CPU-only machine Inductor emits C++ kernels; on a
CUDA device it emits Triton. Random ops are not bit-identical to ``"aten"``: Inductor draws
from its own generator unless ``torch._inductor.config.fallback_random`` is set.

>>> import torch, functrans as ft
>>> g = ft.trace(lambda x: torch.softmax(x, -1) * 2)(torch.zeros(2, 2))
>>> InductorBackend().compile(g, [torch.zeros(2, 2)])(torch.zeros(2, 2))  # doctest: +SKIP
[tensor([[1., 1.],
        [1., 1.]])]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from functrans.extend import Boxed, Graph

from . import register_backend

__all__ = ["InductorBackend", "decompose_for_inductor"]


def decompose_for_inductor(module: fx.GraphModule, example_inputs: Sequence[Any]) -> fx.GraphModule:
    """Re-trace ``module`` with Inductor's decomposition table, on fake copies of the inputs.

    ``example_inputs`` may be real tensors or fake tensors (their device is kept).
    """
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    traced = make_fx(module, decomposition_table=select_decomp_table(), tracing_mode="fake")(
        *example_inputs
    )
    assert isinstance(traced, fx.GraphModule)
    return traced


@dataclass(frozen=True)
class InductorBackend:
    """Compiles ``graph.graph_module`` with Inductor's ``compile_fx_inner``.

    The result takes the graph's flat tensors and returns its outputs as a list, like
    :class:`~functrans.codegen.aten.AtenBackend`.
    """

    def compile(self, graph: Graph, example_inputs: Sequence[torch.Tensor]) -> Callable[..., Any]:
        """Compile now with ``example_inputs``; without them (``jit`` hands a backward graph
        none: its inputs exist only once forward ran) on the first call, with its tensors."""
        module = graph.graph_module
        placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
        compiled = None
        if len(example_inputs) == len(placeholders):
            compiled = _inductor(module, example_inputs)

        def run(args: list[Any]) -> list[Any]:
            nonlocal compiled
            if compiled is None:
                compiled = _inductor(module, args)
            # Inductor's boxed calling convention: one list, which the callee empties.
            return list(compiled(args))

        return Boxed(run)


def _inductor(module: fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> Any:
    from torch._inductor.compile_fx import compile_fx_inner

    decomposed = decompose_for_inductor(module, example_inputs)
    return compile_fx_inner(decomposed, list(example_inputs))


register_backend("inductor", InductorBackend())
