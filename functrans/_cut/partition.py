"""``partition(joint, strategy, **options)``: choose a saved set with a strategy, then split.

Strategies live in the registry of :mod:`functrans.partitioners` (looked up by name at call
time, so the core never imports them) or are passed directly as callables
``(JointGraph, **options) -> saved nodes``.
"""

from __future__ import annotations

import difflib
import functools
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from functrans._core.errors import InvalidArgumentError, InvalidPartitionError, UnknownNameError
from functrans._core.format import format_value_type, op_name
from functrans._core.graph import MADE_BY, SOURCE, Attachment, Graph, JointGraph
from functrans._core.logs import log
from functrans._core.shapes import hint, is_symbolic, legend
from functrans._core.strategies import (
    check_strategy_options,
    registered_strategy,
    strategy_names,
)
from functrans._core.tags import Policy
from functrans._core.validate import check_call, check_joint, describe, saved_items
from functrans._trace.passes import no_gc

from .cost import (
    flops,
    is_input_storage,
    nbytes,
    nbytes_expr,
    storage_of,
    storage_value,
    value_of,
)
from .memory import MemoryProfile, simulate
from .offload import Cut, insert_transfers
from .problem import cut_problem
from .replay import drawn_once, replayable
from .scratch import inner_recompute
from .split import resolve_nodes, split

__all__ = [
    "Partition",
    "SavedValue",
    "Strategy",
    "UnknownStrategyError",
    "apply_cut",
    "format_bytes",
    "get_strategy",
    "partition",
]

#: A partition strategy: ``(joint, **options) -> the forward nodes (or names) to save``, or a
#: :class:`~functrans.extend.Cut` naming the saved values to keep in host memory too.
Strategy = Callable[..., Iterable[str | fx.Node] | Cut]


@dataclass(frozen=True)
class SavedValue:
    """One value the forward pass hands to the backward pass.

    ``storage`` names the buffer the value lives in (the value that allocated it, ``name[i]``
    for one output of a multi-output op) and ``storage_bytes`` is that buffer's size: a view
    lives in its base's storage and keeps all of it alive. Values that share a storage count it
    once in :attr:`Partition.activation_bytes`. ``node`` is the value's node in the joint graph.
    """

    node: fx.Node
    op: str  # producing op, or "input" for a primal
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    nbytes: int  # the value's own elements times their size
    is_input: bool  # a primal input or a view of one: costs no activation memory
    source: str | None  # the user's source line, where known
    storage: str
    storage_bytes: int
    #: where the sizes are symbolic (a ``dynamic`` trace): the shape and the storage's bytes as
    #: formulas in the size symbols (``shape`` and ``storage_bytes`` hold their values at the
    #: trace's example sizes)
    shape_expr: tuple[str, ...] | None = None
    bytes_expr: str | None = None

    @property
    def name(self) -> str:
        """The node's name (for printing; look values up by :attr:`node`)."""
        return self.node.name

    @property
    def activation_bytes(self) -> int:
        """Bytes this value keeps alive on its own: its storage's, 0 for inputs."""
        return 0 if self.is_input else self.storage_bytes

    @classmethod
    def of(cls, node: fx.Node) -> SavedValue:
        val = node.meta.get("val")
        tensor = val if isinstance(val, torch.Tensor) else None
        storage = storage_of(node)
        root, index = storage
        whole = value_of(storage)
        return cls(
            node=node,
            op="input"
            if node.op == "placeholder"
            else node.meta.get(MADE_BY, op_name(node.target)),
            shape=tuple(hint(s) for s in tensor.shape) if tensor is not None else (),
            dtype=tensor.dtype if tensor is not None else None,
            nbytes=nbytes(val),
            is_input=is_input_storage(storage),
            source=node.meta.get(SOURCE),
            storage=root.name if index is None else f"{root.name}[{index}]",
            storage_bytes=nbytes(whole),
            shape_expr=tuple(map(str, tensor.shape))
            if tensor is not None and is_symbolic(tensor)
            else None,
            bytes_expr=nbytes_expr(whole),
        )


@dataclass(frozen=True, eq=False)
class Partition:
    """A joint graph cut into ``forward`` and ``backward`` graphs.

    ``outs, saved = p.forward(*args)`` runs the forward pass; ``grads = p.backward(saved,
    tangents)`` the backward pass, which empties the ``saved`` list it is given so that each
    value is freed after its last use (pass ``tuple(saved)`` to keep them). ``saved`` describes
    what crosses the cut, ``recomputed`` holds the forward ops backward runs again (nodes of
    ``joint``, as :attr:`SavedValue.node` is).

    >>> import torch, functrans as ft
    >>> jg = ft.joint(lambda x: torch.tanh(x).sum())(torch.ones(256))
    >>> p = ft.partition(jg, "default")
    >>> outs, saved = p.forward(torch.zeros(256))
    >>> [s.name for s in p.saved], len(saved)
    (['tanh'], 1)
    >>> grads = p.backward(saved, (torch.tensor(1.0),))
    >>> saved, grads[0][:2]
    ([], tensor([1., 1.]))
    >>> p.peak_bytes  # in backward: tanh and the gradient (1 KiB each), tangent and loss
    2056
    """

    joint: JointGraph
    strategy: str
    forward: Graph
    backward: Graph
    saved: tuple[SavedValue, ...]
    recomputed: tuple[fx.Node, ...]
    #: FLOPs the backward recomputes: its own recomputed ops', and those compiled blocks it
    #: calls recompute inside them (an outlined region's cut, :mod:`functrans._jit.outline`)
    recompute_flops: int
    #: values the shared save/recompute rules (:meth:`~functrans.extend.CutProblem.legalize`)
    #: added to or removed from the strategy's choice, and values it asked to offload that the
    #: offload rules keep on the device: empty for a strategy that obeys them
    adjusted: tuple[fx.Node, ...] = ()
    #: the saved values kept in host memory between the passes (copied out after their last
    #: forward use, back before their first backward use): a strategy's :class:`Cut`, or a
    #: ``MUST_OFFLOAD`` tag (``policies.save_and_offload_only_these_names``)
    offloaded: tuple[SavedValue, ...] = ()

    @property
    def activation_bytes(self) -> int:
        """Saved bytes that are not primal inputs or views of them, each storage counted once
        (a value and views of it saved together keep one buffer alive)."""
        return sum(s.storage_bytes for s in self._counted() if not s.is_input)

    @property
    def offloaded_bytes(self) -> int:
        """Bytes of the values kept in host memory between the passes."""
        return sum(s.storage_bytes for s in self.offloaded)

    @property
    def transfer_bytes(self) -> int:
        """Bytes copied between device and host: each offloaded value out once, back once."""
        return 2 * self.offloaded_bytes

    @property
    def host_peak_bytes(self) -> int:
        """Peak host memory holding offloaded values (liveness simulation)."""
        return self.memory.host_peak_bytes

    @property
    def activation_bytes_expr(self) -> str | None:
        """:attr:`activation_bytes` as a formula in the size symbols of a ``dynamic`` trace
        (``'8*s0*s1 + 1024'``), None where every saved size is static."""
        exprs = [s.bytes_expr for s in self._counted() if not s.is_input]
        if all(e is None for e in exprs):
            return None
        total: Any = 0
        for s in self._counted():
            val = storage_value(s.node)
            if not s.is_input and isinstance(val, torch.Tensor):
                total = total + val.numel() * val.element_size()
        return str(total)

    @functools.cached_property
    def memory(self) -> MemoryProfile:
        """Liveness simulation of forward then backward (see :mod:`functrans._cut.memory`), run
        once: the peaks, the report and the plots all read it."""
        return simulate(self.forward.fx_graph, self.backward.fx_graph, self.joint.num_outputs)

    @property
    def peak_bytes(self) -> int:
        """The most device bytes the step holds at once over forward then backward, above
        its inputs (the caller's parameters and batch): the outputs, saved values while
        backward still reads them, recomputed values, tangents, gradients and temporaries
        (offloaded values count only while they are on the device). It is what
        :func:`functrans.testing.measure_peak` measures of ``jit``'s step, or of
        ``p.forward`` then ``p.backward`` driven directly, within 2% on the zoo (exact where
        no op allocates scratch memory inside); see :mod:`functrans._cut.memory`."""
        return self.memory.peak_bytes

    @property
    def saved_bytes(self) -> int:
        """All saved bytes, inputs included, each storage counted once."""
        return sum(s.storage_bytes for s in self._counted())

    def shared_storage(self) -> dict[fx.Node, fx.Node]:
        """For each saved value whose storage an earlier saved value already holds (a view of it,
        or both views of one base): that earlier value, which counts the bytes (as nodes).

        >>> import torch, functrans as ft
        >>> jg = ft.joint(lambda x: (x.exp() * x.exp().t()).sum())(torch.ones(4, 4))
        >>> p = ft.partition(jg, "default")
        >>> [(s.name, s.storage, s.activation_bytes) for s in p.saved]
        [('exp', 'exp', 64), ('permute', 'exp', 64)]
        >>> p.shared_storage(), p.activation_bytes
        ({permute: exp}, 64)
        """
        first: dict[str, fx.Node] = {}
        out: dict[fx.Node, fx.Node] = {}
        for s in self.saved:
            owner = first.setdefault(s.storage, s.node)
            if owner is not s.node:
                out[s.node] = owner
        return out

    def _counted(self) -> list[SavedValue]:
        shared = self.shared_storage()
        host = {s.node for s in self.offloaded}
        return [s for s in self.saved if s.node not in shared and s.node not in host]

    def report(self) -> str:
        """A table of the saved values with totals, and the recomputed ops.

        ``bytes`` is the size of the storage a value keeps alive (a view keeps its whole base);
        a value in a storage that an earlier row holds shows ``shared with`` that row, and the
        totals count each storage once.
        """
        shared = self.shared_storage()
        host = {v.node for v in self.offloaded}
        head = ("saved", "op", "shape", "dtype", "bytes", "input", "source")
        sizes = [s for s in self.saved if s.dtype is None]
        rows = [
            (
                s.name,
                s.op,
                _type(s),
                str(s.dtype).replace("torch.", ""),
                f"shared with {shared[s.node].name}"
                if s.node in shared
                else _bytes(s) + (" on host" if s.node in host else ""),
                "yes" if s.is_input else "no",
                _short_source(s.source),
            )
            for s in self.saved
            if s.dtype is not None
        ]
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        lines = [
            f"partition {self.strategy!r}: {len(self.saved) - len(sizes)} saved values, "
            f"{format_bytes(self.activation_bytes)} of activations, "
            f"{len(self.recomputed)} ops recomputed ({self.recompute_flops} FLOPs)"
        ]
        for r in [head, *rows]:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
        formula = self.activation_bytes_expr
        at_hint = f"{formula} = " if formula is not None else ""
        lines.append(f"  activation bytes: {at_hint}{self.activation_bytes}")
        lines.append(f"  peak bytes (forward then backward, above the inputs): {self.peak_bytes}")
        if self.offloaded:
            lines.append(
                f"  offloaded to host: {', '.join(v.name for v in self.offloaded)} "
                f"({self.offloaded_bytes} bytes; {self.transfer_bytes} bytes copied; host peak "
                f"{self.host_peak_bytes})"
            )
        if sizes:
            names = ", ".join(s.name for s in sizes)
            lines.append(f"  sizes handed to backward (ints of the symbolic shapes): {names}")
        symbols = legend([n.meta.get("val") for n in self.joint.primals()])
        if symbols is not None:
            lines.append(f"  size symbols (bytes at the example sizes): {symbols}")
        redone = ", ".join(n.name for n in self.recomputed)
        lines.append(f"  recomputed in backward: {redone or '-'}")
        return "\n".join(line.rstrip() for line in lines)

    def __str__(self) -> str:
        return self.report()


def _offloaded(joint: JointGraph, saved: Iterable[fx.Node], asked: set[fx.Node]) -> list[fx.Node]:
    """The saved values to keep in host memory: those the strategy asked for or a remat policy
    tagged ``MUST_OFFLOAD``, where the offload rules allow it and no other saved value shares
    their storage (a view saved beside them would keep the buffer on the device anyway)."""
    problem = cut_problem(joint)
    saved = list(saved)
    holders = Counter(storage_of(n)[0] for n in saved)
    return [
        n
        for n in saved
        if n in problem
        and problem[n].can_offload
        and holders[storage_of(n)[0]] == 1
        and (n in asked or problem[n].tag is Policy.MUST_OFFLOAD)
    ]


def _type(s: SavedValue) -> str:
    if s.dtype is None:
        return "-"
    if s.shape_expr is not None:
        return format_value_type(torch.empty(0, dtype=s.dtype, device="meta")).split("[")[0] + (
            f"[{', '.join(s.shape_expr)}]"
        )
    return format_value_type(torch.empty(s.shape, dtype=s.dtype, device="meta"))


def _bytes(s: SavedValue) -> str:
    """A saved value's storage bytes; with symbolic sizes, the formula and its value at the
    example sizes (``8*s0*s1 = 960``)."""
    return str(s.storage_bytes) if s.bytes_expr is None else f"{s.bytes_expr} = {s.storage_bytes}"


def _short_source(src: str | None) -> str:
    if not src:
        return ""
    path, _, rest = src.partition(":")
    return path.rsplit("/", 1)[-1] + ":" + rest


def format_bytes(n: int) -> str:
    """``16384`` -> ``'16.0 KiB'``.

    >>> format_bytes(16384), format_bytes(12)
    ('16.0 KiB', '12 B')
    """
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def get_strategy(strategy: str | Strategy) -> tuple[str, Strategy]:
    """Resolve a strategy name (via the registry) or accept a callable as is."""
    if isinstance(strategy, str):
        found: Strategy = registered_strategy(strategy)
        return strategy, found
    if callable(strategy):
        return getattr(strategy, "__name__", type(strategy).__name__), strategy
    known = ", ".join(repr(n) for n in strategy_names(aliases=True))
    raise InvalidArgumentError(
        f"partition: strategy={describe(strategy)} is not accepted; strategy must be a "
        f"registered name ({known}) or a callable (joint, **options) -> nodes to save"
    )


#: partition()'s own parameters: never options of a strategy
_OWN_PARAMETERS = ("joint", "strategy")


class UnknownStrategyError(InvalidArgumentError, UnknownNameError):
    """A transform given ``partition=`` a name no strategy is registered under: an
    :class:`InvalidArgumentError` (a bad argument, raised when the transform is made) that is
    also the :class:`UnknownNameError` the registry raises for it at a call.

    >>> import functrans as ft
    >>> try:
    ...     ft.jit(lambda x: x.sum(), partition="mincut")
    ... except ft.InvalidArgumentError as e:
    ...     print(isinstance(e, ft.UnknownNameError), e)
    True jit: partition='mincut' is not a registered partition strategy (did you mean
    'min_cut'?); partition must be one of 'checkpoint', 'default', ...
    """


def check_partition_options(
    where: str, strategy: str | Strategy, options: Mapping[str, object]
) -> None:
    """Check a transform's ``partition=`` and partition ``options`` when the transform is made,
    not at its first call: a strategy name that is not registered (the registry loads the
    built-in strategies and the installed plugins before it answers), an option the strategy
    does not take, a value its declared option check refuses (``register(...,
    check_options=...)``), or one of :func:`partition`'s own parameters, raises
    :class:`InvalidArgumentError` naming the transform, the argument, the value and what is
    accepted.

    >>> check_partition_options("jit", "min_cut", {"strategy": "default"})
    Traceback (most recent call last):
    ...
    functrans._core.errors.InvalidArgumentError: jit: strategy='default' (str) is not a partition
    option; the strategy is chosen with partition=..., e.g. partition='default'
    >>> check_partition_options("jit", "memory_budget", {"budgt": 0.3})
    Traceback (most recent call last):
    ...
    functrans._core.errors.InvalidArgumentError: jit: memory_budget: unknown option budgt=0.3 (did
    you mean budget?); accepted options: budget, max_bytes, peak_bytes, ...
    """
    for key in _OWN_PARAMETERS:
        if key in options:
            raise InvalidArgumentError(
                f"{where}: {key}={describe(options[key])} is not a partition option; the "
                f"strategy is chosen with partition=..., e.g. partition={options[key]!r}"
            )
    try:
        name, fn = get_strategy(strategy)  # a plugin that failed to load raises its PluginError
    except UnknownNameError:
        assert isinstance(strategy, str)  # only names are looked up
        known = strategy_names(aliases=True)
        close = difflib.get_close_matches(strategy, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UnknownStrategyError(
            f"{where}: partition={strategy!r} is not a registered partition strategy{hint}; "
            f"partition must be one of {', '.join(map(repr, known))} (register your own with "
            "functrans.partitioners.register) or a callable (joint, **options) -> nodes to save"
        ) from None
    try:
        _check_options(name, fn, options, registered=isinstance(strategy, str))
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"{where}: {e}") from None


def _check_options(
    name: str, fn: Strategy, options: Mapping[str, object], *, registered: bool
) -> None:
    """``options`` against strategy ``fn``'s signature, then against the check the strategy
    registered as ``name`` declared (``registered``: ``fn`` came from the registry)."""
    check_call(name, fn, options)
    if registered:
        check_strategy_options(name, options)


def partition(joint: JointGraph, strategy: str | Strategy = "default", **options: Any) -> Partition:
    """Cut ``joint`` into forward and backward graphs with ``strategy``.

    An option the strategy does not take raises :class:`InvalidArgumentError` listing the ones
    it takes; a strategy that returns anything but an iterable of forward nodes or node names
    raises :class:`InvalidPartitionError` naming the strategy and what it returned.

    >>> import torch, functrans as ft
    >>> jg = ft.joint(lambda x, w: torch.tanh(x @ w).sum())(torch.ones(4, 4), torch.ones(4, 4))
    >>> p = ft.partition(jg, "full_remat")
    >>> [s.name for s in p.saved], p.activation_bytes, p.recomputed
    (['primals_1', 'primals_2'], 0, (mm, tanh))
    """
    check_joint("partition", joint)
    name, fn = get_strategy(strategy)
    # unknown options list the accepted ones; bad values say what is accepted
    _check_options(name, fn, options, registered=isinstance(strategy, str))
    joint = _replayable(joint)  # random ops the backward may draw again: see replay
    with no_gc():
        returned = fn(joint, **options)
    cut = returned if isinstance(returned, Cut) else Cut(tuple(saved_items(name, returned)))
    return apply_cut(joint, cut, name)


#: a joint graph's copy whose random ops the backward may draw again (its own: not copied)
_REPLAYABLE: Attachment[JointGraph | None] = Attachment("replayable", None)


def _replayable(joint: JointGraph) -> JointGraph:
    """:func:`~functrans._cut.replay.replayable` of ``joint``, made once per joint."""
    found = joint.attached(_REPLAYABLE)
    if found is None:
        found = replayable(joint)
        joint.attach(_REPLAYABLE, found)
    return found


def _adjusted(
    joint: JointGraph,
    picked: set[fx.Node],
    legal: set[fx.Node],
    asked: set[fx.Node],
    host: set[fx.Node],
) -> tuple[fx.Node, ...]:
    """Nodes the shared rules added to or dropped from the strategy's choice, and values it
    asked to offload that stay on the device."""
    return tuple(
        n
        for n in joint.fx_graph.nodes
        if (n in picked) != (n in legal) or (n in asked and n not in host)
    )


def apply_cut(joint: JointGraph, cut: Cut, strategy: str = "cut") -> Partition:
    """The :class:`Partition` that saves (and offloads) what ``cut`` names, after the shared
    rules (:meth:`~functrans.extend.CutProblem.legalize`): what :func:`partition` does with a
    strategy's choice. A strategy that plans by trying cuts uses it to see each one's
    :attr:`~Partition.peak_bytes`.

    >>> import torch, functrans as ft
    >>> from functrans.extend import Cut, apply_cut
    >>> jg = ft.joint(lambda x: torch.tanh(x).exp().sum())(torch.ones(256))
    >>> apply_cut(jg, Cut(saved=("tanh",))).recomputed
    (exp,)
    """
    name = strategy
    with no_gc():
        chosen = saved_items(name, cut.saved + cut.offloaded)
        try:
            picked = resolve_nodes(joint, chosen)
            legal = cut_problem(joint).legalize(picked)
            s = split(joint, legal)
            asked = resolve_nodes(joint, cut.offloaded)
            host = _offloaded(joint, s.saved, asked)
        except InvalidPartitionError as e:
            raise InvalidPartitionError(
                f"partition strategy {name!r} chose an invalid saved set: {e}"
            ) from e
        forward, backward = insert_transfers(s.forward, s.backward, [n.name for n in host])
        if drawn_once(forward.fx_graph):  # the forward draws once, as eager does
            forward.graph_module.recompile()
    saved = tuple(SavedValue.of(n) for n in s.saved)
    p = Partition(
        joint=joint,
        strategy=name,
        forward=forward,
        backward=backward,
        saved=saved,
        recomputed=s.recomputed,
        recompute_flops=sum(flops(n) for n in s.recomputed) + inner_recompute(backward.fx_graph),
        adjusted=_adjusted(joint, set(picked), set(legal), set(asked), set(host)),
        offloaded=tuple(v for v in saved if v.node in host),
    )
    log(
        "partition",
        f"{name}: forward, backward, saved values",
        lambda: f"{p.forward}\n{p.backward}\n{p.report()}",
    )
    return p
