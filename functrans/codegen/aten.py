"""``"aten"``: run the FX graph of ATen ops as it is; ``jit`` 's default backend. Like every
backend it is checked against eager autograd (:func:`functrans.testing.check_backend`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from functrans.extend import Boxed, Capabilities, Graph

from . import register_backend
from ._fastcall import copy_module, use_fast_calls
from ._native import native_function
from ._peephole import cancel_transposes
from ._pycode import flat_function

__all__ = ["AtenBackend"]

_EXECUTORS = ("native", "python", "fx")


@dataclass(frozen=True)
class AtenBackend:
    """Runs the graph's ATen ops as they are, one after the other.

    ``executor`` says how, with the same results bit for bit and different per-op overhead:

    - ``"native"`` (default): a program of boxed dispatcher calls run from C++
      (:mod:`functrans.codegen._native`); graphs it cannot run, or machines where its
      extension cannot be built, get ``"python"``;
    - ``"python"``: one flat Python function whose common ops go through torch's fast Python
      bindings (:mod:`functrans.codegen._fastcall`, :mod:`functrans.codegen._pycode`);
    - ``"fx"``: ``graph.graph_module``'s code, generated for the boxed convention.

    Each takes its inputs as one list it empties (``call_boxed``), freeing every input after
    its last use, or as ``*args``.

    Transposes that undo each other are dropped first (:mod:`functrans.codegen._peephole`),
    except under ``"fx"``.

    >>> import torch, functrans as ft
    >>> g = ft.trace(lambda x: x * 2)(torch.ones(2))
    >>> AtenBackend().compile(g, [torch.ones(2)])(torch.ones(2))
    [tensor([2., 2.])]
    """

    executor: str = "native"

    @property
    def capabilities(self) -> Capabilities:
        """``jit(decompositions="auto")`` traces with the ``minimal`` table (ATen's fused
        composite kernels, ``gelu_backward``, ``native_layer_norm_backward``, beat their
        decompositions run op by op); it compiles symbolic sizes (the executors read sizes
        from the inputs at run time); its programs hand inputs over to compiled regions
        (the native and Python executors; ``"fx"`` calls them through the dispatcher, which
        holds each input until the op returns)."""
        return Capabilities(
            decompositions="minimal", dynamic=True, hands_over=self.executor != "fx"
        )

    def __post_init__(self) -> None:
        if self.executor not in _EXECUTORS:
            raise ValueError(
                f"AtenBackend: executor must be one of {_EXECUTORS}, not {self.executor!r}"
            )

    def compile(self, graph: Graph, example_inputs: Sequence[torch.Tensor]) -> Callable[..., Any]:
        if self.executor != "fx":
            gm = cancel_transposes(graph.graph_module)  # a copy only where it rewrites
            native = native_function(gm) if self.executor == "native" else None
            return native or flat_function(use_fast_calls(gm))
        return Boxed(_boxed_module(graph.graph_module))


def _boxed_module(gm: torch.fx.GraphModule) -> Callable[[list[Any]], list[Any]]:
    """A copy of ``gm`` whose code takes one list of inputs and empties it (FX's boxed code
    generation), freeing each input after its last use as it frees intermediates."""
    from torch.fx.graph import _BoxedCodeGen

    module = copy_module(gm)
    module.graph.set_codegen(_BoxedCodeGen())
    module.recompile()

    def run(args: list[Any]) -> list[Any]:
        return list(module(args))

    return run


register_backend("aten", AtenBackend())
