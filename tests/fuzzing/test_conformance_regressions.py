"""Library bugs found by the OpInfo conformance sweep (tests/conformance), one test each."""

from __future__ import annotations

import pytest
import torch

import functrans as ft
from functrans.testing import check_partition


@pytest.mark.parametrize("strategy", ["default", "full_remat", "min_cut"])
def test_take_with_a_0dim_index(strategy):
    # torch's decomposition of take indexed with Python [], which reads a 0-dim index tensor
    # with .item(): a TraceError for the forward op (take) and for put's backward (grad.take)
    x = torch.randn(3, 4)
    check_partition(lambda x, i: torch.take(x, i) * 2, (x, torch.tensor(5)), strategy)
    check_partition(lambda x, i: torch.take(x, i), (x, torch.tensor([[-1, 2], [0, 11]])), strategy)
    v = torch.randn(())
    check_partition(
        lambda x, i, v: torch.put(x, i, v, accumulate=True), (x, torch.tensor(7), v), strategy
    )


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("transform", ["trace", "joint"])
def test_sparse_input_is_rejected_with_its_name(transform):
    # used to crash inside fake tensors: "Sparse CSR tensors do not have strides"
    a = torch.eye(3).to_sparse_csr()

    def f(a, b):
        return torch.mm(a, b)

    with pytest.raises(ft.UnsupportedOpError, match=r"input a is a torch\.sparse_csr tensor"):
        getattr(ft, transform)(f)(a, torch.randn(3, 2))


def test_data_dependent_error_names_the_aten_op():
    # cov calls aten.equal from C++ on a value it computed: the message used to name only
    # the user's line, not what needed the value
    with pytest.raises(ft.TraceError, match=r"`aten\.equal\.default`, called by torch\.cov"):
        ft.trace(torch.cov)(torch.randn(3, 4))


def test_data_dependent_backward_names_the_op_and_the_pass():
    # index_fill's derivative w.r.t. a tensor fill value calls _unique (dynamic shape); the
    # message used to say "at unknown line" and nothing else
    def f(x, value):
        return torch.index_fill(x, 0, torch.tensor([0, 2]), value)

    with pytest.raises(ft.TraceError) as info:
        ft.joint(f)(torch.randn(3, 2), torch.tensor(1.5))
    msg = str(info.value)
    assert "`aten._unique.default`, in the backward pass" in msg
    assert "unknown line" not in msg


def test_reading_fake_tensor_data_is_a_trace_error():
    # tensor_split with a tensor of split points reads its values in C++: it used to escape as
    # a RuntimeError about unallocated data
    with pytest.raises(ft.TraceError, match=r"depends on the value of a tensor.*tensor_split"):
        ft.trace(lambda x, i: torch.tensor_split(x, i))(torch.randn(6), torch.tensor([2, 4]))
