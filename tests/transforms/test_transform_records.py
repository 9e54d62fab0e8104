"""Transforms tell each other their plans in typed records, and a record describes only the
function it was left on.

``grad`` leaves a :class:`GradSpec` on the function it returns and ``vmap`` of that a
:class:`VmapOfGrad`; eager ``vmap(grad(f))`` and ``jit(vmap(grad(f)))`` read them to plan the
per-example gradients as one joint graph cut by ``grad``'s strategy. ``functools.wraps`` copies
the records onto a wrapper, which computes something else: nothing plans from a copy.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.func as tf
from torch.testing import assert_close

import functrans as ft
from functrans._core.marks import MARK, read
from functrans._transforms import func as _func
from functrans._transforms.transform_records import GradSpec, VmapOfGrad, plan_of


def loss(w, x):
    return torch.tanh(x @ w).pow(2).sum()


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, 2, generator=g), torch.randn(4, 3, generator=g)


@pytest.fixture
def planned(monkeypatch):
    """The functions eager vmap planned per-example gradients for."""
    seen: list[object] = []
    real = _func.plan_per_example

    def spy(spec, *a, **kw):
        seen.append(spec.run)
        return real(spec, *a, **kw)

    monkeypatch.setattr(_func, "plan_per_example", spy)
    return seen


def test_grad_and_vmap_leave_records_under_the_one_mark() -> None:
    g = ft.grad(loss, partition="min_cut")
    spec = read(g, GradSpec)
    assert spec is not None and spec.run is g and spec.f is loss and spec.partition == "min_cut"
    v = ft.vmap(g, in_dims=(None, 0))
    batched = read(v, VmapOfGrad)
    assert batched is not None and batched.run is v and batched.spec is spec
    assert plan_of(v, VmapOfGrad) is batched
    for fn in (g, v):
        assert [k for k in vars(fn) if k.startswith("__functrans")] == [MARK]


def test_vmap_of_grad_plans_per_example_gradients(data, planned) -> None:
    w, xs = data
    g = ft.grad(loss, partition="min_cut")
    assert_close(ft.vmap(g, in_dims=(None, 0))(w, xs), tf.vmap(tf.grad(loss), (None, 0))(w, xs))
    assert planned == [g]


def test_jit_of_vmap_of_grad_plans_per_example_gradients(data) -> None:
    w, xs = data
    jitted = ft.jit(ft.vmap(ft.grad(loss, partition="min_cut"), in_dims=(None, 0)))
    assert_close(jitted(w, xs), tf.vmap(tf.grad(loss), (None, 0))(w, xs))
    (p,) = jitted.partitions()  # the per-example joint graph, cut by grad's strategy
    assert p.strategy == "min_cut"


def test_a_wrapper_carries_a_grad_spec_it_does_not_describe(data, planned) -> None:
    w, xs = data
    g = ft.grad(loss, partition="min_cut")

    @functools.wraps(g)
    def doubled(w, x):
        return 2 * g(w, x)

    assert read(doubled, GradSpec) is read(g, GradSpec)  # copied with __dict__
    assert plan_of(doubled, GradSpec) is None  # ...but it describes g, not doubled
    expected = 2 * tf.vmap(tf.grad(loss), (None, 0))(w, xs)
    assert_close(ft.vmap(doubled, in_dims=(None, 0))(w, xs), expected)
    assert planned == []  # vmap batched doubled as written
    v = ft.vmap(doubled, in_dims=(None, 0))
    assert read(v, VmapOfGrad) is None
    jitted = ft.jit(v)
    assert_close(jitted(w, xs), expected)
    assert all(p.strategy != "min_cut" for p in jitted.partitions())


def test_a_wrapper_of_vmap_of_grad_is_traced_as_written(data) -> None:
    w, xs = data
    v = ft.vmap(ft.grad(loss, partition="min_cut"), in_dims=(None, 0))

    @functools.wraps(v)
    def halved(w, x):
        return v(w, x) / 2

    assert read(halved, VmapOfGrad) is read(v, VmapOfGrad)
    assert plan_of(halved, VmapOfGrad) is None
    jitted = ft.jit(halved)
    assert_close(jitted(w, xs), tf.vmap(tf.grad(loss), (None, 0))(w, xs) / 2)
    assert all(p.strategy != "min_cut" for p in jitted.partitions())
