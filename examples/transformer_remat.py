"""Train a small GPT-style model for a few steps with ``jit`` + ``remat`` policies, and print
how many activation bytes each policy saves for backward."""

import torch
import torch.nn.functional as F

import functrans as ft
from functrans import policies

D, HEADS, SEQ, LAYERS = 32, 4, 16, 2


def block(p, x):
    b, s, d = x.shape
    h = F.layer_norm(x, (d,))
    q, k, v = (h @ p["qkv"]).split(d, dim=-1)
    q, k, v = (t.view(b, s, HEADS, d // HEADS).transpose(1, 2) for t in (q, k, v))
    att = (q @ k.transpose(-1, -2)) / (d // HEADS) ** 0.5
    att = att.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    x = x + ft.checkpoint_name((att @ v).transpose(1, 2).reshape(b, s, d) @ p["proj"], "attn")
    return x + F.gelu(F.layer_norm(x, (d,)) @ p["fc"]) @ p["out"]


def make_model(policy):
    rblock = ft.remat(block, policy=policy) if policy != "none" else block

    def loss_fn(params, tokens):
        x = params["embed"][tokens]
        for p in params["layers"]:
            x = rblock(p, x)
        logits = F.layer_norm(x, (D,)) @ params["embed"].t()
        return F.cross_entropy(logits[:, :-1].reshape(-1, 64), tokens[:, 1:].reshape(-1))

    return loss_fn


def init():
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.1).requires_grad_()

    layers = [
        {"qkv": w(D, 3 * D), "proj": w(D, D), "fc": w(D, 4 * D), "out": w(4 * D, D)}
        for _ in range(LAYERS)
    ]
    return {"embed": w(64, D), "layers": layers}


def main() -> None:
    tokens = torch.randint(0, 64, (4, SEQ), generator=torch.Generator().manual_seed(1))
    choices = {
        "none (no remat)": "none",
        "nothing_saveable": policies.nothing_saveable,
        "dots_saveable": policies.dots_saveable,
        "save_only_these_names('attn')": policies.save_only_these_names("attn"),
    }
    print(f"{'policy':<32} {'saved activations':>18} {'loss after 5 steps':>20}")
    for label, policy in choices.items():
        params = init()
        step = ft.jit(make_model(policy), partition="default")
        leaves = [params["embed"], *(t for p in params["layers"] for t in p.values())]
        opt = torch.optim.Adam(leaves, lr=1e-2)
        for _ in range(5):
            opt.zero_grad()
            loss = step(params, tokens)
            loss.backward()
            opt.step()
        saved = step.partitions()[0].activation_bytes
        print(f"{label:<32} {saved:>16} B {loss.item():>20.4f}")


if __name__ == "__main__":
    main()
