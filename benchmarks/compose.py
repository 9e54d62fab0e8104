"""Composition benchmark: per-example gradients and Hessian-vector products.

Per-example gradients (``vmap(grad(loss))``) of a small MLP and of a small transformer block,
and Hessian-vector products (``jvp(grad(loss))``) of the MLP, each computed by:

- ``ft.jit(ft.vmap(ft.grad(loss, partition=s)))`` for each strategy ``s``: the per-example
  joint graph cut by ``s``, forward then backward in one compiled ATen graph (and
  ``ft.jit(ft.jvp(ft.grad(...)))``);
- ``torch.func`` eagerly and under ``torch.compile`` (the references);
- ``ft.vmap(ft.grad(loss, partition=s))`` eagerly for each strategy ``s``: the per-example
  step planned as one joint graph that ``s`` cuts (its time includes tracing, every call);
- JAX (``jax.jit(jax.vmap(jax.grad(...)))``, ``jax.jit`` of ``jax.jvp`` of ``jax.grad``) when jax
  is installed: an optional column with no target, the peer this library is named after.

Steady-state time is the median over interleaved rounds after warm-up. Memory is the peak of
live tensor bytes created during one step (a dispatch mode follows every storage an op makes
until it is freed; inputs excluded, outputs included), the same measure for every torch-based
variant; ``saved_bytes`` is what each strategy's partition keeps between the per-example
forward and backward.

    python -m benchmarks.compose [--quick] [--repeats N] [--no-compile] [--no-jax]

Writes ``benchmarks/results/compose.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F
from torch import func as tf
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import functrans as ft
from benchmarks import write_results

RESULTS = Path(__file__).resolve().parent / "results" / "compose.json"
STRATEGIES = ("default", "min_cut", "full_remat")


# --- models (torch) ---------------------------------------------------------------------------


def mlp_params(d_in: int, hidden: int, classes: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {
        "w1": (d_in, hidden),
        "b1": (hidden,),
        "w2": (hidden, hidden),
        "b2": (hidden,),
        "w3": (hidden, classes),
        "b3": (classes,),
    }
    return {k: torch.randn(s, generator=g) * s[0] ** -0.5 for k, s in shapes.items()}


def mlp_loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = F.gelu(x @ p["w1"] + p["b1"])
    h = F.gelu(h @ p["w2"] + p["b2"])
    logits = h @ p["w3"] + p["b3"]
    return -(F.log_softmax(logits, -1) * y).sum()  # y: one-hot target


def block_params(d: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    shapes = {"wqkv": (d, 3 * d), "wo": (d, d), "w1": (d, 4 * d), "w2": (4 * d, d)}
    p = {k: torch.randn(s, generator=g) * s[0] ** -0.5 for k, s in shapes.items()}
    p.update(ln1=torch.ones(d), ln2=torch.ones(d))
    return p


def block_loss(
    p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, heads: int = 4
) -> torch.Tensor:
    """One pre-LN transformer block on one sequence ``x`` [T, d]; loss against ``y`` [T, d]."""
    t, d = x.shape
    h = F.layer_norm(x, (d,)) * p["ln1"]
    q, k, v = (h @ p["wqkv"]).reshape(t, 3, heads, d // heads).permute(1, 2, 0, 3)
    scores = (q @ k.transpose(-1, -2)) * (d // heads) ** -0.5
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    att = torch.where(mask, scores, torch.full_like(scores, -1e9)).softmax(-1) @ v
    x = x + att.permute(1, 0, 2).reshape(t, d) @ p["wo"]
    h = F.layer_norm(x, (d,)) * p["ln2"]
    x = x + F.gelu(h @ p["w1"]) @ p["w2"]
    return (x - y).pow(2).mean()


# --- measurement ------------------------------------------------------------------------------


class PeakBytes(TorchDispatchMode):  # type: ignore[misc]  # torch's TorchDispatchMode is unannotated
    """Peak of live bytes of the storages ops create while active."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            if isinstance(t, torch._subclasses.FakeTensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self.seen or storage.nbytes() == 0:
                continue
            self.seen.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, storage.nbytes())
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.live -= nbytes


def peak_bytes(fn: Callable[[], Any]) -> int:
    with PeakBytes() as mode:
        out = fn()
        del out
    return mode.peak


def timed(variants: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds per call, variants interleaved round by round after one warm-up call."""
    for fn in variants.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


# --- JAX (optional) ---------------------------------------------------------------------------


def jax_variants(
    case: str, p: dict[str, torch.Tensor], args: tuple[torch.Tensor, ...]
) -> dict[str, Callable[[], Any]]:
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        return {}
    jp = {k: jnp.asarray(v.numpy()) for k, v in p.items()}
    ja = tuple(jnp.asarray(a.numpy()) for a in args)

    def mlp(p: Any, x: Any, y: Any) -> Any:
        h = jax.nn.gelu(x @ p["w1"] + p["b1"], approximate=False)
        h = jax.nn.gelu(h @ p["w2"] + p["b2"], approximate=False)
        return -(jax.nn.log_softmax(h @ p["w3"] + p["b3"]) * y).sum()

    def block(p: Any, x: Any, y: Any, heads: int = 4) -> Any:
        t, d = x.shape

        def ln(z: Any) -> Any:
            mu, var = z.mean(-1, keepdims=True), z.var(-1, keepdims=True)
            return (z - mu) / jnp.sqrt(var + 1e-5)

        h = ln(x) * p["ln1"]
        q, k, v = (h @ p["wqkv"]).reshape(t, 3, heads, d // heads).transpose(1, 2, 0, 3)
        scores = (q @ k.swapaxes(-1, -2)) * (d // heads) ** -0.5
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
        att = jax.nn.softmax(scores, -1) @ v
        x = x + att.transpose(1, 0, 2).reshape(t, d) @ p["wo"]
        x = x + jax.nn.gelu(ln(x) * p["ln2"] @ p["w1"], approximate=False) @ p["w2"]
        return ((x - y) ** 2).mean()

    if case == "hvp_mlp":

        def batch_loss(p: Any, x: Any, y: Any) -> Any:
            return jax.vmap(mlp, (None, 0, 0))(p, x, y).mean()

        hvp = jax.jit(
            lambda p, v, x, y: jax.jvp(lambda q: jax.grad(batch_loss)(q, x, y), (p,), (v,))[1]
        )
        return {"jax.jit": lambda: jax.block_until_ready(hvp(jp, jp, *ja))}
    loss = mlp if case == "per_example_mlp" else block
    step = jax.jit(jax.vmap(jax.grad(loss), (None, 0, 0)))
    return {"jax.jit": lambda: jax.block_until_ready(step(jp, *ja))}


# --- cases ------------------------------------------------------------------------------------


def per_example_case(
    name: str,
    loss: Callable[..., torch.Tensor],
    p: dict[str, torch.Tensor],
    args: tuple[torch.Tensor, ...],
    repeats: int,
    compile_ref: bool,
    use_jax: bool,
) -> dict[str, Any]:
    dims = (None, 0, 0)
    ref = tf.vmap(tf.grad(loss), in_dims=dims)
    variants: dict[str, Callable[[], Any]] = {"torch.func eager": lambda: ref(p, *args)}
    for s in STRATEGIES:  # jit compiles the per-example joint graph cut by s
        ours = ft.jit(ft.vmap(ft.grad(loss, partition=s), in_dims=dims))
        variants[f"ft.jit(ft.vmap(ft.grad)) [{s}]"] = lambda ours=ours: ours(p, *args)
    if compile_ref:
        compiled = torch.compile(ref)
        variants["torch.compile(torch.func)"] = lambda: compiled(p, *args)
    for s in STRATEGIES:
        planned = ft.vmap(ft.grad(loss, partition=s), in_dims=dims)
        variants[f"ft.vmap(ft.grad) eager [{s}]"] = lambda planned=planned: planned(p, *args)
    expected = ref(p, *args)
    for label, fn in variants.items():
        torch.testing.assert_close(fn(), expected, rtol=1e-4, atol=1e-5, msg=label)
    if use_jax:
        variants.update(jax_variants(name, p, args))
    seconds = timed(variants, repeats)
    # torch.compile's kernels allocate outside any dispatch mode: not measurable this way
    memory = {
        k: peak_bytes(fn) for k, fn in variants.items() if not k.startswith(("jax", "torch.comp"))
    }
    # what the planned step saves: the joint graph ft.vmap(ft.grad) cuts, built here by hand
    # with the public API (grad of sum_i loss over per-example copies of the parameters)
    batch = args[0].shape[0]
    copies = {k: v.unsqueeze(0).expand(batch, *v.shape) for k, v in p.items()}

    def total(q: Any, *a: torch.Tensor) -> torch.Tensor:
        return tf.vmap(loss, in_dims=(0, 0, 0))(q, *a).sum()

    jg = ft.joint(total, argnums=0)(copies, *args)
    saved = {s: ft.partition(jg, s).activation_bytes for s in STRATEGIES}
    base = seconds["torch.func eager"]
    return {
        "seconds": seconds,
        "time_vs_torch_func_eager": {k: v / base for k, v in seconds.items()},
        "peak_bytes": memory,
        "saved_bytes": saved,
    }


def hvp_case(repeats: int, compile_ref: bool, use_jax: bool, batch: int) -> dict[str, Any]:
    p = mlp_params(64, 128, 10)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(batch, 64, generator=g)
    y = F.one_hot(torch.randint(0, 10, (batch,), generator=g), 10).float()
    v = {k: torch.randn(t.shape, generator=g) for k, t in p.items()}

    def batch_loss(p: Any) -> torch.Tensor:
        return tf.vmap(mlp_loss, in_dims=(None, 0, 0))(p, x, y).mean()

    ref = lambda p, v: tf.jvp(tf.grad(batch_loss), (p,), (v,))[1]  # noqa: E731
    ours = ft.jit(lambda p, v: ft.jvp(ft.grad(batch_loss), (p,), (v,))[1])
    variants: dict[str, Callable[[], Any]] = {
        "torch.func eager": lambda: ref(p, v),
        "ft.jit(ft.jvp(ft.grad))": lambda: ours(p, v),
    }
    if compile_ref:
        compiled = torch.compile(ref)
        variants["torch.compile(torch.func)"] = lambda: compiled(p, v)
    expected = ref(p, v)
    for label, fn in variants.items():
        torch.testing.assert_close(fn(), expected, rtol=1e-4, atol=1e-5, msg=label)
    if use_jax:
        variants.update(jax_variants("hvp_mlp", p, (x, y)))
    seconds = timed(variants, repeats)
    base = seconds["torch.func eager"]
    return {
        "seconds": seconds,
        "time_vs_torch_func_eager": {k: t / base for k, t in seconds.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--no-jax", action="store_true", help="skip the JAX column")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    repeats = 3 if a.quick else a.repeats
    batch = 8 if a.quick else 64
    g = torch.Generator().manual_seed(3)
    results: dict[str, Any] = {"threads": a.threads, "torch": torch.__version__}
    labels = torch.randint(0, 10, (batch,), generator=g)
    mlp_args = (torch.randn(batch, 64, generator=g), F.one_hot(labels, 10).float())
    seq, d = 16, 64
    block_args = (
        torch.randn(batch // 4, seq, d, generator=g),
        torch.randn(batch // 4, seq, d, generator=g),
    )
    cases = {
        "per_example_mlp": (mlp_loss, mlp_params(64, 128, 10), mlp_args),
        "per_example_block": (block_loss, block_params(d), block_args),
    }
    for name, (loss, p, args) in cases.items():
        results[name] = per_example_case(
            name, loss, p, args, repeats, not a.no_compile, not a.no_jax
        )
        print(name, json.dumps(results[name]["time_vs_torch_func_eager"], indent=1))
        print(" peak bytes", results[name]["peak_bytes"], "saved", results[name]["saved_bytes"])
    results["hvp_mlp"] = hvp_case(repeats, not a.no_compile, not a.no_jax, batch)
    print("hvp_mlp", json.dumps(results["hvp_mlp"]["time_vs_torch_func_eager"], indent=1))
    write_results(a.out, RESULTS, a.quick, results)


if __name__ == "__main__":
    main()
