"""``benchmarks.dynamic.GPT`` written JAX-style: parameters a pytree, a block a plain function
called in a loop over a list of parameter dicts, no ``nn.Module`` (the same math, without
dropout: functional code draws its keys explicitly, which torch's global generator does not).

>>> import torch
>>> params = init(layers=2, d=32)
>>> idx = torch.zeros(2, 8, dtype=torch.long)
>>> loss(params, idx, idx).shape
torch.Size([])
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.dynamic import SEQ, VOCAB

Params = dict[str, Any]


def _linear(d_in: int, d_out: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    bound = d_in**-0.5
    w = (torch.rand(d_out, d_in, generator=gen) * 2 - 1) * bound
    b = (torch.rand(d_out, generator=gen) * 2 - 1) * bound
    return {"w": w.requires_grad_(), "b": b.requires_grad_()}


def _norm(d: int) -> dict[str, torch.Tensor]:
    return {"w": torch.ones(d, requires_grad=True), "b": torch.zeros(d, requires_grad=True)}


def init(layers: int = 2, d: int = 64, seed: int = 0) -> Params:
    """The parameters of a ``layers``-block model of width ``d``."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [
        {
            "ln1": _norm(d),
            "qkv": _linear(d, 3 * d, gen),
            "proj": _linear(d, d, gen),
            "ln2": _norm(d),
            "fc": _linear(d, 4 * d, gen),
            "out": _linear(4 * d, d, gen),
        }
        for _ in range(layers)
    ]
    wte = (torch.randn(VOCAB, d, generator=gen) * 0.02).requires_grad_()
    wpe = (torch.randn(SEQ, d, generator=gen) * 0.02).requires_grad_()
    return {"wte": wte, "wpe": wpe, "blocks": blocks, "ln": _norm(d)}


def layer_norm(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], p["w"], p["b"])


def dense(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, p["w"], p["b"])


def block(p: Params, x: torch.Tensor, heads: int = 4) -> torch.Tensor:
    """One pre-norm transformer block."""
    B, T, C = x.shape
    q, k, v = dense(p["qkv"], layer_norm(p["ln1"], x)).split(C, dim=2)
    q, k, v = (t.view(B, T, heads, C // heads).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + dense(p["proj"], y.transpose(1, 2).reshape(B, T, C))
    return x + dense(p["out"], F.gelu(dense(p["fc"], layer_norm(p["ln2"], x))))


def loss(params: Params, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the model's next-token predictions (the head tied to ``wte``)."""
    x = params["wte"][idx] + params["wpe"][: idx.shape[1]]
    for p in params["blocks"]:
        x = block(p, x)
    logits = layer_norm(params["ln"], x) @ params["wte"].t()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
