"""Fakes of a trace's inputs built from metadata (``functrans._core.fakes.fakes_of``) are what
``FakeTensorMode.from_tensor`` makes: same sizes, strides, offsets and dtypes, tensors on one
storage on one fake storage, and a joint trace over them gives eager's gradients."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import functrans as ft
from functrans._core.fakes import fakes_of
from functrans._core.torch_compat import is_device_mismatch


def _layout(t: torch.Tensor) -> tuple[object, ...]:
    return (
        tuple(t.shape),
        t.stride(),
        t.storage_offset(),
        t.dtype,
        t.device,
        t.requires_grad,
        t.is_inference(),
    )


def test_fakes_of_plain_tensors_match_from_tensor() -> None:
    tensors = [
        torch.randn(3, 5),
        torch.empty_strided((3, 5), (1, 3)).normal_(),  # column-major, and its own base
        torch.nn.Parameter(torch.randn(2, 2)),
        torch.zeros(0, 3),
        torch.ones((), dtype=torch.int64),
        torch.randn(4, dtype=torch.bfloat16),
    ]
    mode = FakeTensorMode()
    ours = fakes_of(mode, tensors)
    theirs = [FakeTensorMode().from_tensor(t.detach()) for t in tensors]
    assert [_layout(a) for a in ours] == [_layout(b) for b in theirs]
    assert all(a.fake_mode is mode for a in ours)


def test_tensors_on_one_storage_get_one_fake_storage() -> None:
    w = torch.randn(4, 4)
    other = torch.randn(4, 4)
    a, b, c = fakes_of(FakeTensorMode(), [w, w, other])
    assert a.untyped_storage()._cdata == b.untyped_storage()._cdata
    assert a.untyped_storage()._cdata != c.untyped_storage()._cdata


def test_a_view_among_the_inputs_goes_through_from_tensor_for_all() -> None:
    base = torch.randn(4, 4)
    view = base[1:]
    fb, fv = fakes_of(FakeTensorMode(), [base, view])
    assert (fv.shape, fv.storage_offset()) == ((3, 4), 4)
    assert fb.untyped_storage()._cdata == fv.untyped_storage()._cdata  # still one storage


def test_an_inference_tensor_keeps_its_mark() -> None:
    # autograd refuses a tensor made under torch.inference_mode(): its fake must say so too
    with torch.inference_mode():
        made = torch.randn(3)
    tensors = [torch.randn(3), made]
    ours = fakes_of(FakeTensorMode(), tensors)
    theirs = [FakeTensorMode().from_tensor(t.detach()) for t in tensors]
    assert [_layout(a) for a in ours] == [_layout(b) for b in theirs]
    assert ours[1].is_inference()


def test_tied_weights_get_eager_gradients_through_jit() -> None:
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied: one parameter, one storage

    def loss(idx: torch.Tensor) -> torch.Tensor:
        return head(emb(idx)).logsumexp(-1).sum()

    idx = torch.tensor([1, 2, 3])
    loss(idx).backward()
    want = emb.weight.grad.clone()
    emb.weight.grad = None
    ft.jit(loss)(idx).backward()
    torch.testing.assert_close(emb.weight.grad, want)


def test_device_mismatch_is_recognised_on_any_torch() -> None:
    assert is_device_mismatch(
        RuntimeError("Unhandled FakeTensor Device Propagation for aten.add, found two ...")
    )
    assert not is_device_mismatch(ValueError("Unhandled FakeTensor Device Propagation"))
    assert not is_device_mismatch(RuntimeError("CUDA out of memory"))


def test_fake_empty_lays_out_storage_as_torch_does() -> None:
    # a tensor alone on a storage of its own size is built in one call; a given offset or a
    # larger storage still goes through set_: each as torch lays it out
    from functrans._core.fakes import fake_empty

    mode = FakeTensorMode()
    cases = [
        ((2, 3), (3, 1), 0, None),
        ((2, 3), (1, 2), 0, None),
        ((0, 3), (3, 1), 0, None),
        ((4, 1), (1, 7), 0, None),
        ((), (), 0, None),
        ((2, 3), (3, 1), 0, 24),  # exactly its own size
        ((2, 3), (3, 1), 0, 64),  # a bigger storage (a view's base)
        ((2, 3), (3, 1), 5, None),  # an offset
    ]
    for shape, stride, offset, nbytes in cases:
        f = fake_empty(mode, shape, stride, torch.float32, "cpu", offset=offset, nbytes=nbytes)
        reach = (
            0
            if 0 in shape
            else 1 + offset + sum((s - 1) * t for s, t in zip(shape, stride, strict=True))
        )
        want = reach * 4 if nbytes is None else nbytes
        got = (tuple(f.shape), f.stride(), f.storage_offset(), f.untyped_storage().nbytes())
        assert got == (shape, stride, offset, want), (shape, stride, offset, nbytes)
        assert f._base is None and not f.requires_grad and f.fake_mode is mode
