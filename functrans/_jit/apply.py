"""A compiled :mod:`functrans._jit.jitted` entry and the autograd Functions that run it.

:class:`Entry` holds one specialization's flat-tensor callables; :class:`Apply` runs its
forward graph as one autograd node that saves exactly the partition's saved values, and its
backward graph in backward (:class:`ApplySubclass` for tensor-subclass inputs such as DTensor).

A backward autograd runs with ``create_graph=True`` (a gradient penalty, a Hessian-vector
product, ``torch.autograd.functional.hessian``) must itself be differentiable: the compiled
one is not (it computes from saved values with no history). There, :class:`Twice` runs the
function again, eagerly, on the call's own inputs (held weakly since the forward: nothing more
stays alive) and lets autograd differentiate it with ``create_graph=True``: eager's double
backward, its formulas included, at the cost of one more forward where it is asked for.
Steps that draw random numbers (dropout) raise a named error there: a second run would draw
other numbers.
"""

from __future__ import annotations

import contextvars
import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from functrans._core.dtypes import differentiable
from functrans._core.errors import UnsupportedOpError
from functrans._core.ops import is_view_op
from functrans._core.pytree import Flat, Wrapper, flatten, rebuild_leaves
from functrans._core.shapes import ShapeGuard
from functrans._core.state import autocast_off
from functrans._cut.partition import Partition

from .failures import explain

__all__ = [
    "OVERWRITES",
    "Apply",
    "ApplySubclass",
    "Entry",
    "OutMeta",
    "Staged",
    "Twice",
    "apply_graphs",
    "inner_tangent",
    "inner_tensors",
    "run_backward",
    "run_forward",
    "unreached",
    "write_back",
]


@dataclass(frozen=True, slots=True)
class OutMeta:
    """One flat output of a compiled forward, as its backward needs it."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    takes_tangent: bool  # floating outputs; integers and booleans are not differentiable
    # requires grad as in eager: not an output made under no_grad() or detached in the function
    differentiable: bool

    @classmethod
    def of(cls, val: torch.Tensor, takes_tangent: bool, differentiable: bool) -> OutMeta:
        return cls(val.shape, val.dtype, val.device, takes_tangent, differentiable)

    def zeros(self, shape: torch.Size | None = None) -> torch.Tensor:
        """The tangent autograd passes as None: zeros of this output's type (of ``shape``
        where the output's sizes are symbolic)."""
        size = self.shape if shape is None else shape
        return torch.zeros(size, dtype=self.dtype, device=self.device)


class Staged(Protocol):
    """A step compiled in stages (:class:`functrans._jit.staged.Stages`), as an entry sees it."""

    def run(
        self, entry: Entry, apply: Callable[..., Any], inputs: Sequence[torch.Tensor]
    ) -> list[Any]: ...

    def twice(self, make: Callable[[Entry, Any], Twice]) -> Staged: ...


@dataclass(frozen=True)
class Entry:
    """One compiled specialization: flat-tensor callables plus how to rebuild the outputs."""

    forward: Callable[..., list[Any]]
    #: the compiled backward in the boxed convention (:mod:`functrans._core.boxed`): one list of
    #: saved values then tangents, which it empties; None: an inference entry (forward only)
    backward: Callable[[list[Any]], list[Any]] | None
    out_flat: Flat
    out_meta: tuple[OutMeta, ...]
    num_diff: int  # the first num_diff inputs are differentiated
    num_inputs: int
    partition: Partition | None
    copies: dict[int, int]  # flat output -> flat input it is an unmodified copy of
    #: inputs or outputs are tensor subclasses (DTensor): taken apart around the graphs
    subclass: bool = False
    #: a dynamic entry's guards (None: static shapes)
    shape: ShapeGuard | None = None
    #: which saved values are tensors (None: all; a dynamic forward also saves sizes)
    saved_tensors: tuple[bool, ...] | None = None
    #: differentiated inputs no output depends on: their gradient is None, as in eager
    absent: tuple[int, ...] = ()
    #: per differentiated input, the flat outputs its gradient is computed from: with none
    #: of them given a gradient (``autograd.grad(out0, (w1, w2), allow_unused=True)``), it
    #: is None, as eager finds the input unreachable
    grad_outputs: tuple[frozenset[int], ...] = ()
    #: the function turns grad mode on itself (``torch.enable_grad()`` in a body called under
    #: ``torch.no_grad()``): run through autograd with grad mode on, as its body ran
    enable_grad: bool = False
    #: ``(saved position, input index)`` for saved values that are non-differentiated inputs
    #: or views of one (buffers, the batch): what :data:`OVERWRITES` may have to copy
    saved_inputs: tuple[tuple[int, int], ...] = ()
    #: an inference entry's forward graph (a training entry's are its partition's): what an
    #: error names its node and line from
    forward_graph: torch.fx.GraphModule | None = None
    #: how a training entry's backward is differentiated again (``create_graph=True``)
    twice: Twice | None = None
    #: the inputs the function writes in place (positions among the entry's inputs): its
    #: last flat outputs are their final values, copied into them after each call
    writes: tuple[int, ...] = ()
    #: a step compiled in stages, where it returns intermediates other outputs are computed
    #: from (:mod:`functrans._jit.staged`): its calls run those, not ``forward``
    stages: Staged | None = None

    @functools.cached_property
    def own_nodes(self) -> tuple[int, ...]:
        """The outputs that require grad, where there are several: each gets an autograd
        node of its own (a view) after the compiled one, as eager's have. Siblings on one node,
        a hook on an output no gradient reaches would be called (with None) whenever the node
        runs for another; eager never calls it."""
        at = tuple(i for i, m in enumerate(self.out_meta) if m.differentiable)
        return at if len(at) > 1 else ()

    @functools.cached_property
    def frozen(self) -> tuple[int, ...]:
        """The outputs that do not require grad (integers, booleans, values made under
        ``torch.no_grad()``): marked non-differentiable, as eager autograd leaves them."""
        return tuple(i for i, m in enumerate(self.out_meta) if not m.differentiable)


#: Set by a caller that overwrites some inputs in place once the forward returns (a jitted
#: module writing back the buffers it updates): ``(entry, inputs) -> input indices`` it will
#: overwrite. A saved value that is such an input (or a view of one) is saved as a copy, so that
#: backward reads what the forward read, as eager's own saved clone would be (spectral norm's
#: power-iteration vectors); saved by reference, the write-back would bump its version.
OVERWRITES: contextvars.ContextVar[Callable[[Entry, Sequence[torch.Tensor]], set[int]] | None] = (
    contextvars.ContextVar("functrans_overwrites", default=None)
)


def _unshared(entry: Entry, tensors: Sequence[torch.Tensor], flat: list[Any]) -> None:
    """Replace, in ``flat``, saved values that alias an input the caller overwrites by copies
    of the same sizes and strides."""
    hook = OVERWRITES.get()
    written = hook(entry, tensors) if hook is not None else set()
    written = {*written, *entry.writes}  # and what its own write-back overwrites
    if not written:
        return
    n = len(entry.out_meta)
    for at, i in entry.saved_inputs:
        if i in written:
            v = flat[n + at]
            copy = torch.empty_strided(v.size(), v.stride(), dtype=v.dtype, device=v.device)
            flat[n + at] = copy.copy_(v)


def saved_inputs(
    forward: torch.fx.GraphModule, num_outputs: int, num_diff: int
) -> tuple[tuple[int, int], ...]:
    """:attr:`Entry.saved_inputs` of a partition's forward graph: saved outputs (those after
    the first ``num_outputs``) that are inputs from ``num_diff`` on, or views of them."""
    index = {n: i for i, n in enumerate(forward.graph.find_nodes(op="placeholder"))}
    out: Any = forward.graph.output_node().args[0]
    found = []
    for at, node in enumerate(list(out)[num_outputs:]):
        while isinstance(node, torch.fx.Node) and is_view_op(node):
            node = node.args[0]
        i = index.get(node) if isinstance(node, torch.fx.Node) else None
        if i is not None and i >= num_diff:
            found.append((at, i))
    return tuple(found)


def run_forward(entry: Entry, tensors: Sequence[torch.Tensor]) -> list[Any]:
    """``entry``'s compiled forward on ``tensors``; an error it raises gets a note with the op
    and the user's line (:func:`functrans._jit.failures.explain`)."""
    try:
        return entry.forward(*tensors)
    except Exception as e:
        p = entry.partition
        explain(e, p.forward.graph_module if p is not None else entry.forward_graph, "forward")
        raise


def run_backward(entry: Entry, args: list[Any]) -> list[Any]:
    """``entry``'s compiled backward (boxed: it empties ``args``), explained as
    :func:`run_forward` is."""
    assert entry.backward is not None
    try:
        return entry.backward(args)
    except Exception as e:
        p = entry.partition
        explain(e, p.backward.graph_module if p is not None else None, "backward")
        raise


class Twice:
    """How one entry's backward is differentiated: the function run again, eagerly, on the
    call's own inputs, and differentiated by autograd with ``create_graph=True``: eager's own
    double backward, formulas included (see the module docstring).

    >>> import torch, functrans as ft
    >>> f = ft.jit(lambda x: (x.sin() * x).sum())
    >>> x = torch.tensor([0.5, 1.0], requires_grad=True)
    >>> (g,) = torch.autograd.grad(f(x), x, create_graph=True)
    >>> torch.autograd.grad(g.sum(), x)[0]  # d2/dx2 of sum(sin(x) x): 2 cos x - x sin x
    tensor([1.5155, 0.2391])
    """

    def __init__(
        self, fn: Callable[..., Any], num_diff: int, owner: str, random: object | None
    ) -> None:
        """``fn``: the entry's flat function ``(diff_leaves, other_leaves) -> result``;
        ``random``: a random op its graph draws with (None: none)."""
        self._fn, self._num_diff, self._owner, self._random = fn, num_diff, owner, random

    def grads(
        self, inputs: Sequence[torch.Tensor], tangents: Sequence[torch.Tensor | None]
    ) -> list[Any]:
        """The gradients of the first ``num_diff`` inputs given a tangent per flat output
        (None: none), differentiable in ``inputs`` and ``tangents``."""
        if self._random is not None:
            raise UnsupportedOpError(
                f"{self._owner}: differentiating the compiled backward again "
                "(create_graph=True) runs the step again from its inputs, and it draws "
                f"random numbers ({self._random}): a second run would draw others. Call this "
                "function without ft.jit where its gradient is differentiated, or take the "
                "inner gradient inside the jitted function"
            )
        n = self._num_diff
        # each input through a node of its own: the gradient at it counts only the paths from
        # the outputs that run through it, not those through another input computed from it
        # (``f(x, 2 * x)``; a later stage's inputs from an earlier one), which autograd adds
        diff = [t.view_as(t) if t.requires_grad else t for t in inputs[:n]]
        with torch.enable_grad():
            result = self._fn(tuple(diff), tuple(inputs[n:]))
        outs, _ = flatten(result)
        pairs = [
            (o, t) for o, t in zip(outs, tangents, strict=True) if t is not None and o.requires_grad
        ]
        if not pairs:
            return [None] * n
        return list(
            torch.autograd.grad(
                [o for o, _ in pairs],
                diff,
                [t for _, t in pairs],
                create_graph=True,
                allow_unused=True,
            )
        )


class Apply(torch.autograd.Function):
    """Runs a compiled forward graph; its backward runs the compiled backward graph."""

    @staticmethod
    def forward(ctx: Any, entry: Entry, *tensors: torch.Tensor) -> Any:
        n = len(entry.out_meta)
        if entry.twice is not None:  # weakly: a create_graph backward recomputes from them
            ctx.inputs = tuple(map(weakref.ref, tensors))
        ctx.set_materialize_grads(False)  # which outputs got no gradient: see unreached()
        flat = run_forward(entry, tensors)
        if entry.saved_inputs:
            flat = list(flat)
            _unshared(entry, tensors, flat)
        ctx.entry = entry
        if entry.saved_tensors is None:
            ctx.save_for_backward(*flat[n:])
        else:  # sizes of a dynamic entry travel beside the tensors
            mask = entry.saved_tensors
            ctx.save_for_backward(*[v for v, t in zip(flat[n:], mask, strict=True) if t])
            ctx.sizes = [v for v, t in zip(flat[n:], mask, strict=True) if not t]
        if entry.shape is not None:
            ctx.shapes = [o.shape for o in flat[:n]]
        if entry.frozen:
            ctx.mark_non_differentiable(*[flat[i] for i in entry.frozen])
        return tuple(flat[:n])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        entry: Entry = ctx.entry
        assert entry.backward is not None
        if entry.shape is None:
            tangents = [
                g.contiguous() if g is not None else m.zeros()
                for g, m in zip(grads, entry.out_meta, strict=True)
                if m.takes_tangent
            ]
        else:  # zeros of the output's size at this call
            tangents = [
                g.contiguous() if g is not None else m.zeros(shape)
                for g, m, shape in zip(grads, entry.out_meta, ctx.shapes, strict=True)
                if m.takes_tangent
            ]
        none = unreached(entry, grads)
        if torch.is_grad_enabled() and entry.twice is not None:  # create_graph=True
            flat_grads = _twice(ctx, entry, grads, none)
            return (None, *flat_grads, *([None] * (entry.num_inputs - entry.num_diff)))
        args = _consume_saved(ctx, entry)
        args += tangents
        del tangents
        with autocast_off(), torch.no_grad():  # the backward graph holds its own casts
            flat_grads = run_backward(entry, args)  # frees each saved value after its last use
        flat_grads = _once(_without(flat_grads, none))
        return (None, *flat_grads, *([None] * (entry.num_inputs - entry.num_diff)))


class ApplySubclass(torch.autograd.Function):
    """:class:`Apply` for tensor-subclass (DTensor) inputs and outputs: autograd sees the
    subclass tensors themselves; the compiled graphs take and give their inner tensors."""

    @staticmethod
    def forward(ctx: Any, entry: Entry, *tensors: torch.Tensor) -> Any:
        n = len(entry.out_meta)
        ctx.ins = [Wrapper.of(t) for t in tensors]
        flat = run_forward(entry, inner_tensors(tensors))
        ctx.entry = entry
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*flat[n:])
        outs = rebuild_leaves(entry.out_flat, flat[:n])
        if entry.frozen:
            ctx.mark_non_differentiable(*[outs[i] for i in entry.frozen])
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        entry: Entry = ctx.entry
        assert entry.backward is not None
        wrappers = entry.out_flat.wrappers or (None,) * len(grads)
        tangents = [
            inner_tangent(g, w, m)
            for g, w, m in zip(grads, wrappers, entry.out_meta, strict=True)
            if m.takes_tangent
        ]
        none = unreached(entry, grads)
        args = _consume_saved(ctx, entry)
        args += tangents
        del tangents
        with autocast_off(), torch.no_grad():
            flat_grads = run_backward(entry, args)
        flat_grads = _once(_without(flat_grads, none))
        ins = ctx.ins[: entry.num_diff]
        wrapped = [
            g if w is None or g is None else w.rebuild(g)
            for g, w in zip(flat_grads, ins, strict=True)
        ]
        return (None, *wrapped, *([None] * (entry.num_inputs - entry.num_diff)))


def write_back(entry: Entry, outs: list[Any], inputs: Sequence[torch.Tensor]) -> list[Any]:
    """Copy the final values of the inputs ``entry`` writes in place (its last outputs) into
    those inputs, as AOTAutograd does; the other outputs. Under autograd the copy is recorded
    as eager records the in-place op: a leaf that requires grad refuses it as eager does, a
    value computed from one gets a history through the compiled function. An input the call
    turns out not to write (its final value an unmodified copy: a stale hint of
    :mod:`functrans._jit.disk.store` named it) is left alone, its version unchanged."""
    k = len(entry.writes)
    first = len(outs) - k
    for j, (at, value) in enumerate(zip(entry.writes, outs[-k:], strict=True)):
        if entry.copies.get(first + j) == at:  # not written: its copy holds what it held
            continue
        inputs[at].copy_(value)
    return outs[:-k]


def unreached(entry: Entry, grads: Sequence[torch.Tensor | None]) -> tuple[int, ...]:
    """The differentiated inputs whose gradient is None in eager: those no output depends on
    (:attr:`Entry.absent`), and those whose outputs all got no gradient (None) this time."""
    if all(g is not None for g in grads) or not entry.grad_outputs:
        return entry.absent
    given = {i for i, g in enumerate(grads) if g is not None}
    return tuple(i for i, outs in enumerate(entry.grad_outputs) if outs.isdisjoint(given))


def _twice(
    ctx: Any, entry: Entry, grads: Sequence[torch.Tensor | None], none: tuple[int, ...]
) -> list[Any]:
    """The backward of ``entry`` as a differentiable function of its inputs and ``tangents``
    (:class:`Twice`)."""
    assert entry.twice is not None
    inputs = [r() for r in ctx.inputs]
    if any(t is None for t in inputs):
        raise UnsupportedOpError(
            "functrans.jit: differentiating a compiled backward again (create_graph=True) "
            "recomputes the step from the inputs of its call, and one of them is gone (a "
            "temporary freed since the forward). Keep the inputs alive until the backward, or "
            "call the function without ft.jit there"
        )
    ctx.maybe_clear_saved_tensors()  # the compiled backward's values are not used
    return _without(entry.twice.grads(inputs, grads), none)


def _without(grads: Sequence[Any], absent: tuple[int, ...]) -> list[Any]:
    """``grads`` with None where no output depends on the input (eager's ``.grad`` stays
    None there: an optimizer skips it, ``p.grad is None`` checks see it)."""
    out = list(grads)
    for i in absent:
        out[i] = None
    return out


def _consume_saved(ctx: Any, entry: Entry) -> list[Any]:
    """The saved values as a list the backward may empty, with the autograd context's own
    references dropped (as eager autograd drops a node's saved tensors once it ran), so that
    each is freed after its last use in backward. Under ``retain_graph=True`` the context keeps
    them for the next backward."""
    saved = list(ctx.saved_tensors)
    ctx.maybe_clear_saved_tensors()  # a no-op under retain_graph=True
    if entry.saved_tensors is None:
        return saved
    tensors, sizes = iter(saved), iter(ctx.sizes)
    del saved
    return [next(tensors) if t else next(sizes) for t in entry.saved_tensors]


_TWICE = (
    b"functrans.jit: the backward of a compiled function is not differentiable again (this "
    b"backward ran with create_graph=True: a gradient penalty, a Hessian). Take the inner "
    b"gradient inside the jitted function (ft.jit(lambda x: penalty(ft.grad(f)(x)))), whose "
    b"trace then holds the double backward, or run this part without ft.jit"
)


def _once(grads: Sequence[Any]) -> list[Any]:
    """The gradients, made to raise if differentiated again. Under ``create_graph=True`` (grad
    mode on in backward) eager would build a graph of its backward; the compiled one cannot,
    and leaving the gradients detached would drop a gradient penalty's term silently. (torch's
    ``once_differentiable`` marks them only when an incoming gradient requires grad, which
    ``autograd.grad(loss, x, create_graph=True)``'s does not.)"""
    grads = list(grads)
    if not torch.is_grad_enabled():
        return grads
    at = [i for i, g in enumerate(grads) if differentiable(g)]
    if not at:
        return grads
    raising = torch._C._functions.DelayedError(_TWICE, len(at))
    marked = raising(*[grads[i].detach().requires_grad_() for i in at])
    for i, g in zip(at, marked if isinstance(marked, tuple) else (marked,), strict=True):
        grads[i] = g
    return grads


def inner_tensors(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The inner tensors of subclass tensors (DTensor: its local tensor); plain ones as is."""
    out = []
    for t in tensors:
        w = Wrapper.of(t)
        out.append(t if w is None else w.inner(t))
    return out


def inner_tangent(g: torch.Tensor | None, wrapper: Wrapper | None, meta: OutMeta) -> Any:
    """The graph's tangent from autograd's gradient of an output: zeros for None, the inner
    tensor for a subclass (a DTensor laid out as the traced cotangent first: Replicate where the
    output is Partial)."""
    if g is None:
        return meta.zeros()
    if wrapper is not None and hasattr(g, "redistribute"):
        from torch.distributed.tensor import Replicate

        placements = list(getattr(g, "placements", ()))
        wanted = [Replicate() if p.is_partial() else p for p in dtensor_placements(wrapper)]
        if placements != wanted:
            g = g.redistribute(getattr(g, "device_mesh"), wanted)  # noqa: B009
    if wrapper is not None:
        found = Wrapper.of(g)
        g = g if found is None else found.inner(g)
    return g.contiguous()


def dtensor_placements(wrapper: Wrapper) -> tuple[Any, ...]:
    """A DTensor wrapper's placements (its flatten context starts with them)."""
    ctx = wrapper.ctx
    return tuple(ctx[0]) if isinstance(ctx, tuple) and ctx else ()


# Function.apply without its Python layer, for guarded calls (functorch transforms never reach
# them: those calls run the function as written)
apply_graphs: Callable[..., Any] = super(torch.autograd.Function, Apply).apply
