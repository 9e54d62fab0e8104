"""Checkers that compare functrans' graphs with eager PyTorch autograd.

They fail with a message that shows the program, the saved set and the mismatching value, so a
hypothesis counterexample is readable on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from hypothesis import strategies as st

from .._graph import JointGraph, Phase
from .._joint import joint
from .._partition import Partition, Strategy, partition
from .._pytree import NAMESPACE, flatten
from .._split import Split, split

__all__ = [
    "assert_close",
    "check_partition",
    "check_split",
    "eager_vjp",
    "saved_sets",
    "tolerances",
]


def tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """``(rtol, atol)`` for comparing values of ``dtype`` computed in different op orders."""
    return {
        torch.float64: (1e-7, 1e-9),
        # float32 grads legitimately differ ~1e-5 between op orders on ill-conditioned ops
        # (layer_norm over 2 elements); float64 stays tight and is the real oracle
        torch.float32: (1e-4, 1e-4),
        torch.bfloat16: (1.6e-2, 1e-2),
        torch.float16: (1e-3, 1e-3),
    }.get(dtype, (0.0, 0.0))


def assert_close(actual: Any, expected: Any, what: str, context: str = "") -> None:
    """Compare two pytrees of tensors leaf by leaf with dtype-aware tolerances."""
    a_leaves, a_flat = flatten(actual)
    e_leaves, e_flat = flatten(expected)
    if a_flat.spec != e_flat.spec:
        raise AssertionError(f"{what}: structure {a_flat.spec} != expected {e_flat.spec}{context}")
    for path, a, e in zip(e_flat.tensor_paths(), a_leaves, e_leaves, strict=True):
        rtol, atol = tolerances(e.dtype)
        try:
            torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True)
        except AssertionError as err:
            raise AssertionError(f"{what}{path} differs from eager:\n{err}{context}") from None


def _random_like(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(t.shape, generator=gen, dtype=t.dtype).to(t.device)


def eager_vjp(f: Callable[..., Any], args: Sequence[Any], tangents: Sequence[torch.Tensor]) -> Any:
    """Outputs and grads of ``f`` by eager autograd, grads shaped like ``JointGraph`` returns."""

    def prep(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.detach().clone().requires_grad_(True)
        return x

    leaves: Any = optree.tree_map(prep, tuple(args), namespace=NAMESPACE)  # type: ignore[arg-type]
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


def _run_split(
    s: Split | Partition, args: Sequence[Any], tangents: tuple[torch.Tensor, ...]
) -> Any:
    outs, saved = s.forward(*args)
    return outs, s.backward(saved, tangents)


def check_split(
    f: Callable[..., Any], args: Sequence[Any], jg: JointGraph, s: Split | Partition, label: str
) -> None:
    """Run forward then backward of ``s`` and compare outputs and grads with eager autograd."""
    tangents = _tangents(jg, seed=1)
    outs, grads = _run_split(s, args, tangents)
    e_outs, e_grads = eager_vjp(f, args, tangents)
    saved = [x.name for x in s.saved]
    context = f"\n  program: {getattr(f, '__qualname__', f)!r}\n{f!r}\n  {label}\n  saved: {saved}"
    assert_close(outs, e_outs, "output", context)
    assert_close(grads, e_grads, "grad", context)
    s.forward.verify()
    s.backward.verify()


def check_partition(
    f: Callable[..., Any], args: Sequence[Any], strategy: str | Strategy = "default", **options: Any
) -> Partition:
    """Partition ``f``'s joint graph with ``strategy`` and check it against eager autograd.

    >>> import torch
    >>> from functrans.testing import check_partition
    >>> p = check_partition(lambda x: torch.tanh(x).sum(), (torch.randn(3),), "full_remat")
    >>> p.recomputed
    ('tanh',)
    """
    jg = joint(f)(*args)
    jg.verify()
    p = partition(jg, strategy, **options)
    check_split(f, args, jg, p, f"strategy: {strategy!r} {options or ''}")
    return p


@st.composite
def saved_sets(draw: st.DrawFn, jg: JointGraph) -> list[str]:
    """Random valid saved sets for ``split``: any subset of FORWARD-phase ops, keeping the
    outputs of random ops (which must never be recomputed).
    """
    from .._cost import OpClass, op_class

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
