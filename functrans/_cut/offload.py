"""Offload: a saved value kept in host memory between the forward and the backward pass.

A value backward needs can be kept on the device, recomputed, or *offloaded*: copied to host
memory after its last forward use and copied back before its first backward use. This module
holds the pieces every layer shares:

- :class:`Offload`, the option of a strategy that chooses offload, and :class:`Cut`, what such
  a strategy returns;
- :func:`why_not_offload`, the rule for which values may be offloaded (torch's offloading
  rules: not an output of the function, not a view, not one output of a multi-output op, not a
  non-contiguous tensor, not an input);
- :func:`insert_transfers`, the pass that puts the copies (:mod:`functrans._cut.transfer`'s ops)
  into a forward and a backward graph.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from functrans._core.errors import InvalidArgumentError
from functrans._core.graph import PHASE, ROLE, SOURCE, Graph, Phase, Role
from functrans._core.ops import is_getitem, is_view_op
from functrans._core.validate import check_number, check_option, describe

from .cost import flops, storage_of
from .transfer import OFFLOAD_OPS

__all__ = ["HOST", "Cut", "Offload", "insert_transfers", "why_not_offload"]

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
        for field in ("saved", "offloaded"):
            object.__setattr__(self, field, _items(field, getattr(self, field)))
        both = {_name(v) for v in self.saved} & {_name(v) for v in self.offloaded}
        if both:
            raise InvalidArgumentError(
                f"Cut: {sorted(both)} are in both saved= and offloaded=; a value stays on the "
                "device (saved) or goes to host memory (offloaded), not both"
            )


def _name(v: str | fx.Node) -> str:
    return v if isinstance(v, str) else v.name


def _items(field: str, value: object) -> tuple[str | fx.Node, ...]:
    """``value`` as a tuple of nodes or names, or an error naming ``field`` and the value."""
    accepted = f"{field} must be a list or tuple of nodes (torch.fx.Node) or node names (str)"
    if isinstance(value, str):
        raise InvalidArgumentError(
            f"Cut: {field}={value!r} is a string; {accepted}, e.g. [{value!r}]"
        )
    if not isinstance(value, Iterable):
        raise InvalidArgumentError(f"Cut: {field}={describe(value)} is not accepted; {accepted}")
    items = tuple(value)
    bad = [v for v in items if not isinstance(v, (str, fx.Node))]
    if bad:
        raise InvalidArgumentError(f"Cut: {field} holds {describe(bad[0])}; {accepted}")
    return items


@dataclass(frozen=True)
class Offload:
    """Offload as an option of a strategy that chooses it (``memory_budget``): the machine's
    copy bandwidth and host memory, and how copies and compute overlap.

    - ``bandwidth``: bytes per second each way between device and host (``0``: never
      offload, today's save/recompute choice exactly; ``math.inf``: copies are free, so
      nothing offloadable is recomputed). Default 25 GB/s (PCIe 5 x16 in practice).
    - ``host_bytes``: host memory the offloaded values may take (None: no limit; a whole
      float such as ``16e9`` is taken as an int).
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
    functrans._core.errors.InvalidArgumentError: Offload: bandwidth=-1 (int) is not accepted; ...
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
        if isinstance(self.host_bytes, float) and self.host_bytes.is_integer():
            object.__setattr__(self, "host_bytes", int(self.host_bytes))  # host_bytes=16e9
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


def why_not_offload(node: fx.Node, outputs: frozenset[fx.Node] = frozenset()) -> str:
    """Why the forward value ``node`` may not be offloaded ("" if it may). ``outputs``: the
    function's own outputs (the caller holds them, and views of them hold their storage, on
    the device anyway).

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
    if node in _viewed_by(outputs):
        return "an output of the function is a view of it"
    if is_getitem(node):
        return "it is one output of a multi-output op"
    if is_view_op(node):
        return "it is a view"
    if not val.is_contiguous():
        return "it is not contiguous"
    return ""


@functools.lru_cache(maxsize=1)  # one problem's values are asked about one after another
def _viewed_by(outputs: frozenset[fx.Node]) -> frozenset[fx.Node]:
    """The values whose storage ``outputs`` lie on (once per set of outputs: a step that
    writes many buffers back has hundreds of outputs, asked about for every value)."""
    return frozenset(storage_of(o)[0] for o in outputs if isinstance(o, fx.Node))


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


def _prefetch_point(order: list[fx.Node], first: fx.Node) -> fx.Node:
    """Where a copy back is issued: before the nearest op ahead of the value's first use that
    computes something (FLOPs > 0), so the copy runs while it does; the first use if none."""
    for n in reversed(order[: order.index(first)]):
        if n.op == "placeholder":
            break
        if n.op == "call_function" and n.target not in OFFLOAD_OPS and flops(n) > 0:
            return n
    return first


def _offload_backward(backward: Graph, renamed: dict[str, str]) -> Graph:
    """The backward graph taking each offloaded value as its host copy: ``to_device`` issued
    ahead of its first use (:func:`_prefetch_point`), ``wait_copy`` right before it."""
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
    for ph, original in host_inputs:
        order = list(g.nodes)
        users = list(ph.users)
        first = min(users, key=order.index) if users else order[-1]
        val = original.meta["val"]
        meta = {PHASE: Phase.BACKWARD, SOURCE: original.meta.get(SOURCE)}
        with g.inserting_before(_prefetch_point(order, first)):
            back = g.call_function(OFFLOAD_OPS[1], (ph, val.device))
        back.meta.update(meta, val=val)
        with g.inserting_before(first):
            ready = g.call_function(OFFLOAD_OPS[2], (back,))
        ready.meta.update(meta, val=_fake(OFFLOAD_OPS[2], val))
        for u in users:
            u.replace_input_with(ph, ready)
    g.lint()
    return type(backward)(g, backward.in_flat, backward.out_flat, root=backward.graph_module)


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
    >>> print(bwd)  # and comes back for its first backward use (cos)
    def forward(to_host_default: "f32[3]", tangents_1: "f32[]"):
        expand: "f32[3]" = aten.expand.default(tangents_1, [3])
        to_device_default: "f32[3]" = functrans.to_device.default(to_host_default, device('cpu'))
        wait_copy_default: "f32[3]" = functrans.wait_copy.default(to_device_default)
        cos: "f32[3]" = aten.cos.default(wait_copy_default)
        mul: "f32[3]" = aten.mul.Tensor(expand, cos)
        mul_1: "f32[3]" = aten.mul.Tensor(mul, wait_copy_default)
        return (mul_1,)
    """
    if not names:
        return forward, backward
    fwd, renamed = _offload_forward(forward, names)
    return fwd, _offload_backward(backward, renamed)
