"""``jit(grad(f, partition=s))`` and ``jit(vmap(grad(f, partition=s)))``: trace the plan.

Inlined into a forward trace, a gradient would be cut by the jit's own CSE and partition, not by
the strategy ``grad`` was given. For an inference call of such a function, jit traces the
function :func:`plan` builds instead: ``f``'s joint graph (for ``vmap(grad)``, the per-example
joint graph eager plans,
:func:`~functrans._transforms.transform_records.plan_per_example`) cut by ``s``, its forward
then its backward, so the compiled graph saves between them what ``s`` chose and recomputes the
rest (traced without CSE, which would merge the recomputation back). The plans are read from
the records ``grad`` and ``vmap`` leave (:mod:`functrans._transforms.transform_records`).

>>> import torch, functrans as ft
>>> g = ft.jit(ft.grad(lambda x: torch.sin(x).sum(), partition="min_cut"))
>>> torch.allclose(g(torch.zeros(3)), torch.ones(3))
True
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from functrans._core.backends import Backend
from functrans._core.graph import JointGraph
from functrans._core.marks import leave
from functrans._core.pytree import Flat, flatten, unflatten
from functrans._core.shapes import Dims
from functrans._core.stack import transform_frame
from functrans._cut.partition import Partition, partition
from functrans._trace.decomp import Decompositions
from functrans._trace.joint import joint
from functrans._trace.regions import deferred as deferred_regions
from functrans._trace.regions.graph import REGIONS
from functrans._trace.trace import ArgPaths
from functrans._transforms.grad import check_differentiable, scalar_output
from functrans._transforms.transform_records import (
    GradSpec,
    PerExample,
    VmapOfGrad,
    grad_name,
    plan_of,
    plan_per_example,
)

from .captures import Captures
from .outline import OUTLINED
from .step_plan import blockwise, outlined

__all__ = ["Plan", "PlannedCall", "Stitched", "plan"]


@dataclass(frozen=True)
class Stitched:
    """The function a plan traces (the partition's forward then its backward) and the
    partition it stitches (what :meth:`~functrans._jit.jitted.Jitted.partitions` reports)."""

    fn: Callable[..., Any]
    partition: Partition


#: Given the decompositions and the backend, the function to trace (None: the plan does not
#: apply).
Plan = Callable[[Decompositions, Backend], Stitched | None]


@dataclass(frozen=True)
class PlannedCall:
    """The jitted call a plan is made for: the jitted function's captures and name (for
    errors), the call's structure, its example leaves ``(diff, other)`` and their names, its
    symbolic dimensions, and ``written``: the tensor leaves the function writes in place (a
    training batch norm's running statistics, lifted), by position; the plan's function then
    returns ``(result, their final values)`` for jit to write back, as a traced function with
    writes does."""

    captures: Captures
    owner: str
    flat: Flat
    example: Any
    paths: list[str]
    dims: Dims | None
    written: tuple[int, ...] = ()


def plan(f: Callable[..., Any], call: PlannedCall) -> Plan | None:
    """The plan for an inference entry of jitted ``f`` (None: ``f`` is traced as it is)."""
    spec, batched = plan_of(f, GradSpec), plan_of(f, VmapOfGrad)
    if spec is not None and _chosen(spec, call.dims):
        return _planned_grad(spec, call)
    if batched is not None and _chosen(batched.spec, call.dims) and not call.written:
        return _planned_per_example(batched, call)
    return None


def _chosen(spec: GradSpec, dims: Dims | None) -> bool:
    """Whether ``jit(grad(f))`` traces the gradient from a plan (``f``'s joint graph cut by
    the ``partition=`` grad was given), not inline: always with static shapes; with symbolic
    ones only for a strategy the user chose (plans are traced at static shapes), since the
    inline gradient saves what ``"default"`` would."""
    return dims is None or spec.partition != "default" or bool(spec.options)


def _planned_grad(spec: GradSpec, call: PlannedCall) -> Plan:
    """For ``jit(grad(f, partition=s))``: ``f``'s joint graph cut by ``s``, its forward then
    its backward; repeated blocks kept as regions and cut block by block as a training step's
    are (:mod:`functrans._jit.step_plan`), so a peak goal is planned as the step runs. The
    leaves ``f`` writes (``written``) are copied inside the joint graph, and the copies'
    final values are outputs without a tangent, beside ``f``'s aux (:func:`_writing`)."""
    flat, written = call.flat, call.written
    leaves = [*call.example[1]]  # an inference entry: no input is differentiated
    target = call.captures.swapping(spec.f)
    if written:
        target = _writing(target, flat, written, spec.has_aux)
    options = dict(spec.options)

    def make(decompositions: Decompositions, backend: Backend) -> Stitched:
        a, kw = unflatten(flat, leaves)

        def traced() -> JointGraph:
            with transform_frame(grad_name(spec), spec.f):  # errors name jit(grad(f))
                check_differentiable(spec.f, a, spec.argnums)
                return joint(
                    target,
                    argnums=spec.argnums,
                    has_aux=spec.has_aux or bool(written),
                    decompositions=decompositions,
                )(*a, **kw)

        p = _blockwise(traced, spec.partition, options, backend, call.dims)
        if p is None:
            p = partition(traced(), spec.partition, **options)

        def stitched(diff: tuple[Any, ...], other: tuple[Any, ...]) -> Any:
            a, kw = unflatten(flat, list(other))
            value, saved = p.forward(*a, **kw)
            value, copies = _written(value, spec.has_aux) if written else (value, ())
            out = scalar_output(spec.f, value, spec.has_aux)
            grads = p.backward(saved, (torch.ones_like(out),))
            if spec.with_value:
                result = value, grads
            else:
                result = (grads, value[1]) if spec.has_aux else grads
            return (result, copies) if written else result

        return _stitched(stitched, p, spec, call)

    return make


def _writing(
    f: Callable[..., Any], flat: Flat, written: tuple[int, ...], has_aux: bool
) -> Callable[..., Any]:
    """``f`` called with copies of the tensor leaves at ``written`` (what it writes in place
    lands on them); returns ``(loss, (aux, copies))`` (``(loss, copies)`` without
    ``has_aux``), so the copies are outputs a joint graph gives no tangent."""

    def writing(*a: Any, **kw: Any) -> Any:
        tensors, inner = flatten((a, kw), static_argnums=flat.static_argnums)
        copies = tuple(tensors[i].clone() for i in written)
        for i, c in zip(written, copies, strict=True):
            tensors[i] = c
        a, kw = unflatten(inner, tensors)
        out = f(*a, **kw)
        if has_aux:
            loss, aux = out
            return loss, (aux, copies)
        return out, copies

    functools.update_wrapper(writing, f, updated=())
    return writing


def _written(value: Any, has_aux: bool) -> tuple[Any, tuple[torch.Tensor, ...]]:
    """What :func:`_writing`'s function returned, parted: ``f``'s value and the copies."""
    loss, rest = value
    if has_aux:
        aux, copies = rest
        return (loss, aux), tuple(copies)
    return loss, tuple(rest)


def _planned_per_example(batched: VmapOfGrad, call: PlannedCall) -> Plan:
    """For ``jit(vmap(grad(f, partition=s)))``: as :func:`_planned_grad`, for the per-example
    joint graph eager ``vmap(grad)`` plans (None where that plan does not apply: the batched
    function is traced as it is)."""
    spec, flat = batched.spec, call.flat
    leaves, target = [*call.example[1]], call.captures.swapping(batched.spec.f)

    def plan_for(a: tuple[Any, ...]) -> PerExample | None:
        return plan_per_example(spec, target, batched.in_dims, batched.randomness, a)

    def make(decompositions: Decompositions, backend: Backend) -> Stitched | None:
        a, kw = unflatten(flat, leaves)
        first = plan_for(a)
        if first is None:
            return None
        with transform_frame("vmap", spec.f), transform_frame(grad_name(spec), spec.f):
            jg = joint(
                first.total, argnums=spec.argnums, has_aux=True, decompositions=decompositions
            )(*first.args, **kw)
        p = partition(jg, spec.partition, **dict(spec.options))

        def stitched(diff: tuple[Any, ...], other: tuple[Any, ...]) -> Any:
            a, kw = unflatten(flat, list(other))
            again = plan_for(a)
            assert again is not None  # the same shapes as the plan above
            (total, values), saved = p.forward(*again.args, **kw)
            grads = p.backward(saved, (torch.ones_like(total),))
            return again.finish(values, grads)

        return _stitched(stitched, p, spec, call)

    return make


def _blockwise(
    traced: Callable[[], JointGraph],
    strategy: Any,
    options: dict[str, Any],
    backend: Backend,
    dims: Dims | None,
) -> Partition | None:
    """The joint graph ``traced()`` gives, its repeated blocks kept as regions and cut block
    by block, partitioned; None where that does not apply (no regions, symbolic sizes, a
    strategy that is neither local nor a peak goal, or a goal no block-by-block plan meets:
    the unrolled graph's strategy decides, and names the floor)."""
    if dims is not None or not blockwise(strategy, options):
        return None
    with deferred_regions() as held:
        jg = traced()
    jg.attach(REGIONS, tuple(held.regions))
    if not jg.attached(REGIONS):
        return partition(jg, strategy, **options)
    found = outlined(jg, strategy, options, backend)
    if isinstance(found, JointGraph):
        p = partition(found, strategy, **options)
    elif found.planned is None:
        return None
    else:
        p = found.best(traced, strategy, options)
    for o in p.joint.attached(OUTLINED):
        o.compile()
    return p


def _stitched(fn: Callable[..., Any], p: Partition, spec: GradSpec, call: PlannedCall) -> Stitched:
    fn.__qualname__ = getattr(spec.f, "__qualname__", call.owner)
    leave(fn, ArgPaths(tuple(call.paths)))  # errors inside name the jitted function's arguments
    return Stitched(fn, p)
