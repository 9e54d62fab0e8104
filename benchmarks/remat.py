"""Remat benchmark: ``ft.remat`` per layer vs ``torch.utils.checkpoint``, per built-in policy.

A stack of 4 zoo blocks (GPT-style and Llama-style, separate parameters per block, float32) is
run with every block wrapped, one at a time, in:

- ``ft.remat(block, policy=...)`` eagerly (ordinary autograd, ``loss.backward()``);
- ``torch.utils.checkpoint.checkpoint(block, ..., use_reentrant=False)``: plain for ``None``,
  else with ``create_selective_checkpoint_contexts`` and the equivalent torch policy (MUST_SAVE
  where the functrans policy saves, PREFER_RECOMPUTE elsewhere);
- nothing (the no-checkpoint baseline);

and traced: ``ft.partition(ft.joint(stack, argnums=0)(params, x), strategy).activation_bytes``
for the ``default`` and ``min_cut`` strategies.

Eager bytes are the bytes of the storages created during the forward that are still alive
when only the loss is referenced (the autograd graph's saved tensors, checkpoint's saved
inputs and the selective-checkpoint caches), deduplicated by storage, parameters and the input
excluded. The bytes packed by ``saved_tensors_hooks`` around the forward are recorded too
(``hook_bytes``); they miss the selective-checkpoint caches, which autograd never sees.
Step time is the median of fwd+bwd runs, all variants interleaved round by round.

    python -m benchmarks.remat [--quick] [--repeats N] [--limit S] [--threads N]

Writes ``benchmarks/results/remat.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import signal
import statistics
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import functrans as ft
from benchmarks import output_path, zoo
from functrans import policies

RESULTS = Path(__file__).resolve().parent / "results" / "remat.json"
N_BLOCKS = 4
Params = dict[str, Any]
Block = Callable[[Params, torch.Tensor], torch.Tensor]
Stack = Callable[[list[Params], torch.Tensor], torch.Tensor]

#: Row label -> functrans policy (``None`` is ``nothing_saveable``).
POLICIES: dict[str, Any] = {
    "None": None,
    "everything_saveable": policies.everything_saveable,
    "dots_saveable": policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": policies.dots_with_no_batch_dims_saveable,
}
BASELINE = "no checkpoint"


def gpt_block(p: Params, x: torch.Tensor) -> torch.Tensor:
    """The body of :func:`benchmarks.zoo.gpt_block` without its loss: ``x -> x``."""
    d = x.shape[-1]
    n_heads = d // zoo.HEAD_DIM
    h = F.layer_norm(x, (d,), p["ln1"]["w"], p["ln1"]["b"])
    q, k, v = (zoo._heads(F.linear(h, p[n]), n_heads) for n in ("wq", "wk", "wv"))
    x = x + F.linear(zoo._merge(zoo._causal_attention(q, k, v)), **zoo._wb(p["proj"]))
    h = F.layer_norm(x, (d,), p["ln2"]["w"], p["ln2"]["b"])
    return x + F.linear(F.gelu(F.linear(h, **zoo._wb(p["fc1"]))), **zoo._wb(p["fc2"]))


def llama_block(p: Params, x: torch.Tensor) -> torch.Tensor:
    """The body of :func:`benchmarks.zoo.llama_block` without its loss: ``x -> x``."""
    _, t, d = x.shape
    n_heads, dh = d // zoo.HEAD_DIM, zoo.HEAD_DIM
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dh, 2, dtype=x.dtype, device=x.device) / dh))
    angles = torch.arange(t, dtype=x.dtype, device=x.device)[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    h = zoo._rms_norm(x, p["norm1"])
    q, k, v = (zoo._heads(F.linear(h, p[n]), n_heads) for n in ("wq", "wk", "wv"))
    q, k = zoo._rotary(q, cos, sin), zoo._rotary(k, cos, sin)
    x = x + F.linear(zoo._merge(zoo._causal_attention(q, k, v)), p["wo"])
    h = zoo._rms_norm(x, p["norm2"])
    gated = F.silu(F.linear(h, p["w_gate"])) * F.linear(h, p["w_up"])
    return x + F.linear(gated, p["w_down"])


BLOCKS: dict[str, Block] = {"gpt_block": gpt_block, "llama_block": llama_block}


def stack(block: Block) -> Stack:
    """``(params, x) -> mean(y²)`` where ``y`` is ``block`` applied once per parameter dict."""

    def fn(params: list[Params], x: torch.Tensor) -> torch.Tensor:
        for p in params:
            x = block(p, x)
        return (x * x).mean()

    return fn


def torch_sac(block: Block, policy: Any) -> Block:
    """``block`` under torch's non-reentrant checkpoint: plain for ``None``, else selective with
    the same decisions as the functrans ``policy``."""
    if policy is None:
        return lambda p, x: checkpoint(block, p, x, use_reentrant=False)

    def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        save = policy(op, *args, **kwargs)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = functools.partial(create_selective_checkpoint_contexts, policy_fn)
    return lambda p, x: checkpoint(block, p, x, use_reentrant=False, context_fn=context_fn)


class StorageRecorder(TorchDispatchMode):  # type: ignore[no-untyped-call,misc]  # torch's TorchDispatchMode is unannotated
    """Weak references to the storage of every tensor an op returns while active."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's TorchDispatchMode is unannotated
        self.refs: list[weakref.ref[torch.UntypedStorage]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.refs.append(weakref.ref(t.untyped_storage()))
        return out


def _ptr(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


def measure_bytes(fn: Stack, params: list[Params], x: torch.Tensor) -> dict[str, int]:
    """Run one forward; ``live_bytes``: forward-made storages alive while only the loss is held;
    ``hook_bytes``: storages packed by ``saved_tensors_hooks`` (parameters and ``x`` excluded)."""
    exclude = {_ptr(t) for t in tree_leaves(params)} | {_ptr(x)}
    packed: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if _ptr(t) not in exclude:
            packed[_ptr(t)] = max(packed.get(_ptr(t), 0), t.numel() * t.element_size())
        return t

    recorder = StorageRecorder()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), recorder:
        loss = fn(params, x)
    gc.collect()
    alive: dict[int, int] = {}
    for ref in recorder.refs:
        s = ref()
        if s is not None:
            alive[s.data_ptr()] = s.nbytes()
    exclude.add(_ptr(loss))
    live = sum(n for ptr, n in alive.items() if ptr not in exclude)
    loss.backward()  # type: ignore[no-untyped-call]  # the zoo's model functions are unannotated
    return {"live_bytes": live, "hook_bytes": sum(packed.values())}


def _zero(params: list[Params]) -> None:
    for t in tree_leaves(params):
        t.grad = None


def grads(fn: Stack, params: list[Params], x: torch.Tensor) -> list[torch.Tensor]:
    """The parameter gradients of one fwd+bwd step."""
    _zero(params)
    fn(params, x).backward()  # type: ignore[no-untyped-call]  # the zoo's model functions are unannotated
    return [t.grad.clone() for t in tree_leaves(params) if t.grad is not None]


def time_steps(
    variants: dict[str, Stack], params: list[Params], x: torch.Tensor, repeats: int
) -> dict[str, list[float]]:
    """Seconds per fwd+bwd step of every variant; each round runs every variant once, in an
    order rotated round by round, so machine load spreads evenly over the variants."""
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    gc.collect()
    gc.disable()  # as timeit does: no collector pauses inside the timed steps
    try:
        for r in range(-2, repeats):  # two warm-up rounds
            for name in names[r % len(names) :] + names[: r % len(names)]:
                _zero(params)
                t0 = time.perf_counter()
                variants[name](params, x).backward()  # type: ignore[no-untyped-call]  # the zoo's model functions are unannotated
                if r >= 0:
                    times[name].append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return times


def traced_bytes(
    fn: Stack, params: list[Params], x: torch.Tensor, limit_s: float
) -> dict[str, int | str]:
    """Activation bytes of the traced joint graph under ``default`` and ``min_cut`` (the error,
    as a string, where a strategy fails or runs past ``limit_s``)."""
    detached = [
        {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in p.items()}
        for p in params
    ]
    jg = ft.joint(fn, argnums=0)(detached, x)
    out: dict[str, int | str] = {}
    for strategy in ("default", "min_cut"):
        try:
            with _time_limit(limit_s):
                out[strategy] = ft.partition(jg, strategy).activation_bytes
        except (ft.FunctransError, TimeoutError) as e:
            out[strategy] = f"{type(e).__name__}: {e}"
    return out


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise ``TimeoutError`` in the main thread after ``seconds`` (a strategy that hangs must
    not hide the other numbers)."""

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"gave up after {seconds:g} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def bench_model(name: str, size: str, repeats: int, limit_s: float) -> dict[str, Any]:
    """Every policy on one model: bytes, traced bytes, step times and targets."""
    model = zoo.ZOO[name]()
    block = BLOCKS[name]
    made = [model.make(size, torch.float32, seed) for seed in range(N_BLOCKS)]
    params, x = [p for p, _ in made], made[0][1]
    # the mirrored block must be the zoo's: same loss on one block
    torch.testing.assert_close(stack(block)(params[:1], x), model.fn(params[0], x))
    for t in tree_leaves(params):
        t.requires_grad_(True)
    variants: dict[str, Stack] = {BASELINE: stack(block)}
    for label, pol in POLICIES.items():
        variants[f"ours/{label}"] = stack(ft.remat(block, policy=pol))
        variants[f"torch/{label}"] = stack(torch_sac(block, pol))
    ref = grads(variants[BASELINE], params, x)
    grad_ok: dict[str, bool] = {}
    for vname, fn in variants.items():
        got = grads(fn, params, x)
        grad_ok[vname] = len(got) == len(ref) and all(
            torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, ref, strict=True)
        )
        if vname.startswith("ours/"):
            assert grad_ok[vname], f"{name}: {vname} gradients differ from no-checkpoint"
    nbytes = {vname: measure_bytes(fn, params, x) for vname, fn in variants.items()}
    times = time_steps(variants, params, x, repeats)
    ms = {vname: 1e3 * statistics.median(ts) for vname, ts in times.items()}
    rows = [
        {
            "policy": BASELINE,
            "eager_bytes": nbytes[BASELINE]["live_bytes"],
            "hook_bytes": nbytes[BASELINE]["hook_bytes"],
            "traced_bytes": traced_bytes(stack(block), params, x, limit_s),
            "step_ms": ms[BASELINE],
        }
    ]
    for label, pol in POLICIES.items():
        ours, ref_ = nbytes[f"ours/{label}"], nbytes[f"torch/{label}"]
        ours_ms, torch_ms = ms[f"ours/{label}"], ms[f"torch/{label}"]
        rows.append(
            {
                "policy": label,
                "eager_bytes": ours["live_bytes"],
                "hook_bytes": ours["hook_bytes"],
                "torch_bytes": ref_["live_bytes"],
                "torch_hook_bytes": ref_["hook_bytes"],
                "bytes_ratio": ours["live_bytes"] / max(ref_["live_bytes"], 1),
                "traced_bytes": traced_bytes(
                    stack(ft.remat(block, policy=pol)), params, x, limit_s
                ),
                "step_ms": ours_ms,
                "torch_step_ms": torch_ms,
                "time_ratio": ours_ms / torch_ms,
                "grads_match": grad_ok[f"ours/{label}"],
                "torch_grads_match": grad_ok[f"torch/{label}"],
                "bytes_le_torch": ours["live_bytes"] <= ref_["live_bytes"],
                "time_within_1_1x": ours_ms <= 1.1 * torch_ms,
            }
        )
    return {"model": name, "size": size, "n_blocks": N_BLOCKS, "rows": rows}


def _fmt(v: Any, spec: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, str) and ":" in v:  # a strategy's error: its class name only
        return "timeout" if v.startswith("TimeoutError") else f"error ({v.split(':')[0]})"
    return format(v, spec)


def _targets(r: dict[str, Any]) -> str | None:
    """ "met", or "MISSED" and which targets; None for the baseline row."""
    if "bytes_le_torch" not in r:
        return None
    checks = (("bytes", r["bytes_le_torch"]), ("time", r["time_within_1_1x"]))
    missed = [name for name, ok in checks if not ok]
    return f"MISSED ({', '.join(missed)})" if missed else "met"


def format_table(result: dict[str, Any]) -> str:
    """One line per policy, ending with whether the row met the targets; then the traced
    strategies' errors in full."""
    head: tuple[str, ...] = ("policy", "ours eager B", "torch SAC B", "ratio", "traced default B")
    head += ("traced min_cut B", "ours ms", "torch ms", "ratio", "targets")
    lines = [head]
    errors: list[str] = []
    for r in result["rows"]:
        traced = r["traced_bytes"]
        errors += [f"  {r['policy']} / {k}: {v}" for k, v in traced.items() if isinstance(v, str)]
        lines.append(
            (
                r["policy"],
                _fmt(r["eager_bytes"]),
                _fmt(r.get("torch_bytes")),
                _fmt(r.get("bytes_ratio"), ".2f"),
                _fmt(traced["default"]),
                _fmt(traced["min_cut"]),
                _fmt(r["step_ms"], ".2f"),
                _fmt(r.get("torch_step_ms"), ".2f"),
                _fmt(r.get("time_ratio"), ".2f"),
                _fmt(_targets(r)),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = [f"{result['model']} (stack of {result['n_blocks']}, {result['size']}, float32)"]
    for i, line in enumerate(lines):
        cells = [
            c.ljust(w) if j == 0 else c.rjust(w)
            for j, (c, w) in enumerate(zip(line, widths, strict=True))
        ]
        out.append("  ".join(cells).rstrip())
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out + (["traced strategies that failed:", *errors] if errors else []))


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print one table per model, write the JSON."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models, 5 timed rounds")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 50)")
    parser.add_argument("--limit", type=float, default=30.0, help="s per traced partition")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    args.out = output_path(args.out, RESULTS, args.quick)
    # one thread: these matmuls are too small to gain from more, and spinning OpenMP workers on
    # a loaded machine turn millisecond steps into second-long ones
    torch.set_num_threads(args.threads)
    size = "small" if args.quick else "bench"
    repeats = args.repeats or (5 if args.quick else 50)
    t0 = time.perf_counter()
    results = [bench_model(name, size, repeats, args.limit) for name in BLOCKS]
    for res in results:
        print(format_table(res))
        print()
    print(
        "bytes: forward-made storages alive after the forward (saved tensors, checkpoint "
        "inputs, SAC caches), params/x excluded; targets: ours bytes <= torch's, ours ms <= "
        f"1.1x torch's; total {time.perf_counter() - t0:.1f} s"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"size": size, "repeats": repeats, "threads": torch.get_num_threads()}
    doc = {"meta": meta, "models": results}
    args.out.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
