"""Real third-party models: tiny Hugging Face GPT-2, Llama, BERT and Mistral (random weights built
from configs, no download) give eager autograd's loss and every parameter's gradient under every
strategy, through ``functrans.vjp``, ``functrans.jit`` on the functional loss and ``functrans.jit``
on the ``nn.Module`` itself. float32, with the library's float32 tolerances. One layer each, to
keep the file fast (about 40 s of CPU): tests/integration/test_zoo.py checks the zoo's 2-layer
versions.

The first tests need no ``transformers``: they pin down ``jit(module)`` bugs the models revealed.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils._pytree as torch_pytree

import functrans as ft
from functrans import TraceError
from functrans.testing import assert_close

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:  # the benchmarks package lives at the repository root
    sys.path.insert(0, _ROOT)

from benchmarks import zoo  # noqa: E402

MODELS = ["hf_gpt2", "hf_llama", "hf_bert", "hf_mistral"]
LAYERS = 1  # tracing dominates the time, and it grows with the layers
STRATEGIES: dict[str, dict[str, Any]] = {
    "default": {},
    "min_cut": {},
    "full_remat": {},
    "memory_budget": {"budget": 0.5},
}


# ---------------------------------------------------------------------------------------------
# jit(module) regressions, no transformers needed


class _Out:
    """An output container known only to torch's pytree (like transformers' ``ModelOutput``)."""

    def __init__(self, loss: torch.Tensor, logits: torch.Tensor) -> None:
        self.loss, self.logits = loss, logits


torch_pytree.register_pytree_node(
    _Out,
    lambda o: ([o.loss, o.logits], None),
    lambda leaves, _: _Out(*leaves),
    serialized_type_name=f"{__name__}._Out",
)


class _Scaled(torch.nn.Module):
    """A linear layer times a constant float buffer (like rotary ``inv_freq``), plus a counter
    buffer the forward updates in place."""

    def __init__(self, out: str = "container") -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 4))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.out = out

    def forward(self, x: torch.Tensor) -> Any:
        self.calls.add_(1)
        logits = torch.tanh(self.lin(x)) * self.scale
        loss = (logits * logits).mean()
        if self.out == "opaque":
            return SimpleHolder(loss)
        return _Out(loss, logits)


@dataclass
class SimpleHolder:
    """Not a pytree anywhere, yet it holds a tensor."""

    loss: torch.Tensor


def _eager(module: torch.nn.Module, x: torch.Tensor) -> tuple[Any, dict[str, torch.Tensor]]:
    out = module(x)
    grads = torch.autograd.grad(out.loss, list(module.parameters()))
    names = [n for n, _ in module.named_parameters()]
    return out, dict(zip(names, grads, strict=True))


def test_jit_module_output_registered_with_torch_pytree_only() -> None:
    """The container used to be a static leaf: the trace's fake loss came back, without grads."""
    module = _Scaled()
    jm = ft.jit(module, partition="default")
    for seed in range(2):  # the second call must compute, not replay the first
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
        module.zero_grad(set_to_none=True)
        out = jm(x)
        assert isinstance(out, _Out)
        out.loss.backward()
        expected, grads = _eager(_copy_of(module), x)
        assert_close(
            (out.loss.detach(), out.logits.detach()), (expected.loss, expected.logits), "out"
        )
        assert_close({n: p.grad for n, p in module.named_parameters()}, grads, "grad")


def _copy_of(module: _Scaled) -> _Scaled:
    fresh = _Scaled(module.out)
    fresh.load_state_dict(module.state_dict())
    return fresh


def test_jit_module_rejects_an_opaque_output_holding_tensors() -> None:
    with pytest.raises(TraceError, match="SimpleHolder that holds tensors"):
        ft.jit(_Scaled(out="opaque"))(torch.randn(3, 4))


@pytest.mark.parametrize("strategy", ["min_cut", "full_remat"])
def test_jit_module_writes_back_only_changed_buffers(strategy: str) -> None:
    """An unchanged buffer saved for backward (strategies that recompute its copy save the
    buffer itself) used to be copied back over itself, bumping its version: backward raised
    "modified by an inplace operation". Buffers the module changes are still written back."""
    module = _Scaled()
    jm = ft.jit(module, partition=strategy)
    x = torch.randn(3, 4)
    version = module.scale._version
    out = jm(x)
    out.loss.backward()  # raised before the fix
    assert module.scale._version == version
    assert int(module.calls) == 1
    _, grads = _eager(_copy_of(module), x)
    assert_close({n: p.grad for n, p in module.named_parameters()}, grads, "grad")
    jm(x)
    assert int(module.calls) == 2


# ---------------------------------------------------------------------------------------------
# The Hugging Face models


@dataclass
class _Case:
    model: zoo.Model
    params: dict[str, torch.Tensor]
    x: Any
    loss: torch.Tensor
    logits: torch.Tensor
    grads: dict[str, torch.Tensor]


_CASES: dict[str, _Case] = {}


def _case(name: str) -> _Case:
    """The model at its "small" size in float32, with eager autograd's loss and grads."""
    pytest.importorskip("transformers")
    if name not in _CASES:
        model = getattr(zoo, name)(layers=LAYERS)
        params, x = model.make("small", dtype=torch.float32)
        leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        out = torch.func.functional_call(model.module, leaves, (), zoo.hf_kwargs(x))
        grads = torch.autograd.grad(out.loss, list(leaves.values()))
        assert torch.isfinite(out.loss)
        assert all(bool(g.abs().sum() > 0) for g in grads), "every parameter gets a gradient"
        _CASES[name] = _Case(
            model,
            params,
            x,
            out.loss.detach(),
            out.logits.detach(),
            dict(zip(leaves, grads, strict=True)),
        )
    return _CASES[name]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", MODELS)
def test_vjp(name: str, strategy: str) -> None:
    c = _case(name)
    loss, vjp_fn = ft.vjp(c.model.fn, c.params, c.x, partition=strategy, **STRATEGIES[strategy])
    assert_close(loss, c.loss, "loss")
    grads, _ = vjp_fn(torch.ones(()))
    assert_close(grads, c.grads, "grad")


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", MODELS)
def test_jit_module(name: str, strategy: str) -> None:
    transformers = pytest.importorskip("transformers")
    c = _case(name)
    module = c.model.module
    assert module is not None
    missing, unexpected = module.load_state_dict(c.params, strict=False)
    assert not unexpected and all(k not in c.params for k in missing)
    module.zero_grad(set_to_none=True)
    jm = ft.jit(module, partition=strategy, **STRATEGIES[strategy])
    out = jm(**zoo.hf_kwargs(c.x))
    assert isinstance(out, transformers.utils.ModelOutput)  # the model's own class, rebuilt
    assert_close((out.loss.detach(), out.logits.detach()), (c.loss, c.logits), "output")
    out.loss.backward()
    assert_close({k: p.grad for k, p in module.named_parameters()}, c.grads, "grad")
    assert jm.partitions()[0].strategy == strategy


# jit on the functional loss differs from jit on the module only in how the inputs arrive: one
# strategy per model keeps the file fast while every strategy still runs through jit(module)
_FUNCTIONAL = dict(zip(MODELS, ["memory_budget", "full_remat", "min_cut", "default"], strict=True))


@pytest.mark.parametrize(("name", "strategy"), _FUNCTIONAL.items())
def test_jit_functional(name: str, strategy: str) -> None:
    c = _case(name)
    leaves = {k: v.clone().requires_grad_(True) for k, v in c.params.items()}
    loss = ft.jit(c.model.fn, partition=strategy, **STRATEGIES[strategy])(leaves, c.x)
    assert_close(loss.detach(), c.loss, "loss")
    loss.backward()
    assert_close({k: v.grad for k, v in leaves.items()}, c.grads, "grad")


def _logits(model: zoo.Model, params: dict[str, torch.Tensor], kwargs: dict[str, Any]) -> Any:
    return torch.func.functional_call(model.module, params, (), kwargs).logits.detach()


def test_mistral_window_shapes_the_attention() -> None:
    """At the "small" sequence length the window masks keys a causal mask keeps: the first
    positions see the same keys either way, the later ones do not. So the Mistral tests exercise
    a different attention pattern from Llama's."""
    c = _case("hf_mistral")
    causal = zoo.hf_mistral(layers=LAYERS, sliding_window=None)
    window = zoo.MISTRAL_WINDOW
    diff = (_logits(causal, c.params, {"input_ids": c.x}) - c.logits).abs().amax(-1)[0]
    assert diff[:window].max() < 1e-5 < 1e-3 < diff[window:].min()


def test_bert_padding_mask_matters() -> None:
    """BERT's batch carries padding that the attention mask hides from the other positions."""
    c = _case("hf_bert")
    unmasked = {k: v for k, v in c.x.items() if k != "attention_mask"}
    kept = c.x["attention_mask"].bool()
    diff = (_logits(c.model, c.params, unmasked) - c.logits)[kept].abs().max()
    assert diff > 1e-3
