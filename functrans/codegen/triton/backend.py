"""The ``"triton"`` backend: decompose, fuse, render, load, and run with liveness-freed buffers.

>>> import torch, functrans as ft
>>> from functrans.codegen import get_backend
>>> g = ft.trace(lambda x: torch.softmax(x, -1))(torch.randn(4, 8))
>>> run = get_backend("triton").compile(g, [torch.randn(4, 8)])
>>> run.num_kernels, run.num_extern_calls
(1, 0)
>>> x = torch.randn(4, 8)
>>> torch.allclose(run(x)[0], torch.softmax(x, -1))
True
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
import torch.fx as fx

from functrans.extend import (
    RECOMPUTED,
    Capabilities,
    Graph,
    decomposition_table_all,
    nbytes,
    read_bytes,
    retrace,
)

from . import runtime
from .fusion import fuse
from .regions import Access, Extern, Kernel, Plan, View
from .relayout import relayout
from .render import Rendered, render
from .unview import unview

__all__ = ["Compiled", "TritonBackend"]

aten = torch.ops.aten
# composite ops core ATen keeps whole, which kernels want as their parts
_DECOMPOSE = (
    aten.native_layer_norm.default,
    aten.native_layer_norm_backward.default,
    aten._softmax.default,
    aten._log_softmax.default,
    aten._softmax_backward_data.default,
    aten._log_softmax_backward_data.default,
    aten.gelu.default,
    aten.gelu_backward.default,
    aten.silu.default,
    aten.silu_backward.default,
    aten.sigmoid_backward.default,
    aten.tanh_backward.default,
    aten.threshold_backward.default,
    aten.native_batch_norm_backward.default,
    aten._native_batch_norm_legit_functional.default,
    aten._native_batch_norm_legit_no_training.default,
    aten.mse_loss.default,
    aten.mse_loss_backward.default,
)


def decompose(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with composite ops (layer_norm, softmax, gelu, ...) split into their parts."""
    table = decomposition_table_all()
    present = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    todo = {op: table[op] for op in _DECOMPOSE if op in present and op in table}
    return retrace(gm, todo) if todo else gm


@dataclass(frozen=True)
class Built:
    """One kernel region rendered to source and loaded, ready to launch."""

    rendered: Rendered
    kernel: runtime.Kernel


class Compiled:
    """A graph compiled to Triton kernels; call it with the graph's flat tensors."""

    def __init__(self, gm: fx.GraphModule, plan: Plan, kernels: dict[Kernel, Built]):
        self.graph_module = gm
        self.plan = plan
        self._kernels = kernels
        self._steps = _steps(gm, plan, kernels)
        self._placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self._output = next(n for n in gm.graph.nodes if n.op == "output")

    @property
    def rendered(self) -> list[Rendered]:
        return [b.rendered for b in self._kernels.values()]

    @property
    def source(self) -> str:
        """Every generated kernel's source, in launch order."""
        return "\n\n".join(r.source for r in self.rendered)

    @property
    def num_kernels(self) -> int:
        return len(self._kernels)

    @property
    def num_extern_calls(self) -> int:
        return sum(
            isinstance(r, Extern) and r.node.target is not operator.getitem
            for r in self.plan.regions
        )

    @property
    def num_recompute_only_kernels(self) -> int:
        """Kernels launched only to recompute forward values (zero when they fused)."""
        return sum(
            all(n.meta.get(RECOMPUTED) for n in r.nodes)
            for r in self.plan.regions
            if isinstance(r, Kernel)
        )

    @property
    def bytes_moved(self) -> int:
        """Estimated global-memory bytes read and written by one call: per kernel, the distinct
        elements it loads and the buffers it stores; per extern call, its tensor inputs
        (broadcast dims once) and outputs. Views and getitems move nothing."""
        total = sum(r.read_bytes + r.write_bytes for r in self.rendered)
        for r in self.plan.regions:
            if isinstance(r, Extern) and r.node.target is not operator.getitem:
                total += sum(read_bytes(a.meta.get("val")) for a in r.node.all_input_nodes)
                total += nbytes(r.node.meta.get("val"))
        return total

    def __call__(self, *tensors: torch.Tensor) -> list[Any]:
        return self.call_boxed(list(tensors))

    def call_boxed(self, tensors: list[Any]) -> list[Any]:
        """Run on the graph's flat tensors given as one list, which this empties: each input
        is freed after its last use (the boxed convention of ``functrans.extend.Boxed``)."""
        env: dict[fx.Node, Any] = dict(zip(self._placeholders, tensors, strict=True))
        device = tensors[0].device if tensors else torch.device("cpu")
        tensors.clear()
        for step, free in self._steps:
            step(env, device)
            for n in free:
                del env[n]
        return list(fx.node.map_arg(self._output.args[0], env.__getitem__))


Step = Callable[[dict[fx.Node, Any], torch.device], None]


def _run_node(node: fx.Node, gm: fx.GraphModule) -> Step:
    if node.op == "get_attr":  # a constant the trace captured (an index tensor, ...)
        const = getattr(gm, str(node.target))

        def fetch(env: dict[fx.Node, Any], device: torch.device) -> None:
            env[node] = const

        return fetch

    def step(env: dict[fx.Node, Any], device: torch.device) -> None:
        args = fx.node.map_arg(node.args, env.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
        env[node] = node.target(*args, **kwargs)  # type: ignore[operator]  # fx types target as str | Callable; here it is an op

    return step


def _view(node: fx.Node, acc: Access) -> Step:
    """A free view as a tensor: the root's storage at the traced offset and strides."""
    root = acc.root

    def step(env: dict[fx.Node, Any], device: torch.device) -> None:
        base = env[root]
        env[node] = base.as_strided(acc.shape, acc.strides, base.storage_offset() + acc.offset)

    return step


def _launch(rendered: Rendered, kernel: runtime.Kernel) -> Step:
    outs = [
        (o, tuple(o.meta["val"].shape), tuple(o.meta["val"].stride()), o.meta["val"].dtype)
        for o in rendered.outputs
    ]

    def step(env: dict[fx.Node, Any], device: torch.device) -> None:
        for o, shape, stride, dtype in outs:
            env[o] = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        kernel(rendered.grid, *(env[r] for r in rendered.inputs), *(env[o] for o, *_ in outs))

    return step


class _Scheduled(NamedTuple):
    """One region's step, and the values that die after it (freed by liveness)."""

    run: Step
    frees: list[fx.Node]


def _steps(gm: fx.GraphModule, plan: Plan, kernels: dict[Kernel, Built]) -> list[_Scheduled]:
    """One step per region, each with the values that die after it."""
    steps: list[_Scheduled] = []
    uses: list[set[fx.Node]] = []
    for r in plan.regions:
        if isinstance(r, Kernel):
            built = kernels[r]
            steps.append(_Scheduled(_launch(built.rendered, built.kernel), []))
            uses.append(set(built.rendered.inputs))
        elif isinstance(r, View):
            acc = plan.access[r.node]
            steps.append(_Scheduled(_view(r.node, acc), []))
            uses.append({acc.root})
        else:
            steps.append(_Scheduled(_run_node(r.node, gm), []))
            uses.append(set(r.node.all_input_nodes))
    output = next(n for n in gm.graph.nodes if n.op == "output")
    keep = set(output.all_input_nodes)
    last: dict[fx.Node, int] = {}
    for i, used in enumerate(uses):
        for n in used:
            last[n] = i
    for n, i in last.items():
        if n not in keep:  # inputs too: a boxed call holds the only reference
            steps[i].frees.append(n)
    return steps


@dataclass(frozen=True)
class TritonBackend:
    """Fuses pointwise and reduction ops into Triton kernels; the rest runs as ATen calls.

    ``persistent_limit``: the largest row (rounded up to a power of two) a reduction keeps in
    one block; longer rows loop. ``max_block``: the most elements a block takes along one dim
    (small values exercise many programs and ragged edges in tests).
    """

    persistent_limit: int = 1024
    max_block: int = 1024
    #: ``jit(decompositions="auto")``: small core ops, which fuse
    capabilities: ClassVar[Capabilities] = Capabilities(decompositions="core")

    def compile(self, graph: Graph, example_inputs: Sequence[torch.Tensor]) -> Compiled:
        gm = unview(relayout(decompose(graph.graph_module)))
        plan = fuse(gm.graph)
        kernels: dict[Kernel, Built] = {}
        for i, r in enumerate(x for x in plan.regions if isinstance(x, Kernel)):
            rendered = render(r, plan.access, i, plan.inline, self.persistent_limit, self.max_block)
            src = runtime.KernelSource(
                rendered.name, rendered.source, rendered.signature, rendered.constexprs
            )
            kernels[r] = Built(rendered, runtime.load(src))
        return Compiled(gm, plan, kernels)
