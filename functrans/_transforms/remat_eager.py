"""Eager remat: torch's non-reentrant checkpoint with our dispatch modes at the op layer.

:func:`eager` runs a region under torch's checkpoint (saved-tensor hooks at the autograd layer:
RNG state restored, recomputation stopped early once everything backward needs is produced)
with two dispatch modes: forward (:class:`_Record`) keeps only the outputs the policy saves,
keyed by (op, call index), in a :class:`_Cache`; recomputation (:class:`_Replay`) serves them
back while they are as the op made them. Outputs the policy offloads (``MUST_OFFLOAD``) are
copied to host memory once when the region ends. A random op given its own ``generator=`` draws
again from a copy of that generator's state at the op. Where ``torch.compile`` traces the
region, :func:`compiled_checkpoint` hands the policy to torch's selective checkpointing instead.
:func:`functrans._transforms.remat.remat` chooses between these and the traced mode.
"""

from __future__ import annotations

import functools
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, ParamSpec, TypeVar

import optree
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from functrans._core.context import functorch_active
from functrans._core.errors import InvalidArgumentError
from functrans._core.tags import SAVE_TAGS, Policy
from functrans._cut import transfer as _transfer

from . import policies as policies

__all__ = [
    "SAVE_NOTHING",
    "compiled_checkpoint",
    "eager",
    "hooks_refused",
    "under_functorch_autodiff",
]

_P = ParamSpec("_P")
_R = TypeVar("_R")


class _Entry(NamedTuple):
    """An op's outputs as the policy saved them (detached aliases: no copy), with each tensor
    output's version counter when the op returned. An offloaded entry holds the host copy of
    its one tensor and the device it goes back to."""

    value: Any
    versions: tuple[int, ...]
    device: torch.device | None = None  # set: ``value`` is a host copy

    def served(self) -> Any:
        """The value a recomputation gets: the saved one, or a device copy of the host copy
        (one per recomputation: a second backward copies it again)."""
        if self.device is None:
            return self.value
        back = _transfer.copy_back(self.value, self.device)
        _transfer.wait(back)  # the op's output is read right away
        return back


def _tensors(out: Any) -> list[torch.Tensor]:
    return [t for t in optree.tree_leaves(out) if isinstance(t, torch.Tensor)]


_Where = tuple[torch.device, int]  # a storage: its device and address


class _Cache:
    """Outputs the policy saved during forward, keyed by (op, call index).

    A saved output is an alias of the tensor the region goes on computing with, so a later
    in-place op (``x.sin().mul_(2)``, a write through a view of it, or of its base) changes it.
    Every write bumps the tensor's version counter, which views share; an entry whose counter
    moved is stale and its op is recomputed instead (what traced mode's functionalized graph
    does). Nothing is copied on the device: the common case, no mutation, costs no memory.
    Offloaded outputs are copied to host memory once, when the forward ends (:meth:`offload`).
    """

    def __init__(self) -> None:
        self.store: dict[tuple[Any, int], _Entry] = {}
        # a random op's own generators' states before it ran (see _with_generators)
        self.draws: dict[tuple[Any, int], tuple[torch.Tensor, ...]] = {}
        self.offloads: list[tuple[Any, int]] = []  # keys to copy to host at the forward's end
        self.held: set[_Where] = set()  # storages of the region's inputs and outputs
        self.ended = False  # the forward ended: what the caller holds is known

    def put(self, key: tuple[Any, int], out: Any, offload: bool = False) -> None:
        value = tree_map(_detach, out)
        self.store[key] = _Entry(value, tuple(t._version for t in _tensors(value)))
        if offload:
            self.offloads.append(key)

    def hold(self, *trees: Any) -> None:
        """Note the tensors of ``trees`` (the region's inputs and outputs): the caller holds
        them on the device, so values in their storages are not offloaded. Recomputations
        rerun the region: only the forward's call counts."""
        if not self.ended:
            self.held |= {p for p in map(_storage, _tensors(trees)) if p is not None}

    def take(self, key: tuple[Any, int]) -> _Entry | None:
        """The entry, or None when nothing was saved or it was mutated since. A device entry
        is dropped from the cache (a recomputation uses each once, and the recomputed tensors
        keep it alive as long as backward needs them); a host copy stays for another backward,
        costing no device memory."""
        entry = self.store.get(key)
        if entry is None or not _unchanged(entry):
            return None
        if entry.device is None:
            del self.store[key]
        return entry

    def drop_mutated(self) -> None:
        """Forget the entries the rest of the forward mutated: backward recomputes them, and
        their tensors are freed here unless the region still holds them."""
        self.store = {k: e for k, e in self.store.items() if _unchanged(e)}

    def offload(self) -> None:
        """Copy the entries the policy offloads to host memory, once, in forward order, and
        drop their device tensors. Run after :meth:`drop_mutated`: a value the region changed
        is recomputed, never copied stale. One an offload rule refuses stays on the device."""
        saved = Counter(_storage(t) for e in self.store.values() for t in _tensors(e.value))
        busy = self.held | {p for p, n in saved.items() if p is not None and n > 1}
        for key in self.offloads:
            entry = self.store.get(key)
            if entry is not None and not _why_not_offload(entry.value, busy):
                host = _transfer.copy_out(entry.value)
                self.store[key] = _Entry(host, (host._version,), entry.value.device)
        self.offloads, self.held, self.ended = [], set(), True


def _storage(t: torch.Tensor) -> _Where | None:
    """Where ``t``'s memory is, or None for a tensor without its own (a wrapper subclass)."""
    try:
        return t.device, t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _why_not_offload(value: Any, busy: set[_Where]) -> str:
    """Why a saved output stays on the device ("" if it may go to host memory): traced mode's
    rules (:func:`functrans._cut.offload.why_not_offload`, and no other saved value in its storage)
    for an eager value. ``busy``: storages something else keeps on the device. Views and
    outputs that alias an argument are never saved (:func:`_aliases`)."""
    if not isinstance(value, torch.Tensor):
        return "it is not one tensor (a multi-output op)"
    if type(value) is not torch.Tensor or value.layout is not torch.strided:
        return "it is not a dense tensor"
    if not value.is_contiguous():
        return "it is not contiguous"
    if _storage(value) in busy:
        return (
            "its storage stays on the device (an input or output of the region holds it, or "
            "another saved value)"
        )
    return ""


def _unchanged(entry: _Entry) -> bool:
    now = tuple(t._version for t in _tensors(entry.value))
    return now == entry.versions


@functools.cache
def _aliases(func: Any) -> bool:
    """Whether the op writes to an argument (``mul_``, ``copy_``, ``index_put_``, ``out=``) or
    returns a view of one (``view``, ``select``, ``t``). Such an op is never served from the
    cache: recomputing it costs no memory and (a view) no arithmetic, and only running it keeps
    the recomputed tensors aliased, and mutated, as in forward. Caching a view would spare
    nothing (replay runs the ops before it, its base's among them, in program order) but would
    keep its storage alive, and the cached view would not even share its base's version
    counter: autograd ties them only after the op returns."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return False
    return bool(schema.is_mutable) or any(r.alias_info is not None for r in schema.returns)


class _Record(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's class is untyped
    """Forward: run every op, ask the policy, keep the outputs it saves."""

    def __init__(self, decide: Callable[..., Policy], cache: _Cache) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's class is untyped
        self.decide, self.cache = decide, cache
        self.calls: dict[Any, int] = defaultdict(int)

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)  # type: ignore[no-untyped-call]  # torch's class is untyped
        self.cache.drop_mutated()
        if exc[0] is None:  # a failed forward has no backward
            with torch.no_grad():
                self.cache.offload()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _faking():  # a trace inside the region (``ft.vmap(ft.grad(g))`` plans one)
            return func(*args, **kwargs)  # runs on fake tensors: nothing to keep or count
        key = (func, self.calls[func])
        self.calls[func] += 1
        generators = _generators((args, kwargs))
        if generators:
            self.cache.draws[key] = tuple(g.get_state() for g in generators)
        out = func(*args, **kwargs)
        decision = self.decide(func, *args, **kwargs)
        if decision in SAVE_TAGS and not _aliases(func):
            self.cache.put(key, out, offload=decision is Policy.MUST_OFFLOAD)
        return out


class _Replay(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's class is untyped
    """Recompute: serve saved outputs that are still as the op made them, run the rest.
    Each entry is served once and dropped, as torch's selective checkpoint pops its cache: the
    cache would otherwise keep every saved output of the region alive until the whole backward
    ends (a measured 0.91x eager's peak on a GPT stack with ``dots_saveable`` where torch's
    reaches 0.82x). A second backward (``retain_graph=True``) finds the entries gone and
    recomputes those ops too: the same values (checkpoint restores the RNG state), more work;
    offloaded outputs wait in host memory and come back again."""

    def __init__(self, cache: _Cache) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's class is untyped
        self.cache = cache
        self.calls: dict[Any, int] = defaultdict(int)

    def __enter__(self) -> _Replay:
        self.calls.clear()  # every recomputation replays the region from its first op
        super().__enter__()  # type: ignore[no-untyped-call]  # torch's class is untyped
        return self  # what TorchDispatchMode.__enter__ returns

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if _faking():  # as in _Record (a recomputation may reuse the trace's result)
            return func(*args, **(kwargs or {}))
        key = (func, self.calls[func])
        self.calls[func] += 1
        entry = self.cache.take(key)  # None too when mutated after the region (user code)
        if entry is not None:
            return entry.served()
        if key in self.cache.draws:  # the same numbers, the caller's generator untouched
            args, kwargs = _with_generators((args, kwargs or {}), self.cache.draws[key])
        return func(*args, **(kwargs or {}))


def _faking() -> bool:
    """Whether a fake-tensor or tracing mode is active (a trace run inside an eager region,
    its fake inputs made before it starts included): its ops compute no real values."""
    keys = torch._C._TorchDispatchModeKey
    get = torch._C._get_dispatch_mode
    return get(keys.FAKE) is not None or get(keys.PROXY) is not None


def _generators(tree: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects an op call was given (``generator=`` of ``rand``,
    ``bernoulli_``, ``multinomial``...)."""
    return [g for g in optree.tree_leaves(tree) if isinstance(g, torch.Generator)]


def _with_generators(tree: Any, states: tuple[torch.Tensor, ...]) -> Any:
    """``tree`` (an op call's ``(args, kwargs)``) with each generator replaced by a copy set to
    the state it had when forward ran the op. Checkpointing restores the default generators'
    states only: a recomputation would otherwise draw other numbers from the caller's
    generator (a wrong gradient) and advance it a second time."""
    leaves, spec = optree.tree_flatten(tree)
    found = iter(states)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Generator):
            copy = torch.Generator(device=leaf.device)
            copy.set_state(next(found))
            leaves[i] = copy
    return optree.tree_unflatten(spec, leaves)


SAVE_NOTHING = policies.normalize(policies.nothing_saveable)


def _detach(x: Any) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    # below autograd ADInplaceOrView is excluded, and a detach made there would not share the
    # version counter of a view's base (torch's selective checkpoint does the same)
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return x.detach()


def hooks_refused(e: BaseException) -> bool:
    """Whether ``e`` is torch refusing to disable saved-tensor hooks that are in use (what
    torch.func's grad/vjp do on entry under eager remat's): raised from torch's
    ``disable_saved_tensors_hooks``, told by the raising frame's code, not by message text."""
    disable: Any = torch.autograd.graph.disable_saved_tensors_hooks
    code = getattr(getattr(disable, "__wrapped__", None), "__code__", None)
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and code is not None and tb.tb_frame.f_code is code


def under_functorch_autodiff() -> bool:
    """Whether torch.func's grad/vjp/jvp is running: their levels do not support saved-tensor
    hooks, so eager remat runs the region as written there (same values; memory as without
    remat). Inside ``ft.jit`` and ``ft.vmap(ft.grad(...))`` the traced remat applies."""
    if not functorch_active():
        return False
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    autodiff = (TransformType.Grad, TransformType.Jvp)
    return any(i.key() in autodiff for i in retrieve_all_functorch_interpreters())


#: Our policy decisions as torch's selective checkpointing names them.
_TORCH_POLICY = {
    Policy.MUST_SAVE: "MUST_SAVE",
    Policy.PREFER_SAVE: "PREFER_SAVE",
    Policy.MUST_RECOMPUTE: "MUST_RECOMPUTE",
    Policy.PREFER_RECOMPUTE: "PREFER_RECOMPUTE",
    Policy.MUST_OFFLOAD: "MUST_CPU_OFFLOAD",
}


def compiled_checkpoint(
    f: Callable[_P, _R],
    decide: Callable[..., Policy],
    args: Any,
    kwargs: Any,
    options: Mapping[str, Any] | None,
) -> _R:
    """A remat region where ``torch.compile`` traces it: torch's non-reentrant checkpoint,
    which Dynamo captures as its checkpoint higher-order op and compiles with the code around
    it (no graph break), the policy's decisions handed to torch's selective checkpointing
    (``MUST_OFFLOAD`` as ``MUST_CPU_OFFLOAD``). Random numbers are replayed as torch's
    checkpoint replays them. ``options``: ``ft.checkpoint``'s torch keywords."""
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    opts = {"preserve_rng_state": True, **(options or {})}
    if decide is SAVE_NOTHING:
        out: _R = checkpoint(f, *args, use_reentrant=False, **opts, **kwargs)
        return out

    def torch_policy(ctx: Any, op: Any, *a: Any, **k: Any) -> Any:
        return getattr(CheckpointPolicy, _TORCH_POLICY[decide(op, *a, **k)])

    contexts = functools.partial(create_selective_checkpoint_contexts, torch_policy)
    out = checkpoint(f, *args, use_reentrant=False, context_fn=contexts, **opts, **kwargs)
    return out


def eager(
    f: Callable[_P, _R],
    decide: Callable[..., Policy],
    args: Any,
    kwargs: Any,
    options: Mapping[str, Any] | None = None,
) -> _R:
    """torch's non-reentrant checkpoint (saved-tensor hooks, RNG replay, early stop) with our
    caching modes at the op layer. ``options``: more of torch's checkpoint keywords
    (``ft.checkpoint`` passes ``preserve_rng_state``, ``determinism_check``, ``debug``...)."""
    if not torch.is_grad_enabled():
        return f(*args, **kwargs)
    from torch.utils.checkpoint import checkpoint

    opts = {"preserve_rng_state": True, **(options or {})}
    out: _R  # checkpoint returns what f returns
    if opts.get("debug"):  # torch's debug trace runs without op-layer contexts only
        if decide is not SAVE_NOTHING:
            raise InvalidArgumentError(
                "checkpoint: debug=True records torch's own operator trace, which torch allows "
                "only without a selective policy; drop debug or use policy=None"
            )
        out = checkpoint(f, *args, use_reentrant=False, **opts, **kwargs)
        return out
    # the modes run whatever the policy (nothing_saveable too): they also replay the draws
    # from generators passed to random ops, which checkpoint's RNG restore does not cover
    cache = _Cache()  # checkpoint asks for the contexts once per call

    def region(*a: Any, **k: Any) -> Any:
        result = f(*a, **k)
        cache.hold(a, k, result)  # the caller holds these: never offloaded
        return result

    def contexts() -> tuple[_Record, _Replay]:
        return _Record(decide, cache), _Replay(cache)

    out = checkpoint(region, *args, use_reentrant=False, context_fn=contexts, **opts, **kwargs)
    return out
