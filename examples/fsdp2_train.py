"""Train a small GPT with FSDP2 and functrans on 2 CPU processes (gloo):

    torchrun --nproc-per-node 2 examples/fsdp2_train.py [--steps 5] [--partition min_cut]

Each transformer block is its own FSDP unit (``fully_shard``); ``ft.distributed.jit_blocks``
compiles each block's forward with ``ft.jit`` inside its unit, where FSDP has already gathered
the parameters. The same model is trained eagerly alongside, from the same initial weights and
batches, and each rank prints both losses and the activation bytes the compiled blocks save.

On GPUs use the nccl backend and ``--nproc-per-node`` = GPUs per machine; across machines add
``--nnodes N --rdzv-endpoint HOST:PORT``. Nothing in functrans changes.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

import functrans as ft


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(torch.nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens[:, :-1])
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def sharded(model: torch.nn.Module) -> torch.nn.Module:
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def say(line: str) -> None:
    """One write per line: the ranks share stdout, and print() writes the newline apart."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--partition", default="min_cut")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    base = GPT()
    eager = sharded(copy.deepcopy(base))
    ours = ft.distributed.jit_blocks(sharded(copy.deepcopy(base)), partition=args.partition)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, ours)]
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    for step in range(args.steps):
        tokens = torch.randint(0, 64, (4, 17), generator=data)
        losses = []
        for model, opt in zip((eager, ours), optimizers, strict=True):
            loss = model(tokens)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        say(f"rank {rank} step {step}: loss eager {losses[0]:.6f}  functrans {losses[1]:.6f}")
    saved = sum(p.activation_bytes for b in ours.blocks for p in b.forward.partitions())
    say(f"rank {rank}: the compiled blocks save {saved} bytes of activations ({args.partition})")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
