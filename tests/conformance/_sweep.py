"""OpInfo conformance: run torch's own op database through functrans and compare with eager.

For every OpInfo in ``op_db`` that supports autograd in float32 on CPU, each sample input goes
through ``trace``, ``joint`` and every registered partition strategy (with each of its example
option sets); outputs and gradients are compared with eager autograd on the same sample and the
same cotangents. Each sample ends in one of:

- ``passed``: every graph agrees with eager (a float32 mismatch counts as agreement only if the
  same sample, upcast to float64, agrees tightly: the difference was rounding, not math);
- ``unsupported``: functrans refused with ``TraceError`` or ``UnsupportedOpError``, whose
  message names the op -- a clear, documented limitation;
- ``wrong``: a graph ran and returned a different value than eager: a silent wrong result;
- ``error``: functrans crashed with an exception other than those (an internal error, an
  invalid graph or partition);
- ``skipped``: the sample cannot be checked against eager (eager itself fails, nothing
  requires grad, the op is random), with the reason. Random ops are still checked for
  consistency: every strategy must agree with the unpartitioned joint graph under one seed.

An op's status is the worst of its samples' (``wrong`` > ``error`` > ``unsupported`` >
``passed``); an op all of whose samples were skipped is ``skipped``.
"""

from __future__ import annotations

import re
import time
import traceback
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

import functrans as ft
from functrans import partitioners
from functrans.codegen import _native

RANK = {"wrong": 4, "error": 3, "unsupported": 2, "passed": 1, "skipped": 0}
# a clear refusal; any other FunctransError (GraphError, InvalidPartitionError) is a bug: "error"
UNSUPPORTED = (ft.TraceError, ft.UnsupportedOpError)
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float64: (1e-7, 1e-7)}


class Skip(Exception):
    """The sample cannot be checked; the message says why."""


class Mismatch(AssertionError):
    """A functrans graph disagrees with eager autograd."""


def op_key(op: Any) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def select_ops(keys: Sequence[str] | None = None) -> list[Any]:
    """OpInfos that support autograd in float32 on CPU (all of them, or those named)."""
    from torch.testing._internal.common_methods_invocations import op_db

    ops = [
        op
        for op in op_db
        if op.supports_autograd
        and torch.float32 in op.supported_dtypes("cpu")
        and torch.float32 in op.supported_backward_dtypes("cpu")
    ]
    if keys is None:
        return ops
    by_key = {op_key(op): op for op in ops}
    missing = [k for k in keys if k not in by_key]
    if missing:
        raise KeyError(f"not OpInfos with float32 autograd on CPU: {missing}")
    return [by_key[k] for k in keys]


def strategies() -> list[tuple[str, dict[str, Any]]]:
    return [
        (name, dict(opts)) for name in partitioners.names() for opts in partitioners.examples(name)
    ]


# ----------------------------------------------------------------------------------------------
# one sample as a function of its tensors


def _real_view(out: Any) -> Any:
    """Complex outputs as real pairs, so their gradients get checked as well."""
    return pytree.tree_map(
        lambda x: (
            torch.view_as_real(x.resolve_conj())
            if isinstance(x, torch.Tensor) and x.is_complex()
            else x
        ),
        out,
    )


def bind(
    op: Any, sample: Any, dtype: torch.dtype
) -> tuple[Callable[..., Any], list[torch.Tensor], int]:
    """``(f, tensors, n_diff)``: ``f(*tensors)`` runs the sample; the first ``n_diff`` tensors
    are the ones the sample marks ``requires_grad`` (they get gradients).
    """
    leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    diff = [i for i in where if leaves[i].requires_grad]
    order = diff + [i for i in where if not leaves[i].requires_grad]

    tensors = [_convert(leaves[i].detach(), dtype) for i in order]
    process = sample.output_process_fn_grad

    def f(*ts: torch.Tensor) -> Any:
        new = list(leaves)
        for i, t in zip(order, ts, strict=True):
            new[i] = t
        inp, args, kwargs = pytree.tree_unflatten(new, spec)
        return _real_view(process(op(inp, *args, **kwargs)))

    f.__qualname__ = f"opinfo[{op_key(op)}]"
    return f, tensors, len(diff)


def _convert(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype`` with the same strides and storage offset in a storage of the same
    length: ops like ``as_strided`` read the storage around a view, not just the view.
    """
    if t.dtype != torch.float32 or dtype == torch.float32:
        return t
    if t.layout != torch.strided:
        return t.to(dtype)
    whole = t.new_empty(0).set_(t.untyped_storage(), 0, (t.untyped_storage().nbytes() // 4,))
    return whole.to(dtype).as_strided(t.shape, t.stride(), t.storage_offset())


def _tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """Tensor leaves, sparse ones as dense (so they can be compared)."""
    return [
        x if x.layout == torch.strided else x.to_dense()
        for x in pytree.tree_leaves(tree)
        if isinstance(x, torch.Tensor)
    ]


def _floats(tree: Any) -> list[torch.Tensor]:
    return [x for x in _tensor_leaves(tree) if x.is_floating_point()]


def eager(
    f: Callable[..., Any], tensors: Sequence[torch.Tensor], n_diff: int, seed: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], tuple[torch.Tensor, ...]]:
    """Eager ``(outputs, grads, tangents)``; the tangents are seeded random cotangents, one per
    floating-point output, which is the order functrans' joint graphs take them in.
    """
    xs = [t.detach().requires_grad_(i < n_diff) for i, t in enumerate(tensors)]
    torch.manual_seed(RNG_SEED)
    out = f(*xs)
    gen = torch.Generator().manual_seed(seed)
    floats = _floats(out)
    tangents = tuple(torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in floats)
    pairs = [(o, t) for o, t in zip(floats, tangents, strict=True) if o.requires_grad]
    wrt = xs[:n_diff]
    grads: Sequence[torch.Tensor | None] = [None] * n_diff
    if pairs:
        grads = torch.autograd.grad(
            [o for o, _ in pairs], wrt, [t for _, t in pairs], allow_unused=True
        )
    full = [g if g is not None else torch.zeros_like(x) for g, x in zip(grads, wrt, strict=True)]
    return [o.detach() for o in _tensor_leaves(out)], [g.detach() for g in full], tangents


def compare(actual: Any, expected: Sequence[torch.Tensor], what: str) -> None:
    got = _tensor_leaves(actual)
    if len(got) != len(expected):
        raise Mismatch(f"{what}: {len(got)} tensors, eager has {len(expected)}")
    for i, (a, e) in enumerate(zip(got, expected, strict=True)):
        rtol, atol = TOLERANCES.get(e.dtype, (0.0, 0.0))
        try:
            torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True)
        except AssertionError as err:
            first = str(err).strip().splitlines()
            raise Mismatch(f"{what}[{i}]: {' '.join(first[:3])}") from None


# ----------------------------------------------------------------------------------------------
# checking one sample


def _is_random(f: Callable[..., Any], tensors: Sequence[torch.Tensor]) -> bool:
    outs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        with torch.no_grad():
            outs.append(_tensor_leaves(f(*tensors)))
    return any(
        a.shape == b.shape and not torch.equal(a, b) and not (a.isnan() | b.isnan()).any()
        for a, b in zip(*outs, strict=True)
    )


def _random_ops(graph: torch.fx.Graph) -> list[str]:
    return sorted(
        {
            str(n.target)
            for n in graph.nodes
            if isinstance(n.target, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded in n.target.tags
        }
    )


RNG_SEED = 42  # every run, eager and graph, starts from this seed (OpInfo's own, too)


def _triton_backend() -> Any:
    """The ``"triton"`` codegen backend when triton is installed, else None."""
    from functrans import codegen
    from functrans.codegen.triton import runtime

    return codegen.get_backend("triton") if runtime.available() else None


BACKEND = _triton_backend()


def _check_backend(
    p: Any,
    tensors: list[torch.Tensor],
    tangents: tuple[torch.Tensor, ...],
    reference: tuple[list[torch.Tensor], list[torch.Tensor]],
) -> None:
    """The partition's forward and backward compiled by the Triton backend (kernels run in
    Triton's interpreter) against the reference outputs and grads."""
    fwd = BACKEND.compile(p.forward, tensors)
    torch.manual_seed(RNG_SEED)
    flat = fwd(*tensors)
    n_out = len(flat) - len(p.saved)
    compare(flat[:n_out], reference[0], "output")
    wanted = [n for n in p.backward.placeholders()][len(p.saved) :]
    bwd = BACKEND.compile(p.backward, [*flat[n_out:], *tangents[: len(wanted)]])
    compare(bwd(*flat[n_out:], *tangents[: len(wanted)]), reference[1], "grad")


NATIVE = _native.native_module() is not None  # the aten backend's C++ executor is built


def _check_native(p: Any, tensors: list[torch.Tensor], tangents: tuple[torch.Tensor, ...]) -> None:
    """The ``"aten"`` backend's native executor runs the partition bit for bit as the FX graphs
    do: the same outputs, and the same grads from a backward fed each side's own saved values
    (saved values themselves may hold memory nobody wrote, e.g. eval-mode rrelu's noise from
    ``empty``, which no backward reads). A graph it declines runs in Python: nothing to check."""
    if not NATIVE:
        return
    fwd = _native.native_function(p.forward.graph_module)
    bwd = _native.native_function(p.backward.graph_module)
    if fwd is None or bwd is None:
        return
    n_tangents = len(p.backward.placeholders()) - len(p.saved)
    results = []
    for run_fwd, run_bwd in ((p.forward.graph_module, p.backward.graph_module), (fwd, bwd)):
        torch.manual_seed(RNG_SEED)
        flat = list(run_fwd(*tensors))
        n_out = len(flat) - len(p.saved)
        grads = list(run_bwd(*flat[n_out:], *tangents[:n_tangents]))
        results.append((flat[:n_out], grads))
    for label, want, got in zip(("output", "grad"), *results, strict=True):
        if len(got) != len(want) or not all(map(_identical, got, want)):
            raise Mismatch(f"native executor: {label} differs from the FX graph's")


def _identical(a: Any, b: Any) -> bool:
    """Same type, layout and bits (NaNs where the other has NaNs)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return type(a) is type(b) and bool(a == b)
    if (a.shape, a.dtype, a.stride()) != (b.shape, b.dtype, b.stride()):
        return False
    try:
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    except AssertionError:
        return False
    return True


def check_sample(
    f: Callable[..., Any],
    tensors: list[torch.Tensor],
    n_diff: int,
    configs: Sequence[tuple[str, dict[str, Any]]],
) -> None:
    """Raise Skip, Mismatch, a FunctransError or anything else; return if every graph agrees.

    Random ops are compared with eager too: eager and every graph start from one seed, so a
    graph that draws what eager draws passes. If the draws differ (OpInfo's ``wrapper_set_seed``
    reseeds inside the op, which a graph cannot see), the sample is skipped with that reason
    after checking that every strategy agrees with the joint graph under one seed.
    """
    if n_diff == 0:
        raise Skip("no input requires grad")
    try:
        e_outs, e_grads, tangents = eager(f, tensors, n_diff, seed=0)
        random = _is_random(f, tensors)
    except Exception as e:
        raise Skip(f"eager reference fails: {type(e).__name__}: {_first_line(e)}") from None
    try:
        g = ft.trace(f)(*tensors)
    except ft.FunctransError as e:
        e.args = (f"trace: {e}",)
        raise
    random_ops = _random_ops(g.fx_graph)
    try:
        _check_graphs(f, g, tensors, n_diff, configs, (e_outs, e_grads), tangents)
    except Mismatch as e:
        if not (random or random_ops):
            raise
        jg = ft.joint(f, argnums=tuple(range(n_diff)))(*tensors)
        torch.manual_seed(RNG_SEED)
        j_outs, j_grads = jg(tuple(tensors), tangents)
        reference = (_tensor_leaves(j_outs), _tensor_leaves(j_grads))
        _check_graphs(f, None, tensors, n_diff, configs, reference, tangents)
        raise Skip(
            f"random op ({', '.join(random_ops) or 'seeded inside'}): eager draws other numbers "
            f"({e}); checked: every strategy agrees with the joint graph under one seed"
        ) from None


def _check_graphs(
    f: Callable[..., Any],
    g: Any,
    tensors: list[torch.Tensor],
    n_diff: int,
    configs: Sequence[tuple[str, dict[str, Any]]],
    reference: tuple[list[torch.Tensor], list[torch.Tensor]],
    tangents: tuple[torch.Tensor, ...],
) -> None:
    """Trace output (when ``g`` is given), joint graph and every partition against
    ``reference`` (outputs, grads), each run from ``RNG_SEED``."""
    e_outs, e_grads = reference
    stage = "trace"
    try:
        if g is not None:
            torch.manual_seed(RNG_SEED)
            compare(g(*tensors), e_outs, "trace output")
        stage = "joint"
        jg = ft.joint(f, argnums=tuple(range(n_diff)))(*tensors)
        jg.verify()
        torch.manual_seed(RNG_SEED)
        j_outs, j_grads = jg(tuple(tensors), tangents)
        compare(j_outs, e_outs, "joint output")
        compare(j_grads, e_grads, "joint grad")
        for name, opts in configs:
            stage = f"partition {name} {opts or ''}".strip()
            p = ft.partition(jg, name, **opts)
            torch.manual_seed(RNG_SEED)
            outs, saved = p.forward(*tensors)
            compare(outs, e_outs, f"{stage}: output")
            compare(p.backward(saved, tangents), e_grads, f"{stage}: grad")
            p.forward.verify()
            p.backward.verify()
        stage = "aten native executor (min_cut)"
        _check_native(ft.partition(jg, "min_cut"), tensors, tangents)
        if BACKEND is not None:
            stage = "triton backend (min_cut)"
            _check_backend(ft.partition(jg, "min_cut"), tensors, tangents, reference)
    except (Mismatch, ft.FunctransError) as e:
        e.args = (f"{stage}: {e}" if not str(e).startswith(stage) else str(e),)
        raise


_CALL = "return _real_view(process(op(inp, *args, **kwargs)))"  # the line in bind's f


def _first_line(e: BaseException) -> str:
    """The first line of a message, without this file's path and source line (which functrans
    errors quote as the user's line): the same reason on every machine.
    """
    text = (str(e).strip().splitlines() or [""])[0]
    text = re.sub(r"/\S*_sweep\.py:\d+: ", "", text)
    return text.replace(f"`{_CALL}`", "the op call").replace(_CALL, "the op call")[:300]


def run_sample(
    op: Any, sample: Any, configs: Sequence[tuple[str, dict[str, Any]]]
) -> tuple[str, str]:
    """``(status, reason)`` of one sample (reason empty when it passed)."""
    try:
        check_sample(*bind(op, sample, torch.float32), configs)
        return "passed", ""
    except Skip as e:
        return "skipped", str(e)
    except UNSUPPORTED as e:
        return "unsupported", f"{type(e).__name__}: {_first_line(e)}"
    except Mismatch as e:
        fp32 = f"float32: {e}"
    except Exception as e:
        where = traceback.extract_tb(e.__traceback__)[-1]
        return "error", f"{type(e).__name__}: {_first_line(e)} ({where.name})"
    try:  # float32 mismatch: rounding, or math? float64 decides
        check_sample(*bind(op, sample, torch.float64), configs)
        return "passed", f"float32 rounding only ({fp32}); float64 agrees"
    except Mismatch as e:
        return "wrong", f"{fp32}; float64: {e}"
    except Exception as e:
        return "wrong", f"{fp32}; float64 run failed: {type(e).__name__}: {_first_line(e)}"


def samples(op: Any) -> Iterator[Any]:
    torch.manual_seed(zlib.crc32(op_key(op).encode()))
    yield from op.sample_inputs("cpu", torch.float32, requires_grad=True)


def run_op(op: Any, max_samples: int | None = None) -> dict[str, Any]:
    """Check the first ``max_samples`` samples of ``op``; its status, counts and reasons."""
    configs = strategies()
    start = time.perf_counter()
    outcomes: list[tuple[str, str]] = []
    try:
        for i, sample in enumerate(samples(op)):
            if max_samples is not None and i >= max_samples:
                break
            outcomes.append(run_sample(op, sample, configs))
    except Exception as e:  # the OpInfo's own sample generator failed
        outcomes.append(("skipped", f"sample_inputs fails: {type(e).__name__}: {_first_line(e)}"))
    counts = {s: sum(1 for o, _ in outcomes if o == s) for s in RANK}
    status = max((o for o, _ in outcomes), key=RANK.__getitem__, default="skipped")
    reasons = sorted({r for o, r in outcomes if o == status and r})
    notes = sorted({r for o, r in outcomes if o == "passed" and r})
    result: dict[str, Any] = {
        "status": status,
        "samples": {k: v for k, v in counts.items() if v},
        "seconds": round(time.perf_counter() - start, 2),
    }
    if status != "passed":
        result["reason"] = "; ".join(reasons[:3]) or "no samples"
    if notes:
        result["notes"] = notes[:2]
    return result
