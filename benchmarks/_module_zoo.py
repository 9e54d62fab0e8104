"""Model families the zoo lacks, built as ``nn.Module`` stacks: the peak-memory benchmark's
``--family unseen``.

Each is a :class:`benchmarks._model.Model` whose ``fn(params, x)`` is
``torch.func.functional_call(model.module, params, ...)``: the module holds its blocks, instances
of one class, in an ``nn.ModuleList``, so ``ft.jit`` finds them as repeated regions. The
hand-written ones (``dropout_gpt``, ``tied_uneven``, ``mlp_mixer``, ``bn_resnet``) have
``blockwise(wrap)``: the same loss with each block called as ``wrap(block, block_params, h)``,
where ``block(p, h)`` is ``functional_call(block_module, p, (h,))`` (so a
``torch.utils.checkpoint`` recomputation in the backward swaps the parameters in again). The
Hugging Face ones (``hf_qwen2``, ``hf_vit``, ``hf_gpt_neox``; random weights from configs, eager
attention, no dropout) checkpoint with ``gradient_checkpointing_enable`` instead.

- ``dropout_gpt``: pre-LayerNorm GPT blocks, causal matmul + softmax attention, GELU MLP,
  dropout 0.1 on the attention probabilities and both residual branches, in train mode; LM
  cross-entropy over a small vocabulary;
- ``tied_uneven``: an LM whose output head is its embedding (one ``Parameter``), three
  SwiGLU blocks at one width, a projection up, three at twice the width, a projection down;
- ``mlp_mixer``: MLP-Mixer blocks (token mixing and channel mixing MLPs, LayerNorm) over image
  patches, classification cross-entropy;
- ``bn_resnet``: basic residual blocks (conv3x3, train-mode ``BatchNorm2d``, ReLU) at fixed
  channels, the running statistics updated at every step; mean pool, linear head.

A model's architecture is the same at both sizes ("small" and "bench" differ in the batch,
sequence or image size only: ``fn`` calls one module). Dropout draws from the global
generator: seed it before each call to compare two runs.

>>> model = UNSEEN["mlp_mixer_8"]()
>>> params, x = model.make("small")
>>> model.fn(params, x).shape
torch.Size([])
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._hf_zoo import _hf_model, has_transformers
from ._model import LossFn, Model, Params, Wrap, pick

__all__ = [
    "UNSEEN",
    "bn_resnet",
    "dropout_gpt",
    "hf_gpt_neox",
    "hf_qwen2",
    "hf_vit",
    "mlp_mixer",
    "tied_uneven",
]

#: how a stack runs its ``i``-th block in :meth:`_Stack.forward` (``None``: ``block(h)``)
RunBlock = Callable[[int, nn.Module, torch.Tensor], torch.Tensor]


class _Stack(nn.Module):
    """``loss(blocks(embed(x)), x)``: the blocks in one ``nn.ModuleList``."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def embed(self, x: Any) -> torch.Tensor:
        raise NotImplementedError

    def loss(self, h: torch.Tensor, x: Any) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: Any, run_block: RunBlock | None = None) -> torch.Tensor:
        h = self.embed(x)
        for i, block in enumerate(self.blocks):
            h = block(h) if run_block is None else run_block(i, block, h)
        return self.loss(h, x)


def _call_block(block: nn.Module, params: Params, h: torch.Tensor) -> torch.Tensor:
    return torch.func.functional_call(block, params, (h,))  # type: ignore[no-any-return]  # functional_call returns Any


def _module_model(
    name: str,
    build: Callable[[], _Stack],
    batch: Callable[[torch.Generator, str, torch.dtype], Any],
    supports_float64: bool = True,
) -> Model:
    """A :class:`Model` over ``build()``'s module: ``make`` seeds a fresh module's
    initialization and takes its parameters (tied ones once, as ``named_parameters`` lists
    them); ``batch(gen, size, dtype)`` makes the input."""
    module = build()

    def fn(params: Params, x: Any) -> torch.Tensor:
        return torch.func.functional_call(module, params, (x,))  # type: ignore[no-any-return]  # functional_call returns Any

    def blockwise(wrap: Wrap) -> LossFn:
        def fn(params: Params, x: Any) -> torch.Tensor:
            def run(i: int, block: nn.Module, h: torch.Tensor) -> torch.Tensor:
                prefix = f"blocks.{i}."
                p = {k[len(prefix) :]: v for k, v in params.items() if k.startswith(prefix)}
                return wrap(functools.partial(_call_block, block), p, h)

            return torch.func.functional_call(module, params, (x,), {"run_block": run})  # type: ignore[no-any-return]  # functional_call returns Any

        return fn

    def make(
        size: str = "small", dtype: torch.dtype = torch.float32, seed: int = 0
    ) -> tuple[Params, Any]:
        with torch.random.fork_rng():  # the module's own initialization, seeded
            torch.manual_seed(seed)
            fresh = build()
        params = {k: v.detach().to(dtype) for k, v in fresh.named_parameters()}
        return params, batch(torch.Generator().manual_seed(seed), size, dtype)

    return Model(name, fn, make, supports_float64, module=module.train(), blockwise=blockwise)


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def _lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: position ``t`` predicts ``ids[:, t + 1]``."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


# ---------------------------------------------------------------------------------------------
# GPT with dropout, in train mode


class _GPTBlock(nn.Module):
    """Pre-LayerNorm: causal self-attention (matmul + masked softmax, dropout on the
    probabilities) and a GELU MLP, both residual through dropout."""

    def __init__(self, d: int, n_heads: int, p: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.attn_drop, self.resid_drop = nn.Dropout(p), nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            z.reshape(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)
            for z in self.qkv(self.ln1(x)).split(d, dim=-1)
        )
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        probs = self.attn_drop(torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1))
        attn = (probs @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.resid_drop(self.proj(attn))
        return x + self.resid_drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))  # type: ignore[no-any-return]  # nn.Module.__call__ returns Any


class _GPT(_Stack):
    def __init__(self, vocab: int, d: int, n_heads: int, t_max: int, n_blocks: int) -> None:
        super().__init__([_GPTBlock(d, n_heads, 0.1) for _ in range(n_blocks)])
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(t_max, d)
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))  # type: ignore[no-any-return]  # nn.Module.__call__ returns Any

    def loss(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return _lm_loss(self.head(self.ln_f(h)), x)


#: (batch, seq) at "small" and at "bench"; width 128 in 2 heads of 64, vocabulary 256
_GPT_SIZES = ((2, 8), (4, 128))
_GPT_VOCAB = 256


def dropout_gpt(n_blocks: int = 10) -> Model:
    """``n_blocks`` pre-LayerNorm GPT blocks (width 128, 2 heads) with dropout 0.1, in train
    mode; LM cross-entropy over a 256-token vocabulary."""

    def batch(gen: torch.Generator, size: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.randint(0, _GPT_VOCAB, pick(size, *_GPT_SIZES), generator=gen)

    build = functools.partial(_GPT, _GPT_VOCAB, 128, 2, _GPT_SIZES[1][1], n_blocks)
    return _module_model(f"dropout_gpt_{n_blocks}", build, batch)


# ---------------------------------------------------------------------------------------------
# Tied embedding and head, blocks of two widths


class _SwiGLUBlock(nn.Module):
    """``x + W_down(SiLU(W_gate h) * W_up h)``, ``h = LayerNorm(x)``: one token at a time."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.gate, self.up = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, 3 * d, bias=False)
        self.down = nn.Linear(3 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))  # type: ignore[no-any-return]  # nn.Module.__call__ returns Any


class _Resize(nn.Module):
    """``Linear(LayerNorm(x))`` from one width to another."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.ln, self.proj = nn.LayerNorm(d_in), nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.ln(x))  # type: ignore[no-any-return]  # nn.Module.__call__ returns Any


class _TiedLM(_Stack):
    def __init__(self, vocab: int, d: int, per_width: int) -> None:
        narrow = [_SwiGLUBlock(d) for _ in range(per_width)]
        wide = [_SwiGLUBlock(2 * d) for _ in range(per_width)]
        super().__init__([*narrow, _Resize(d, 2 * d), *wide, _Resize(2 * d, d)])
        self.tok, self.ln_f = nn.Embedding(vocab, d), nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: one Parameter
        nn.init.normal_(self.tok.weight, std=d**-0.5)  # logits of unit scale

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.tok(x)  # type: ignore[no-any-return]  # nn.Module.__call__ returns Any

    def loss(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return _lm_loss(self.head(self.ln_f(h)), x)


#: (batch, seq) at "small" and at "bench"; widths 128 and 256, vocabulary 512
_TIED_SIZES = ((2, 8), (4, 128))
_TIED_VOCAB = 512


def tied_uneven(per_width: int = 3) -> Model:
    """An LM whose head is its embedding (one ``Parameter``, vocabulary 512): ``per_width``
    SwiGLU blocks at width 128, a projection to 256, ``per_width`` blocks at 256, a projection
    back; next-token cross-entropy (no attention: the blocks see one token at a time)."""

    def batch(gen: torch.Generator, size: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.randint(0, _TIED_VOCAB, pick(size, *_TIED_SIZES), generator=gen)

    build = functools.partial(_TiedLM, _TIED_VOCAB, 128, per_width)
    return _module_model("tied_uneven", build, batch)


# ---------------------------------------------------------------------------------------------
# MLP-Mixer


class _MixerBlock(nn.Module):
    """Token mixing (an MLP across the tokens of each channel), then channel mixing (an MLP
    across the channels of each token), each pre-LayerNorm and residual."""

    def __init__(self, tokens: int, d: int, token_hidden: int, channel_hidden: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.tok1, self.tok2 = nn.Linear(tokens, token_hidden), nn.Linear(token_hidden, tokens)
        self.ch1, self.ch2 = nn.Linear(d, channel_hidden), nn.Linear(channel_hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x).transpose(1, 2)
        x = x + self.tok2(F.gelu(self.tok1(h))).transpose(1, 2)
        return x + self.ch2(F.gelu(self.ch1(self.ln2(x))))  # type: ignore[no-any-return]  # nn.Module.__call__ returns Any


class _Mixer(_Stack):
    def __init__(self, image: int, patch: int, d: int, classes: int, n_blocks: int) -> None:
        tokens = (image // patch) ** 2
        super().__init__([_MixerBlock(tokens, d, d, 4 * d) for _ in range(n_blocks)])
        self.stem = nn.Conv2d(3, d, patch, stride=patch)
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, classes)

    def embed(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.stem(x["image"]).flatten(2).transpose(1, 2)  # type: ignore[no-any-return]  # nn.Module.__call__ returns Any

    def loss(self, h: torch.Tensor, x: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(self.head(self.ln_f(h).mean(1)), x["labels"])


_CLASSES = 10


def _images(gen: torch.Generator, b: int, hw: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {
        "image": _randn(gen, b, 3, hw, hw, dtype=dtype),
        "labels": torch.randint(0, _CLASSES, (b,), generator=gen),
    }


def mlp_mixer(n_blocks: int = 8) -> Model:
    """``n_blocks`` MLP-Mixer blocks over the 64 patches (4x4) of a 32x32 image, width 128,
    token MLP 128, channel MLP 512; batch 2 at "small", 16 at "bench"; 10-class
    cross-entropy."""

    def batch(gen: torch.Generator, size: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return _images(gen, pick(size, 2, 16), 32, dtype)

    build = functools.partial(_Mixer, 32, 4, 128, _CLASSES, n_blocks)
    return _module_model(f"mlp_mixer_{n_blocks}", build, batch)


# ---------------------------------------------------------------------------------------------
# ResNet basic blocks with train-mode batch norm


class _BasicBlock(nn.Module):
    """``ReLU(x + BN(conv(ReLU(BN(conv(x))))))``, 3x3 convolutions at fixed channels."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1, self.bn2 = nn.BatchNorm2d(c), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(h)))


class _ResNet(_Stack):
    def __init__(self, c: int, classes: int, n_blocks: int) -> None:
        super().__init__([_BasicBlock(c) for _ in range(n_blocks)])
        self.stem, self.bn = nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.head = nn.Linear(c, classes)

    def embed(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.relu(self.bn(self.stem(x["image"])))

    def loss(self, h: torch.Tensor, x: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(self.head(h.mean((2, 3))), x["labels"])


def bn_resnet(n_blocks: int = 8) -> Model:
    """A 3x3 conv stem and ``n_blocks`` basic residual blocks at 32 channels, batch norm in
    train mode (batch statistics; the running ones updated at every call), mean pool, a
    linear 10-class head; images 2x8x8 at "small", 8x32x32 at "bench".

    The running statistics are float32 buffers of the module: no float64.
    """

    def batch(gen: torch.Generator, size: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        b, hw = pick(size, (2, 8), (8, 32))
        return _images(gen, b, hw, dtype)

    build = functools.partial(_ResNet, 32, _CLASSES, n_blocks)
    return _module_model(f"bn_resnet_{n_blocks}", build, batch, supports_float64=False)


# ---------------------------------------------------------------------------------------------
# Hugging Face models from configs: random weights, eager attention, no dropout

#: Hugging Face models' (batch, seq) at "small" and at "bench"
_HF_LM_SIZES = ((2, 8), (8, 128))
_HF_VOCAB = 256


def _lm_batch(gen: torch.Generator, b: int, t: int) -> dict[str, Any]:
    """A causal LM's kwargs: the ids are the labels; ``use_cache=False`` (a training step)."""
    ids = torch.randint(0, _HF_VOCAB, (b, t), generator=gen)
    return {"input_ids": ids, "labels": ids, "use_cache": False}


def hf_qwen2(layers: int = 6) -> Model:
    """A Qwen2 causal LM of ``layers`` layers (hidden 128, 4 query heads over 2 key/value
    heads, MLP 344, vocabulary 256) from ``Qwen2Config``; batch 8 of 128 tokens at "bench"."""

    def build(tf: Any) -> nn.Module:
        cfg = tf.Qwen2Config(
            vocab_size=_HF_VOCAB,
            hidden_size=128,
            intermediate_size=344,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            attention_dropout=0.0,
            use_cache=False,
            attn_implementation="eager",
        )
        return tf.Qwen2ForCausalLM(cfg)  # type: ignore[no-any-return]  # transformers is untyped

    return _hf_model(f"hf_qwen2_{layers}l", build, _lm_batch, _HF_LM_SIZES)


def hf_gpt_neox(layers: int = 6) -> Model:
    """A GPT-NeoX causal LM of ``layers`` layers (hidden 128, 4 heads, MLP 512, rotary on a
    quarter of each head, parallel residual, vocabulary 256) from ``GPTNeoXConfig``; batch 8 of
    128 tokens at "bench"."""

    def build(tf: Any) -> nn.Module:
        cfg = tf.GPTNeoXConfig(
            vocab_size=_HF_VOCAB,
            hidden_size=128,
            intermediate_size=512,
            num_hidden_layers=layers,
            num_attention_heads=4,
            max_position_embeddings=256,
            attention_dropout=0.0,
            hidden_dropout=0.0,
            bos_token_id=0,
            eos_token_id=0,
            use_cache=False,
            attn_implementation="eager",
        )
        return tf.GPTNeoXForCausalLM(cfg)  # type: ignore[no-any-return]  # transformers is untyped

    return _hf_model(f"hf_gpt_neox_{layers}l", build, _lm_batch, _HF_LM_SIZES)


def _vit_batch(gen: torch.Generator, b: int, hw: int) -> dict[str, torch.Tensor]:
    return {
        "pixel_values": torch.randn(b, 3, hw, hw, generator=gen),
        "labels": torch.randint(0, _CLASSES, (b,), generator=gen),
    }


def hf_vit(layers: int = 6) -> Model:
    """A ViT image classifier of ``layers`` layers (hidden 128, 4 heads, MLP 512, 4x4 patches
    of a 32x32 image: 65 tokens with the class token, 10 classes) from ``ViTConfig``; batch 2
    at "small", 16 at "bench"."""

    def build(tf: Any) -> nn.Module:
        cfg = tf.ViTConfig(
            hidden_size=128,
            num_hidden_layers=layers,
            num_attention_heads=4,
            intermediate_size=512,
            image_size=32,
            patch_size=4,
            num_channels=3,
            num_labels=_CLASSES,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            attn_implementation="eager",
        )
        return tf.ViTForImageClassification(cfg)  # type: ignore[no-any-return]  # transformers is untyped

    return _hf_model(f"hf_vit_{layers}l", build, _vit_batch, ((2, 32), (16, 32)))


UNSEEN: dict[str, Callable[[], Model]] = {
    "dropout_gpt_10": dropout_gpt,
    "tied_uneven": tied_uneven,
    "mlp_mixer_8": mlp_mixer,
    "bn_resnet_8": bn_resnet,
}
if has_transformers():
    UNSEEN.update(hf_qwen2_6l=hf_qwen2, hf_vit_6l=hf_vit, hf_gpt_neox_6l=hf_gpt_neox)
