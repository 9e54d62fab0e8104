"""``jit(f)``: trace on first call, partition, compile, and run as one autograd node.

Each call looks up a compiled entry by everything the trace depends on (pytree structure, static
values, each tensor's type, dispatch keys, shape, strides, dtype, device and requires_grad, grad
mode): first through cheap guards (:class:`~functrans._pytree.Guards`), then by the exact key.
Training calls run the forward graph inside a ``torch.autograd.Function`` that saves exactly the
partition's saved values; inference calls (nothing requires grad, or grad mode off) run a
forward-only graph that saves nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch
import torch.utils._pytree as torch_pytree

from ._decomp import Decompositions
from ._errors import TraceError
from ._joint import joint
from ._logs import log
from ._partition import Partition, Strategy, partition
from ._pytree import NAMESPACE, Flat, Guards, exact_key, leaves_of, split, unflatten, wrap_tree
from ._trace import arg_names, trace

__all__ = ["CacheInfo", "JitModule", "jit"]


@dataclass
class CacheInfo:
    """Cache statistics and cumulative stage times (seconds) of a jitted function."""

    hits: int = 0
    misses: int = 0
    entries: int = 0
    trace_s: float = 0.0
    partition_s: float = 0.0
    compile_s: float = 0.0


@dataclass(frozen=True)
class _Entry:
    """One compiled specialization: flat-tensor callables plus how to rebuild the outputs."""

    forward: Callable[..., list[Any]]
    backward: Callable[..., list[Any]] | None
    out_flat: Flat
    out_meta: tuple[tuple[torch.Size, torch.dtype, torch.device, bool], ...]  # ..., tangent?
    num_diff: int
    num_inputs: int
    partition: Partition | None
    copies: dict[int, int]  # flat output -> flat input it is an unmodified copy of

    @functools.cached_property
    def frozen(self) -> tuple[int, ...]:
        """The outputs that take no tangent (integers, booleans): not differentiable."""
        return tuple(i for i, m in enumerate(self.out_meta) if not m[3])


_Found = tuple[tuple[_Entry, list[int]], Sequence[torch.Tensor]]  # (entry, order), inputs


class _Apply(torch.autograd.Function):
    """Runs a compiled forward graph; its backward runs the compiled backward graph."""

    @staticmethod
    def forward(ctx: Any, entry: _Entry, *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        n = len(entry.out_meta)
        flat = entry.forward(*tensors)
        ctx.entry = entry
        ctx.save_for_backward(*flat[n:])
        if entry.frozen:
            ctx.mark_non_differentiable(*[flat[i] for i in entry.frozen])
        return tuple(flat[:n])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:  # type: ignore[override]
        entry: _Entry = ctx.entry
        assert entry.backward is not None
        tangents = [
            g.contiguous() if g is not None else torch.zeros(shape, dtype=dtype, device=device)
            for g, (shape, dtype, device, wants) in zip(grads, entry.out_meta, strict=True)
            if wants
        ]
        flat_grads = entry.backward(*ctx.saved_tensors, *tangents)
        return (None, *flat_grads, *([None] * (entry.num_inputs - entry.num_diff)))


# Function.apply without its Python layer, for guarded calls outside functorch transforms (the
# layer unwraps dead functorch wrappers, which guards reject, and hands off to functorch)
_apply: Callable[..., Any] = super(torch.autograd.Function, _Apply).apply


@dataclass(frozen=True)
class _Options:
    """What :func:`jit` was asked for (see its parameters)."""

    partition: str | Strategy
    backend: str
    static_argnums: tuple[int, ...]
    decompositions: Decompositions
    partition_options: dict[str, Any]


class _Jitted:
    """The callable ``jit`` returns (see :func:`jit`)."""

    def __init__(self, f: Callable[..., Any], options: _Options) -> None:
        self._f, self._opts = f, options
        self._cache: dict[Any, tuple[_Entry, list[int]]] = {}  # exact key -> entry, order
        self._guards: Guards[tuple[_Entry, list[int]]] = Guards()  # the same, checked faster
        self._lock = threading.Lock()
        self._info = CacheInfo()
        functools.update_wrapper(self, f)

    def cache_info(self) -> CacheInfo:
        """Hits, misses, entries and time spent tracing, partitioning and compiling."""
        return CacheInfo(**{**self._info.__dict__, "entries": len(self._cache)})

    def partitions(self) -> list[Partition]:
        """The partition of every cached training specialization (saved values, bytes, ...)."""
        return [e.partition for e, _ in self._cache.values() if e.partition is not None]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        outs, entry, _ = self._run(args, kwargs)
        return unflatten(entry.out_flat, outs)

    def _run(self, args: Any, kwargs: Any) -> tuple[list[Any], _Entry, Sequence[torch.Tensor]]:
        """Flat outputs, the entry that computed them and the inputs in the entry's order."""
        tree = wrap_tree((args, kwargs), self._opts.static_argnums)
        grad = torch.is_grad_enabled()
        found: _Found | None = self._guards.find(tree, grad)
        if found is None:
            found = self._lookup(tree, grad)
            apply: Callable[..., Any] = _Apply.apply
        else:
            self._info.hits += 1
            apply = _Apply.apply if torch._C._are_functorch_transforms_active() else _apply
        (entry, _), ordered = found
        if entry.backward is None:
            return entry.forward(*ordered), entry, ordered
        return list(apply(entry, *ordered)), entry, ordered

    def _lookup(self, tree: Any, grad: bool) -> _Found:
        """The exact path: the entry by its full key (compiled on a miss); the guarded path
        above is the same lookup, cheaper, for trees :class:`Guards` can describe."""
        leaves, spec = leaves_of(tree)
        tensors, flat = split(leaves, spec, self._opts.static_argnums)
        key = (exact_key(flat, tensors), grad)
        hit = self._cache.get(key)
        if hit is None:
            with self._lock:  # one thread compiles; the others wait and then hit
                hit = self._cache.get(key)
                if hit is None:
                    hit = self._compile(flat, tensors)
                    self._cache[key] = hit
                    self._info.misses += 1
                    at = [i for i, t in enumerate(flat.is_tensor) if t]
                    self._guards.add(tree, leaves, [at[i] for i in hit[1]], grad, hit)
                else:
                    self._info.hits += 1
        else:
            self._info.hits += 1
        return hit, [tensors[i] for i in hit[1]]

    def _compile(self, flat: Flat, tensors: list[torch.Tensor]) -> tuple[_Entry, list[int]]:
        training = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        diff = [
            i
            for i, t in enumerate(tensors)
            if training and t.requires_grad and t.is_floating_point()
        ]
        other = [i for i in range(len(tensors)) if i not in set(diff)]
        f = self._f

        def flat_f(
            diff_leaves: tuple[torch.Tensor, ...], other_leaves: tuple[torch.Tensor, ...]
        ) -> Any:
            leaves: list[Any] = [None] * len(tensors)
            for i, t in zip(diff, diff_leaves, strict=True):
                leaves[i] = t
            for i, t in zip(other, other_leaves, strict=True):
                leaves[i] = t
            a, kw = unflatten(flat, leaves)
            return f(*a, **kw)

        names = arg_names(f, flat)
        flat_f.__functrans_paths__ = [names[i] for i in diff + other]  # type: ignore[attr-defined]
        example = (
            tuple(tensors[i].detach() for i in diff),
            tuple(tensors[i].detach() for i in other),
        )
        entry = self._build(flat_f, example, training)
        return entry, diff + other

    def _build(self, flat_f: Callable[..., Any], example: Any, training: bool) -> _Entry:
        backend = importlib.import_module("functrans.codegen").get_backend(self._opts.backend)
        decompositions = self._opts.decompositions
        if decompositions == "auto":
            decompositions = getattr(backend, "decompositions", "core")
        inputs = [*example[0], *example[1]]
        t0 = time.perf_counter()
        if not training:
            g = trace(flat_f, decompositions=decompositions)(*example)
            t1 = time.perf_counter()
            fwd = backend.compile(g, inputs)
            self._info.trace_s += t1 - t0
            self._info.compile_s += time.perf_counter() - t1
            vals = [n for n in g.output_nodes()]
            meta = tuple(
                (v.meta["val"].shape, v.meta["val"].dtype, v.meta["val"].device, False)
                for v in vals
            )
            copies = _copies(g.placeholders(), vals)
            return _Entry(fwd, None, g.out_flat, meta, 0, len(inputs), None, copies)
        jg = joint(flat_f, argnums=0, decompositions=decompositions)(*example)
        t1 = time.perf_counter()
        p = partition(jg, self._opts.partition, **self._opts.partition_options)
        t2 = time.perf_counter()
        fwd = backend.compile(p.forward, inputs)
        bwd = backend.compile(p.backward, [])
        log(
            "codegen",
            f"forward and backward compiled by {self._opts.backend!r}",
            lambda: f"{p.forward.graph_module.code}\n{p.backward.graph_module.code}",
        )
        self._info.trace_s += t1 - t0
        self._info.partition_s += t2 - t1
        self._info.compile_s += time.perf_counter() - t2
        wants = _tangent_mask(jg)
        meta = tuple(
            (v.meta["val"].shape, v.meta["val"].dtype, v.meta["val"].device, w)
            for v, w in zip(jg.forward_outputs(), wants, strict=True)
        )
        tangents = set(jg.tangents())
        primals = [n for n in jg.placeholders() if n not in tangents]
        copies = _copies(primals, jg.forward_outputs())
        return _Entry(fwd, bwd, jg.fn_out, meta, len(example[0]), len(inputs), p, copies)


_COPY_OPS = (torch.ops.aten.clone.default, torch.ops.aten.alias.default)


def _copies(inputs: list[Any], outputs: list[Any]) -> dict[int, int]:
    """``{output index: input index}`` for outputs that are unmodified copies of an input."""
    where = {n: i for i, n in enumerate(inputs)}
    found: dict[int, int] = {}
    for i, node in enumerate(outputs):
        while getattr(node, "op", None) == "call_function" and node.target in _COPY_OPS:
            node = node.args[0]
        if node in where:
            found[i] = where[node]
    return found


def _tangent_mask(jg: Any) -> list[bool]:
    """Which forward outputs took a tangent in the joint graph (float outputs, in order)."""
    return [bool(v.meta["val"].is_floating_point()) for v in jg.forward_outputs()]


def jit(
    f: Any = None,
    *,
    partition: str | Strategy = "min_cut",
    backend: str = "aten",
    static_argnums: Sequence[int] = (),
    decompositions: Decompositions = "auto",
    **partition_options: Any,
) -> Any:
    """Compile ``f``: trace on first call per input signature, partition with ``partition``,
    compile forward and backward with ``backend``; results are ordinary autograd tensors.

    ``decompositions="auto"`` uses the table the backend asks for (its ``decompositions``
    attribute, ``"core"`` when it has none): ``"aten"`` runs ATen's own fused kernels and keeps
    composite ops such as ``gelu_backward`` whole (``"minimal"``); a code generator that fuses
    wants small ``"core"`` ops. Any value :func:`functrans.trace` takes overrides it.

    >>> import torch, functrans as ft
    >>> @ft.jit
    ... def f(x, w):
    ...     return torch.tanh(x @ w).sum()
    >>> w = torch.ones(3, 3, requires_grad=True)
    >>> f(torch.ones(2, 3), w).backward()
    >>> w.grad.shape, f.cache_info().misses
    (torch.Size([3, 3]), 1)
    """
    if f is None:
        return functools.partial(
            jit,
            partition=partition,
            backend=backend,
            static_argnums=static_argnums,
            decompositions=decompositions,
            **partition_options,
        )
    opts = _Options(partition, backend, tuple(static_argnums), decompositions, partition_options)
    return JitModule(f, opts) if isinstance(f, torch.nn.Module) else _Jitted(f, opts)


class JitModule(torch.nn.Module):
    """``jit(module)``: the module's parameters and buffers are lifted to graph inputs on every
    call (``functional_call``), so an optimizer updating them in place keeps working and nothing
    is baked in as a constant. Buffers the module updates in place (BatchNorm's running
    statistics in training mode) are updated on copies inside the graph, returned as extra
    outputs and written back after the call: the same values as eager.

    Outputs are taken apart with torch's pytree as well as optree's, so containers registered
    only with ``torch.utils._pytree`` (Hugging Face's ``ModelOutput``) come back rebuilt with
    live tensors; an output object that hides tensors from both raises ``TraceError``."""

    def __init__(self, module: torch.nn.Module, options: _Options) -> None:
        super().__init__()
        self.module = module

        def call(
            params: dict[str, torch.Tensor],
            buffers: dict[str, torch.Tensor],
            *args: Any,
            **kwargs: Any,
        ) -> Any:
            fresh = {k: v.clone() for k, v in buffers.items()}  # in-place updates land here
            out = torch.func.functional_call(self.module, {**params, **fresh}, args, kwargs)
            state = {k: v.detach() for k, v in fresh.items()}  # state, not differentiated
            return _take_apart(out, type(self.module).__name__), state

        statics = tuple(i + 2 for i in options.static_argnums)  # after params and buffers
        self._jitted = _Jitted(call, dataclasses.replace(options, static_argnums=statics))

    def cache_info(self) -> CacheInfo:
        return self._jitted.cache_info()

    def partitions(self) -> list[Partition]:
        return self._jitted.partitions()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        params = dict(self.module.named_parameters())
        buffers = dict(self.module.named_buffers())
        outs, entry, ordered = self._jitted._run((params, buffers, *args), kwargs)
        (spec, leaves), updated = unflatten(entry.out_flat, outs)
        _, slots = unflatten(entry.out_flat, range(len(outs)))  # buffer name -> flat output
        with torch.no_grad():
            for name, value in updated.items():
                source = entry.copies.get(slots[name])
                if source is None or ordered[source] is not buffers[name]:
                    # only buffers the module changed: a copy_ bumps the version counter, and
                    # the backward may have saved the buffer itself
                    buffers[name].copy_(value)
        return torch_pytree.tree_unflatten(leaves, spec.spec)


class _TorchSpec:
    """A torch pytree spec carried through the trace as one static output leaf."""

    def __init__(self, spec: torch_pytree.TreeSpec) -> None:
        self.spec = spec

    def __repr__(self) -> str:
        return f"_TorchSpec({self.spec})"


def _take_apart(out: Any, owner: str) -> tuple[_TorchSpec, list[Any]]:
    """Flatten a module's output with torch's pytree (which knows ``ModelOutput`` and friends);
    what torch leaves whole optree flattens next. An object left opaque to both that holds
    tensors would return the trace's fake tensors, so it is an error."""
    leaves, spec = torch_pytree.tree_flatten(out)
    for i, leaf in enumerate(leaves):
        for inner in optree.tree_leaves(leaf, namespace=NAMESPACE):
            if not isinstance(inner, torch.Tensor) and _holds_tensor(inner):
                raise TraceError(
                    f"jit({owner}): output leaf {i} is a {type(inner).__qualname__} that holds "
                    "tensors functrans cannot see, so they would not be computed on later calls. "
                    "Register its type as a pytree (optree namespace 'functrans' or "
                    "torch.utils._pytree), return plain tensors, or turn it off (for Hugging Face "
                    "models: use_cache=False)."
                )
    return _TorchSpec(spec), leaves


def _holds_tensor(obj: Any, depth: int = 4) -> bool:
    """Whether ``obj`` reaches a tensor through its attributes and containers (a few levels)."""
    if isinstance(obj, torch.Tensor):
        return True
    if depth == 0 or isinstance(obj, (str, bytes, int, float, bool, type(None), torch.nn.Module)):
        return False
    if isinstance(obj, dict):
        children: list[Any] = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = list(obj)
    else:
        children = list(getattr(obj, "__dict__", {}).values())
    return any(_holds_tensor(c, depth - 1) for c in children)
