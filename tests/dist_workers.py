"""Worker functions for tests/integration/test_distributed.py: each runs on every rank (see
tests/_dist.py) and returns picklable results the test compares across ranks and with eager."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import functrans as ft
from functrans import policies
from functrans.extend import is_collective

STRATEGIES: list[tuple[str, dict[str, Any]]] = [
    ("default", {}),
    ("min_cut", {}),
    ("full_remat", {}),
    ("memory_budget", {"budget": 0.2}),
    ("memory_budget", {"budget": 0.7}),
]


def sharded_mlp(x: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """A 2-layer MLP whose weights are sharded across ranks (FSDP style): each is all-gathered
    (differentiably: its gradient is reduce-scattered back to the shard) before use."""
    w1 = funcol.all_gather_tensor_autograd(s1, 0, dist.group.WORLD)
    w2 = funcol.all_gather_tensor_autograd(s2, 0, dist.group.WORLD)
    return torch.tanh(torch.nn.functional.gelu(x @ w1) @ w2).pow(2).mean()


def _collectives(graph: Any) -> list[str]:
    return [str(n.target) for n in graph.graph_module.graph.nodes if is_collective(n)]


def sharded_mlp_every_strategy(rank: int, world: int, batches: list[int]) -> dict[str, Any]:
    """For every strategy (and the reshard policy): loss and shard gradients equal eager's,
    and the collective sequence each partition issues; batch sizes differ per rank."""
    torch.manual_seed(0)
    w1, w2 = torch.randn(16, 32) / 4, torch.randn(32, 16) / 6
    s1, s2 = w1.chunk(world)[rank].clone(), w2.chunk(world)[rank].clone()
    x = torch.randn(batches[rank], 16, generator=torch.Generator().manual_seed(rank))
    ref_s1, ref_s2 = s1.clone().requires_grad_(), s2.clone().requires_grad_()
    ref_loss = sharded_mlp(x, ref_s1, ref_s2)
    ref_loss.backward()
    out: dict[str, Any] = {}
    resharded = ft.remat(sharded_mlp, policy=policies.reshard_after_forward)
    for fn, label in ((sharded_mlp, ""), (resharded, "+reshard")):
        jg = ft.joint(fn, argnums=(1, 2))(x, s1, s2)
        for strategy, options in STRATEGIES:
            p = ft.partition(jg, strategy, **options)
            loss, saved = p.forward(x, s1, s2)
            g1, g2 = p.backward(saved, (torch.ones(()),))
            name = f"{strategy}{options.get('budget', '')}{label}"
            torch.testing.assert_close(loss, ref_loss.detach(), msg=name)
            torch.testing.assert_close((g1, g2), (ref_s1.grad, ref_s2.grad), msg=name)
            gathered_saved = [s.name for s in p.saved if "wait" in s.name]
            out[name] = {
                "forward": _collectives(p.forward),
                "backward": _collectives(p.backward),
                "saved_gathered": gathered_saved,
                "activation_bytes": p.activation_bytes,
            }
    jitted = ft.jit(ft.value_and_grad(sharded_mlp, argnums=(1, 2)), partition="min_cut")
    for _ in range(2):
        loss, (g1, g2) = jitted(x, s1, s2)
        torch.testing.assert_close((loss, g1, g2), (ref_loss.detach(), ref_s1.grad, ref_s2.grad))
    return out


class Block(torch.nn.Module):
    def __init__(self, d: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x)))))


class Net(torch.nn.Module):
    def __init__(self, d: int = 16, n: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(d, dropout) for _ in range(n))
        self.head = torch.nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()


def fsdp2_training(rank: int, world: int) -> dict[str, Any]:
    """3 SGD steps of a 2-block model with dropout under FSDP2, then an evaluation pass in
    eval mode and one more training step: eager vs jit_blocks for several strategies and a
    remat policy, under one seed per step; losses and (sharded) parameters equal eager's on
    each rank."""
    import copy

    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    base = Net(dropout=0.2)
    variants: dict[str, Any] = {
        "eager": None,
        "min_cut": {"partition": "min_cut"},
        "default": {"partition": "default"},
        "full_remat": {"partition": "full_remat"},
        "memory_budget": {"partition": "memory_budget", "budget": 0.3},
        "remat(dots)": {"partition": "min_cut", "policy": policies.dots_saveable},
    }
    models, opts = {}, {}
    for name, options in variants.items():
        m = copy.deepcopy(base)
        for b in m.blocks:
            fully_shard(b)
        fully_shard(m)
        if options is not None:
            ft.distributed.jit_blocks(m, **options)
        models[name], opts[name] = m, torch.optim.SGD(m.parameters(), lr=0.1)
    losses: dict[str, list[float]] = {k: [] for k in variants}

    def train_step(step: int) -> None:
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        for name, m in models.items():
            torch.manual_seed(100 + step)  # the same dropout masks for every variant
            loss = m(x)
            loss.backward()
            opts[name].step()
            opts[name].zero_grad()
            losses[name].append(loss.item())

    for step in range(3):
        train_step(step)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(99 + rank))
    with torch.no_grad():  # evaluation: dropout off, no gradients
        for name, m in models.items():
            m.eval()
            losses[name].append(m(x).item())
            m.train()
    train_step(3)
    for name, m in models.items():
        for (pname, a), (_, b) in zip(
            models["eager"].named_parameters(), m.named_parameters(), strict=True
        ):
            torch.testing.assert_close(b.to_local(), a.to_local(), msg=f"{name}: {pname}")
    refused = ""
    try:
        ft.jit(models["eager"])
    except ft.UnsupportedOpError as e:
        refused = str(e)
    return {"losses": losses, "refused": refused}


def fsdp2_step_budget(rank: int, world: int) -> dict[str, Any]:
    """budget_blocks on a 3-block FSDP2 model: at no limit (nothing recomputed) and at the
    lowest bound a refusal names, each rank's later steps measure within the bound, and
    training losses equal eager FSDP2's."""
    import copy

    from torch.distributed.fsdp import fully_shard

    from functrans.testing import measure_peak

    torch.manual_seed(0)
    base = Net(d=32, n=3)
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(rank))

    def sharded() -> Net:
        m = copy.deepcopy(base)
        for b in m.blocks:
            fully_shard(b)
        fully_shard(m)
        return m

    def peaks(m: Net) -> list[int]:
        out = []
        for _ in range(6):
            m.zero_grad(set_to_none=True)
            dist.barrier()
            out.append(measure_peak(lambda: m(x).backward()).peak_bytes)
        return out

    def budget(m: Net, limit: int) -> ft.distributed.StepBudget:
        return ft.distributed.budget_blocks(m, lambda: m(x).backward(), peak_bytes=limit)

    eager = sharded()
    out: dict[str, Any] = {"eager": peaks(eager)}
    try:  # each rank its own limit: refused on both, no rank left waiting
        budget(sharded(), 1 << (20 + rank))
    except ft.InvalidArgumentError as e:
        out["mismatch"] = str(e)
    try:
        budget(sharded(), 1)
    except ft.InvalidPartitionError as e:
        out["refused"] = str(e)
    lowest = int(out["refused"].split("bound is ")[1].split(" ")[0])
    models = {"eager": eager}
    for name, limit in (("roomy", 1 << 30), ("lowest", lowest)):
        m = sharded()
        b = budget(m, limit)
        out[name] = {"bound": b.peak_bytes, "cuts": b.chosen.cuts, "measured": peaks(m)}
        out[name]["margin"] = b.margin
        models[name] = m
    losses: dict[str, list[float]] = {k: [] for k in models}
    for name, m in models.items():
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            loss = m(x)
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    out["losses"] = losses
    return out


def dtensor_arguments(rank: int, world: int) -> dict[str, Any]:
    """DTensor arguments to trace, jit and grad: taken apart to their local tensors (the graph
    has local shapes and the collectives DTensor issues), rebuilt on the way out, values equal
    eager DTensor; a DTensor replaced between calls gives the new values."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    w, x = torch.randn(8, 16), torch.randn(4, 8)
    dw = distribute_tensor(w, mesh, [Shard(1)])
    dx = distribute_tensor(x, mesh, [Replicate()])

    def f(x: Any, w: Any) -> Any:
        return torch.tanh(x @ w).sum()

    graph = ft.trace(f)(dx, dw)
    placeholders = [
        n.meta["val"].shape for n in graph.graph_module.graph.nodes if n.op == "placeholder"
    ]
    assert placeholders == [(4, 8), (8, 16 // world)], placeholders  # local shapes
    jitted = ft.jit(f)
    for scale in (1.0, 3.0):  # a new DTensor each call: never baked in
        dw2 = distribute_tensor(w * scale, mesh, [Shard(1)])
        expected = f(dx, dw2).full_tensor()
        torch.testing.assert_close(graph(dx, dw2).full_tensor(), expected)
        with torch.no_grad():
            torch.testing.assert_close(jitted(dx, dw2).full_tensor(), expected)
    ref_w = dw.detach().clone().requires_grad_()
    f(dx, ref_w).backward()
    out: dict[str, Any] = {}
    for strategy in ("default", "min_cut", "full_remat"):
        g = ft.grad(f, argnums=1, partition=strategy)(dx, dw)
        assert g.placements == ref_w.grad.placements
        torch.testing.assert_close(g.to_local(), ref_w.grad.to_local(), msg=strategy)

    def gathered(x: Any, w: Any) -> torch.Tensor:  # all-gathers in forward: a plain output
        return torch.tanh((x @ w).full_tensor()).pow(2).sum()

    for strategy in ("default", "min_cut"):  # jit training: DTensor in, DTensor grads out
        w_leaf = dw.detach().clone().requires_grad_()
        ft.jit(gathered, partition=strategy)(dx, w_leaf).backward()
        ref_w = dw.detach().clone().requires_grad_()
        gathered(dx, ref_w).backward()
        assert w_leaf.grad.placements == ref_w.grad.placements
        torch.testing.assert_close(w_leaf.grad.to_local(), ref_w.grad.to_local(), msg=strategy)
    jg = ft.joint(gathered, argnums=1)(dx, dw)
    out["collectives"] = [str(n.target) for n in jg.ops() if is_collective(n)]
    ref_w = dw.detach().clone().requires_grad_()
    gathered(dx, ref_w).backward()
    for strategy in ("default", "min_cut", "full_remat"):
        g = ft.grad(gathered, argnums=1, partition=strategy)(dx, dw)
        torch.testing.assert_close(g.to_local(), ref_w.grad.to_local(), msg=strategy)
    return out


def tensor_parallel_blocks(rank: int, world: int) -> dict[str, Any]:
    """An MLP and an attention block under parallelize_module (Colwise/RowwiseParallel):
    ``ft.jit`` of the block equals eager TP, compiled for inference and for training (DTensor
    parameters get DTensor gradients); three training steps with SGD."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)

    class Attention(torch.nn.Module):
        def __init__(self, d: int = 16, heads: int = 4) -> None:
            super().__init__()
            self.q, self.k, self.v = (torch.nn.Linear(d, d) for _ in range(3))
            self.o = torch.nn.Linear(d, d)
            self.heads = heads

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape

            def split(y: torch.Tensor) -> torch.Tensor:
                return y.view(b, t, -1, 16 // self.heads).transpose(1, 2)

            q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o(a.transpose(1, 2).reshape(b, t, -1))

    plans = {
        "mlp": (Block(16), {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}),
        "attention": (
            Attention(),
            {
                "q": ColwiseParallel(),
                "k": ColwiseParallel(),
                "v": ColwiseParallel(),
                "o": RowwiseParallel(),
            },
        ),
    }
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))  # same on each rank
    compiled: dict[str, int] = {}
    for name, (module, plan) in plans.items():
        eager = parallelize_module(copy.deepcopy(module), mesh, plan)
        ours = ft.jit(parallelize_module(copy.deepcopy(module), mesh, plan))
        with torch.no_grad():
            torch.testing.assert_close(ours(x), eager(x), msg=name)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, ours)]
        for _ in range(3):
            for m, opt in zip((eager, ours), opts, strict=True):
                m(x).pow(2).mean().backward()
                opt.step()
            for (pname, a), (_, b) in zip(
                eager.named_parameters(), ours.named_parameters(), strict=True
            ):
                torch.testing.assert_close(_local(b.grad), _local(a.grad), msg=pname)
                torch.testing.assert_close(_local(b), _local(a), msg=pname)
            for opt in opts:
                opt.zero_grad()
        compiled[name] = ours.cache_info().misses
    return compiled


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t
