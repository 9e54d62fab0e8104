"""Offload as a third decision: the save/recompute/offload front against ``memory_budget``
(save/recompute only) and torch's activation-offloading pass, per zoo model.

Everything here is the cost model, on this machine's CPU, at the zoo's ``bench`` sizes: no
copy is timed (on the CPU host and device are one memory). The model's assumptions are printed
and stored with the figures:

- copies run at ``BANDWIDTH`` bytes/s each way and hide behind the forward's (copies out) and
  the backward's (copies back) compute, which runs at ``COMPUTE_RATE`` FLOP/s;
- a strategy's *cost* is its recompute FLOPs plus the copy time compute cannot hide, in FLOPs
  (seconds x ``COMPUTE_RATE``). Two machines are modelled: an H100-class GPU on PCIe 5
  (1e14 FLOP/s, 25 GB/s) and the same device with the copy bandwidth of a Grace-Hopper link
  (450 GB/s).

Per model and machine:

``dropout_mlp`` (two Linear-GELU-dropout layers, from ``benchmarks.memory_budget``) has random
masks, which may not be recomputed: its budgets below ``full_remat``'s bytes are infeasible
without offload.

1. **The front**: device budgets from 0 bytes to ``min_cut``'s activation bytes (fractions of
   ``full_remat``'s bytes below it, torch's scale above it). At each: ``memory_budget``'s cost
   (infeasible below ``full_remat``'s bytes) and ours with ``offload=Offload(...)`` (cost,
   offloaded bytes, exposed copy time).
2. **Torch's pass** (``torch._functorch._activation_offloading``, what ``enable_activation_
   offloading`` runs after torch's min-cut partition): it offloads the saved values a user (or
   a policy) marked and its rules allow; it chooses nothing itself, so every saved activation is
   marked (the most it can offload). Its device bytes, host bytes and cost under the same model,
   beside our ILP at the same device bytes.

    python -m benchmarks.offload [--quick] [--models a,b]

Writes ``benchmarks/results/offload.json`` (``--quick``: two small models, into a temporary
folder).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.fx as fx
from torch._functorch._activation_offloading.activation_offloading import (
    enable_activation_offloading,
)
from torch.utils._ordered_set import OrderedSet

import functrans as ft
from benchmarks import zoo
from benchmarks._torch_ref import torch_min_cut, torch_partition
from functrans import Offload
from functrans.extend import HOST, InvalidPartitionError, flops, saved_activation_bytes, simulate

RESULTS = Path(__file__).resolve().parent / "results"
MACHINES = {
    "pcie5": Offload(bandwidth=25e9, compute_rate=1e14),
    "nvlink_c2c": Offload(bandwidth=450e9, compute_rate=1e14),
}
#: device budgets: fractions of full_remat's bytes (below it), then torch's 0..1 scale
BELOW = (0.0, 0.25, 0.5, 0.75)
ABOVE = (0.0, 0.25, 0.5, 0.75, 1.0)


def cost(recompute_flops: float, offloaded: float, joint: ft.JointGraph, o: Offload) -> float:
    """Recompute FLOPs plus the copy time compute cannot hide (in FLOPs)."""
    fwd = sum(flops(n) for n in joint.forward_nodes() if n.op == "call_function")
    bwd = sum(flops(n) for n in joint.backward_nodes() if n.op == "call_function")
    exposed = sum(
        max(0.0, o.seconds(offloaded) - o.overlap * work / o.compute_rate) for work in (fwd, bwd)
    )
    return recompute_flops + exposed * o.compute_rate


def _point(jg: ft.JointGraph, max_bytes: int, o: Offload | None) -> dict[str, Any] | None:
    try:
        p = ft.partition(jg, "memory_budget", max_bytes=max_bytes, offload=o)
    except InvalidPartitionError:
        return None
    used = o or Offload(bandwidth=0)
    return {
        "device_bytes": p.activation_bytes,
        "offloaded_bytes": p.offloaded_bytes,
        "recompute_flops": p.recompute_flops,
        "cost_flops": cost(p.recompute_flops, p.offloaded_bytes, jg, used),
        "peak_bytes": p.peak_bytes,
        "host_peak_bytes": p.host_peak_bytes,
    }


def front(jg: ft.JointGraph, o: Offload, budgets: list[int]) -> list[dict[str, Any]]:
    rows = []
    for b in budgets:
        rows.append(
            {"max_bytes": b, "memory_budget": _point(jg, b, None), "offload": _point(jg, b, o)}
        )
    return rows


def budgets(jg: ft.JointGraph, quick: bool) -> list[int]:
    low = ft.partition(jg, "full_remat").activation_bytes
    high = ft.partition(jg, "min_cut").activation_bytes
    below = (0.0, 0.5) if quick else BELOW
    above = (0.0, 1.0) if quick else ABOVE
    return sorted({int(low * f) for f in below} | {int(low + f * (high - low)) for f in above})


def _mark_host(fw: fx.GraphModule, bw: fx.GraphModule) -> None:
    """Tell our liveness simulation which of torch's values live on the host: its copies out
    (``device_put`` to the CPU in forward) and the backward inputs they became."""
    for n in fw.graph.nodes:
        if n.target is torch.ops.prims.device_put.default and n.meta.get("val") is not None:
            n.meta[HOST] = True
    for n in bw.graph.nodes:
        if n.op == "placeholder" and n.meta.get("saved_for_offloading"):
            n.meta[HOST] = True


def torch_offload(jg: ft.JointGraph, o: Offload) -> dict[str, Any]:
    """Torch's min-cut partition, then its offloading pass with every saved value marked."""
    fw, bw = torch_partition(jg)
    outputs = next(n for n in reversed(fw.graph.nodes) if n.op == "output").args[0]
    for n in outputs[jg.num_outputs :]:
        if isinstance(n, fx.Node):
            n.meta["should_offload"] = True
    enable_activation_offloading(fw, bw, jg.num_outputs, OrderedSet())
    _mark_host(fw, bw)
    joint_nodes = {n.name: n for n in jg.fx_graph.nodes}
    outputs = next(n for n in reversed(fw.graph.nodes) if n.op == "output").args[0]
    host = [n for n in outputs if isinstance(n, fx.Node) and n.meta.get(HOST)]
    offloaded = sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in host)
    device = [
        joint_nodes[n.name]
        for n in outputs[jg.num_outputs :]
        if isinstance(n, fx.Node) and not n.meta.get(HOST) and n.name in joint_nodes
    ]
    ref = torch_min_cut(jg)
    profile = simulate(fw.graph, bw.graph)
    return {
        "device_bytes": saved_activation_bytes(device),
        "offloaded_bytes": offloaded,
        "offloaded_values": len(host),
        "recompute_flops": ref["recompute_flops"],
        "cost_flops": cost(ref["recompute_flops"], offloaded, jg, o),
        "peak_bytes": profile.peak_bytes,
        "host_peak_bytes": profile.host_peak_bytes,
    }


def _model(name: str) -> zoo.Model:
    if name == "dropout_mlp":  # random masks: budgets below full_remat's bytes exist
        from benchmarks.memory_budget import dropout_mlp

        return dropout_mlp()
    return zoo.ZOO[name]()


def measure(name: str, o: Offload, quick: bool) -> dict[str, Any]:
    model = _model(name)
    params, x = model.make("small" if quick else "bench")
    jg = ft.joint(model.fn, argnums=0)(params, x)
    ref = torch_offload(jg, o)
    ours = _point(jg, ref["device_bytes"], o)
    return {
        "front": front(jg, o, budgets(jg, quick)),
        "torch_offload": ref,
        "ours_at_torch_device_bytes": ours,
    }


def _fmt(v: float | None) -> str:
    if v is None:
        return "infeasible"
    return f"{v / 1e6:10.2f}"


def report(name: str, machine: str, r: dict[str, Any]) -> None:
    print(f"\n{name} [{machine}] cost = recompute MFLOP + exposed copies (MFLOP)")
    print(f"  {'device bytes':>12}  {'memory_budget':>13}  {'+offload':>10}  {'offloaded':>10}")
    for row in r["front"]:
        mb, off = row["memory_budget"], row["offload"]
        print(
            f"  {row['max_bytes']:>12}  {_fmt(mb and mb['cost_flops']):>13}  "
            f"{_fmt(off and off['cost_flops']):>10}  {off['offloaded_bytes'] if off else '-':>10}"
        )
    t, ours = r["torch_offload"], r["ours_at_torch_device_bytes"]
    print(
        f"  torch min-cut + offload pass: device {t['device_bytes']} B, host {t['offloaded_bytes']}"
        f" B, cost {_fmt(t['cost_flops'])}; ours at those device bytes: cost "
        f"{_fmt(ours and ours['cost_flops'])}, host {ours['offloaded_bytes'] if ours else '-'} B"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", default=None)
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)
    names = (
        args.models.split(",")
        if args.models
        else (
            ["mlp_stack", "gpt_block"]
            if args.quick
            else ["mlp_stack", "gpt_block", "llama_block", "conv_block", "dropout_mlp"]
        )
    )
    out_dir = (
        Path(args.out_dir)
        if args.out_dir
        else (Path(tempfile.mkdtemp()) if args.quick else RESULTS)
    )
    results: dict[str, Any] = {
        "assumptions": {
            m: {
                "bandwidth_bytes_per_s": o.bandwidth,
                "compute_flops_per_s": o.compute_rate,
                "overlap": o.overlap,
            }
            for m, o in MACHINES.items()
        },
        "cost": "recompute FLOPs + copy time compute cannot hide, times compute rate",
        "models": {},
    }
    for m, o in MACHINES.items():
        print(
            f"machine {m}: copies at {o.bandwidth / 1e9:g} GB/s each way, compute "
            f"{o.compute_rate:g} FLOP/s, overlap {o.overlap}"
        )
    for name in names:
        results["models"][name] = {}
        for m, o in MACHINES.items():
            r = measure(name, o, args.quick)
            results["models"][name][m] = r
            report(name, m, r)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "offload.json"
    path.write_text(json.dumps(results, indent=1, default=_json_default))
    print(f"\nwrote {path}")
    return 0


def _json_default(v: Any) -> Any:
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    return str(v)


if __name__ == "__main__":
    sys.exit(main())
