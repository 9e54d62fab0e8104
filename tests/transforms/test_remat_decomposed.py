"""Traced ``remat`` asks its policy about the op the user wrote, not its decomposition.

Tracing decomposes ``silu`` into ``sigmoid`` and ``mul`` (and ``mish``, ``baddbmm``, ``lerp``...
into their pieces). A policy naming ``aten.silu.default`` kept the silu output in eager mode and
nothing once traced, because the traced region asked the policy about each graph node. The
policy now sees each op before decomposition, as eager selective checkpointing does; its
decision goes to the node(s) holding the op's outputs, and the decomposition's inner nodes are
recomputed (eager never keeps them: they do not exist there). Both modes keep the same bytes.

And ``dots_with_no_batch_dims_saveable`` judges batch dimensions by what an op computes: the
batch-of-one ``bmm`` that a 2-D ``einsum`` lowers to is a plain matmul, saved like ``x @ w``.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import functrans as ft
from benchmarks.remat import StorageRecorder
from functrans import policies
from functrans.extend import REMAT, Policy

aten = torch.ops.aten
DTYPE = torch.float64


def _ptr(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


def eager_kept(
    f: Callable[..., torch.Tensor], args: Sequence[torch.Tensor]
) -> tuple[int, list[torch.Tensor]]:
    """Bytes of the distinct storages one eager forward of ``f`` keeps for backward (alive while
    only the loss is held; inputs and the loss left out), and the gradients of its backward.

    Like ``benchmarks/remat.py::measure_bytes``'s ``live_bytes``: saved-tensor hooks alone
    cannot see inside a checkpointed region (torch's checkpoint installs its own, innermost),
    nor the outputs selective checkpointing caches outside autograd.
    """
    leaves = [a.clone().requires_grad_() for a in args]
    recorder = StorageRecorder()
    with recorder:
        loss = f(*leaves)
    gc.collect()
    left_out = {_ptr(t) for t in leaves} | {_ptr(loss)}
    alive = {}
    for ref in recorder.refs:
        s = ref()
        if s is not None and s.data_ptr() not in left_out:
            alive[s.data_ptr()] = s.nbytes()
    loss.backward()
    return sum(alive.values()), [t.grad for t in leaves]  # type: ignore[misc]


def _r(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_GEN, dtype=DTYPE)


_GEN = torch.Generator().manual_seed(0)

#: op as the user writes it, the ATen op eager selective checkpointing sees, example inputs
OPS: dict[str, tuple[Callable[..., torch.Tensor], Any, tuple[torch.Tensor, ...]]] = {
    "silu": (F.silu, aten.silu.default, (_r(4, 4),)),
    "mish": (F.mish, aten.mish.default, (_r(4, 4),)),
    "hardswish": (F.hardswish, aten.hardswish.default, (_r(4, 4),)),
    "softplus": (F.softplus, aten.softplus.default, (_r(4, 4),)),
    "baddbmm": (torch.baddbmm, aten.baddbmm.default, (_r(2, 3, 4), _r(2, 3, 5), _r(2, 5, 4))),
    "mv": (torch.mv, aten.mv.default, (_r(3, 4), _r(4))),
    "dot": (torch.dot, aten.dot.default, (_r(4), _r(4))),
    "addcmul": (torch.addcmul, aten.addcmul.default, (_r(4, 4), _r(4, 4), _r(4, 4))),
    "lerp": (torch.lerp, aten.lerp.Tensor, (_r(4, 4), _r(4, 4), _r(4, 4))),
    # decomposed, three outputs; mean and invstd are views (squeeze) of inner values
    "batch_norm": (
        lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
        aten.native_batch_norm.default,
        (_r(4, 3), _r(3), _r(3)),
    ),
    # not decomposed (core ATen keeps them): three outputs (out, mean, rstd) as getitems
    "group_norm": (
        lambda x, w, b: F.group_norm(x, 1, w, b),
        aten.native_group_norm.default,
        (_r(4, 3, 2), _r(3), _r(3)),
    ),
    "layer_norm": (
        lambda x, w, b: F.layer_norm(x, (4,), w, b),
        aten.native_layer_norm.default,
        (_r(3, 4), _r(4), _r(4)),
    ),
    # rms_norm is CompositeImplicitAutograd in torch 2.13: both modes see its pieces already
    "rms_norm": (lambda x, w: F.rms_norm(x, (4,), w), aten.rsqrt.default, (_r(3, 4), _r(4))),
}


def _region(name: str) -> Callable[..., torch.Tensor]:
    """``sin(op(*args)).sum()`` under a policy saving ``op``: backward's ``cos`` reads the op's
    output, so both modes must keep it, and nothing else."""
    op, aten_op, _ = OPS[name]
    return ft.remat(lambda *a: torch.sin(op(*a)).sum(), policy=[aten_op])


@pytest.mark.parametrize("name", list(OPS))
def test_a_policy_on_a_decomposed_op_saves_what_eager_saves(name: str) -> None:
    f, args = _region(name), OPS[name][2]
    want_bytes, want_grads = eager_kept(f, args)
    assert want_bytes > 0  # eager keeps the op's output(s)
    jg = ft.joint(f)(*args)
    for strategy in ("default", "min_cut"):
        p = ft.partition(jg, strategy)
        assert p.activation_bytes == want_bytes, f"{strategy}\n{p.report()}"
        grads = ft.grad(f, argnums=tuple(range(len(args))), partition=strategy)(*args)
        torch.testing.assert_close(list(grads), want_grads)


def test_the_op_output_gets_the_decision_its_decomposition_is_recomputed() -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.silu(x @ w)  # the region's output: the code around it decides

    def outer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        inner = ft.remat(f, policy=[aten.silu.default, aten.mm.default])
        return torch.sin(F.silu(inner(x, w))).sum()

    jg = ft.joint(ft.remat(outer, policy=[aten.silu.default]))(*OPS["addcmul"][2][:2])
    tags = {str(n.target) + ":" + n.name: n.meta.get(REMAT) for n in jg.forward_nodes()}
    assert tags["aten.mm.default:mm"] is Policy.MUST_SAVE  # the inner policy
    # the inner silu: its sigmoid is recomputed, its output (the inner region's) is the
    # outer policy's, which saves silu
    assert tags["aten.sigmoid.default:sigmoid"] is Policy.MUST_RECOMPUTE
    assert tags["aten.mul.Tensor:mul"] is Policy.MUST_SAVE
    # the outer silu
    assert tags["aten.sigmoid.default:sigmoid_1"] is Policy.MUST_RECOMPUTE
    assert tags["aten.mul.Tensor:mul_1"] is Policy.MUST_SAVE
    assert tags["aten.sin.default:sin"] is Policy.MUST_RECOMPUTE


@pytest.mark.parametrize(
    ("decision", "inner"),
    [
        (Policy.PREFER_SAVE, Policy.MUST_RECOMPUTE),
        (Policy.MUST_RECOMPUTE, Policy.MUST_RECOMPUTE),
        (Policy.PREFER_RECOMPUTE, Policy.PREFER_RECOMPUTE),  # a preference stays one
    ],
)
def test_inside_a_decomposition_is_recomputed(decision: Policy, inner: Policy) -> None:
    def policy(op: Any, *args: Any, **kwargs: Any) -> Policy:
        return decision if op is aten.silu.default else Policy.MUST_RECOMPUTE

    jg = ft.joint(ft.remat(lambda x: torch.sin(F.silu(x)).sum(), policy=policy))(_r(4))
    tags = {n.target: n.meta.get(REMAT) for n in jg.forward_nodes() if REMAT in n.meta}
    assert tags[aten.sigmoid.default] is inner and tags[aten.mul.Tensor] is decision


def test_what_a_policy_computes_is_not_part_of_the_region() -> None:
    asked: list[Any] = []

    def policy(op: Any, *args: Any, **kwargs: Any) -> bool:
        asked.append(op)
        return bool((args[0] * 2).numel() > 8)  # runs an op: not the user's, not recorded

    f = ft.remat(lambda x: torch.sin(torch.cos(x)).sum(), policy=policy)
    jg = ft.joint(f)(_r(16))
    assert asked == [aten.cos.default, aten.sin.default, aten.sum.default]
    assert {n.meta.get(REMAT) for n in jg.forward_nodes()} == {None, Policy.MUST_SAVE}


def test_policies_are_asked_once_per_op_the_user_wrote() -> None:
    asked: list[Any] = []

    def policy(op: Any, *args: Any, **kwargs: Any) -> bool:
        asked.append(op)
        return op is aten.mish.default

    f = ft.remat(lambda x: torch.sin(F.mish(x)).sum(), policy=policy)
    ft.joint(f)(*OPS["mish"][2])
    traced, asked[:] = list(asked), []
    f(*[a.clone().requires_grad_() for a in OPS["mish"][2]])
    eager = [op for op in asked if op.namespace != "prim"]
    assert aten.mish.default in traced and aten.exp.default not in traced
    # eager's sum is sum.default; tracing records sum.dim_IntList -- asked about sum.default
    assert [op for op in traced if op.namespace != "prim"] == eager


# ---------------------------------------------------------------------------------------------
# dots_with_no_batch_dims_saveable: a batch of one is no batch


def _chain(matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Any:
    def f(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return torch.sin(matmul(torch.sin(matmul(x, w1)), w2)).sum()

    return ft.remat(f, policy=policies.dots_with_no_batch_dims_saveable)


EINSUM = _chain(lambda a, b: torch.einsum("ij,jk->ik", a, b))
MATMUL = _chain(lambda a, b: a @ b)
CHAIN_ARGS = (_r(4, 6), _r(6, 5), _r(5, 3))


def test_2d_einsum_is_saved_like_matmul_in_eager_mode() -> None:
    want, want_grads = eager_kept(MATMUL, CHAIN_ARGS)
    got, grads = eager_kept(EINSUM, CHAIN_ARGS)
    assert got == want > 0
    torch.testing.assert_close(grads, want_grads)


def _dots(g: Any) -> int:
    return sum(n.target in (aten.mm.default, aten.bmm.default) for n in g.fx_graph.nodes)


@pytest.mark.parametrize("strategy", ["default", "min_cut"])
def test_2d_einsum_is_saved_like_matmul_when_traced(strategy: str) -> None:
    want = ft.partition(ft.joint(MATMUL)(*CHAIN_ARGS), strategy)
    got = ft.partition(ft.joint(EINSUM)(*CHAIN_ARGS), strategy)
    assert got.activation_bytes == want.activation_bytes > 0, got.report()
    assert _dots(got.backward) == _dots(want.backward) == 4  # two grads per matmul, none redone
    torch.testing.assert_close(
        ft.grad(EINSUM, argnums=(0, 1, 2), partition=strategy)(*CHAIN_ARGS),
        ft.grad(MATMUL, argnums=(0, 1, 2), partition=strategy)(*CHAIN_ARGS),
    )


@pytest.mark.parametrize(
    ("op", "shapes", "saved"),
    [
        (aten.mm.default, ((2, 3), (3, 4)), True),
        (aten.bmm.default, ((1, 2, 3), (1, 3, 4)), True),
        (aten.bmm.default, ((2, 2, 3), (2, 3, 4)), False),
        (aten.baddbmm.default, ((1, 2, 4), (1, 2, 3), (1, 3, 4)), True),
        (aten.baddbmm.default, ((3, 2, 4), (3, 2, 3), (3, 3, 4)), False),
        (aten.sin.default, ((2, 3),), False),
    ],
)
def test_no_batch_dims_is_judged_by_shapes(
    op: Any, shapes: tuple[tuple[int, ...], ...], saved: bool
) -> None:
    args = [torch.empty(s, device="meta") for s in shapes]
    assert policies.dots_with_no_batch_dims_saveable(op, *args) is saved
