"""Checkers that compare functrans' graphs with eager PyTorch autograd.

They fail with a message that shows the program, the saved set and the mismatching value, so a
hypothesis counterexample is readable on its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import optree
import torch
from hypothesis import strategies as st

from functrans._core.graph import JointGraph, Phase
from functrans._core.pytree import NAMESPACE, flatten
from functrans._core.shapes import shape_env_of
from functrans._cut.cost import OpClass, op_class
from functrans._cut.partition import Partition, Strategy, partition
from functrans._cut.problem import ForwardValue, cut_problem
from functrans._cut.split import Split, split
from functrans._trace.joint import joint

from ._program import Program

__all__ = [
    "assert_close",
    "check_partition",
    "check_split",
    "compare",
    "eager_vjp",
    "saved_sets",
    "seeded",
    "tolerances",
]


def tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """``(rtol, atol)`` for comparing values of ``dtype`` computed in different op orders.

    >>> tolerances(torch.float64), tolerances(torch.bfloat16)
    ((1e-07, 1e-09), (0.016, 0.01))
    """
    return {
        torch.float64: (1e-7, 1e-9),
        # float32 grads legitimately differ ~1e-5 between op orders on ill-conditioned ops
        # (layer_norm over 2 elements); float64 stays tight and is the real oracle
        torch.float32: (1e-4, 1e-4),
        torch.bfloat16: (1.6e-2, 1e-2),
        torch.float16: (1e-3, 1e-3),
    }.get(dtype, (0.0, 0.0))


def assert_close(
    actual: Any, expected: Any, what: str, context: str = "", reference: Any = None
) -> None:
    """Compare two pytrees of tensors leaf by leaf with dtype-aware tolerances.

    With ``reference`` (the same computation in float64), a leaf also passes when it is no
    further from the reference than twice eager's own rounding error (plus the tolerance): in
    bfloat16 a decomposed op computed in float32 may be *more* accurate than eager, and a
    float32 gradient of an ill-conditioned op is rounding noise in any op order.

    >>> import torch
    >>> assert_close((torch.ones(2),), (torch.ones(2) + 1e-6,), "output")
    >>> assert_close((torch.ones(2),), (torch.zeros(2),), "output")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    AssertionError: output[0] differs from eager:
    ...
    """
    a_leaves, a_flat = flatten(actual)
    e_leaves, e_flat = flatten(expected)
    if a_flat.spec != e_flat.spec:
        raise AssertionError(f"{what}: structure {a_flat.spec} != expected {e_flat.spec}{context}")
    r_leaves = flatten(reference)[0] if reference is not None else [None] * len(e_leaves)
    for path, a, e, r in zip(e_flat.tensor_paths(), a_leaves, e_leaves, r_leaves, strict=True):
        rtol, atol = tolerances(e.dtype)
        try:
            torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True)
        except AssertionError as err:
            if r is not None and _as_accurate(a, e, r, rtol, atol):
                continue
            values = f"\n  got:      {_short(a)}\n  expected: {_short(e)}"
            if r is not None:
                values += f"\n  float64:  {_short(r)}"
            raise AssertionError(
                f"{what}{path} differs from eager:\n{err}{values}{context}"
            ) from None


def _as_accurate(a: Any, e: Any, r: Any, rtol: float, atol: float) -> bool:
    """Is ``a`` within tolerance of twice eager ``e``'s distance from the float64 ``r``?"""
    if not (isinstance(a, torch.Tensor) and a.is_floating_point() and a.shape == r.shape):
        return False
    a64, e64, r64 = a.double(), e.double(), r.double()
    allowed = atol + rtol * r64.abs() + 2 * (e64 - r64).abs()
    return bool(((a64 - r64).abs() <= allowed).all())


def _reference64(
    f: Callable[..., Any], args: Sequence[Any], tangents: tuple[torch.Tensor, ...]
) -> tuple[Any, Any]:
    """Outputs and grads of ``f`` computed in float64."""

    def up(x: Any) -> Any:
        return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    tree: Any = tuple(args)  # any pytree (optree's PyTree type takes no tuple[Any, ...])
    up_args: Any = optree.tree_map(up, tree, namespace=NAMESPACE)
    with seeded():
        result: tuple[Any, Any] = eager_vjp(f, up_args, tuple(up(t) for t in tangents))
    return result


def _matches_eager(
    f: Callable[..., Any],
    args: Sequence[Any],
    tangents: tuple[torch.Tensor, ...],
    got: tuple[Any, Any],
    eager: tuple[Any, Any],
    random: bool,
    context: str,
) -> None:
    """Outputs and grads ``got`` against eager's; where they differ past the dtype's tolerance
    (float32 on an ill-conditioned op such as layer_norm over 2 elements, whose gradients are
    rounding noise; a bfloat16 op decomposed into float32 steps), float64 is the oracle and
    ``got`` passes as accurate as eager. Not for random programs: masks may differ in float64."""
    try:
        assert_close(got[0], eager[0], "output", context)
        assert_close(got[1], eager[1], "grad", context)
    except AssertionError:
        if random:
            raise
        ref = _reference64(f, args, tangents)
        assert_close(got[0], eager[0], "output", context, ref[0])
        assert_close(got[1], eager[1], "grad", context, ref[1])


def _short(t: Any) -> str:
    """A tensor on one line (at most 12 elements), for failure messages."""
    if not isinstance(t, torch.Tensor):
        return repr(t)
    flat = t.detach().flatten()[:12].tolist()
    more = ", ..." if t.numel() > 12 else ""
    return f"{str(t.dtype)[6:]}{list(t.shape)} {flat}{more}"


@contextlib.contextmanager
def seeded(seed: int = 0) -> Iterator[None]:
    """Run a block with torch's global RNG seeded to ``seed``, restoring the RNG afterwards.

    Random ops (``dropout``) then draw the same numbers eagerly and in a graph: the checkers run
    both sides under the same seed (functrans never recomputes a random op in backward).

    >>> import torch
    >>> with seeded(3):
    ...     a = torch.rand(2)
    >>> with seeded(3):
    ...     b = torch.rand(2)
    >>> torch.equal(a, b)
    True
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _random_like(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(t.shape, generator=gen, dtype=t.dtype).to(t.device)


def eager_vjp(f: Callable[..., Any], args: Sequence[Any], tangents: Sequence[torch.Tensor]) -> Any:
    """Outputs and grads of ``f`` by eager autograd, grads shaped like ``JointGraph`` returns.

    >>> import torch
    >>> eager_vjp(lambda x: (x * x).sum(), (torch.ones(2),), (torch.tensor(1.0),))
    (tensor(2.), (tensor([2., 2.]),))
    """

    def prep(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.detach().clone().requires_grad_(True)
        return x

    tree: Any = tuple(args)  # any pytree, as above
    leaves: Any = optree.tree_map(prep, tree, namespace=NAMESPACE)
    outs = f(*leaves)
    out_leaves, _ = flatten(outs)
    pairs = [
        (o, t)
        for o, t in zip([o for o in out_leaves if o.is_floating_point()], tangents, strict=True)
        if o.requires_grad
    ]
    inputs, _ = flatten(leaves)
    diff = [x for x in inputs if x.requires_grad]
    grads = (
        torch.autograd.grad([o for o, _ in pairs], diff, [t for _, t in pairs], allow_unused=True)
        if pairs and diff
        else [None] * len(diff)
    )
    it = iter(g if g is not None else torch.zeros_like(x) for g, x in zip(grads, diff, strict=True))

    def fill(x: Any) -> Any:
        return next(it) if isinstance(x, torch.Tensor) and x.requires_grad else None

    grad_tree = optree.tree_map(fill, leaves, namespace=NAMESPACE)
    detached = optree.tree_map(
        lambda x: x.detach() if isinstance(x, torch.Tensor) else x, outs, namespace=NAMESPACE
    )
    return detached, grad_tree


def _tangents(jg: JointGraph, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(_random_like(t.meta["val"], gen) for t in jg.tangents())


def describe(f: Callable[..., Any]) -> str:
    """The function (a program's source) for failure messages."""
    f = getattr(f, "__wrapped__", f)
    return f"\n  program: {getattr(f, '__qualname__', type(f).__name__)}\n{f!r}"


def compare(
    f: Callable[..., Any],
    args: Sequence[Any],
    jg: JointGraph,
    run: Callable[[Sequence[Any], tuple[torch.Tensor, ...]], tuple[Any, Any]],
    context: str,
) -> None:
    """Compare ``run(args, tangents) -> (outputs, grads)`` with eager autograd on ``f``, both
    under the same RNG seed; ``context`` (what was saved, by whom) ends any failure message."""
    tangents = _tangents(jg, seed=1)
    with seeded():
        outs, grads = run(args, tangents)
    with seeded():
        e_outs, e_grads = eager_vjp(f, args, tangents)
    random = any(op_class(n) is OpClass.RANDOM for n in jg.ops())
    context = f"{describe(f)}\n  {context}"
    _matches_eager(f, args, tangents, (outs, grads), (e_outs, e_grads), random, context)


def check_split(
    f: Callable[..., Any],
    args: Sequence[Any],
    jg: JointGraph,
    s: Split | Partition,
    label: str,
    eager: Callable[..., Any] | None = None,
) -> None:
    """Run forward then backward of ``s`` and compare outputs and grads with eager autograd on
    ``f`` (or on ``eager``, a function computing the same, e.g. ``f`` without ``remat``)."""

    def run(a: Sequence[Any], tangents: tuple[torch.Tensor, ...]) -> tuple[Any, Any]:
        outs, saved = s.forward(*a)
        return outs, s.backward(saved, tangents)

    saved = [x.name for x in s.saved]
    context = f"{label}\n  saved: {saved}\n  recomputed: {_names(s)}"
    compare(eager or f, args, jg, run, context)
    s.forward.verify()
    s.backward.verify()


def _names(s: Split | Partition) -> list[str]:
    return [n.name for n in s.recomputed]


def check_partition(
    f: Callable[..., Any], args: Sequence[Any], strategy: str | Strategy = "default", **options: Any
) -> Partition:
    """Partition ``f``'s joint graph with ``strategy`` and check it against eager autograd.

    >>> import torch
    >>> from functrans.testing import check_partition
    >>> p = check_partition(lambda x: torch.tanh(x).sum(), (torch.randn(3),), "full_remat")
    >>> p.recomputed
    (tanh,)
    """
    jg = joint(f)(*args)
    jg.verify()
    return partition_and_check(f, args, jg, strategy, options)


def partition_and_check(
    f: Callable[..., Any],
    args: Sequence[Any],
    jg: JointGraph,
    strategy: str | Strategy,
    options: dict[str, Any],
    eager: Callable[..., Any] | None = None,
) -> Partition:
    """:func:`check_partition` on an already traced joint graph ``jg`` of ``f``.

    Besides gradients, the strategy's own choice must obey the shared save/recompute rules
    (:class:`functrans.extend.CutProblem`): ``partition`` would fix it (:attr:`Partition.adjusted`),
    but a strategy that relies on that is told which values it got wrong.
    """
    p = partition(jg, strategy, **options)
    if p.adjusted:
        problem = cut_problem(p.joint)  # the graph it cut (random ops replayable: a copy)
        values = [problem[n] for n in p.adjusted]
        what = "ignored remat tags" if any(v.tag for v in values) else "broke the op rules"
        why = "; ".join(f"{v.describe()}: {_why_adjusted(v)}" for v in values)
        raise AssertionError(
            f"strategy {strategy!r} {options or ''} {what}: its saved set breaks the shared "
            f"save/recompute rules and partition() adjusted {[v.node.name for v in values]} "
            f"({why})"
        )
    check_split(f, args, jg, p, f"strategy: {strategy!r} {options or ''}", eager)
    return p


def _why_adjusted(v: ForwardValue) -> str:
    return (
        v.why_not_save
        or v.why_not_recompute
        or (f"it was asked to be offloaded but {v.why_not_offload}" if v.why_not_offload else "")
        or "it was asked to be offloaded but a saved value shares its storage (a view of it)"
    )


@st.composite
def saved_sets(draw: st.DrawFn, jg: JointGraph) -> list[str]:
    """Random valid saved sets for ``split``: any subset of FORWARD-phase ops, keeping the
    outputs of random ops (which must never be recomputed).
    """
    candidates = [
        n
        for n in jg.fx_graph.nodes
        if n.op == "call_function" and n.meta.get("functrans.phase") is Phase.FORWARD
    ]
    must = [n.name for n in candidates if op_class(n) is OpClass.RANDOM]
    chosen = draw(st.lists(st.sampled_from(candidates), unique=True) if candidates else st.just([]))
    return sorted({n.name for n in chosen} | set(must))


def split_and_check(
    f: Callable[..., Any], args: Sequence[Any], jg: JointGraph, saved: Sequence[str]
) -> Split:
    """``split(jg, saved)`` and compare with eager autograd."""
    s = split(jg, saved)
    check_split(f, args, jg, s, f"saved set: {list(saved)}")
    return s


def _pinned(env: Any, jg: JointGraph) -> bool:
    """Whether the trace's guards fixed every symbolic size of the inputs to a number."""
    sizes = [s for n in jg.primals() for s in n.meta["val"].shape if isinstance(s, torch.SymInt)]
    return all(env.replace(s.node.expr).is_number for s in sizes)


def check_dynamic_partition(
    prog: Program,
    strategy: str | Strategy = "default",
    *,
    batches: Sequence[int] = (),
    **options: Any,
) -> Partition:
    """Partition a dynamic-batch program (``programs(batch=True)``) traced with a symbolic
    batch, and check it: partitioning adds no guard to the shape environment (cost estimates
    read sizes at the example without specialising them), and at the traced batch and each of
    ``batches`` (default: the traced one and two more) forward then backward match eager
    autograd of the vmapped program.

    >>> import torch
    >>> from functrans.testing._program import InputSpec, Program, Step
    >>> prog = Program((InputSpec((3,), torch.float32),), (Step("tanh", (0,), (), (3,)),), (1,), 2)
    >>> p = check_dynamic_partition(prog, "default", batches=(2, 5))
    >>> p.activation_bytes_expr.startswith("12*s")  # tanh's output: 3 float32 per example
    True
    """
    if not prog.batch:
        raise ValueError("check_dynamic_partition takes a program drawn with programs(batch=True)")
    jg = joint(prog, dynamic=prog.dynamic_dims())(*prog.example_inputs())
    env = shape_env_of([n.meta["val"] for n in jg.primals()])
    guards = len(env.guards) if env is not None else 0
    p = partition(jg, strategy, **options)
    added = [str(g.expr) for g in env.guards[guards:]] if env is not None else []
    if added:
        raise AssertionError(f"partitioning {strategy!r} added guards {added}{describe(prog)}")
    p.forward.verify()
    p.backward.verify()
    if env is None or _pinned(env, jg):  # torch's trace fixed the batch (F.pad reads its
        batches = (prog.batch,)  # sizes): no other batch runs this graph; jit traces again
    for batch in batches or (prog.batch, prog.batch + 1, prog.batch + 3):
        args = prog.example_inputs(seed=batch, batch=batch)
        with seeded():
            outs = prog(*args)
        gen = torch.Generator().manual_seed(1)
        floats = [o for o in flatten(outs)[0] if o.is_floating_point()]
        tangents = tuple(_random_like(o, gen) for o in floats)
        with seeded():
            got, saved = p.forward(*args)
            grads = p.backward(saved, tangents)
        with seeded():
            e_outs, e_grads = eager_vjp(prog, args, tangents)
        context = f"{describe(prog)}\n  strategy {strategy!r} {options or ''} at batch {batch}"
        random = any(op_class(n) is OpClass.RANDOM for n in jg.ops())
        _matches_eager(prog, args, tangents, (got, grads), (e_outs, e_grads), random, context)
    return p
