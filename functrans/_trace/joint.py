"""``joint(f)(*args)``: forward and backward traced into one :class:`JointGraph`.

The joint function runs ``f`` on the primals under autograd, then ``torch.autograd.grad`` with
the tangents, and the whole thing is traced by ``make_fx``: forward and backward end up in one
graph, connected only by data flow, which is what lets a partitioner plan globally what to save.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec

import optree
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from functrans._core.dtypes import differentiable
from functrans._core.errors import TraceError, UnsupportedOpError
from functrans._core.fakes import fakes_of, trace_as_themselves
from functrans._core.graph import JointGraph, Role, assign_phases
from functrans._core.logs import log
from functrans._core.pytree import (
    NAMESPACE,
    Flat,
    Wrapper,
    flatten,
    leaves_of,
    rebuild_leaves,
    unflatten,
)
from functrans._core.shapes import Dynamic, refuse_size_outputs, resolve, symbolic_fakes
from functrans._core.state import autocast_off
from functrans._core.validate import check_argnums, check_bool, check_callable

from . import stops
from .decomp import Decompositions, decomposition_table
from .escape import refuse_escapes
from .options import OPTIONS, TraceOptions, options
from .passes import InputSpec, canonicalize, no_gc
from .record import late_inputs, no_stack_traces, untraced
from .regions import Undifferentiable
from .regions import extension as _region_extension  # noqa: F401  # registers its extension
from .regions import session as region_session
from .trace import (
    arg_names,
    check_inputs,
    flatten_args,
    refuse_closure_outputs,
    trace,
    trace_module,
)

__all__ = ["joint", "normalize_argnums"]

_P = ParamSpec("_P")


def normalize_argnums(argnums: int | Sequence[int] | None, nargs: int) -> tuple[int, ...]:
    """``None`` -> all positional args; an int or a tuple selects them (negative ints allowed)."""
    if argnums is None:
        return tuple(range(nargs))
    picked = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    for i in picked:
        if not isinstance(i, int) or not -nargs <= i < nargs:
            raise TraceError(
                f"argnums={argnums!r} names argument {i!r}, but the function was called with "
                f"{nargs} positional arguments"
            )
    normalized = tuple(i % nargs for i in picked)
    if len(set(normalized)) != len(normalized):
        raise TraceError(f"argnums={argnums!r} names an argument twice")
    return normalized


def _is_float(t: torch.Tensor) -> bool:
    """Differentiated as eager does: floating-point and complex leaves."""
    return differentiable(t)


def _diff_leaves(args: tuple[Any, ...], argnums: tuple[int, ...]) -> list[int]:
    """Flat indices (into the tensor leaves of ``(args, kwargs)``) of the differentiated float
    leaves, in ``argnums`` order: the order the grads come out in.
    """
    offsets, start = [], 0
    for a in args:
        leaves, _ = flatten(a)
        offsets.append([start + j for j, t in enumerate(leaves) if _is_float(t)])
        start += len(leaves)
    return [i for n in argnums for i in offsets[n]]


def _grads_structure(args: tuple[Any, ...], argnums: tuple[int, ...], is_int: bool) -> Any:
    """The grads pytree: the tensor where a gradient goes, ``None`` for every other leaf."""

    def slot(x: Any) -> Any:
        return x if isinstance(x, torch.Tensor) and _is_float(x) else None

    per_arg = [optree.tree_map(slot, args[i], namespace=NAMESPACE) for i in argnums]
    return per_arg[0] if is_int else tuple(per_arg)


@contextlib.contextmanager
def _tracing(read: TraceOptions) -> Iterator[None]:
    """A joint trace's frame: its options bound, the collector waiting, out of inference
    mode (under it autograd records nothing: the backward would be zeros; the trace runs on
    fake tensors, so leaving it costs nothing)."""
    with OPTIONS.bound(read), no_gc(), torch.inference_mode(False):
        yield


def joint(
    f: Callable[_P, Any],
    *,
    argnums: int | Sequence[int] | None = None,
    has_aux: bool = False,
    decompositions: Decompositions = "core",
    dynamic: Dynamic = False,
) -> Callable[_P, JointGraph]:
    """Trace ``f`` forward+backward into one :class:`JointGraph`.

    The result computes ``(outputs, grads)`` from ``(primals, tangents)``: ``primals`` are the
    positional arguments, ``tangents`` one cotangent per floating-point output leaf. With
    ``has_aux``, ``f`` returns ``(output, aux)`` and ``aux`` gets no tangent. ``joint(f)``
    takes ``f``'s parameters. ``dynamic`` keeps input dimensions symbolic, as in
    :func:`~functrans.trace`. Repeated blocks are traced once each
    (:mod:`functrans._trace.regions`) unless ``FUNCTRANS_REGIONS=0`` when ``joint`` is called.

    >>> import torch, functrans as ft
    >>> jg = ft.joint(lambda x: (x * x).sum())(torch.ones(3))
    >>> outs, grads = jg((torch.tensor([1.0, 2.0, 3.0]),), (torch.tensor(1.0),))
    >>> outs, grads
    (tensor(14.), (tensor([2., 4., 6.]),))
    """
    check_callable("joint", "f", f)
    if argnums is not None:
        check_argnums("joint", argnums)
    check_bool("joint", "has_aux", has_aux)
    table = decomposition_table(decompositions)
    read = options()  # the environment's (or an enclosing trace's), read once, here

    def traced(*args: _P.args, **kwargs: _P.kwargs) -> JointGraph:
        try:
            try:
                with _tracing(read), region_session(table):
                    return build(*args, **kwargs)
            except Undifferentiable:  # a gradient differentiated again: blocks inline
                with _tracing(read), region_session(table, on=False):
                    return build(*args, **kwargs)
        except RuntimeError as e:
            if "in-place operation" in str(e):  # autograd refused to mutate a leaf: name it
                trace(f, decompositions=decompositions)(*args, **kwargs)
            raise

    def build(*args: Any, **kwargs: Any) -> JointGraph:
        nums = normalize_argnums(argnums, len(args))
        tensors, fn_in = flatten_args(f, (args, kwargs))
        check_inputs(f, tensors, fn_in)
        wrt = _diff_leaves(args, nums)
        mask = [i in wrt for i in range(len(tensors))]
        paths = arg_names(f, fn_in)
        dims = resolve(dynamic, paths, tensors)
        fakes: list[torch.Tensor]
        if dims is None:
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            fakes = fakes_of(mode, tensors)
        else:
            fakes = symbolic_fakes(tensors, dims, paths)
        found: list[_Outputs] = []
        joint_fn = _joint_function(f, fn_in, wrt, _outputs_check(f, has_aux, dims), found)
        inputs = trace_as_themselves(
            [t.requires_grad_(m) for t, m in zip(fakes, mask, strict=True)]
        )
        gm = trace_module(joint_fn, inputs, user_fn=f, table=table, input_paths=paths)
        every = lambda: arg_names(f, fn_in, every_leaf=True)  # noqa: E731
        refuse_escapes(
            f,
            gm,
            "joint",
            statics=fn_in.static,
            static_names=every,
            input_names=paths,
            real_inputs=tensors,
        )
        (outs,) = found
        out_tree, differentiable, fn_out = outs.tree, outs.differentiable, outs.flat
        wants_tangent, tangents = outs.wants_tangent, outs.tangents
        tangent_paths = [p for p, w in zip(fn_out.tensor_paths(), wants_tangent, strict=True) if w]
        specs = [InputSpec(f"primals_{i + 1}", Role.PRIMAL, p) for i, p in enumerate(paths)]
        specs += [
            InputSpec(f"tangents_{i + 1}", Role.TANGENT, f"tangent of output{p}")
            for i, p in enumerate(tangent_paths)
        ]
        gm = canonicalize(gm, specs)
        assign_phases(gm.graph)
        _, in_flat = flatten(((args, tuple(tangents)), kwargs))
        grads_tree = _grads_structure(args, nums, isinstance(argnums, int))
        _, out_flat = flatten((out_tree, grads_tree))
        jg = JointGraph(
            gm,
            in_flat,
            out_flat,
            fn_in=fn_in,
            fn_out=fn_out,
            grads_flat=flatten(grads_tree)[1],
            num_outputs=fn_out.num_tensors,
            argnums=nums,
            differentiable=differentiable,
        )
        log("joint", f"joint graph of {getattr(f, '__qualname__', f)}", lambda: str(jg))
        return jg

    return traced


@dataclass(frozen=True)
class _Outputs:
    """What the joint trace learned of ``f``'s outputs when it ran it."""

    tree: Any  # the result, its tensors detached
    flat: Flat
    differentiable: tuple[bool, ...]  # per flat tensor: requires grad (not no_grad/detached)
    wants_tangent: list[bool]
    tangents: list[torch.Tensor]  # the tangent inputs the trace made, one per wanted output


def _outputs_check(
    f: Callable[..., Any], has_aux: bool, dims: Any
) -> Callable[[Any, list[torch.Tensor], Flat], list[bool]]:
    """Checks ``f``'s result as the trace meets it; returns which flat outputs get a tangent."""

    def check(result: Any, outs: list[torch.Tensor], flat: Flat) -> list[bool]:
        refuse_closure_outputs(f, flat.static)
        if dims is not None:
            refuse_size_outputs(f, [*flat.static, *outs])
        return _tangent_mask(f, result, outs, has_aux)

    return check


def _joint_function(
    f: Callable[..., Any],
    fn_in: Flat,
    wrt_index: list[int],
    check: Callable[[Any, list[torch.Tensor], Flat], list[bool]],
    found: list[_Outputs],
) -> Callable[..., list[torch.Tensor]]:
    """The flat function ``(*primals) -> [*outputs, *grads]`` that gets traced. It makes the
    tangents inputs of the trace when ``f``'s outputs are known (:func:`late_inputs`), so
    ``f`` runs once, and leaves what it learned of them in ``found``."""
    n_primals = fn_in.num_tensors

    def joint_fn(*leaves: torch.Tensor) -> list[torch.Tensor]:
        primals = list(leaves[:n_primals])
        with torch.enable_grad():
            # tensor subclasses (DTensor) are differentiated as themselves: rebuilt around
            # their inner tensors, their gradients taken apart again below
            rebuilt = rebuild_leaves(fn_in, primals)
            for i in wrt_index:
                if rebuilt[i] is not primals[i] and not rebuilt[i].requires_grad:
                    rebuilt[i].requires_grad_()
            a, kw = unflatten(fn_in, rebuilt, rebuilt=True)
            with stops.recording():  # where autograd stops in the forward, noted
                result = f(*a, **kw)
            outs, flat = flatten(result)
            raw = [t for t in leaves_of(result)[0] if isinstance(t, torch.Tensor)]
            wants_tangent = check(result, outs, flat)
            # contiguous, as callers (and autograd) usually hand them in
            cots = late_inputs([o for o, w in zip(outs, wants_tangent, strict=True) if w])
            with untraced():
                tree = optree.tree_map(
                    lambda x: x.detach() if isinstance(x, torch.Tensor) else x,
                    result,
                    namespace=NAMESPACE,
                )
            differentiable = tuple(t.requires_grad for t in raw)
            found.append(_Outputs(tree, flat, differentiable, wants_tangent, cots))
            wrt = [rebuilt[i] for i in wrt_index]
            diff_outs = [o for o, w in zip(raw, wants_tangent, strict=True) if w]
            cots = [_like(o, t) for o, t in zip(diff_outs, cots, strict=True)]
            pairs = [(o, t) for o, t in zip(diff_outs, cots, strict=True) if o.requires_grad]
            grads: Sequence[torch.Tensor | None] = [None] * len(wrt)
            if pairs and wrt:
                # backward as eager runs it: loss.backward() is called outside autocast (as
                # torch recommends), so backward ops see no autocast
                with autocast_off(), no_stack_traces():
                    grads = torch.autograd.grad(
                        [o for o, _ in pairs], wrt, [t for _, t in pairs], allow_unused=True
                    )
        full = [
            _inner_grad(g if g is not None else torch.zeros_like(w), w)
            for g, w in zip(grads, wrt, strict=True)
        ]
        # a detach is a node of the trace (with a stack trace): only where there is a graph.
        # Plain tensors' detaches need no torch-function mode (each would see the ~20 metadata
        # reads of tracking a result: 5 ms a block of 13 parameters)
        plain = all(type(t) is FakeTensor for t in (*full, *outs))
        with torch._C.DisableTorchFunction() if plain else contextlib.nullcontext():
            detached = [g.detach() if g.requires_grad else g for g in full]
            return [o.detach() for o in outs] + detached

    return joint_fn


def _like(out: torch.Tensor, tangent: torch.Tensor) -> torch.Tensor:
    """``tangent`` (a plain tensor) as the same tensor subclass as ``out``. A cotangent lives in
    the dual space: where a DTensor output is Partial (a pending sum), its cotangent is
    Replicate (what ``torch.ones_like`` of it gives, and what eager ``backward()`` uses)."""
    wrapper = Wrapper.of(out)
    if wrapper is None:
        return tangent
    rebuilt = wrapper.rebuild(tangent)
    placements = getattr(out, "placements", None)
    if placements is not None and any(p.is_partial() for p in placements):
        from torch.distributed.tensor import DTensor, Replicate

        dual = [Replicate() if p.is_partial() else p for p in placements]
        mesh = getattr(out, "device_mesh")  # noqa: B009  # a DTensor's, untyped for mypy
        rebuilt = DTensor.from_local(
            tangent, mesh, dual, run_check=False, shape=out.shape, stride=out.stride()
        )
    return rebuilt


def _inner_grad(g: torch.Tensor, wrt: torch.Tensor) -> torch.Tensor:
    """The gradient ``g`` of ``wrt`` as what its graph output holds: for a tensor subclass, its
    inner tensor, laid out as ``wrt`` is (a DTensor gradient is redistributed to ``wrt``'s
    placements first)."""
    wrapper = Wrapper.of(wrt)
    if wrapper is None:
        return g
    if hasattr(g, "redistribute") and hasattr(wrt, "placements"):
        g = g.redistribute(getattr(wrt, "device_mesh"), getattr(wrt, "placements"))  # noqa: B009
    found = Wrapper.of(g)
    if found is None or found.cls is not wrapper.cls or found.size != wrapper.size:
        raise UnsupportedOpError(
            f"the gradient of a {type(wrt).__qualname__} input is laid out differently from "
            "the input; functrans cannot return it as the input's inner tensor"
        )
    return found.inner(g)


def _tangent_mask(
    f: Callable[..., Any], out_tree: Any, out_vals: list[torch.Tensor], has_aux: bool
) -> list[bool]:
    """Which output leaves get a tangent: float leaves (of ``output`` only, with has_aux)."""
    floats = [_is_float(o) for o in out_vals]
    if not has_aux:
        return floats
    if not (isinstance(out_tree, tuple) and len(out_tree) == 2):
        raise TraceError(
            f"{getattr(f, '__qualname__', f)} was marked has_aux=True, so it must return a pair "
            f"(output, aux); it returned {type(out_tree).__name__}"
        )
    n_main = len(flatten(out_tree[0])[0])
    return [fl and i < n_main for i, fl in enumerate(floats)]
