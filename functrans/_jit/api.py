"""``jit(f)``: the public entry point, a function or a module in, a compiled callable out.

It only dispatches: :class:`~functrans._jit.jitted.Jitted` compiles functions (guards, cache,
partition, backend), :class:`~functrans._jit.module.JitModule` wraps a module around one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, Protocol, TypeVar, cast, overload

import torch

from functrans._core.errors import UnsupportedOpError
from functrans._core.module_view import is_fsdp_module
from functrans._core.shapes import JitDynamic, check_dynamic
from functrans._core.validate import (
    check_callable,
    check_number,
    check_option,
    check_static_argnums,
    check_static_signature,
)
from functrans._cut.partition import Strategy, check_partition_options, get_strategy
from functrans._trace.decomp import Decompositions, decomposition_table
from functrans._trace.options import RegionsMode, TraceOptions

from .jitted import Jitted
from .module import JitModule
from .options import CACHE_SIZE, Options

__all__ = ["JitDecorator", "jit"]

_P = ParamSpec("_P")
_R = TypeVar("_R")
_M = TypeVar("_M", bound=torch.nn.Module)


class JitDecorator(Protocol):
    """What ``jit(partition=..., ...)`` (options, no function) returns: a decorator that
    compiles a module or a function with those options, as :func:`jit` does."""

    @overload
    def __call__(  # type: ignore[overload-overlap]  # a Module is callable: first one wins
        self, f: _M, /
    ) -> JitModule: ...
    @overload
    def __call__(self, f: Callable[_P, _R], /) -> Jitted[_P, _R]: ...


@overload
def jit(
    f: _M,
    *,
    partition: str | Strategy = ...,
    backend: str = ...,
    static_argnums: Sequence[int] = ...,
    decompositions: Decompositions = ...,
    cache_size: int = ...,
    dynamic: JitDynamic = ...,
    regions: RegionsMode | None = ...,
    **partition_options: Any,
) -> JitModule: ...
@overload
def jit(
    f: Callable[_P, _R],
    *,
    partition: str | Strategy = ...,
    backend: str = ...,
    static_argnums: Sequence[int] = ...,
    decompositions: Decompositions = ...,
    cache_size: int = ...,
    dynamic: JitDynamic = ...,
    regions: RegionsMode | None = ...,
    **partition_options: Any,
) -> Jitted[_P, _R]: ...
@overload
def jit(
    f: None = None,
    *,
    partition: str | Strategy = ...,
    backend: str = ...,
    static_argnums: Sequence[int] = ...,
    decompositions: Decompositions = ...,
    cache_size: int = ...,
    dynamic: JitDynamic = ...,
    regions: RegionsMode | None = ...,
    **partition_options: Any,
) -> JitDecorator: ...
def jit(
    f: Callable[..., Any] | None = None,
    *,
    partition: str | Strategy = "min_cut",
    backend: str = "aten",
    static_argnums: Sequence[int] = (),
    decompositions: Decompositions = "auto",
    cache_size: int = CACHE_SIZE,
    dynamic: JitDynamic = "auto",
    regions: RegionsMode | None = None,
    **partition_options: Any,
) -> JitModule | Jitted[..., Any] | JitDecorator:
    """Compile ``f``: trace on first call per input signature, partition with ``partition``,
    compile forward and backward with ``backend``; results are ordinary autograd tensors.

    A compiled entry is reused only where eager would compute the same thing (see the module
    docs): new shapes, dtypes, static values, grad mode, autocast, default dtype or a module's
    ``training`` flag compile a new entry (``FUNCTRANS_LOGS=recompiles`` says why); tensors
    ``f`` captures (closures, globals, module parameters) are graph inputs re-read on every
    call. Python numbers are static: a float that changes every call recompiles every call
    (it warns on the second change; pass a tensor instead). At most ``cache_size`` entries are
    kept, least recently used out.

    ``decompositions="auto"`` uses the table the backend asks for (its ``decompositions``
    attribute, ``"core"`` when it has none): ``"aten"`` runs ATen's own fused kernels and keeps
    composite ops such as ``gelu_backward`` whole (``"minimal"``); a code generator that fuses
    wants small ``"core"`` ops. Any value :func:`functrans.trace` takes overrides it.

    ``regions`` says how repeated blocks are traced: ``"compiled"`` (cut and compiled once,
    called per block), ``"unrolled"`` (traced once, pasted into the step) or ``"off"`` (every
    block traced inline); None reads ``FUNCTRANS_REGIONS`` (by default ``"compiled"``). It is
    read once, here: changing the variable between two calls of the result changes neither.

    Every option is checked when ``jit`` is called, not at the first training step: a
    ``partition`` name that is not registered, an option the strategy does not take or a value
    it refuses, and ``static_argnums`` that name no positional parameter of ``f`` (of a
    module's ``forward``; negative ones count from the end) raise
    :class:`~functrans.InvalidArgumentError`. Where ``f``'s signature cannot be read, or it
    takes ``*args``, ``static_argnums`` is checked against each call's arguments.

    ``jit(f)`` has ``f``'s parameters and result type (a :class:`Jitted`); ``jit(module)`` is
    a :class:`~functrans._jit.module.JitModule`; ``jit(partition=..., ...)`` without ``f`` is
    a decorator with those options (``@ft.jit(partition="default")``).

    >>> import torch, functrans as ft
    >>> @ft.jit
    ... def f(x, w):
    ...     return torch.tanh(x @ w).sum()
    >>> w = torch.ones(3, 3, requires_grad=True)
    >>> f(torch.ones(2, 3), w).backward()
    >>> w.grad.shape, f.cache_info().misses
    (torch.Size([3, 3]), 1)
    """
    _check_options(f, partition, backend, static_argnums, decompositions, cache_size)
    check_partition_options("jit", partition, partition_options)
    trace_options = TraceOptions.read(regions=regions)  # the environment, read once: here
    if f is None:
        # mypy sees partial(jit) through jit's first overload only
        decorate = functools.partial(
            jit,
            partition=partition,
            backend=backend,
            static_argnums=static_argnums,
            decompositions=decompositions,
            cache_size=cache_size,
            dynamic=dynamic,
            regions=regions,
            **partition_options,
        )
        return cast(JitDecorator, decorate)
    opts = Options(
        partition=partition,
        backend=backend,
        static_argnums=check_static_argnums("jit", static_argnums),
        decompositions=decompositions,
        partition_options=partition_options,
        cache_size=cache_size,
        dynamic=check_dynamic(dynamic),
        trace=trace_options,
    )
    if isinstance(f, torch.nn.Module):
        _refuse_fsdp(f)
        return JitModule(f, opts)
    return Jitted(f, opts)


def _check_options(
    f: object,
    partition: object,
    backend: object,
    static_argnums: object,
    decompositions: object,
    cache_size: object,
) -> None:
    """``jit``'s own arguments, checked when ``jit`` is called (not at the first call)."""
    if f is not None:
        check_callable("jit", "f", f)
    if not isinstance(partition, str):
        get_strategy(partition)  # type: ignore[arg-type]  # refuses what is not a strategy
    check_option("jit", "backend", backend, isinstance(backend, str), "a registered backend name")
    statics = check_static_argnums("jit", static_argnums)
    if callable(f):  # a module's static_argnums count its forward's parameters
        check_static_signature("jit", f, statics)
    if decompositions != "auto":
        decomposition_table(decompositions)  # type: ignore[arg-type]  # checked there
    check_number("jit", "cache_size", cache_size, at_least=1, integer=True, meaning="entries")


def _refuse_fsdp(module: torch.nn.Module) -> None:
    """``jit`` of a module FSDP2 shards is refused with the supported way: its parameters are
    DTensors that FSDP all-gathers in hooks around each unit, outside any trace."""
    if any(is_fsdp_module(m) for m in module.modules()):
        raise UnsupportedOpError(
            f"jit({type(module).__name__}): the model is sharded with FSDP2 (fully_shard); "
            "its parameters are gathered by hooks around each FSDP unit, outside any trace. "
            "Compile the blocks inside the units instead: "
            "functrans.distributed.jit_blocks(model, partition=...) (see the README, "
            "'Distributed training')"
        )
