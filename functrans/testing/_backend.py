"""``check_backend``: compile a function's graphs with a codegen backend and compare the results
with eager autograd."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from functrans._core.backends import get_backend
from functrans._core.graph import JointGraph
from functrans._core.pytree import flatten, unflatten
from functrans._cut.partition import Partition, Strategy, partition
from functrans._trace.joint import joint
from functrans._trace.trace import trace

from ._check import assert_close, compare, describe, seeded

__all__ = ["check_backend", "check_compiled", "compile_partition"]


def _backend(backend: Any) -> Any:
    """A registered backend by name, or a backend object (anything with ``compile``) as is."""
    if isinstance(backend, str):
        return get_backend(backend)
    return backend


def compile_partition(
    p: Partition, args: Sequence[Any], backend: Any
) -> Callable[[Sequence[Any], tuple[torch.Tensor, ...]], tuple[Any, Any]]:
    """A runner ``(args, tangents) -> (outputs, grads)`` for ``p`` compiled by ``backend``: the
    forward graph now (for ``args``), the backward graph when it runs (for the saved values the
    forward returned and the tangents, as ``jit`` hands them over)."""
    jg: JointGraph = p.joint
    fwd = _backend(backend).compile(p.forward, flatten((tuple(args), {}))[0])
    n = jg.num_outputs

    def run(a: Sequence[Any], tangents: tuple[torch.Tensor, ...]) -> tuple[Any, Any]:
        flat = list(fwd(*flatten((tuple(a), {}))[0]))
        outs, saved = flat[:n], flat[n:]
        if len(saved) != len(p.saved):
            raise AssertionError(
                f"backend {backend!r}: forward returned {len(saved)} saved values, the "
                f"partition saves {len(p.saved)}"
            )
        bwd = _backend(backend).compile(p.backward, [*saved, *tangents])
        grads = list(bwd(*saved, *tangents))
        return unflatten(jg.fn_out, outs), unflatten(jg.grads_flat, grads)

    return run


def check_backend(
    f: Callable[..., Any],
    args: Sequence[Any],
    backend: Any = "aten",
    strategy: str | Strategy = "default",
    **options: Any,
) -> Partition:
    """Compile ``f`` with the codegen ``backend`` (a registered name, or an object with
    ``compile(graph, example_inputs)``) and compare with eager autograd: the forward
    and backward graphs of its ``strategy`` partition (outputs and gradients), and its
    forward-only inference graph (outputs). Random ops run under the same seed on both sides.

    Fails with a message that shows the program, the saved set and the mismatching value.

    >>> import torch
    >>> from functrans.testing import check_backend
    >>> p = check_backend(lambda x: (x.sin() * x).sum(), (torch.randn(3),), "aten", "min_cut")
    >>> [s.name for s in p.saved]
    ['primals_1']
    """
    jg = joint(f)(*args)
    jg.verify()
    p = partition(jg, strategy, **options)
    return check_compiled(f, args, p, backend)


def check_compiled(
    f: Callable[..., Any], args: Sequence[Any], p: Partition, backend: Any, inference: bool = True
) -> Partition:
    """:func:`check_backend` on an existing partition ``p`` of ``f`` (``inference=False`` skips
    the inference graph)."""
    saved = [f"{s.name}: {s.op} {s.dtype} {list(s.shape)}" for s in p.saved]
    context = (
        f"backend: {backend!r}, strategy: {p.strategy!r}\n  saved: {saved}\n"
        f"  recomputed: {[n.name for n in p.recomputed]}"
    )
    compare(f, args, p.joint, compile_partition(p, args, backend), context)
    if not inference:
        return p
    g = trace(f)(*args)  # what jit runs for inference calls
    tensors = flatten((tuple(args), {}))[0]
    run = _backend(backend).compile(g, tensors)
    with seeded():
        outs = unflatten(g.out_flat, list(run(*tensors)))
    with seeded(), torch.no_grad():
        expected = f(*args)
    assert_close(outs, expected, "inference output", f"{describe(f)}\n  backend: {backend!r}")
    return p
