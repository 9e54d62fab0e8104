"""OpInfo conformance: run torch's op database through functrans and compare with eager.

For every OpInfo in ``op_db`` that supports autograd in float32 on CPU, each sample input goes
through ``trace``, ``joint`` and every registered partition strategy (with each of its example
option sets), the aten backend's native executor and the Triton backend; outputs and gradients
are compared with eager autograd on the same sample and the same cotangents. Each sample ends
in one of:

- ``passed``: every graph agrees with eager. The bar is numerical, the one a compiled step
  must clear (DESIGN.md, "a compiled step's error against float64 is at most 2x eager's"):
  each float32 output and gradient's error against a float64 reference (eager autograd on the
  same sample and cotangents upcast to float64) is at most ``BOUND`` times eager float32's own
  error, plus ``FLOOR`` for results eager gets exact (see :func:`error`). Integer outputs, and
  results that have no float64 reference (a random sample: float64 draws other numbers; eager
  float32 further than ``UNREFERENCED`` from float64: an overflow float64 does not have), must
  equal eager float32's (within ``TOLERANCES``; a mismatch there counts as agreement if the
  same sample, upcast to float64, agrees tightly: the difference was rounding, not math);
- ``unsupported``: functrans refused with ``TraceError`` or ``UnsupportedOpError``, whose
  message names the op -- a clear, documented limitation;
- ``wrong``: a graph ran and returned a different value than eager, or one further from the
  float64 reference than the bound allows (the reason says which, and whether the float64
  run agrees: then precision was lost, not the math);
- ``error``: functrans crashed with an exception other than those (an internal error, an
  invalid graph or partition);
- ``skipped``: the sample cannot be checked against eager (eager itself fails, nothing
  requires grad), with the reason.

Random ops are checked like the others: OpInfo reseeds inside the op (``wrapper_set_seed``),
which functrans refuses in a traced function by design (graphs draw from the caller's
generator), so the harness takes that reseeding out (:func:`unseeded`) and seeds outside
instead: the generator is set to ``RNG_SEED`` before eager runs and before every graph runs,
and both must draw the same numbers.

An op's status is the worst of its samples' (``wrong`` > ``error`` > ``unsupported`` >
``passed``); an op all of whose samples were skipped is ``skipped``. Its ``error`` entry is the
worst checked result's error against float64 next to eager float32's (worst: furthest past its
share of the bound).
"""

from __future__ import annotations

import math
import re
import time
import traceback
import types
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
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
# A float32 result's error against float64 may be BOUND x eager float32's, plus FLOOR (in the
# units of error(): a fraction of the result's largest magnitude). The floor is for results
# eager gets exact or nearly so (views, copies, a max) or by luck: a short sum that cancels
# (nn.functional.hinge_embedding_loss: five terms up to 16.3 summing to -0.62) lands 9.6e-8
# from float64 in ATen's order and 1.6e-6 in the Triton backend's, both within half a float32
# ulp of the largest term. 32 ulps of the result: 25x tighter than TOLERANCES, and 8x below
# the errors it exists to catch (Triton's tanh near 0 in mish: 2.9e-5).
BOUND = 2.0
FLOOR = 32 * torch.finfo(torch.float32).eps
# Where eager float32 is further than this from float64 (an overflow or underflow float64 does
# not have: prod of many factors at 1.0, normalize of a near-zero row at 2e9), float64 says
# nothing of float32's rounding and 2x of that bounds nothing: eager float32 is the reference
UNREFERENCED = 1e-2


class Skip(Exception):
    """The sample cannot be checked; the message says why."""


class Mismatch(AssertionError):
    """A functrans graph disagrees with eager autograd."""


class Imprecise(Mismatch):
    """A functrans graph's result is further from the float64 reference than the bound."""


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
    name, op = op_key(op), unseeded(op)

    def f(*ts: torch.Tensor) -> Any:
        new = list(leaves)
        for i, t in zip(order, ts, strict=True):
            new[i] = t
        inp, args, kwargs = pytree.tree_unflatten(new, spec)
        return _real_view(process(op(inp, *args, **kwargs)))

    f.__qualname__ = f"opinfo[{name}]"
    return f, tensors, len(diff)


def _call(op: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return op(*args, **kwargs)


def unseeded(op: Any) -> Callable[..., Any]:
    """``op`` (an OpInfo) without OpInfo's reseeding: random ops run their function through
    ``wrapper_set_seed``, which calls ``torch.manual_seed(42)`` inside, so that two eager calls
    draw the same numbers. A traced function may not reseed (functrans refuses it: its graphs
    draw from the caller's generator), so the harness seeds outside instead (``RNG_SEED``
    before every eager and graph run) and calls the OpInfo's function with ``wrapper_set_seed``
    bound to a plain call. Any other op is returned as it is.
    """
    fn = getattr(op, "op", None)
    code = getattr(fn, "__code__", None)
    if fn is None or code is None or "wrapper_set_seed" not in code.co_names:
        return op  # type: ignore[no-any-return]
    scope = {**fn.__globals__, "wrapper_set_seed": _call}
    return types.FunctionType(code, scope, fn.__name__, fn.__defaults__, fn.__closure__)


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
    f: Callable[..., Any],
    tensors: Sequence[torch.Tensor],
    n_diff: int,
    seed: int,
    tangents: Sequence[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], tuple[torch.Tensor, ...]]:
    """Eager ``(outputs, grads, tangents)``; the tangents are seeded random cotangents, one per
    floating-point output, which is the order functrans' joint graphs take them in (or the
    ``tangents`` given, cast to the outputs' dtypes: the float64 reference takes float32's).
    """
    xs = [t.detach().requires_grad_(i < n_diff) for i, t in enumerate(tensors)]
    torch.manual_seed(RNG_SEED)
    out = f(*xs)
    floats = _floats(out)
    if tangents is None:
        gen = torch.Generator().manual_seed(seed)
        tangents = tuple(torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in floats)
    else:
        tangents = tuple(t.to(o.dtype) for o, t in zip(floats, tangents, strict=True))
    pairs = [(o, t) for o, t in zip(floats, tangents, strict=True) if o.requires_grad]
    wrt = xs[:n_diff]
    grads: Sequence[torch.Tensor | None] = [None] * n_diff
    if pairs:
        grads = torch.autograd.grad(
            [o for o, _ in pairs], wrt, [t for _, t in pairs], allow_unused=True
        )
    full = [g if g is not None else torch.zeros_like(x) for g, x in zip(grads, wrt, strict=True)]
    return [o.detach() for o in _tensor_leaves(out)], [g.detach() for g in full], tangents


@dataclass(frozen=True)
class Expected:
    """What every graph must reproduce: eager float32's outputs and grads and, where the
    sample has a float64 reference, eager float64's (``None`` where it has none)."""

    outs: list[torch.Tensor]
    grads: list[torch.Tensor]
    wide_outs: list[torch.Tensor] | None = None
    wide_grads: list[torch.Tensor] | None = None


@dataclass
class Numerics:
    """The worst error against float64 seen (``ours``), next to eager float32's (``eager``):
    worst is furthest past its share of the bound, ``ours / (BOUND * eager + FLOOR)``."""

    ours: float = 0.0
    eager: float = 0.0
    where: str = ""
    measured: bool = False

    def share(self) -> float:
        return self.ours / (BOUND * self.eager + FLOOR)

    def add(self, ours: float, eager: float, where: str) -> None:
        if not self.measured or ours / (BOUND * eager + FLOOR) > self.share():
            self.ours, self.eager, self.where, self.measured = ours, eager, where, True


def error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``x``'s error against ``ref``: the largest absolute difference over ``ref``'s finite
    entries, relative to their largest magnitude (absolute where that is 0); ``inf`` where the
    shapes or the non-finite entries differ (a NaN where ``ref`` has NaN, the same inf).

    Relative to the tensor's scale rather than entry by entry, so that entries that cancel to
    near zero (a gradient summed from terms of both signs) do not decide alone.
    """
    if x.shape != ref.shape:
        return math.inf
    if x.numel() == 0:
        return 0.0
    x, ref = x.detach().double(), ref.detach().double()
    finite = ref.isfinite()
    if not bool(finite.all()):
        a, b = x[~finite], ref[~finite]
        if not bool(((a == b) | (a.isnan() & b.isnan())).all()):
            return math.inf
        if not bool(finite.any()):
            return 0.0
        x, ref = x[finite], ref[finite]
    diff = float((x - ref).abs().max())
    scale = float(ref.abs().max())
    if math.isnan(diff):
        return math.inf
    return diff / scale if scale > 0 else diff


def compare(
    actual: Any,
    expected: Sequence[torch.Tensor],
    what: str,
    wide: Sequence[torch.Tensor] | None = None,
    numerics: Numerics | None = None,
) -> None:
    """``actual``'s tensors against eager's: float ones within the bound of the float64
    reference ``wide`` when it is given, the others (and all without ``wide``) close to
    eager float32's ``expected``."""
    got = _tensor_leaves(actual)
    if len(got) != len(expected):
        raise Mismatch(f"{what}: {len(got)} tensors, eager has {len(expected)}")
    for i, (a, e) in enumerate(zip(got, expected, strict=True)):
        if wide is not None and a.is_floating_point():
            _within_bound(a, e, wide[i], f"{what}[{i}]", numerics)
        else:
            _close(a, e, f"{what}[{i}]")


def _close(a: torch.Tensor, e: torch.Tensor, what: str) -> None:
    rtol, atol = TOLERANCES.get(e.dtype, (0.0, 0.0))
    try:
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True)
    except AssertionError as err:
        first = str(err).strip().splitlines()
        raise Mismatch(f"{what}: {' '.join(first[:3])}") from None


def _within_bound(
    a: torch.Tensor, e: torch.Tensor, w: torch.Tensor, what: str, numerics: Numerics | None
) -> None:
    """``a``'s error against ``w`` is at most ``BOUND`` x eager's (``e``'s) + ``FLOOR``."""
    if (a.shape, a.dtype) != (e.shape, e.dtype):
        raise Mismatch(f"{what}: {a.dtype}{list(a.shape)}, eager has {e.dtype}{list(e.shape)}")
    theirs = error(e, w)
    if not theirs <= UNREFERENCED:  # float64 is no reference for float32 here (or inf, NaN):
        _close(a, e, what)  # eager float32's own result is
        return
    ours = error(a, w)
    if numerics is not None:
        numerics.add(ours, theirs, what)
    if not ours <= BOUND * theirs + FLOOR:
        raise Imprecise(
            f"{what}: error {ours:.2g} against float64, eager float32's {theirs:.2g} "
            f"(bound {BOUND:g}x + {FLOOR:.2g})"
        )


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


RNG_SEED = 42  # every run, eager and graph, starts from this seed (the one OpInfo reseeds to)


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
    expected: Expected,
    numerics: Numerics | None,
) -> None:
    """The partition's forward and backward compiled by the Triton backend (kernels run in
    Triton's interpreter) against eager's outputs and grads."""
    fwd = BACKEND.compile(p.forward, tensors)
    torch.manual_seed(RNG_SEED)
    flat = fwd(*tensors)
    n_out = len(flat) - len(p.saved)
    compare(flat[:n_out], expected.outs, "output", expected.wide_outs, numerics)
    wanted = [n for n in p.backward.placeholders()][len(p.saved) :]
    bwd = BACKEND.compile(p.backward, [*flat[n_out:], *tangents[: len(wanted)]])
    grads = bwd(*flat[n_out:], *tangents[: len(wanted)])
    compare(grads, expected.grads, "grad", expected.wide_grads, numerics)


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
    wide: Sequence[torch.Tensor] | None = None,
    numerics: Numerics | None = None,
) -> None:
    """Raise Skip, Mismatch, a FunctransError or anything else; return if every graph agrees.

    ``wide``: the sample's tensors in float64, for the reference the numerics bound measures
    against (eager autograd on them, with the float32 cotangents upcast); the worst error seen
    goes to ``numerics``. Without ``wide``, or where the sample draws random numbers (float64
    draws other numbers than float32 from one generator state), or where eager float64 fails,
    results are compared with eager's of the same dtype.

    Random ops are compared with eager like the others: eager and every graph start from one
    generator state (``RNG_SEED``), and must draw the same numbers.
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
    expected = Expected(e_outs, e_grads)
    if wide is not None and not (random or _random_ops(g.fx_graph)):
        try:
            w_outs, w_grads, _ = eager(f, wide, n_diff, seed=0, tangents=tangents)
        except Exception:  # no float64 reference: compared with eager float32 alone
            pass
        else:
            if len(w_outs) == len(e_outs) and len(w_grads) == len(e_grads):
                expected = Expected(e_outs, e_grads, w_outs, w_grads)
    _check_graphs(f, g, tensors, n_diff, configs, expected, tangents, numerics)


def _check_graphs(
    f: Callable[..., Any],
    g: Any,
    tensors: list[torch.Tensor],
    n_diff: int,
    configs: Sequence[tuple[str, dict[str, Any]]],
    expected: Expected,
    tangents: tuple[torch.Tensor, ...],
    numerics: Numerics | None,
) -> None:
    """Trace output, joint graph, every partition, the native executor and the Triton backend
    against eager (``expected``), each run from ``RNG_SEED``."""

    def check_outs(actual: Any, what: str) -> None:
        compare(actual, expected.outs, what, expected.wide_outs, numerics)

    def check_grads(actual: Any, what: str) -> None:
        compare(actual, expected.grads, what, expected.wide_grads, numerics)

    stage = "trace"
    try:
        torch.manual_seed(RNG_SEED)
        check_outs(g(*tensors), "trace output")
        stage = "joint"
        jg = ft.joint(f, argnums=tuple(range(n_diff)))(*tensors)
        jg.verify()
        torch.manual_seed(RNG_SEED)
        j_outs, j_grads = jg(tuple(tensors), tangents)
        check_outs(j_outs, "joint output")
        check_grads(j_grads, "joint grad")
        for name, opts in configs:
            stage = f"partition {name} {opts or ''}".strip()
            p = ft.partition(jg, name, **opts)
            torch.manual_seed(RNG_SEED)
            outs, saved = p.forward(*tensors)
            check_outs(outs, f"{stage}: output")
            check_grads(p.backward(saved, tangents), f"{stage}: grad")
            p.forward.verify()
            p.backward.verify()
        stage = "aten native executor (min_cut)"
        _check_native(ft.partition(jg, "min_cut"), tensors, tangents)
        if BACKEND is not None:
            stage = "triton backend (min_cut)"
            _check_backend(ft.partition(jg, "min_cut"), tensors, tangents, expected, numerics)
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
    op: Any,
    sample: Any,
    configs: Sequence[tuple[str, dict[str, Any]]],
    numerics: Numerics | None = None,
) -> tuple[str, str]:
    """``(status, reason)`` of one sample (reason empty when it passed); the worst error
    against float64 it measured goes to ``numerics``."""
    try:
        wide = bind(op, sample, torch.float64)[1]
        check_sample(*bind(op, sample, torch.float32), configs, wide, numerics)
        return "passed", ""
    except Skip as e:
        return "skipped", str(e)
    except UNSUPPORTED as e:
        return "unsupported", f"{type(e).__name__}: {_first_line(e)}"
    except Mismatch as e:
        fp32, imprecise = f"float32: {e}", isinstance(e, Imprecise)
    except Exception as e:
        where = traceback.extract_tb(e.__traceback__)[-1]
        return "error", f"{type(e).__name__}: {_first_line(e)} ({where.name})"
    try:  # float32 mismatch: precision or rounding, or math? float64 says which
        check_sample(*bind(op, sample, torch.float64), configs)
    except Mismatch as e:
        return "wrong", f"{fp32}; float64: {e}"
    except Exception as e:
        return "wrong", f"{fp32}; float64 run failed: {type(e).__name__}: {_first_line(e)}"
    if imprecise:  # the bound is the bar: an answer further from float64 than it is wrong
        return "wrong", f"{fp32}; float64 agrees with eager (precision lost, not the math)"
    return "passed", f"float32 rounding only ({fp32}); float64 agrees"


def _significant(x: float) -> float:
    """Two significant digits: the report changes when an error does, not with its noise."""
    return float(f"{x:.2g}")


def samples(op: Any) -> Iterator[Any]:
    torch.manual_seed(zlib.crc32(op_key(op).encode()))
    yield from op.sample_inputs("cpu", torch.float32, requires_grad=True)


def run_op(op: Any, max_samples: int | None = None) -> dict[str, Any]:
    """Check the first ``max_samples`` samples of ``op``; its status, counts, reasons, and
    (``"error"``) the worst checked result's error against float64 next to eager float32's."""
    configs = strategies()
    start = time.perf_counter()
    outcomes: list[tuple[str, str]] = []
    numerics = Numerics()
    try:
        for i, sample in enumerate(samples(op)):
            if max_samples is not None and i >= max_samples:
                break
            outcomes.append(run_sample(op, sample, configs, numerics))
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
    if numerics.measured:  # the worst result's error against float64, and eager float32's
        result["error"] = {
            "functrans": _significant(numerics.ours),
            "eager": _significant(numerics.eager),
        }
    return result
