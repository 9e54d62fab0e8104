"""``jit(module)``: a compiled module that otherwise behaves as the module does (see
:mod:`functrans._core.module_view`)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import optree
import torch
import torch.utils._pytree as torch_pytree

from functrans._core.context import runs_as_written
from functrans._core.dynamo_skip import compiling, outside_dynamo
from functrans._core.errors import TraceError
from functrans._core.hf_cache import is_cache_object, register_type, writable
from functrans._core.module_view import ModuleView
from functrans._core.pytree import (
    NAMESPACE,
    OutputAliases,
    TorchSpec,
    register_lazy_rules,
    unflatten,
)
from functrans._core.shapes import EveryInput
from functrans._core.stack import transform_frame
from functrans._core.state import GLOBAL_HOOKS, ModuleFlags, module_state
from functrans._cut.partition import Partition
from functrans._trace.capture import carry_rebinding

from .apply import OVERWRITES, Entry
from .cache import CacheInfo
from .jitted import Jitted
from .options import Options

__all__ = ["JitModule"]


def _compiled_call(module: torch.nn.Module, options: Options) -> Jitted[..., Any]:
    """``module``'s forward as a function of its parameters and buffers, jitted. (The closure
    variable is named ``model``: the guards on what the trace reads name it so,
    ``model.config.output_hidden_states``.)"""
    model = module

    def call(
        params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], *args: Any, **kw: Any
    ) -> Any:
        fresh = {k: v.clone() for k, v in buffers.items()}  # in-place updates land here
        args, kw, caches = _writable_caches(args, kw)  # updated by the forward: returned too
        with _swapped(model, {**params, **fresh}):
            out = model(*args, **kw)
        state = {k: v.detach() for k, v in fresh.items()}  # state, not differentiated
        spec, leaves = _take_apart(out, type(model).__name__)
        ids = {id(c): i for i, c in enumerate(caches)}
        aliases = OutputAliases(
            tuple((j, ids[id(x)]) for j, x in enumerate(leaves) if id(x) in ids)
        )
        return (spec, leaves), state, (aliases, caches)

    def names() -> list[str]:
        return [f"model.{name}" if name else "model" for name, _ in module.named_modules()]

    call.__qualname__ = type(module).__qualname__
    # after params and buffers; a negative index counts from the end as it did
    statics = tuple(i + 2 if i >= 0 else i for i in options.static_argnums)
    dynamic = _forward_names(module, options.dynamic)
    opts = dataclasses.replace(options, static_argnums=statics, dynamic=dynamic)
    return Jitted(call, opts, names)


def _forward_names(module: torch.nn.Module, dynamic: Any) -> Any:
    """``dynamic={"idx": {0: "batch"}}`` names ``forward``'s parameters; the compiled call
    takes them as ``args[i]`` (after the parameters and buffers): rename the keys.
    ``dynamic=True`` makes the inputs' sizes symbolic and keeps the parameters' and buffers'
    static (name one, ``{"params['wte.weight']": (0,)}``, to make it symbolic)."""
    if dynamic is True:
        return EveryInput(static=("params", "buffers"))
    if not isinstance(dynamic, Mapping):
        return dynamic
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return dynamic
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    out = {}
    for key, dims in dynamic.items():
        head, sep, rest = key.partition("[") if "[" in key else key.partition(".")
        if head in positional:
            key = f"args[{positional.index(head)}]" + (sep + rest if sep else "")
        out[key] = dims
    return out


def _gather(
    module: torch.nn.Module,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], ModuleFlags]:
    """``named_parameters()``, ``named_buffers()`` and every module's ``(module, training)``
    in one walk, in ``named_modules()`` order (each module, parameter and buffer once)."""
    params: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    flags: list[Any] = []
    seen: set[int] = set()
    stack: list[tuple[str, torch.nn.Module]] = [("", module)]
    while stack:
        prefix, m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        flags.append((m, module_state(m)))
        for table, out in ((m._parameters, params), (m._buffers, buffers)):
            for name, t in table.items():
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    out[prefix + name] = t
        children = [(f"{prefix}{k}.", c) for k, c in m._modules.items() if c is not None]
        stack.extend(reversed(children))
    flags.append((GLOBAL_HOOKS, module_state(GLOBAL_HOOKS)))
    return params, buffers, tuple(flags)


@contextlib.contextmanager
def _swapped(module: torch.nn.Module, values: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """``module`` with the tensors named in ``values`` replaced, everywhere they are held
    (tied weights too), and put back after: ``functional_call``'s reparametrization, by table
    slot. A view (``remat(self.blk)`` beside ``self.blk``) shares the tables of its module:
    torch's swap-by-name visits such a slot twice and puts the stand-in back on exit."""
    slots: dict[int, list[tuple[dict[str, Any], str]]] = {}  # tensor id -> slots holding it
    seen: set[tuple[int, str]] = set()
    tables: dict[str, dict[str, Any]] = {}  # name (as _gather gives it) -> its table
    stack: list[tuple[str, torch.nn.Module]] = [("", module)]
    visited: set[int] = set()
    while stack:
        prefix, m = stack.pop()
        if id(m) in visited:
            continue
        visited.add(id(m))
        own: tuple[dict[str, Any], ...] = (m._parameters, m._buffers)
        for held_in in own:
            for key, t in held_in.items():
                tables.setdefault(prefix + key, held_in)
                if t is not None and (id(held_in), key) not in seen:
                    seen.add((id(held_in), key))
                    slots.setdefault(id(t), []).append((held_in, key))
        children = [(f"{prefix}{k}.", c) for k, c in m._modules.items() if c is not None]
        stack.extend(reversed(children))  # _gather's order: its names are found here
    restore: list[tuple[dict[str, Any], str, Any]] = []
    put: list[tuple[str, dict[str, Any], str, Any]] = []
    try:
        for name, value in values.items():
            held = tables[name][name.rpartition(".")[2]]
            for table, key in slots.pop(id(held), ()):
                restore.append((table, key, table[key]))
                table[key] = value
                put.append((name, table, key, value))
        yield
        stand_ins = {id(v) for v in values.values()}
        for name, table, key, value in put:  # a slot the forward rebound: see carry_rebinding
            now = table.get(key)
            if id(now) not in stand_ins:  # not a cache refreshed from the others
                carry_rebinding(name, value, now)
    finally:
        for table, key, old in reversed(restore):
            table[key] = old


class JitModule(ModuleView):
    """``jit(module)``: the module's parameters and buffers are lifted to graph inputs on every
    call (swapped in by table slot, as ``functional_call`` swaps by name), so an optimizer
    updating them in place keeps working and nothing is baked in as a constant. Buffers the
    module updates in place (BatchNorm's running statistics in training mode) are updated on
    copies inside the graph, returned as extra outputs and written back after the call: the
    same values as eager. The ``training`` flag
    of the module and of each submodule is part of every cache key. Otherwise it is the module
    (a :class:`~functrans._core.module_view.ModuleView`): same ``state_dict`` keys, parameter names
    and attributes; copies compile again on first use.

    Outputs are taken apart with torch's pytree as well as optree's, so containers registered
    only with ``torch.utils._pytree`` (Hugging Face's ``ModelOutput``) come back rebuilt with
    live tensors; an output object that hides tensors from both raises ``TraceError``.

    >>> import copy, torch, functrans as ft
    >>> net = torch.nn.Linear(2, 2)
    >>> model = ft.jit(net)
    >>> list(model.state_dict()) == list(net.state_dict()), model.in_features
    (True, 2)
    >>> ema = copy.deepcopy(model)
    >>> torch.equal(ema(torch.ones(1, 2)), net(torch.ones(1, 2)))
    True
    """

    # compiled entries hold graphs and kernels: compile again; the signature is the module's
    _derived = ("_jitted", "forward", "__wrapped__", "__signature__")

    def __init__(self, module: torch.nn.Module, options: Options) -> None:
        super().__init__(module)
        self.__dict__["_opts"] = options
        self._derive()

    def _derive(self) -> None:
        module = self._wrapped
        self.__dict__["_jitted"] = _compiled_call(module, self.__dict__["_opts"])
        # frameworks read the forward's parameters (Hugging Face's Trainer keeps only the
        # dataset columns ``inspect.signature(model.forward)`` names): show the module's
        self.__dict__["__wrapped__"] = module
        forward = functools.partial(JitModule.forward, self)
        try:
            signature = inspect.signature(module.forward)
        except (TypeError, ValueError):  # a forward inspect cannot read: ours stays
            return
        self.__dict__["__signature__"] = signature
        self.__dict__["forward"] = functools.update_wrapper(
            _Forward(forward, signature), module.forward, updated=()
        )

    @property
    def _compiled(self) -> Jitted[..., Any]:
        jitted: Jitted[..., Any] = self.__dict__["_jitted"]
        return jitted

    def __repr__(self) -> str:
        return f"jit({self._wrapped!r})"

    def cache_info(self) -> CacheInfo:
        """The compiled entries' statistics (see :meth:`Jitted.cache_info`)."""
        return self._compiled.cache_info()

    def partitions(self) -> list[Partition]:
        """The partition of every cached training specialization."""
        return self._compiled.partitions()

    def __getattr__(self, name: str) -> Any:
        found = super().__getattr__(name)
        module = self.__dict__.get("module")
        if inspect.ismethod(found) and found.__self__ is module and name != "forward":
            return _through_view(self, found)
        return found

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if compiling():  # torch.compile around this call: it runs here, as a graph break
            return outside_dynamo(self._forward_here, args, kwargs)
        return self._forward_here(*args, **kwargs)

    def _forward_here(self, *args: Any, **kwargs: Any) -> Any:
        token = _IN_VIEW.set(True)
        try:
            return self._forward(*args, **kwargs)
        finally:
            _IN_VIEW.reset(token)

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        jitted = self._compiled
        if runs_as_written():
            with transform_frame("jit", self.module):
                return self.module(*args, **kwargs)
        params, buffers, flags = _gather(self.module)

        def overwrites(entry: Entry, ordered: Sequence[torch.Tensor]) -> set[int]:
            at = {id(t): i for i, t in enumerate(ordered)}
            return {at[id(buffers[name])] for name in _written(entry, ordered, buffers)}

        token = OVERWRITES.set(overwrites)  # saved buffers the write-back changes: copies
        try:
            run = jitted.run_or_none((params, buffers, *args), kwargs, flags)
        finally:
            OVERWRITES.reset(token)
        if run is None:
            return self.module(*args, **kwargs)
        outs, entry, ordered = run
        (spec, leaves), updated, (aliases, caches) = unflatten(entry.out_flat, outs)
        with torch.no_grad():
            # only buffers the module changed: a copy_ bumps the version counter
            for name in _written(entry, ordered, buffers):
                buffers[name].copy_(updated[name])
        given = _cache_inputs(args, kwargs)
        for mine, new in zip(given, caches, strict=True):  # eager updates them in place
            mine.__dict__.clear()
            mine.__dict__.update(new.__dict__)
        leaves = list(leaves)
        for j, i in aliases.value:  # the cache the forward returned is the one passed in
            leaves[j] = given[i]
        return torch_pytree.tree_unflatten(leaves, spec.spec)


#: True while a view's forward runs: the module's own forward is the one to call then
_IN_VIEW: contextvars.ContextVar[bool] = contextvars.ContextVar("functrans_in_view", default=False)


def _through_view(view: JitModule, method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (the module's, such as ``generate``) with every ``self(...)`` it makes run
    the view's compiled forward: the module's ``forward`` is routed for the call's length."""

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        module = view.module
        own = module.__dict__.get("forward", _NONE)
        module.__dict__["forward"] = _Routed(view, module.forward)
        try:
            return method(*args, **kwargs)
        finally:
            if own is _NONE:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = own

    return run


_NONE = object()


class _Routed:
    """A module's ``forward`` while one of its methods runs through the view: the view's
    compiled forward, or the module's own where the view is what calls it."""

    def __init__(self, view: JitModule, own: Callable[..., Any]) -> None:
        self._view, self._own = view, own

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _IN_VIEW.get():
            return self._own(*args, **kwargs)
        return self._view.forward(*args, **kwargs)


class _Forward:
    """``jit(module).forward``: the compiled forward, showing the module forward's signature
    (``inspect.signature`` reads ``__signature__``; ``__wrapped__`` is the module's)."""

    def __init__(self, call: Callable[..., Any], signature: inspect.Signature) -> None:
        self._call = call
        self.__signature__ = signature

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)


def _cache_inputs(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
    """The cache objects (Hugging Face's ``DynamicCache``...) passed as arguments, in a fixed
    order: the forward updates them in place, so the compiled call hands their new state
    back and the caller's objects are updated with it, as eager updates them."""
    values = [*args, *(kwargs[k] for k in sorted(kwargs))]
    return [v for v in values if is_cache_object(v)]


def _writable_caches(
    args: Sequence[Any], kwargs: Mapping[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any], list[Any]]:
    """``args`` and ``kwargs`` with each cache object replaced by one whose in-place writes
    land on copies (see :func:`functrans._core.hf_cache.writable`), and those objects in
    :func:`_cache_inputs`' order."""
    swap = {id(c): writable(c) for c in _cache_inputs(args, kwargs)}
    if not swap:
        return tuple(args), dict(kwargs), []
    new_args = tuple(swap.get(id(a), a) for a in args)
    new_kwargs = {k: swap.get(id(v), v) for k, v in kwargs.items()}
    return new_args, new_kwargs, _cache_inputs(new_args, new_kwargs)


def _written(
    entry: Entry, ordered: Sequence[torch.Tensor], buffers: Mapping[str, torch.Tensor]
) -> list[str]:
    """The buffers a call of ``entry`` changed (its state output is not the buffer as given)."""
    _, slots, _ = unflatten(entry.out_flat, range(len(entry.out_meta)))  # name -> flat output
    out = []
    for name, slot in slots.items():
        source = entry.copies.get(slot)
        if source is None or ordered[source] is not buffers[name]:
            out.append(name)
    return out


def _take_apart(out: Any, owner: str) -> tuple[TorchSpec, list[Any]]:
    """Flatten a module's output with torch's pytree (which knows ``ModelOutput`` and friends);
    what torch leaves whole optree flattens next. An object left opaque to both that holds
    tensors would return the trace's fake tensors, so it is an error."""
    register_lazy_rules()
    leaves, spec = torch_pytree.tree_flatten(out)
    for i, leaf in enumerate(leaves):
        for inner in optree.tree_leaves(leaf, namespace=NAMESPACE):
            if not isinstance(inner, torch.Tensor) and _holds_tensor(inner):
                if is_cache_object(inner) and register_type(type(inner)):
                    return _take_apart(out, owner)  # a cache class defined after the others
                raise TraceError(
                    f"jit({owner}): output leaf {i} is a {type(inner).__qualname__} that holds "
                    "tensors functrans cannot see, so they would not be computed on later calls. "
                    "Register its type as a pytree (optree namespace 'functrans' or "
                    "torch.utils._pytree), return plain tensors, or turn it off (for Hugging Face "
                    "models: use_cache=False)."
                )
    return TorchSpec(spec), leaves


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
