"""Peak memory of a training step as the allocator measures it, against what users reach for.

For each model of ``--family zoo`` (the default: a GPT stack of 4 and of 8 blocks, a 4-block
Llama stack, the 8-block MLP of ``benchmarks.zoo.STACKS``; tiny HF Llama and GPT-2) or of
``--family unseen`` (``benchmarks._module_zoo.UNSEEN``, ``nn.Module`` stacks the zoo lacks: a
GPT with dropout in train mode, an LM with a tied head and blocks of two widths, an MLP-Mixer,
a ResNet with train-mode batch norm; tiny HF Qwen2, ViT and GPT-NeoX), or both (``all``), one
training step (``fn(params, x).backward()``, float32) in one process under one seed, every
variant:

- ``eager``; per-block ``torch.utils.checkpoint`` (``use_reentrant=False``; HF models:
  ``gradient_checkpointing_enable``); torch selective checkpointing per block with a dots
  policy (matmul outputs MUST_SAVE, the rest PREFER_RECOMPUTE); ``ft.remat`` per block with
  ``policies.dots_saveable`` and ``nothing_saveable``;
- ``torch.compile(backend="aot_eager")`` (torch's min-cut partitioner) and Inductor (with
  ``fallback_random``: dropout draws eager's numbers), and aot_eager under torch's
  ``activation_memory_budget`` knob at 0.5 and 0.0;
- ``ft.jit`` with ``default``, ``min_cut``, ``full_remat``, ``min_peak``, and
  ``memory_budget(peak_bytes=P)`` at three limits: per-block checkpoint's measured peak, 0.9
  of it, and halfway between it and ``min_cut``'s (a limit below what the planner reaches is
  a row with the error);
- ``ft.remat(model, peak_bytes=...)`` (module families): the model run eagerly, the blocks a
  plan for the limit chooses checkpointed, at 1.1 P and halfway between P and eager's peak;
- ``ft.grad peak_bytes=P``: ``ft.grad(fn, partition="memory_budget", peak_bytes=P)(params, x)``
  at the first limit, its peak measured around that call (gradients returned, not stored in
  ``.grad``), the parameters passed as plain tensors as JAX-style code holds them (parameters
  that require grad make the returned gradients differentiable in them, as
  ``torch.func.grad``'s are, and the call keeps what a second derivative needs).

Peak is the most bytes allocated at once during the step above what was live before it (the
parameters and the batch): on the CPU from the profiler's allocator events, on CUDA from
``max_memory_allocated`` (``functrans.testing.measure_peak``). Step time is the median of
interleaved steps. Gradients of every variant are checked against eager's first, every call
after ``torch.manual_seed(0)`` (dropout draws the same numbers). Ratios are to eager's in the
same run; ``reported`` is ``Partition.peak_bytes`` of the ``ft.jit`` rows.

    python -m benchmarks.peak_memory [--quick] [--family zoo|unseen|all] [--device cpu|cuda]
        [--steps N] [--models NAME ...] [--out PATH]

Writes ``benchmarks/results/peak_memory.json``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import functrans as ft
from benchmarks import _module_zoo, write_results, zoo
from functrans import policies
from functrans.testing import measure_peak

RESULTS = Path(__file__).resolve().parent / "results" / "peak_memory.json"
Fn = Callable[..., torch.Tensor]
#: one gradient per leaf of the parameters, ``None`` where eager gives none
Grads = list[torch.Tensor | None]
#: the seed set before each call whose gradients are compared (dropout draws the same numbers)
SEED = 0

_DOTS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.baddbmm.default,
}


def _dots_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _DOTS else CheckpointPolicy.PREFER_RECOMPUTE


def _torch_wrap(sac: bool) -> Callable[..., torch.Tensor]:
    context = functools.partial(create_selective_checkpoint_contexts, _dots_policy)

    def wrap(block: Fn, p: Any, h: torch.Tensor) -> torch.Tensor:
        if sac:
            return checkpoint(block, p, h, use_reentrant=False, context_fn=context)  # type: ignore[no-any-return]  # torch.utils.checkpoint returns Any
        return checkpoint(block, p, h, use_reentrant=False)  # type: ignore[no-any-return]  # torch.utils.checkpoint returns Any

    return wrap


def _remat_wrap(policy: Any) -> Callable[..., torch.Tensor]:
    def wrap(block: Fn, p: Any, h: torch.Tensor) -> torch.Tensor:
        return ft.remat(block, policy=policy)(p, h)

    return wrap


def _budget_backend(budget: float) -> Callable[..., Any]:
    """``aot_eager`` with torch's ``activation_memory_budget`` knob at ``budget``: a backend of
    its own, so Dynamo keeps its compiled graphs apart from plain ``aot_eager``'s."""
    from torch._dynamo.backends.debugging import aot_eager

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return aot_eager(gm, example_inputs)

    return backend


def _compiled(fn: Fn, backend: str, budget: float | None = None) -> Fn:
    chosen: Any = backend if budget is None else _budget_backend(budget)
    if backend == "inductor":  # random numbers from ATen's ops, as eager draws them (dropout)
        return torch.compile(fn, backend=chosen, options={"fallback_random": True})
    return torch.compile(fn, backend=chosen)


def _hf_checkpointed(model: zoo.Model, sac: bool) -> Fn:
    """The HF model's own gradient checkpointing on a copy of its module."""
    import copy

    module = copy.deepcopy(model.module)
    assert module is not None
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if sac:
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _dots_policy)
    module.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    module.train()  # HF checkpoints only in training mode (dropout is 0 in the zoo configs)
    bound: list[Any] = []

    def fn(params: Any, x: Any) -> torch.Tensor:
        # the parameters become the module's own: a recomputation in backward runs after
        # functional_call would have swapped them back
        if not bound or bound[0] is not params:
            _bind(module, params)
            bound[:] = [params]
        return module(**zoo.hf_kwargs(x)).loss  # type: ignore[no-any-return]  # transformers' outputs are untyped

    return fn


def _bind(module: torch.nn.Module, params: dict[str, torch.Tensor]) -> None:
    """Make ``params`` the module's parameters, tied ones (GPT-2's head and embedding) too."""
    by_param = {id(p): params[n] for n, p in module.named_parameters() if n in params}
    for owner in module.modules():
        for attr, p in list(owner._parameters.items()):
            if p is not None and id(p) in by_param:
                del owner._parameters[attr]
                setattr(owner, attr, by_param[id(p)])


def _step(fn: Fn, params: Any, x: Any) -> None:
    for t in tree_leaves(params):
        t.grad = None
    fn(params, x).backward()


def _grads(fn: Fn, params: Any, x: Any) -> Grads:
    torch.manual_seed(SEED)
    _step(fn, params, x)
    return [None if t.grad is None else t.grad.detach().clone() for t in tree_leaves(params)]


def _check(got: Grads, ref: Grads) -> None:
    """``got`` is eager's ``ref`` (where eager gives none, ``ft.grad`` gives zeros: skipped)."""
    for a, b in zip(got, ref, strict=True):
        if b is not None:
            assert a is not None, "no gradient where eager gives one"
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak(fn: Fn, params: Any, x: Any, device: torch.device) -> int:
    for t in tree_leaves(params):
        t.grad = None
    return measure_peak(lambda: fn(params, x).backward(), device=device).peak_bytes


def variants(model: zoo.Model, quick: bool) -> dict[str, Fn]:
    fn = model.fn
    out: dict[str, Fn] = {"eager": fn}
    if model.blockwise is not None:
        out["per-block checkpoint"] = model.blockwise(_torch_wrap(sac=False))
        out["torch SAC (dots)"] = model.blockwise(_torch_wrap(sac=True))
        out["ft.remat dots_saveable"] = model.blockwise(_remat_wrap(policies.dots_saveable))
        out["ft.remat nothing_saveable"] = model.blockwise(_remat_wrap(policies.nothing_saveable))
    elif model.module is not None:
        out["per-block checkpoint"] = _hf_checkpointed(model, sac=False)
        out["torch SAC (dots)"] = _hf_checkpointed(model, sac=True)
    if not quick:
        out["torch.compile aot_eager"] = _compiled(fn, "aot_eager")
        out["torch.compile inductor"] = _compiled(fn, "inductor")
        out["aot_eager budget 0.5"] = _compiled(fn, "aot_eager", 0.5)
        out["aot_eager budget 0.0"] = _compiled(fn, "aot_eager", 0.0)
    for strategy in ("default", "min_cut", "full_remat", "min_peak"):
        out[f"ft.jit {strategy}"] = ft.jit(fn, partition=strategy)
    return out


def run_model(model: zoo.Model, size: str, steps: int, device: torch.device, quick: bool) -> Any:
    # models built alike share their loss's code object: without a reset, Dynamo's compiled
    # entries for earlier models count toward its recompile limit, past which it runs eager
    torch._dynamo.reset()
    params, x = model.make(size)
    if model.module is not None:  # its buffers (rotary tables) live on the device too
        model.module.to(device)
    params = tree_map(lambda t: t.to(device).requires_grad_(t.is_floating_point()), params)
    x = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, x)
    ref = _grads(model.fn, params, x)
    rows: dict[str, dict[str, Any]] = {}

    def add(name: str, row: Callable[[], dict[str, Any]]) -> None:
        try:  # one variant failing must not lose the others' figures
            rows[name] = row()
        except Exception as e:  # recorded in the JSON
            rows[name] = {"error": f"{type(e).__name__}: {e}"[:400]}
            print(f"benchmarks.peak_memory: {model.name}/{name} failed: {rows[name]['error']}")

    for name, f in variants(model, quick).items():
        add(name, functools.partial(_loss_row, f, params, x, ref, device))
    ckpt = rows.get("per-block checkpoint", {}).get("peak_bytes")
    mincut = rows.get("ft.jit min_cut", {}).get("peak_bytes")
    if ckpt:
        limits = {"P": ckpt, "0.9 P": int(0.9 * ckpt)}
        if mincut:
            limits["(P + min_cut) / 2"] = (ckpt + mincut) // 2
        for label, limit in limits.items():
            jitted = ft.jit(model.fn, partition="memory_budget", peak_bytes=int(limit))
            add(
                f"ft.jit peak_bytes={label}",
                functools.partial(_loss_row, jitted, params, x, ref, device),
            )
            rows[f"ft.jit peak_bytes={label}"]["limit_bytes"] = int(limit)
        grad = ft.grad(model.fn, partition="memory_budget", peak_bytes=int(ckpt))
        add("ft.grad peak_bytes=P", functools.partial(_grad_row, grad, params, x, ref, device))
        rows["ft.grad peak_bytes=P"]["limit_bytes"] = int(ckpt)
        eager_peak = rows.get("eager", {}).get("peak_bytes")
        if model.module is not None and eager_peak:
            for label, limit in {
                "1.1 P": int(1.1 * ckpt),
                "(P + eager) / 2": (ckpt + eager_peak) // 2,
            }.items():
                name = f"ft.remat(model, peak_bytes={label})"
                budgeted = _eager_budget(model, limit)
                add(name, functools.partial(_loss_row, budgeted, params, x, ref, device))
                rows[name]["limit_bytes"] = limit
    _times(rows, steps, device)
    eager = rows["eager"]
    full = rows.get("ft.jit full_remat", {}).get("recompute_flops")
    table = []
    for name, r in rows.items():
        r.pop("step", None)
        if "peak_bytes" in r:
            r["peak_ratio"] = r["peak_bytes"] / eager["peak_bytes"]
            r["time_ratio"] = r["ms"] / eager["ms"]
            if full and "recompute_flops" in r:
                r["recompute_vs_full_remat"] = r["recompute_flops"] / full
        table.append({"variant": name, **r})
    return {"model": model.name, "rows": table}


def _loss_row(f: Fn, params: Any, x: Any, ref: Grads, device: torch.device) -> dict[str, Any]:
    """A variant of the loss: gradients checked, the step's peak, what its partition reports."""
    _check(_grads(f, params, x), ref)
    row: dict[str, Any] = {
        "peak_bytes": _peak(f, params, x, device),
        "step": functools.partial(_step, f, params, x),
    }
    p = _partition(f)
    if p is not None:
        row["reported_bytes"] = p.peak_bytes
        row["recompute_flops"] = p.recompute_flops
    return row


def _eager_budget(model: zoo.Model, limit: int) -> Fn:
    """The model's module under ``ft.remat(module, peak_bytes=limit)``, run eagerly with its
    parameters swapped in as ``model.fn`` does (an HF model's loss from its keyword inputs)."""
    from torch.func import functional_call

    assert model.module is not None
    budgeted = ft.remat(model.module, peak_bytes=limit)
    hf = type(model.module).__module__.startswith("transformers")

    def fn(params: Any, x: Any) -> torch.Tensor:
        if hf:
            return functional_call(budgeted, params, (), zoo.hf_kwargs(x)).loss  # type: ignore[no-any-return]  # transformers' outputs are untyped
        return functional_call(budgeted, params, (x,))  # type: ignore[no-any-return]  # functional_call returns Any

    return fn


def _grad_row(
    grad: Callable[..., Any], params: Any, x: Any, ref: Grads, device: torch.device
) -> dict[str, Any]:
    """A gradient function (``ft.grad``): its gradients checked, the peak of one call."""
    params = tree_map(lambda t: t.detach(), params)  # values, as JAX-style code holds them
    torch.manual_seed(SEED)
    _check(tree_leaves(grad(params, x)), ref)
    torch.manual_seed(SEED)
    peak = measure_peak(lambda: (grad(params, x), None)[1], device=device).peak_bytes
    return {"peak_bytes": peak, "step": functools.partial(grad, params, x)}


def _partition(f: Fn) -> ft.Partition | None:
    partitions = getattr(f, "partitions", None)
    found = partitions() if callable(partitions) else []
    return found[0] if found else None


def _times(rows: dict[str, dict[str, Any]], steps: int, device: torch.device) -> None:
    """Median step time of every variant, interleaved round by round."""
    live = {n: r for n, r in rows.items() if "step" in r}
    samples: dict[str, list[float]] = {n: [] for n in live}
    for _ in range(steps):
        for n, r in live.items():
            _sync(device)
            t0 = time.perf_counter()
            r["step"]()
            _sync(device)
            samples[n].append(time.perf_counter() - t0)
    for n, r in live.items():
        r["ms"] = 1e3 * statistics.median(samples[n])


MODELS: dict[str, Callable[[], zoo.Model]] = {
    **zoo.STACKS,
    "hf_llama": lambda: zoo.hf_llama(),
    "hf_gpt2": lambda: zoo.hf_gpt2(),
}

#: ``--family``: the models each measures (``all``: both)
FAMILIES: dict[str, dict[str, Callable[[], zoo.Model]]] = {
    "zoo": MODELS,
    "unseen": _module_zoo.UNSEEN,
    "all": {**MODELS, **_module_zoo.UNSEEN},
}
#: ``--quick`` without ``--models``: the zoo's two smallest stacks, every unseen model
QUICK: dict[str, list[str]] = {
    "zoo": ["gpt_stack_4", "mlp_blocks_8"],
    "unseen": list(_module_zoo.UNSEEN),
    "all": ["gpt_stack_4", "mlp_blocks_8", *_module_zoo.UNSEEN],
}


def print_model(result: dict[str, Any]) -> None:
    print(f"\n{result['model']}")
    for r in result["rows"]:
        if "peak_ratio" in r:
            extra = (
                f"  recompute/full_remat {r['recompute_vs_full_remat']:.2f}"
                if ("recompute_vs_full_remat" in r)
                else ""
            )
            reported = (
                f"  measured/reported {r['peak_bytes'] / r['reported_bytes']:.3f}"
                if r.get("reported_bytes")
                else ""
            )
            print(
                f"  {r['variant']:<34} peak {r['peak_ratio']:.3f}  time {r['time_ratio']:.2f}"
                f"{reported}{extra}"
            )
        else:
            print(f"  {r['variant']:<34} {r.get('error', '')}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, no torch.compile")
    parser.add_argument(
        "--family",
        choices=tuple(FAMILIES),
        default="zoo",
        help="zoo: benchmarks.zoo stacks and HF Llama/GPT-2; unseen: benchmarks._module_zoo",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--models", nargs="*", default=None)
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: results/)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks.peak_memory: no CUDA device here; nothing measured")
        return 0
    torch.manual_seed(0)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    size = "small" if args.quick else "bench"
    models = FAMILIES[args.family]
    names = args.models or (QUICK[args.family] if args.quick else list(models))
    results = []
    t0 = time.perf_counter()
    for name in names:
        if name.startswith("hf_") and not zoo.has_transformers():
            continue
        results.append(
            run_model(models[name](), size, 2 if args.quick else args.steps, device, args.quick)
        )
        print_model(results[-1])
    meta = {
        "device": str(device),
        "torch": torch.__version__,
        "size": size,
        "family": args.family,
        "threads": 1,
        "seconds": time.perf_counter() - t0,
    }
    write_results(args.out, RESULTS, args.quick, {"meta": meta, "models": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
