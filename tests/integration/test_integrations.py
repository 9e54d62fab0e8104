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
        assert_close(
            [g for g in self.grads if g is not None], [g for g in other.grads if g is not None]
        )


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
    trained = [n for n, g in zip(names, run.grads, strict=True) if g is not None]
    assert trained and all("lora_" in n for n in trained)
    assert len(trained) == sum("lora_" in n for n in names)  # every LoRA matrix, nothing else


# ---------------------------------------------------------------------------------------------
# peft LoRA


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ft.checkpoint"])
def test_peft_lora_under_jit_trains_like_eager(checkpointing: bool) -> None:
    eager_model = _lora(_gpt2())
    jit_model = copy.deepcopy(eager_model)
    if checkpointing:  # transformers' gradient checkpointing through ft.checkpoint, then jit
        jit_model.base_model.model._set_gradient_checkpointing(
            enable=True, gradient_checkpointing_func=ft.checkpoint
        )
    eager = _Run(eager_model, _sgd_step(eager_model, eager_model))
    jitted = ft.jit(jit_model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback to running eagerly
        warnings.simplefilter("ignore", FutureWarning)  # names renamed in transformers 5
        ours = _Run(jit_model, _sgd_step(jit_model, jitted))
    ours.check_equal(eager)
    _check_only_lora_trains(jit_model, ours)
    assert jitted.cache_info().entries == 1  # compiled, not run eagerly


def _remat_blocks(model: Any, calls: list[int]) -> None:
    blocks = model.base_model.model.transformer.h
    for i, block in enumerate(blocks):
        blocks[i] = ft.remat(block, policy=policies.dots_saveable)
        calls.append(1)


def _hf_checkpointing(model: Any, calls: list[int]) -> None:
    # transformers calls gradient_checkpointing_func(layer.__call__, *args) for each layer
    def checkpoint(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return ft.checkpoint(fn, *args, **kwargs)

    model.base_model.model._set_gradient_checkpointing(
        enable=True, gradient_checkpointing_func=checkpoint
    )


@pytest.mark.parametrize("apply", [_remat_blocks, _hf_checkpointing], ids=["remat", "hf"])
def test_peft_lora_under_remat_trains_like_eager(apply: Callable[[Any, list[int]], None]) -> None:
    eager_model = _lora(_gpt2())
    remat_model = copy.deepcopy(eager_model)
    calls: list[int] = []
    apply(remat_model, calls)
    eager = _Run(eager_model, _sgd_step(eager_model, eager_model))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # names renamed in transformers 5
        ours = _Run(remat_model, _sgd_step(remat_model, remat_model))
    ours.check_equal(eager)
    _check_only_lora_trains(remat_model, ours)
    assert len(calls) >= 2  # both blocks ran under functrans' remat


# ---------------------------------------------------------------------------------------------
# accelerate


@pytest.mark.parametrize(
    ("order", "precision"),
    [("prepare-then-jit", "no"), ("jit-then-prepare", "no"), ("prepare-then-jit", "bf16")],
)
def test_accelerate_prepare_with_jit_trains_like_eager(order: str, precision: str) -> None:
    accelerate = pytest.importorskip("accelerate")

    def train(jit: bool, precision: str) -> _Run:
        model = _gpt2()
        # accelerate keeps one process-wide state; a new precision needs it reset
        accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
        # bf16 wraps the prepared model's forward in CPU autocast
        accelerator = accelerate.Accelerator(cpu=True, mixed_precision=precision)
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

    eager = train(False, precision)
    train(True, precision).check_equal(eager)
    if precision != "no":  # autocast changed the numbers, so the check above saw it applied
        assert not torch.equal(eager.losses[0], train(False, "no").losses[0])


# ---------------------------------------------------------------------------------------------
# Lightning


def _lightning() -> Any:
    try:
        import lightning
    except ImportError as e:  # a Lightning release that does not import with this torch
        pytest.skip(f"lightning does not import: {e}")
    return lightning


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.lin2 = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.tanh(self.norm(self.lin1(x))))


_WRAP: dict[str, Callable[[torch.nn.Module], Any]] = {
    "eager": lambda net: net,
    "jit": ft.jit,
    "remat": lambda net: ft.remat(net, policy=policies.dots_saveable),
    "jit-remat": lambda net: ft.jit(ft.remat(net)),
}


@pytest.mark.parametrize("wrap", ["jit", "remat", "jit-remat"])
def test_lightning_trainer_with_jit_and_remat_trains_like_eager(wrap: str) -> None:
    L = _lightning()

    class Module(L.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self, wrap: str) -> None:
            super().__init__()
            self.net = _Net()
            self.run = _WRAP[wrap](self.net)
            self.losses: list[torch.Tensor] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.run(x)
            return out

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self(x), y)
            self.losses.append(loss.detach())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.net.parameters(), lr=0.1)

    def train(wrap: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        L.seed_everything(0, verbose=False)
        module = Module(wrap)
        data = torch.utils.data.TensorDataset(torch.randn(8, 8), torch.randn(8, 1))
        trainer = L.Trainer(
            max_steps=2,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning's advice on dataloader workers
            trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
        if hasattr(module.run, "cache_info"):
            assert module.run.cache_info().entries == 1  # compiled, not run eagerly
        return module.losses, [p.detach().clone() for p in module.net.parameters()]

    eager_losses, eager_params = train("eager")
    losses, params = train(wrap)
    assert len(losses) == 2
    assert_close(losses, eager_losses)
    assert_close(params, eager_params)


# ---------------------------------------------------------------------------------------------
# HF gradient checkpointing switched on the usual way, then ft.jit


@pytest.mark.parametrize("peft_lora", [False, True], ids=["full", "lora"])
def test_hf_gradient_checkpointing_enable_then_jit_compiles_and_trains_like_eager(
    peft_lora: bool,
) -> None:
    """``model.gradient_checkpointing_enable()`` registers HF's input-require-grads hook on
    the embeddings (it only marks the output as requiring grad): ft.jit ran every call as
    written, in silence but for a warning (issue 52). The hook is traced now: the step
    compiles (a miss, then hits) and trains as eager, HF's checkpointed layers included."""

    def make() -> Any:
        model = _gpt2()
        if peft_lora:
            model = _lora(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # names renamed in transformers 5
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        return model

    eager = make()
    want = _Run(eager, _sgd_step(eager, eager))
    model = make()
    jitted = ft.jit(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "runs as written" fallback
        got = _Run(model, _sgd_step(model, jitted))
    got.check_equal(want)
    info = jitted.cache_info()
    assert info.misses >= 1 and info.hits >= 1
