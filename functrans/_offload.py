"""Offload: a saved value kept in host memory between the forward and the backward pass.

A value backward needs can be kept on the device, recomputed, or *offloaded*: copied to host
memory after its last forward use and copied back before its first backward use. This module
holds the pieces every layer shares:

- the two graph ops, ``functrans::to_host`` and ``functrans::to_device`` (torch custom ops, so
  every executor runs them through the dispatcher and FX graphs print them plainly);
- :class:`Transfer`, how the copies are made, swappable with :func:`use_transfer` (a test can
  poison what stays behind; the default copies to pinned host memory on a side stream on CUDA,
  and on the CPU, where host and device are one memory, copies);
- :func:`why_not_offload`, the rule for which values may be offloaded (torch's offloading
  rules: not an output of the function, not a view, not one output of a multi-output op, not a
  non-contiguous tensor, not an input);
- :func:`insert_transfers`, the pass that puts the copies into a forward and a backward graph.

>>> import torch
>>> x = torch.arange(3.0)
>>> torch.ops.functrans.to_device(torch.ops.functrans.to_host(x), x.device)
tensor([0., 1., 2.])
"""

from __future__ import annotations

import contextlib
import math
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.fx as fx

from ._graph import PHASE, ROLE, SOURCE, Graph, Phase, Role
from ._validate import check_number, check_option

__all__ = [
    "HOST",
    "OFFLOAD_OPS",
    "Cut",
    "Offload",
    "PinnedHost",
    "Transfer",
    "insert_transfers",
    "is_transfer",
    "use_transfer",
    "why_not_offload",
]

#: On a node whose value lives in host memory (an offloaded copy): True.
HOST = "functrans.host"


@dataclass(frozen=True)
class Cut:
    """What a strategy that offloads returns: ``saved`` stay on the device, ``offloaded`` go to
    host memory between the passes (both cross the cut; nodes or their names). A strategy
    that only saves returns the saved values as a plain iterable.

    >>> import torch, functrans as ft
    >>> jg = ft.joint(lambda x: x.exp().sin().sum())(torch.ones(3))
    >>> p = ft.partition(jg, lambda jg: Cut(saved=(), offloaded=("exp",)))
    >>> [s.name for s in p.offloaded], p.activation_bytes, p.transfer_bytes
    (['exp'], 0, 24)
    """

    saved: tuple[str | fx.Node, ...] = ()
    offloaded: tuple[str | fx.Node, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "saved", tuple(self.saved))
        object.__setattr__(self, "offloaded", tuple(self.offloaded))


@dataclass(frozen=True)
class Offload:
    """Offload as an option of a strategy that chooses it (``memory_budget``): the machine's
    copy bandwidth and host memory, and how copies and compute overlap.

    - ``bandwidth``: bytes per second each way between device and host (``0``: never
      offload, today's save/recompute choice exactly; ``math.inf``: copies are free, so
      nothing offloadable is recomputed). Default 25 GB/s (PCIe 5 x16 in practice).
    - ``host_bytes``: host memory the offloaded values may take (None: no limit).
    - ``compute_rate``: how fast the cost model's units run, per second (FLOP/s for the
      default FLOP cost; default 1e14, a large GPU at realistic utilisation). It converts copy
      time into the units recomputation is priced in.
    - ``overlap``: the fraction of the forward's compute time the copies out may hide behind,
      and of the backward's the copies back (1.0: all of it; 0.0: every copy is exposed).

    Copies beyond what overlap hides cost their exposed time; recomputation costs its FLOPs.

    >>> Offload(bandwidth=50e9, host_bytes=2**34).seconds(10**9)  # 1 GB one way
    0.02
    >>> Offload(bandwidth=-1)
    Traceback (most recent call last):
    ...
    functrans._errors.InvalidArgumentError: Offload: bandwidth=-1 (int) is not accepted; ...
    """

    bandwidth: float = 25e9
    host_bytes: int | None = None
    compute_rate: float = 1e14
    overlap: float = 1.0

    def __post_init__(self) -> None:
        where = "Offload"
        check_number(
            where,
            "bandwidth",
            self.bandwidth,
            at_least=0,
            allow_inf=True,
            meaning="bytes per second each way; 0 never offloads",
        )
        if self.host_bytes is not None:
            check_number(
                where,
                "host_bytes",
                self.host_bytes,
                at_least=0,
                integer=True,
                meaning="bytes of host memory, or None for no limit",
            )
        check_number(
            where,
            "compute_rate",
            self.compute_rate,
            above=0,
            meaning="cost units (FLOPs) per second",
        )
        check_number(where, "overlap", self.overlap, at_least=0, meaning="a fraction in [0, 1]")
        check_option(where, "overlap", self.overlap, self.overlap <= 1, "a fraction in [0, 1]")

    @property
    def enabled(self) -> bool:
        """Whether anything can be offloaded (bandwidth and host memory both above 0)."""
        return self.bandwidth > 0 and self.host_bytes != 0

    def seconds(self, nbytes: float) -> float:
        """Time to copy ``nbytes`` one way (infinite at bandwidth 0)."""
        if nbytes == 0 or math.isinf(self.bandwidth):
            return 0.0
        return math.inf if self.bandwidth == 0 else nbytes / self.bandwidth


class Transfer(Protocol):
    """How offloaded values are copied out and back (see :func:`use_transfer`).

    >>> class Copy:
    ...     def to_host(self, x):
    ...         return x.to("cpu", copy=True)
    ...     def to_device(self, x, device):
    ...         return x.to(device, copy=True)
    >>> t: Transfer = Copy()
    """

    def to_host(self, x: torch.Tensor) -> torch.Tensor: ...

    def to_device(self, x: torch.Tensor, device: torch.device) -> torch.Tensor: ...


class PinnedHost:
    """The default :class:`Transfer`. On CUDA: copies out to pinned host memory on a side
    stream (the forward's compute goes on while they run), copies back on the same stream
    and makes the compute stream wait for the copy. On the CPU host and device are one
    memory: both directions are plain copies (what a test of the wiring needs)."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}

    def _stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            new: Any = torch.cuda.Stream  # torch's class is untyped
            self._streams[device] = new(device)
        return self._streams[device]

    def to_host(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cuda":
            return x.clone()
        side = self._stream(x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        out = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=True)
        with torch.cuda.stream(side):
            out.copy_(x, non_blocking=True)
        x.record_stream(side)  # the caching allocator must not reuse x before the copy ends
        return out

    def to_device(self, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        if device.type != "cuda":
            return x.clone() if x.device == device else x.to(device)
        side = self._stream(device)
        current = torch.cuda.current_stream(device)
        with torch.cuda.stream(side):
            out = x.to(device, non_blocking=True)
        current.wait_stream(side)
        out.record_stream(current)
        return out


_TRANSFER: list[Transfer] = [PinnedHost()]


@contextlib.contextmanager
def use_transfer(transfer: Transfer) -> Iterator[Transfer]:
    """Copy offloaded values with ``transfer`` meanwhile (graphs read it when they run, not
    when they are traced).

    >>> import torch
    >>> class Counting(PinnedHost):
    ...     out = 0
    ...     def to_host(self, x):
    ...         self.out += 1
    ...         return super().to_host(x)
    >>> with use_transfer(Counting()) as t:
    ...     _ = torch.ops.functrans.to_host(torch.ones(2))
    >>> t.out
    1
    """
    _TRANSFER.append(transfer)
    try:
        yield transfer
    finally:
        _TRANSFER.remove(transfer)


@torch.library.custom_op("functrans::to_host", mutates_args=())
def _to_host(x: torch.Tensor) -> torch.Tensor:
    return _TRANSFER[-1].to_host(x)


@_to_host.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, device="cpu")


@torch.library.custom_op("functrans::to_device", mutates_args=())
def _to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    return _TRANSFER[-1].to_device(x, device)


@_to_device.register_fake
def _(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty_like(x, device=device)


#: The graph ops that copy an offloaded value out (forward) and back (backward).
OFFLOAD_OPS = (torch.ops.functrans.to_host.default, torch.ops.functrans.to_device.default)


def is_transfer(node: fx.Node) -> bool:
    """Whether ``node`` copies a value to or from host memory."""
    return node.op == "call_function" and node.target in OFFLOAD_OPS


def why_not_offload(node: fx.Node, outputs: frozenset[fx.Node] = frozenset()) -> str:
    """Why the forward value ``node`` may not be offloaded ("" if it may). ``outputs``: the
    function's own outputs (the caller holds them on the device anyway).

    >>> import torch, functrans as ft
    >>> jg = ft.joint(lambda x: x.exp().t().sum())(torch.ones(2, 3))
    >>> {n.name: why_not_offload(n) for n in jg.forward_nodes()}
    {'primals_1': 'it is an input', 'exp': '', 'permute': 'it is a view', 'sum_1': ''}
    """
    val = node.meta.get("val")
    if node.op == "placeholder":
        return "it is an input"
    if not isinstance(val, torch.Tensor):
        return "it is not a tensor"
    if node in outputs:
        return "it is an output of the function"
    target = node.target
    if target is operator.getitem:
        return "it is one output of a multi-output op"
    if isinstance(target, torch._ops.OpOverload) and target.is_view:
        return "it is a view"
    if not val.is_contiguous():
        return "it is not contiguous"
    return ""


def _fake(op: Any, val: torch.Tensor, *args: Any) -> torch.Tensor:
    """``op``'s output value for the traced value ``val`` (a FakeTensor: in its fake mode)."""
    mode = getattr(val, "fake_mode", None)
    with mode if mode is not None else contextlib.nullcontext():
        out: torch.Tensor = op(val, *args)
    return out


def _last_forward_use(graph: fx.Graph, node: fx.Node) -> fx.Node:
    order = {n: i for i, n in enumerate(graph.nodes)}
    users = [u for u in node.users if u.op != "output"]
    return max(users, key=order.__getitem__) if users else node


def _offload_forward(forward: Graph, names: Sequence[str]) -> tuple[Graph, dict[str, str]]:
    """The forward graph with ``to_host`` after each named saved value's last use; returns it
    and the host copy's name for each value."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in forward.fx_graph.nodes:
        env[n] = g.node_copy(n, lambda a: env[a])
    by_name = {n.name: n for n in g.nodes}
    out = next(n for n in reversed(g.nodes) if n.op == "output")
    renamed: dict[str, str] = {}
    for name in names:
        value = by_name[name]
        with g.inserting_after(_last_forward_use(g, value)):
            host = g.call_function(OFFLOAD_OPS[0], (value,))
        host.meta.update(
            {
                "val": _fake(OFFLOAD_OPS[0], value.meta["val"]),
                HOST: True,
                PHASE: Phase.FORWARD,
                SOURCE: value.meta.get(SOURCE),
            }
        )
        out.args = (tuple(host if a is value else a for a in out.args[0]),)
        renamed[name] = host.name
    g.lint()
    return Graph(g, forward.in_flat, forward.out_flat, root=forward.graph_module), renamed


def _offload_backward(backward: Graph, renamed: dict[str, str]) -> Graph:
    """The backward graph taking each offloaded value as its host copy, with ``to_device``
    one op before the value's first use (the copy overlaps that op on CUDA)."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    host_inputs: list[tuple[fx.Node, fx.Node]] = []
    for n in backward.fx_graph.nodes:
        if n.op == "placeholder" and n.name in renamed:
            ph = g.placeholder(renamed[n.name])
            ph.meta.update(n.meta)
            ph.meta.update({"val": _fake(OFFLOAD_OPS[0], n.meta["val"]), HOST: True})
            ph.meta[ROLE] = Role.SAVED
            env[n] = ph
            host_inputs.append((ph, n))
        else:
            env[n] = g.node_copy(n, lambda a: env[a])
    order = list(g.nodes)
    for ph, original in host_inputs:
        users = [u for u in ph.users]
        first = min(users, key=order.index) if users else None
        at = first if first is not None else next(n for n in order if n.op == "output")
        before = order[max(order.index(at) - 1, 0)]
        anchor = before if before.op != "placeholder" else at
        with g.inserting_before(anchor):
            back = g.call_function(OFFLOAD_OPS[1], (ph, original.meta["val"].device))
        back.meta.update(
            {"val": original.meta["val"], PHASE: Phase.BACKWARD, SOURCE: original.meta.get(SOURCE)}
        )
        for u in users:
            u.replace_input_with(ph, back)
        order = list(g.nodes)
    g.lint()
    return Graph(g, backward.in_flat, backward.out_flat, root=backward.graph_module)


def insert_transfers(forward: Graph, backward: Graph, names: Sequence[str]) -> tuple[Graph, Graph]:
    """Offload the saved values ``names`` (forward outputs the backward graph takes): new
    forward and backward graphs, the inputs untouched (a pure pass).

    >>> import torch, functrans as ft
    >>> p = ft.partition(ft.joint(lambda x: x.exp().sin().sum())(torch.ones(3)), "default")
    >>> fwd, bwd = insert_transfers(p.forward, p.backward, ["exp"])
    >>> print(fwd)  # exp's copy goes out after its last forward use, sin
    def forward(primals_1: "f32[3]"):
        exp: "f32[3]" = aten.exp.default(primals_1)
        sin: "f32[3]" = aten.sin.default(exp)
        to_host_default: "f32[3]" = functrans.to_host.default(exp)
        sum_1: "f32[]" = aten.sum.dim_IntList(sin, [])
        return (sum_1, to_host_default)
    >>> print(bwd)  # and comes back one op before its first backward use
    def forward(to_host_default: "f32[3]", tangents_1: "f32[]"):
        to_device_default: "f32[3]" = functrans.to_device.default(to_host_default, device('cpu'))
        expand: "f32[3]" = aten.expand.default(tangents_1, [3])
        cos: "f32[3]" = aten.cos.default(to_device_default)
        mul: "f32[3]" = aten.mul.Tensor(expand, cos)
        mul_1: "f32[3]" = aten.mul.Tensor(mul, to_device_default)
        return (mul_1,)
    """
    if not names:
        return forward, backward
    fwd, renamed = _offload_forward(forward, names)
    return fwd, _offload_backward(backward, renamed)
