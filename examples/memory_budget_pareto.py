"""Sweep activation-memory budgets for a small MLP and write the Pareto plot (needs
matplotlib, the `viz` extra)."""

import sys

import torch
import torch.nn.functional as F

import functrans as ft


def mlp(params, x):
    for w1, w2 in params:
        x = x + F.gelu(x @ w1) @ w2
    return x.pow(2).mean()


def main(path: str = "pareto.png") -> None:
    g = torch.Generator().manual_seed(0)
    params = [
        (torch.randn(32, 128, generator=g), torch.randn(128, 32, generator=g)) for _ in range(3)
    ]
    jg = ft.joint(mlp, argnums=0)(params, torch.randn(16, 32, generator=g))
    points = ft.pareto(jg, points=11)
    for p in points:
        saved, redo = p.activation_bytes, p.recompute_flops
        print(f"budget {p.budget:.1f}: {saved:>7} B saved, {redo:>9} FLOPs recomputed")
    print(f"wrote {ft.viz.plot_pareto(points, path, title='3-block MLP')}")


if __name__ == "__main__":
    main(*sys.argv[1:])
