"""A model zoo for benchmarks and tests: pure ``fn(params, x) -> scalar loss`` functions.

Every entry is a :class:`Model`: a name, a pure loss function over a dict pytree of parameters
(plain ``torch.nn.functional`` ops, no module state) and a ``make(size, dtype, seed)`` builder
that returns ``(params, x)``. ``size="small"`` is for fast tests, ``size="bench"`` for benchmarks.

``ZOO`` maps names to zero-argument factories. The tiny Hugging Face models (``hf_llama``,
``hf_gpt2``, ``hf_bert``, ``hf_mistral``; defined in ``benchmarks/_hf_zoo.py``, re-exported here)
are listed only when ``transformers`` can be imported; it is imported lazily, when one of them is
built, so this module works without it.

>>> from benchmarks.zoo import ZOO
>>> model = ZOO["gpt_block"]()
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

import functrans as ft
from functrans.extend import flops

from ._hf_zoo import (
    HF_MODELS,
    MISTRAL_WINDOW,
    SDPA_NOTE,
    has_transformers,
    hf_bert,
    hf_gpt2,
    hf_kwargs,
    hf_llama,
    hf_mistral,
    hf_qwen2_default,
)
from ._model import LossFn, Model, Params, Wrap, pick

__all__ = [
    "FAMILIES",
    "HF_MODELS",
    "MISTRAL_WINDOW",
    "SDPA_NOTE",
    "STACKS",
    "ZOO",
    "Model",
    "conv_block",
    "forward_flops",
    "functional_gpt",
    "gpt_block",
    "gpt_layer",
    "gpt_stack",
    "has_transformers",
    "hf_bert",
    "hf_gpt2",
    "hf_kwargs",
    "hf_llama",
    "hf_mistral",
    "hf_qwen2_default",
    "llama_block",
    "llama_layer",
    "llama_stack",
    "mlp_blocks",
    "mlp_stack",
    "rotary_tables",
]


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> Any:
    return torch.randn(*shape, generator=gen, dtype=torch.float64).mul_(scale).to(dtype)


def _linear(gen: torch.Generator, n_in: int, n_out: int, dtype: torch.dtype) -> Params:
    return {
        "w": _randn(gen, n_out, n_in, dtype=dtype, scale=1 / math.sqrt(n_in)),
        "b": _randn(gen, n_out, dtype=dtype, scale=0.02),
    }


def _norm(gen: torch.Generator, d: int, dtype: torch.dtype, bias: bool = True) -> Params:
    p = {"w": 1 + _randn(gen, d, dtype=dtype, scale=0.1)}
    if bias:
        p["b"] = _randn(gen, d, dtype=dtype, scale=0.1)
    return p


# ---------------------------------------------------------------------------------------------
# MLP stack: blocks of Linear-GELU-Linear-LayerNorm with a residual


def mlp_stack(
    n_blocks: int = 4,
    sizes: tuple[tuple[int, int, int], tuple[int, int, int]] = ((8, 16, 32), (64, 64, 256)),
    name: str | None = None,
) -> Model:
    """``n_blocks`` blocks ``x = LayerNorm(x + W2 GELU(W1 x))``; loss ``mean(x²)``; ``sizes``
    holds (tokens, width, hidden) at "small" and at "bench"."""

    def blockwise(wrap: Wrap) -> LossFn:
        def fn(params: Params, x: torch.Tensor) -> torch.Tensor:
            for p in params["blocks"]:
                x = wrap(_mlp_layer, p, x)
            return (x * x).mean()

        return fn

    def make(
        size: str = "small", dtype: torch.dtype = torch.float32, seed: int = 0
    ) -> tuple[Params, torch.Tensor]:
        tokens, d, ffn = pick(size, *sizes)
        gen = torch.Generator().manual_seed(seed)
        blocks = [
            {
                "fc1": _linear(gen, d, ffn, dtype),
                "fc2": _linear(gen, ffn, d, dtype),
                "ln": _norm(gen, d, dtype),
            }
            for _ in range(n_blocks)
        ]
        return {"blocks": blocks}, _randn(gen, tokens, d, dtype=dtype)

    label = name or f"mlp_stack_{n_blocks}"
    return Model(label, blockwise(_call), make, blockwise=blockwise)


def _mlp_layer(params: Params, x: torch.Tensor) -> torch.Tensor:
    h = F.linear(F.gelu(F.linear(x, params["fc1"]["w"], params["fc1"]["b"])), **_wb(params["fc2"]))
    return F.layer_norm(x + h, (x.shape[-1],), params["ln"]["w"], params["ln"]["b"])


def _call(block: Callable[..., torch.Tensor], params: Params, x: torch.Tensor) -> Any:
    return block(params, x)


def _wb(p: Params) -> dict[str, torch.Tensor]:
    return {"weight": p["w"], "bias": p["b"]}


# ---------------------------------------------------------------------------------------------
# Transformer blocks with hand-written causal attention (matmul + masked softmax)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``softmax(q kᵀ / √d + causal mask) v`` on ``(batch, heads, seq, head_dim)`` tensors."""
    t = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    b, t, d = x.shape
    return x.reshape(b, t, n_heads, d // n_heads).transpose(1, 2)


def _merge(x: torch.Tensor) -> torch.Tensor:
    b, h, t, dh = x.shape
    return x.transpose(1, 2).reshape(b, t, h * dh)


#: Head size of the hand-written attention blocks: heads = d_model // HEAD_DIM.
HEAD_DIM = 16


def _block_sizes(size: str) -> tuple[int, int, int]:
    """``(batch, seq, d_model)``: 2 heads at "small", 4 at "bench"."""
    return pick(size, (1, 8, 32), (2, 32, 64))  # type: ignore[no-any-return]  # pick returns the chosen value of a tuple of Any


def gpt_layer(params: Params, x: torch.Tensor, head_dim: int = HEAD_DIM) -> torch.Tensor:
    """One pre-LayerNorm GPT layer: causal self-attention and a GELU MLP, both residual."""
    d = x.shape[-1]
    n_heads = d // head_dim
    h = F.layer_norm(x, (d,), params["ln1"]["w"], params["ln1"]["b"])
    q, k, v = (_heads(F.linear(h, params[n]), n_heads) for n in ("wq", "wk", "wv"))
    x = x + F.linear(_merge(_causal_attention(q, k, v)), **_wb(params["proj"]))
    h = F.layer_norm(x, (d,), params["ln2"]["w"], params["ln2"]["b"])
    return x + F.linear(F.gelu(F.linear(h, **_wb(params["fc1"]))), **_wb(params["fc2"]))


def _gpt_params(gen: torch.Generator, d: int, dtype: torch.dtype) -> Params:
    params: Params = {n: _randn(gen, d, d, dtype=dtype, scale=d**-0.5) for n in ("wq", "wk")}
    params["wv"] = _randn(gen, d, d, dtype=dtype, scale=d**-0.5)
    params["proj"] = _linear(gen, d, d, dtype)
    params["fc1"] = _linear(gen, d, 4 * d, dtype)
    params["fc2"] = _linear(gen, 4 * d, d, dtype)
    params["ln1"], params["ln2"] = _norm(gen, d, dtype), _norm(gen, d, dtype)
    return params


def gpt_block() -> Model:
    """Pre-LayerNorm GPT block: causal self-attention and a GELU MLP, both residual."""

    def fn(params: Params, x: torch.Tensor) -> torch.Tensor:
        x = gpt_layer(params, x)
        return (x * x).mean()

    def make(
        size: str = "small", dtype: torch.dtype = torch.float32, seed: int = 0
    ) -> tuple[Params, torch.Tensor]:
        b, t, d = _block_sizes(size)
        gen = torch.Generator().manual_seed(seed)
        return _gpt_params(gen, d, dtype), _randn(gen, b, t, d, dtype=dtype)

    return Model("gpt_block", fn, make)


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of the last dimension (the "rotate_half" rotary embedding)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rotary_tables(x: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary ``cos``/``sin`` tables for ``x``'s sequence length, from positions alone."""
    t, dh = x.shape[-2], head_dim
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dh, 2, dtype=x.dtype, device=x.device) / dh))
    angles = torch.arange(t, dtype=x.dtype, device=x.device)[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def llama_layer(
    params: Params, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
) -> torch.Tensor:
    """One Llama layer: RMSNorm, rotary causal self-attention, SiLU-gated MLP, residuals."""
    n_heads = x.shape[-1] // head_dim
    h = _rms_norm(x, params["norm1"])
    q, k, v = (_heads(F.linear(h, params[n]), n_heads) for n in ("wq", "wk", "wv"))
    q, k = _rotary(q, cos, sin), _rotary(k, cos, sin)
    x = x + F.linear(_merge(_causal_attention(q, k, v)), params["wo"])
    h = _rms_norm(x, params["norm2"])
    gated = F.silu(F.linear(h, params["w_gate"])) * F.linear(h, params["w_up"])
    return x + F.linear(gated, params["w_down"])


def _llama_params(gen: torch.Generator, d: int, ffn: int, dtype: torch.dtype) -> Params:
    params: Params = {
        n: _randn(gen, d, d, dtype=dtype, scale=d**-0.5) for n in ("wq", "wk", "wv", "wo")
    }
    params["w_gate"] = _randn(gen, ffn, d, dtype=dtype, scale=d**-0.5)
    params["w_up"] = _randn(gen, ffn, d, dtype=dtype, scale=d**-0.5)
    params["w_down"] = _randn(gen, d, ffn, dtype=dtype, scale=ffn**-0.5)
    params["norm1"] = _norm(gen, d, dtype, bias=False)["w"]
    params["norm2"] = _norm(gen, d, dtype, bias=False)["w"]
    return params


def llama_block() -> Model:
    """Llama block: RMSNorm, rotary causal self-attention, SiLU-gated MLP, residuals.

    The rotary ``cos``/``sin`` tables are computed inside from positions (no inputs, no grads).
    """

    def fn(params: Params, x: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary_tables(x, HEAD_DIM)
        x = llama_layer(params, x, cos, sin, HEAD_DIM)
        return (x * x).mean()

    def make(
        size: str = "small", dtype: torch.dtype = torch.float32, seed: int = 0
    ) -> tuple[Params, torch.Tensor]:
        b, t, d = _block_sizes(size)
        ffn = pick(size, 32, 172)
        gen = torch.Generator().manual_seed(seed)
        return _llama_params(gen, d, ffn, dtype), _randn(gen, b, t, d, dtype=dtype)

    return Model("llama_block", fn, make)


# ---------------------------------------------------------------------------------------------
# Conv block with eval-mode batch norm


def conv_block() -> Model:
    """``x + ReLU(BN(conv(ReLU(BN(conv(x))))))`` with eval-mode batch norm.

    ``x`` is a dict: the image and each batch norm's running stats, so the stats are inputs that
    get no gradient (as in a module's buffers).
    """

    def fn(params: Params, x: dict[str, Any]) -> torch.Tensor:
        h: torch.Tensor = x["image"]
        for i, (conv, bn) in enumerate(zip(params["conv"], params["bn"], strict=True)):
            h = F.conv2d(h, conv["w"], conv["b"], padding=1)
            stats = x["stats"][i]
            h = F.batch_norm(h, stats["mean"], stats["var"], bn["w"], bn["b"], training=False)
            h = F.relu(h)
        out: torch.Tensor = h + x["image"]
        return (out * out).mean()

    def make(
        size: str = "small", dtype: torch.dtype = torch.float32, seed: int = 0
    ) -> tuple[Params, dict[str, Any]]:
        b, c, hw = pick(size, (1, 4, 6), (2, 16, 16))
        gen = torch.Generator().manual_seed(seed)
        params: Params = {"conv": [], "bn": []}
        stats = []
        for _ in range(2):
            w = _randn(gen, c, c, 3, 3, dtype=dtype, scale=1 / math.sqrt(9 * c))
            params["conv"].append({"w": w, "b": _randn(gen, c, dtype=dtype, scale=0.02)})
            params["bn"].append(_norm(gen, c, dtype))
            var = 0.5 + torch.rand(c, generator=gen, dtype=torch.float64).to(dtype)
            stats.append({"mean": _randn(gen, c, dtype=dtype, scale=0.1), "var": var})
        image = _randn(gen, b, c, hw, hw, dtype=dtype)
        return params, {"image": image, "stats": stats}

    return Model("conv_block", fn, make)


# ---------------------------------------------------------------------------------------------
# Stacks of blocks, for the peak-memory benchmarks: sized so activations outweigh parameters


def gpt_stack(n_blocks: int = 4) -> Model:
    """``n_blocks`` GPT layers (width 256, 4 heads of 64), loss ``mean(x²)``; ``blockwise``
    calls each layer through a wrapper (per-block checkpointing)."""
    block = functools.partial(gpt_layer, head_dim=64)

    def blockwise(wrap: Wrap) -> LossFn:
        def fn(params: Params, x: torch.Tensor) -> torch.Tensor:
            for p in params["blocks"]:
                x = wrap(block, p, x)
            return (x * x).mean()

        return fn

    def make(
        size: str = "small", dtype: torch.dtype = torch.float32, seed: int = 0
    ) -> tuple[Params, torch.Tensor]:
        b, t, d = pick(size, (2, 16, 128), (8, 128, 256))
        gen = torch.Generator().manual_seed(seed)
        blocks = [_gpt_params(gen, d, dtype) for _ in range(n_blocks)]
        return {"blocks": blocks}, _randn(gen, b, t, d, dtype=dtype)

    return Model(f"gpt_stack_{n_blocks}", blockwise(_call), make, blockwise=blockwise)


def _llama_stack_layer(
    params: Params, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    return llama_layer(params, x, cos, sin, 32)


def llama_stack(n_blocks: int = 4) -> Model:
    """``n_blocks`` Llama layers (width 128, 4 heads of 32, MLP 344) sharing one rotary
    table; ``blockwise`` calls each layer through a wrapper."""

    def blockwise(wrap: Wrap) -> LossFn:
        def fn(params: Params, x: torch.Tensor) -> torch.Tensor:
            cos, sin = rotary_tables(x, 32)
            for p in params["blocks"]:
                x = wrap(functools.partial(_llama_stack_layer, cos=cos, sin=sin), p, x)
            return (x * x).mean()

        return fn

    def make(
        size: str = "small", dtype: torch.dtype = torch.float32, seed: int = 0
    ) -> tuple[Params, torch.Tensor]:
        b, t, d, ffn = pick(size, (2, 16, 64, 172), (8, 128, 128, 344))
        gen = torch.Generator().manual_seed(seed)
        blocks = [_llama_params(gen, d, ffn, dtype) for _ in range(n_blocks)]
        return {"blocks": blocks}, _randn(gen, b, t, d, dtype=dtype)

    return Model(f"llama_stack_{n_blocks}", blockwise(_call), make, blockwise=blockwise)


def mlp_blocks(n_blocks: int = 8) -> Model:
    """:func:`mlp_stack` at width 256, hidden 1024, 512 tokens at "bench": activations
    outweigh the parameters."""
    return mlp_stack(n_blocks, ((16, 32, 64), (512, 256, 1024)), f"mlp_blocks_{n_blocks}")


#: Stacks with ``blockwise``: the peak-memory benchmark's models (not in ``ZOO``).
STACKS: dict[str, Callable[[], Model]] = {
    "gpt_stack_4": lambda: gpt_stack(4),
    "gpt_stack_8": lambda: gpt_stack(8),
    "llama_stack_4": lambda: llama_stack(4),
    "mlp_blocks_8": lambda: mlp_blocks(8),
}


ZOO: dict[str, Callable[[], Model]] = {
    "mlp_stack": lambda: mlp_stack(4),
    "gpt_block": gpt_block,
    "llama_block": llama_block,
    "conv_block": conv_block,
}
if has_transformers():
    ZOO.update(hf_llama=hf_llama, hf_gpt2=hf_gpt2, hf_bert=hf_bert, hf_mistral=hf_mistral)
    ZOO["hf_qwen2_default"] = hf_qwen2_default  # HF's defaults: use_cache=True


def functional_gpt(layers: int = 12) -> Model:
    """``benchmarks._functional_gpt`` (a block a plain function called in a loop over a list
    of parameter dicts) as a zoo model: ``x`` is ``(idx, targets)``, batch 2 of its 32 tokens,
    width 32 at "small" and 64 at "bench"."""
    from benchmarks import _functional_gpt as fg
    from benchmarks.dynamic import SEQ, VOCAB

    def fn(params: Params, x: Any) -> torch.Tensor:
        return fg.loss(params, *x)

    def make(
        size: str = "small", dtype: torch.dtype = torch.float32, seed: int = 0
    ) -> tuple[Params, Any]:
        gen = torch.Generator().manual_seed(seed)
        idx = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
        params = fg.init(layers, pick(size, 32, 64), seed)
        params = torch.utils._pytree.tree_map(lambda t: t.detach().to(dtype), params)
        return params, (idx, idx)

    return Model(f"functional_gpt_{layers}", fn, make)


def _bn_resnet_12() -> Model:
    from benchmarks._module_zoo import bn_resnet

    return bn_resnet(12)


#: the families of issue 51 written the ways research code is, beside the zoo (not in it, so
#: the per-model test sweeps stay as they are): ``benchmarks._disk_first_call`` takes them by
#: name
FAMILIES: dict[str, Callable[[], Model]] = {
    "functional_gpt": functional_gpt,
    "bn_resnet": _bn_resnet_12,
}


def forward_flops(model: Model, size: str = "bench", dtype: torch.dtype = torch.float32) -> int:
    """FLOPs of one forward pass: ``functrans.extend.flops`` summed over the traced graph."""
    params, x = model.make(size, dtype)
    graph = ft.trace(model.fn)(params, x)
    return sum(flops(n) for n in graph.ops())
