"""The model families of ``benchmarks._module_zoo`` (``python -m benchmarks.peak_memory --family
unseen``): each builds at its "small" size and runs an eager step; ``ft.jit`` of its loss gives
eager's loss and gradients (dropout: the same seed before each call), updates batch norm's
running statistics as eager does, and finds the blocks of the ``nn.Module`` stacks as repeated
regions; ``blockwise`` with ``torch.utils.checkpoint`` per block (the benchmark's per-block
checkpoint) gives eager's gradients too.

float32 (the peak-memory benchmark's dtype), tolerances rtol 1e-4, atol 1e-5. The Hugging Face
models skip without ``transformers``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import functrans as ft

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:  # the benchmarks package lives at the repository root
    sys.path.insert(0, _ROOT)

from benchmarks import _module_zoo  # noqa: E402
from benchmarks._model import Model  # noqa: E402

#: the hand-written ``nn.Module`` stacks, which have ``blockwise``
MODULES = ["dropout_gpt_10", "tied_uneven", "mlp_mixer_8", "bn_resnet_8"]
HF = ["hf_qwen2_6l", "hf_vit_6l", "hf_gpt_neox_6l"]
TOL = {"rtol": 1e-4, "atol": 1e-5}


def _model(name: str) -> Model:
    if name in HF:
        pytest.importorskip("transformers")
    return _module_zoo.UNSEEN[name]()


def _setup(name: str) -> tuple[Model, dict[str, torch.Tensor], Any]:
    model = _model(name)
    params, x = model.make("small")
    return model, {k: v.requires_grad_() for k, v in params.items()}, x


def _step(fn: Any, params: dict[str, torch.Tensor], x: Any) -> tuple[torch.Tensor, list[Any]]:
    """One seeded training step: the loss and every parameter's gradient."""
    for p in params.values():
        p.grad = None
    torch.manual_seed(0)
    loss = fn(params, x)
    loss.backward()
    return loss.detach(), [p.grad for p in params.values()]


def _buffers(module: torch.nn.Module | None) -> dict[str, torch.Tensor]:
    assert module is not None
    return {k: b.detach().clone() for k, b in module.named_buffers()}


def _restore(module: torch.nn.Module | None, saved: dict[str, torch.Tensor]) -> None:
    assert module is not None
    with torch.no_grad():
        for k, b in module.named_buffers():
            b.copy_(saved[k])


def _same_grads(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a is not None and b is not None
        torch.testing.assert_close(a, b, **TOL)


def test_unseen_lists_every_family() -> None:
    from benchmarks._hf_zoo import has_transformers

    assert set(MODULES) <= set(_module_zoo.UNSEEN)
    assert all((n in _module_zoo.UNSEEN) == has_transformers() for n in HF)
    for name in MODULES:
        assert _module_zoo.UNSEEN[name]().name == name


@pytest.mark.parametrize("name", MODULES + HF)
def test_jit_gives_eager_loss_grads_and_buffers(name: str) -> None:
    model, params, x = _setup(name)
    before = _buffers(model.module)
    loss, grads = _step(model.fn, params, x)
    assert loss.shape == () and torch.isfinite(loss)
    after = _buffers(model.module)

    _restore(model.module, before)
    jitted = ft.jit(model.fn)
    jit_loss, jit_grads = _step(jitted, params, x)
    torch.testing.assert_close(jit_loss, loss, **TOL)
    _same_grads(jit_grads, grads)
    for k, b in _buffers(model.module).items():  # batch norm's running statistics
        torch.testing.assert_close(b, after[k], **TOL, msg=f"buffer {k}")
    if name not in HF:  # batch norm blocks too: their buffer updates are part of the region
        assert jitted.cache_info().regions_reused > 0


@pytest.mark.parametrize("name", MODULES)
def test_blockwise_checkpoint_gives_eager_grads(name: str) -> None:
    model, params, x = _setup(name)
    assert model.blockwise is not None
    _, grads = _step(model.fn, params, x)

    def wrap(block: Any, p: Any, h: torch.Tensor) -> torch.Tensor:
        return checkpoint(block, p, h, use_reentrant=False)  # type: ignore[no-any-return]  # torch.utils.checkpoint returns Any

    _same_grads(_step(model.blockwise(wrap), params, x)[1], grads)


def test_the_module_families_are_what_they_say() -> None:
    gpt = _module_zoo.dropout_gpt()
    assert gpt.module is not None and gpt.module.training
    assert any(isinstance(m, torch.nn.Dropout) and m.p == 0.1 for m in gpt.module.modules())

    tied = _module_zoo.tied_uneven()
    assert tied.module is not None
    assert tied.module.head.weight is tied.module.tok.weight  # one Parameter
    params, _ = tied.make("small")
    assert "tok.weight" in params and "head.weight" not in params
    widths = {b.ln.normalized_shape for b in tied.module.blocks}
    assert widths == {(128,), (256,)}

    resnet = _module_zoo.bn_resnet()
    assert resnet.module is not None and resnet.module.training
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in resnet.module.modules())
