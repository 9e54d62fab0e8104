"""Torch's reference partitioner applied to a functrans joint graph, measured our way.

``torch_min_cut(jg)`` runs ``torch._functorch.partitioners.min_cut_rematerialization_partition``
on a deep copy of ``jg.graph_module`` and measures the result exactly like
:class:`functrans.Partition` measures ours, so the numbers compare:

- activation bytes: bytes of the forward graph's outputs past the ``num_outputs`` user outputs
  (its saved values), each storage once (``saved_activation_bytes`` on the joint nodes of the
  same names: views share their base's storage, primal inputs and views of them count 0),
  non-tensor values (SymInts) left out;
- recompute FLOPs: ``flops(joint_node)`` summed over the call_function nodes present, by name,
  in both the forward and the backward graph;
- peak bytes: ``functrans.extend.peak_bytes(fw_graph, bw_graph)`` (the liveness simulation
  that gives :attr:`functrans.Partition.peak_bytes`).

Why this works without an adapter graph: functrans' joint graph already follows AOTAutograd's
conventions. Placeholders are named ``primals_N``/``tangents_N`` (torch classifies them by
those names), the output node returns a flat tuple of the forward outputs followed by the grads
(torch reads it with ``pytree.arg_tree_leaves``, so a tuple and a list are the same), every node
carries ``meta["val"]``, and ``_joint_inputs`` is unused by torch. Torch keeps node names when it
copies nodes into the forward and backward graphs, so they match the joint graph's by name.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import optree
import torch
import torch.fx as fx
from torch._functorch.partitioners import min_cut_rematerialization_partition

from functrans import JointGraph
from functrans.extend import OpClass, flops, op_class, peak_bytes, saved_activation_bytes

__all__ = [
    "PartitionFn",
    "bad_recomputes",
    "random_recomputes",
    "recomputed_names",
    "torch_memory_budget",
    "torch_min_cut",
    "torch_partition",
]

#: A torch partition function: ``(joint_module, joint_inputs, *, num_fwd_outputs) -> (fw, bw)``.
PartitionFn = Callable[..., tuple[fx.GraphModule, fx.GraphModule]]


def torch_partition(
    jg: JointGraph, partition_fn: PartitionFn = min_cut_rematerialization_partition
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Run a torch partitioner on a deep copy of ``jg``'s module (torch mutates its input)."""
    gm = copy.deepcopy(jg.graph_module)
    return partition_fn(gm, None, num_fwd_outputs=jg.num_outputs)


def _outputs(gm: fx.GraphModule) -> list[Any]:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return list(torch.utils._pytree.arg_tree_leaves(*out.args))


def recomputed_names(fw: fx.GraphModule, bw: fx.GraphModule) -> list[str]:
    """Names of the call_function nodes present in both graphs (forward order)."""
    bw_names = {n.name for n in bw.graph.nodes if n.op == "call_function"}
    return [n.name for n in fw.graph.nodes if n.op == "call_function" and n.name in bw_names]


def _measure(jg: JointGraph, fw: fx.GraphModule, bw: fx.GraphModule) -> dict[str, Any]:
    joint_nodes = {n.name: n for n in jg.fx_graph.nodes}
    saved = _outputs(fw)[jg.num_outputs :]
    tensors, unmatched = [], []
    for s in saved:
        if not isinstance(s, fx.Node) or not isinstance(s.meta.get("val"), torch.Tensor):
            continue  # SymInts and constants cost no activation memory
        node = joint_nodes.get(s.name)
        if node is None:  # a node torch made itself: judge it on torch's graph
            unmatched.append(s.name)
            node = s
        tensors.append(node)
    activation = saved_activation_bytes(tensors)  # each storage once, as Partition counts
    recomputed = recomputed_names(fw, bw)
    missing = [r for r in recomputed if r not in joint_nodes]
    return {
        "activation_bytes": activation,
        "saved": [s.name for s in saved if isinstance(s, fx.Node)],
        "recomputed": recomputed,
        "recompute_flops": sum(flops(joint_nodes[r]) for r in recomputed if r in joint_nodes),
        "peak_bytes": peak_bytes(fw.graph, bw.graph),
        "unmatched_names": sorted(set(unmatched + missing)),
    }


def torch_min_cut(jg: JointGraph, *, repeats: int = 1) -> dict[str, Any]:
    """Torch's min-cut partition of ``jg`` and its metrics (see the module docstring).

    Returns ``activation_bytes``, ``recompute_flops``, ``peak_bytes``, ``saved``/``recomputed``
    node names, ``times_s`` (one partition
    wall time per repeat, the deep copy excluded), ``fw``/``bw`` (the graph modules of the last
    run) and ``unmatched_names`` (names torch invented that the joint graph lacks; expected
    empty).
    """
    times, fw, bw = [], None, None
    for _ in range(max(1, repeats)):
        gm = copy.deepcopy(jg.graph_module)
        t0 = time.perf_counter()
        fw, bw = min_cut_rematerialization_partition(gm, None, num_fwd_outputs=jg.num_outputs)
        times.append(time.perf_counter() - t0)
    assert fw is not None and bw is not None
    result = _measure(jg, fw, bw)
    result.update(times_s=times, fw=fw, bw=bw)
    return result


def torch_memory_budget(jg: JointGraph, budget: float, *, repeats: int = 1) -> dict[str, Any]:
    """:func:`torch_min_cut` under ``torch._functorch.config.activation_memory_budget=budget``
    (torch's default knapsack solver and runtime estimator); same result keys.

    Torch's scale: 0.0 saves only the primal inputs (everything else is recomputed, random ops
    included), 1.0 is its default min-cut; in between, the fraction of the way from the inputs'
    bytes to the min-cut's bytes (both counting the primal inputs), see
    ``choose_saved_values_set`` in ``torch/_functorch/partitioners.py``.
    """
    with torch._functorch.config.patch(activation_memory_budget=budget):
        return torch_min_cut(jg, repeats=repeats)


def random_recomputes(jg: JointGraph, names: list[str] | tuple[str, ...]) -> list[str]:
    """The recomputed nodes among ``names`` that are random ops (recomputing one changes the
    numbers: the backward sees a different sample than the forward did)."""
    nodes = {n.name: n for n in jg.fx_graph.nodes}
    return [
        f"{n} ({nodes[n].target})"
        for n in names
        if n in nodes and op_class(nodes[n]) is OpClass.RANDOM
    ]


def bad_recomputes(jg: JointGraph, names: list[str] | tuple[str, ...]) -> list[str]:
    """The recomputed nodes among ``names`` that are compute-intensive or random."""
    nodes = {n.name: n for n in jg.fx_graph.nodes}
    bad = (OpClass.COMPUTE, OpClass.RANDOM)
    return [f"{n} ({nodes[n].target})" for n in names if n in nodes and op_class(nodes[n]) in bad]


def run_torch_partition(
    jg: JointGraph,
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    args: tuple[Any, ...],
    tangents: list[torch.Tensor],
) -> tuple[list[Any], list[Any]]:
    """Run torch's forward then backward graph on real values: ``(outputs, grads)``.

    ``args`` are the joint function's positional arguments (their tensor leaves are the primals,
    in functrans' flattening order); backward placeholders are fed by name, from the forward
    graph's saved outputs and from ``tangents``.
    """
    leaves: list[Any] = optree.tree_leaves(args, namespace="functrans")  # type: ignore[arg-type]  # optree's PyTree type is narrower than Any
    primals = [t for t in leaves if isinstance(t, torch.Tensor)]
    fw_vals = list(fw(*primals))
    by_name = {n.name: v for n, v in zip(_outputs(fw), fw_vals, strict=True) if hasattr(n, "name")}
    by_name.update(zip([t.name for t in jg.tangents()], tangents, strict=True))
    placeholders = [n for n in bw.graph.nodes if n.op == "placeholder"]
    grads = list(bw(*(by_name[n.name] for n in placeholders)))
    return fw_vals[: jg.num_outputs], grads
