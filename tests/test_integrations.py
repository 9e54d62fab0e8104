"""functrans with the packages research code trains through: peft LoRA, accelerate and Lightning.

Each test trains a tiny model a few steps with and without functrans under one seed and compares
the losses, the gradients that exist and the parameters after the steps.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.testing import assert_close

import functrans as ft
from functrans import policies

transformers = pytest.importorskip("transformers")

_VOCAB = 64


def _gpt2() -> Any:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=_VOCAB,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(config)
    model.train()
    return model


def _lora(model: Any) -> Any:
    peft = pytest.importorskip("peft")
    # init_lora_weights=False: B starts nonzero, so A gets a nonzero gradient from step one
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, init_lora_weights=False
    )
    torch.manual_seed(0)
    return peft.get_peft_model(model, config)


class _Run:
    """Losses, parameters after the steps and which parameters got a gradient."""

    def __init__(self, model: torch.nn.Module, step: Callable[[torch.Tensor], torch.Tensor]):
        torch.manual_seed(1)
        batches = [torch.randint(0, _VOCAB, (2, 8)) for _ in range(2)]
        self.losses = [step(ids).detach() for ids in batches]
        self.params = [p.detach().clone() for p in model.parameters()]
        self.grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]

    def check_equal(self, other: _Run) -> None:
        assert_close(self.losses, other.losses)
        assert_close(self.params, other.params)
        assert [g is None for g in self.grads] == [g is None for g in other.grads]
        assert_close([g for g in self.grads if g is not None], [g for g in other.grads if g is not None])


def _sgd_step(model: torch.nn.Module, run: Callable[..., Any]) -> Callable[[torch.Tensor], Any]:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)

    def step(ids: torch.Tensor) -> Any:
        opt.zero_grad(set_to_none=True)
        loss = run(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        return loss

    return step


def _check_only_lora_trains(model: Any, run: _Run) -> None:
    names = [n for n, _ in model.named_parameters()]
    trained = [n for n, g in zip(names, run.grads) if g is not None]
    assert trained and all("lora_" in n for n in trained)
    assert len(trained) == sum("lora_" in n for n in names)  # every LoRA matrix, nothing else


# ---------------------------------------------------------------------------------------------
# peft LoRA


def test_peft_lora_under_jit_trains_like_eager() -> None:
    eager_model = _lora(_gpt2())
    jit_model = copy.deepcopy(eager_model)
    eager = _Run(eager_model, _sgd_step(eager_model, eager_model))
    jitted = ft.jit(jit_model)
    ours = _Run(jit_model, _sgd_step(jit_model, jitted))
    ours.check_equal(eager)
    _check_only_lora_trains(jit_model, ours)
    assert jitted.cache_info().entries == 1  # compiled, not run eagerly


def _remat_blocks(model: Any) -> None:
    blocks = model.base_model.model.transformer.h
    for i, block in enumerate(blocks):
        blocks[i] = ft.remat(block, policy=policies.dots_saveable)


def _hf_checkpointing(model: Any) -> None:
    # peft's model forwards gradient_checkpointing_enable to the transformers model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # names renamed in transformers 5
        model.base_model.model._set_gradient_checkpointing(
            enable=True, gradient_checkpointing_func=ft.checkpoint
        )


@pytest.mark.parametrize("apply", [_remat_blocks, _hf_checkpointing], ids=["remat", "hf"])
def test_peft_lora_under_remat_trains_like_eager(apply: Callable[[Any], None]) -> None:
    eager_model = _lora(_gpt2())
    remat_model = copy.deepcopy(eager_model)
    apply(remat_model)
    eager = _Run(eager_model, _sgd_step(eager_model, eager_model))
    ours = _Run(remat_model, _sgd_step(remat_model, remat_model))
    ours.check_equal(eager)
    _check_only_lora_trains(remat_model, ours)


# ---------------------------------------------------------------------------------------------
# accelerate


@pytest.mark.parametrize("order", ["prepare-then-jit", "jit-then-prepare"])
def test_accelerate_prepare_with_jit_trains_like_eager(order: str) -> None:
    accelerate = pytest.importorskip("accelerate")

    def train(jit: bool) -> _Run:
        model = _gpt2()
        accelerator = accelerate.Accelerator(cpu=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        run: Any = model
        if jit and order == "jit-then-prepare":
            run, opt = accelerator.prepare(ft.jit(model), opt)
        else:
            run, opt = accelerator.prepare(model, opt)
            if jit:
                run = ft.jit(run)

        def step(ids: torch.Tensor) -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            loss: torch.Tensor = run(input_ids=ids, labels=ids, use_cache=False).loss
            accelerator.backward(loss)
            opt.step()
            return loss

        result = _Run(model, step)
        if jit:
            assert run.cache_info().entries == 1  # compiled, not run eagerly
        accelerator.free_memory()
        return result

    train(True).check_equal(train(False))
