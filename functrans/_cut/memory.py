"""Liveness simulation: the peak memory of running a forward graph, then its backward graph.

The figure is what a step allocates above what its caller already holds, which is what an
allocator profile of the step measures (:func:`functrans.testing.measure_peak`, within 2% on
the zoo; ``tests/cut/test_peak_memory.py``). The model follows what ``jit`` and a
:class:`~functrans.Partition` driven directly do:

- primal inputs are the caller's (parameters, the batch): live throughout, counted in neither
  pass;
- every other value is allocated when its op runs and freed after its last use; views share
  their base's storage (a view costs nothing and keeps its base alive); multi-output ops
  allocate one storage per output (the rule is :func:`functrans._cut.cost.storage_of`, which the
  partition's saved-bytes figures use too);
- forward outputs live to the end of backward (the caller holds the loss it calls backward on);
  saved values (forward outputs that the backward graph takes as inputs, matched by name) live
  until their last use in backward, as the backward frees each after its last use;
- tangents are allocated when backward starts and live until it ends (autograd holds them for
  the whole call); gradients live until it ends;
- offloaded values (:mod:`functrans._cut.offload`) live in host memory between their copy out and
  their copy back: their bytes count in :attr:`MemoryProfile.host_peak_bytes`, not on the device.

- an op's scratch memory (a convolution's column buffer, :mod:`functrans._cut.scratch`, measured
  once per signature) is live while the op runs;
- an op that runs a compiled graph of its own (an outlined region) holds that graph's
  temporaries while it runs (:data:`functrans._cut.scratch.CALL_SCRATCH`); where the backend
  hands it its inputs, those whose last use it is are freed inside it, at their last use there.

What it does not see: a few bytes of scratch in other ops (Python scalars wrapped into
tensors), and the allocator's rounding (a CUDA caching allocator rounds each block up to 512
bytes).

Works on any pair of FX graphs whose nodes carry ``meta["val"]`` (ours, or torch's partitions).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch.fx as fx

from functrans._core.graph import HANDED_OVER, RECOMPUTED

from .cost import nbytes, storage_of
from .offload import HOST
from .scratch import CALL_SCRATCH, scratch_bytes

__all__ = ["MemoryProfile", "MemoryStep", "call_scratch", "peak_bytes", "simulate"]


@dataclass(frozen=True)
class MemoryStep:
    """Live bytes right after one op ran: ``phase`` is ``"forward"`` or ``"backward"``,
    ``op`` the node's name, ``target`` its op (``"aten.mm.default"``).

    >>> import torch, functrans as ft
    >>> p = ft.partition(ft.joint(lambda x: torch.tanh(x).sum())(torch.ones(256)), "default")
    >>> step = p.memory.timeline[0]
    >>> step.phase, step.op, step.target, step.device_bytes, step.host_bytes
    ('forward', 'tanh', 'aten.tanh.default', 1024, 0)
    """

    phase: str
    op: str
    target: str
    device_bytes: int
    host_bytes: int
    recomputed: bool = False


_FOREVER = 1 << 62


@dataclass(frozen=True)
class MemoryProfile:
    """Result of :func:`simulate` (all in bytes, above the inputs): peaks on the device over
    both passes and each, live bytes between them, the host peak (offloaded values) and a
    per-op timeline. On the CPU, where host and device memory are one allocator,
    :attr:`combined_peak_bytes` is what a profile of the step measures.

    >>> import torch, functrans as ft
    >>> p = ft.partition(ft.joint(lambda x: torch.tanh(x).sum())(torch.ones(256)), "default")
    >>> m = p.memory
    >>> m.peak_bytes, m.host_peak_bytes, len(m.timeline)
    (2056, 0, 6)
    """

    peak_bytes: int  # device memory
    forward_peak: int
    backward_peak: int
    boundary_bytes: int  # live between the passes: outputs and saved values
    host_peak_bytes: int = 0  # host memory holding offloaded values
    #: live bytes after every op of forward, then backward (for plots)
    timeline: tuple[MemoryStep, ...] = field(default=(), repr=False, compare=False)

    @property
    def combined_peak_bytes(self) -> int:
        """The peak of device and host bytes together (the figure when both are one memory)."""
        return max((s.device_bytes + s.host_bytes for s in self.timeline), default=0)


class _Timeline:
    """Storages with their size, allocation time and last-use time."""

    def __init__(self) -> None:
        self.size: dict[Any, int] = {}
        self.start: dict[Any, int] = {}
        self.end: dict[Any, int] = {}
        self.host: set[Any] = set()
        #: calls of graphs of their own (CALL_SCRATCH ops): the node, its time, its list's keys
        self.calls: list[tuple[fx.Node, int, list[Any]]] = []

    def new(self, key: Any, size: int, t: int, host: bool = False) -> Any:
        self.size[key], self.start[key], self.end[key] = size, t, t
        if host:
            self.host.add(key)
        return key

    def touch(self, keys: Any, t: int) -> None:
        for k in keys if isinstance(keys, list) else (keys,):  # a list: one per output
            self.end[k] = max(self.end[k], t)

    def live(self, t_end: int, host: bool = False) -> list[int]:
        """Summed sizes of the live storages (device, or host) at each time ``0..t_end``."""
        delta = [0] * (t_end + 2)
        for k, size in self.size.items():
            if (k in self.host) == host and self.start[k] <= t_end:
                delta[self.start[k]] += size
                delta[min(self.end[k], t_end) + 1] -= size
        out, cur = [], 0
        for d in delta[:-1]:
            cur += d
            out.append(cur)
        return out


def _storages(
    graph: fx.Graph, tl: _Timeline, t: int, env: dict[str, Any], tag: str, *, inputs_free: bool
) -> int:
    """Walk ``graph``'s ops from time ``t``; record storages and uses; return the end time.
    Inputs not in ``env`` are new storages, of no bytes where ``inputs_free`` (the caller's)."""
    keys: dict[fx.Node, Any] = {}
    for node in graph.nodes:
        if node.op == "output":
            break
        if node.op == "placeholder":
            size = 0 if inputs_free else nbytes(node.meta.get("val"))
            keys[node] = env.get(node.name) or tl.new(
                (tag, node.name), size, t, bool(node.meta.get(HOST))
            )
            continue
        t += 1
        if node.op == "get_attr":  # a constant the graph module holds: allocated before the step
            keys[node] = tl.new((tag, node.name), 0, t)
            continue
        for inp in node.all_input_nodes:
            tl.touch(keys[inp], t)
        keys[node] = _key_of(node, keys, tl, t, tag)
        if node.target in CALL_SCRATCH:  # its scratch depends on which inputs die in it
            items = node.args[1] if len(node.args) > 1 else ()
            tl.calls.append((node, t, [keys[a] for a in cast(list[fx.Node], items)]))
            continue
        scratch = scratch_bytes(node)
        if scratch:  # working memory inside the op: live while it runs
            tl.new((tag, node.name, "scratch"), scratch, t)
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    for o in out.all_input_nodes:  # results outlive the pass: they are handed over at t + 1
        tl.touch(keys[o], t + 1)
    env.clear()
    env.update({n.name: k for n, k in keys.items()})
    return t


def _settle_calls(tl: _Timeline) -> None:
    """Once every use is known: each call of a graph of its own holds its scratch while it
    runs; one whose inputs are handed over (:data:`~functrans._core.graph.HANDED_OVER`) frees
    those whose last use it is inside itself (they leave the timeline as it starts, and count
    in its scratch until their last use in its graph)."""
    for node, t, keys in tl.calls:
        # each with the bytes of its storage (a slice keeps its whole base alive)
        candidates = tuple(
            (i, tl.size[k])
            for i, k in enumerate(keys if node.meta.get(HANDED_OVER) else ())
            if not isinstance(k, list)
            and tl.end[k] == t
            and tl.size[k] > 0
            and k not in tl.host
            and keys.count(k) == 1
        )
        memory = CALL_SCRATCH[node.target](node, candidates)
        for i in memory.owned:
            tl.end[keys[i]] = t - 1
        if memory.scratch:
            tl.new((id(node), "scratch"), memory.scratch, t)


def _key_of(node: fx.Node, keys: dict[fx.Node, Any], tl: _Timeline, t: int, tag: str) -> Any:
    root, index = storage_of(node)
    if root is not node:  # a view, or one output of a multi-output op: an existing storage
        return keys[root] if index is None else keys[root][index]
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):  # one storage per result; a result given twice, one
        made: list[Any] = []
        for i, v in enumerate(val):
            again = next((j for j in range(i) if val[j] is v), None) if v is not None else None
            made.append(
                made[again] if again is not None else tl.new((tag, node.name, i), nbytes(v), t)
            )
        return made
    return tl.new((tag, node.name), nbytes(val), t, bool(node.meta.get(HOST)))


def simulate(
    forward: fx.Graph, backward: fx.Graph, num_outputs: int | None = None
) -> MemoryProfile:
    """Simulate ``forward`` then ``backward`` and report peak live bytes above the inputs.

    ``num_outputs``: how many of the forward graph's outputs are the function's (the rest are
    saved values); None takes every output the backward graph does not read as the function's.

    >>> import torch, functrans as ft
    >>> jg = ft.joint(lambda x: torch.tanh(x).sum())(torch.ones(256))
    >>> p = ft.partition(jg, "default")
    >>> simulate(p.forward.fx_graph, p.backward.fx_graph)  # 1 KiB tensors, a 4-byte loss
    MemoryProfile(peak_bytes=2056, forward_peak=1028, backward_peak=2056, boundary_bytes=1028,
                  host_peak_bytes=0)
    """
    tl = _Timeline()
    env: dict[str, Any] = {}
    t_fwd = _storages(forward, tl, 0, env, "f", inputs_free=True)
    fwd_env = dict(env)
    for o in _user_outputs(forward, backward, num_outputs):  # the caller keeps them
        tl.touch(fwd_env[o.name], _FOREVER)
    saved = {
        n.name: fwd_env[n.name]
        for n in backward.nodes
        if n.op == "placeholder" and n.name in fwd_env
    }
    env = dict(saved)
    t_end = _storages(backward, tl, t_fwd + 2, env, "b", inputs_free=False)
    for n in backward.nodes:  # tangents: held by autograd (or the caller) for the whole call
        if n.op == "placeholder" and n.name not in fwd_env:
            tl.touch(env[n.name], _FOREVER)
    _settle_calls(tl)
    for k in tl.end:
        tl.end[k] = min(tl.end[k], t_end)
    device, host = tl.live(t_end), tl.live(t_end, host=True)
    return MemoryProfile(
        peak_bytes=max(device),
        forward_peak=max(device[: t_fwd + 1]),
        backward_peak=max(device[t_fwd + 2 :], default=0),
        boundary_bytes=device[t_fwd + 1],
        host_peak_bytes=max(host),
        timeline=_steps(forward, backward, t_fwd, device, host),
    )


def _user_outputs(forward: fx.Graph, backward: fx.Graph, num_outputs: int | None) -> list[fx.Node]:
    out = next(n for n in reversed(forward.nodes) if n.op == "output")
    raw = list(out.args[0])
    if num_outputs is not None:
        return [v for v in raw[:num_outputs] if isinstance(v, fx.Node)]
    saved = {n.name for n in backward.nodes if n.op == "placeholder"}
    return [v for v in raw if isinstance(v, fx.Node) and v.name not in saved]


def _steps(
    forward: fx.Graph, backward: fx.Graph, t_fwd: int, device: list[int], host: list[int]
) -> tuple[MemoryStep, ...]:
    """One :class:`MemoryStep` per op, at the times :func:`_storages` gave them."""
    out = []
    for graph, t, phase in ((forward, 0, "forward"), (backward, t_fwd + 2, "backward")):
        for n in graph.nodes:
            if n.op in ("placeholder", "output"):
                continue
            t += 1
            out.append(
                MemoryStep(
                    phase,
                    n.name,
                    str(n.target),
                    device[t],
                    host[t],
                    bool(n.meta.get(RECOMPUTED)),
                )
            )
    return tuple(out)


def peak_bytes(forward: fx.Graph, backward: fx.Graph) -> int:
    """Peak live bytes of running ``forward`` then ``backward`` (see :func:`simulate`): any
    pair of FX graphs whose nodes carry ``meta["val"]``, ours or another partitioner's; the
    backward graph's inputs that the forward graph produced are matched by name.

    >>> import torch, functrans as ft
    >>> from functrans.extend import peak_bytes
    >>> p = ft.partition(ft.joint(lambda x: torch.tanh(x).sum())(torch.ones(256)), "default")
    >>> peak_bytes(p.forward.fx_graph, p.backward.fx_graph)  # 1 KiB tensors, a 4-byte loss
    2056
    """
    return simulate(forward, backward).peak_bytes


def call_scratch(graph: fx.Graph, owned: Mapping[int, int] | None = None) -> int:
    """Bytes a call of ``graph`` holds at its peak beyond the results it hands back and the
    inputs the caller holds throughout: the scratch of an op that runs the graph. ``owned``
    maps the positions of the inputs that are the call's own (handed over) to the bytes of
    their storages: they count until their last use in ``graph``.

    >>> import torch, functrans as ft
    >>> g = ft.trace(lambda x: (torch.tanh(x) + x).exp().sum())(torch.ones(256))
    >>> call_scratch(g.fx_graph)  # tanh and the sum live together (2 KiB), less the 4-byte sum
    2044
    >>> call_scratch(g.fx_graph, {0: 1024})  # and x (1 KiB), until the add has read it
    3068
    """
    tl = _Timeline()
    env: dict[str, Any] = {}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for i, size in (owned or {}).items():
        env[placeholders[i].name] = tl.new(("call", placeholders[i].name), size, 0)
    t = _storages(graph, tl, 0, env, "call", inputs_free=True)
    live = tl.live(t + 1)
    return max(0, max(live) - live[t + 1])
