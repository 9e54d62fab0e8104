"""``remat(f, policy)``: selective activation checkpointing in eager PyTorch and in traces.

- Traced (inside ``trace``/``joint``/``grad``/``vjp``): ``f`` runs inline and every ATen op it
  records is tagged with the policy's decision (``node.meta["functrans.remat"]``); partition
  strategies honor the tags. Inner ``remat`` regions keep their own tags.
- Eager (ordinary autograd): ``f`` runs under torch's non-reentrant checkpoint (saved-tensor
  hooks at the autograd layer: RNG state restored, recomputation stopped early once everything
  backward needs is produced) with our dispatch modes at the op layer: forward keeps only the
  outputs the policy saves, keyed by (op, call index); recomputation serves them back. Outputs
  it offloads (``MUST_OFFLOAD``) are copied to host memory once when the region ends and back
  in each recomputation. A random op given its own ``generator=`` draws again from a copy of
  that generator's state at the op (checkpoint restores the default generators only). The
  same policy object decides in both modes.
- The body runs once per call and once per recomputation, never retried: functrans's
  reverse-mode transforms inside an eager region set its saved-tensor hooks aside while they
  run (torch.func's refuse them on entry); a direct torch.func call there raises
  :class:`~functrans.UnsupportedOpError`.
"""

from __future__ import annotations

import functools
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, ParamSpec, Protocol, TypeVar, cast, overload

import optree
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import (
    disable_proxy_modes_tracing,
    get_proxy_mode,
    get_proxy_slot,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from functrans._core.context import functorch_active, is_tracing
from functrans._core.dynamo_skip import compiling, outside_dynamo, refuse_export
from functrans._core.errors import InvalidArgumentError, UnsupportedOpError
from functrans._core.module_view import ModuleView
from functrans._core.ops import is_getitem, is_view_op
from functrans._core.pytree import NAMESPACE
from functrans._core.stack import fn_name, transform_frame
from functrans._core.tags import REMAT, REMAT_OP, SAVE_TAGS, Policy, PolicyLike, RematOp
from functrans._cut import transfer as _transfer
from functrans._trace.passes import _IDENTITY_OPS

from . import policies as policies

__all__ = ["RematDecorator", "RematModule", "remat"]

_P = ParamSpec("_P")
_R = TypeVar("_R")
_M = TypeVar("_M", bound=torch.nn.Module)


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


_SAVE_NOTHING = policies.normalize(policies.nothing_saveable)


def _detach(x: Any) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    # below autograd ADInplaceOrView is excluded, and a detach made there would not share the
    # version counter of a view's base (torch's selective checkpoint does the same)
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return x.detach()


def _hooks_refused(e: BaseException) -> bool:
    """Whether ``e`` is torch refusing to disable saved-tensor hooks that are in use (what
    torch.func's grad/vjp do on entry under eager remat's): raised from torch's
    ``disable_saved_tensors_hooks``, told by the raising frame's code, not by message text."""
    disable: Any = torch.autograd.graph.disable_saved_tensors_hooks
    code = getattr(getattr(disable, "__wrapped__", None), "__code__", None)
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and code is not None and tb.tb_frame.f_code is code


def _under_functorch_autodiff() -> bool:
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


def _compiled_checkpoint(
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
    if decide is _SAVE_NOTHING:
        out: _R = checkpoint(f, *args, use_reentrant=False, **opts, **kwargs)
        return out

    def torch_policy(ctx: Any, op: Any, *a: Any, **k: Any) -> Any:
        return getattr(CheckpointPolicy, _TORCH_POLICY[decide(op, *a, **k)])

    contexts = functools.partial(create_selective_checkpoint_contexts, torch_policy)
    out = checkpoint(f, *args, use_reentrant=False, context_fn=contexts, **opts, **kwargs)
    return out


def _eager(
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
        if decide is not _SAVE_NOTHING:
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


class _Ask(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's class is untyped
    """Traced region: ask the policy about each op as the user wrote it and remember its
    decision for the graph nodes the call records.

    Pushed above make_fx's proxy mode, it sees ops before the decomposition table splits them
    (``silu`` rather than ``sigmoid`` and ``mul``): the same ops eager's :class:`_Record` sees.
    An op that records no node (``prim.device``, constants) is not asked about.
    """

    def __init__(self, decide: Callable[..., Policy], graph: fx.Graph, mode: Any) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's class is untyped
        self.decide, self.graph, self.mode = decide, graph, mode
        self.tags: dict[fx.Node, Policy] = {}
        self.ops: dict[fx.Node, RematOp] = {}  # node -> the op call that recorded it

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        last = self.graph._root.prev
        out = func(*args, **kwargs)
        made = _nodes_after(last, self.graph)
        if any(n.op == "call_function" for n in made):
            tree: Any = out  # any pytree
            held = {_node_of(t, self.mode) for t in optree.tree_leaves(tree, namespace=NAMESPACE)}
            with disable_proxy_modes_tracing():  # whatever the policy runs is not the region's
                decision = self.decide(func, *args, **kwargs)
            tags, holders = _tags_of_call(made, held, decision)
            self.tags.update(tags)
            self.ops.update((n, RematOp(func, n in holders)) for n in tags)
        return out


def _nodes_after(last: fx.Node, graph: fx.Graph) -> list[fx.Node]:
    """The nodes recorded after ``last`` (make_fx appends), in graph order."""
    out, node = [], last.next
    while node is not graph._root:
        out.append(node)
        node = node.next
    return out


def _tags_of_call(
    made: Sequence[fx.Node], held: set[fx.Node | None], decision: Policy
) -> tuple[dict[fx.Node, Policy], set[fx.Node]]:
    """Tags for the nodes one op call recorded: ``decision`` for the nodes holding the op's
    outputs, a recompute tag for the nodes inside its decomposition.

    Holders are the nodes of the output tensors, a multi-output node all of whose recorded
    parts (``getitem``) are outputs (an op the table did not split), and the values these are
    views of: an output that views an inner value lives in its storage (batch norm's mean is
    ``squeeze(mean)`` of its ``var_mean``). Eager never keeps the values inside a decomposition
    (they do not exist there: ``silu_backward`` recomputes ``sigmoid``), so they are
    ``MUST_RECOMPUTE``, unless the policy only prefers recomputing the op. Returns the tags and
    the holders.
    """
    ours = set(made)
    holders: set[fx.Node] = set()

    def hold(node: fx.Node | None) -> None:
        while node is not None and node in ours and node not in holders:
            holders.add(node)
            node = _viewed(node)

    for node in held:
        hold(node)
    for node in made:
        parts = [u for u in node.users if u in ours]
        if parts and all(is_getitem(u) and u in holders for u in parts):
            hold(node)
    inner = (
        Policy.PREFER_RECOMPUTE if decision is Policy.PREFER_RECOMPUTE else Policy.MUST_RECOMPUTE
    )
    tags = {n: decision if n in holders else inner for n in made if n.op == "call_function"}
    return tags, holders


def _viewed(node: fx.Node) -> fx.Node | None:
    """The value ``node`` is a view of (or ``alias``/``detach``, which canonicalization drops)."""
    target, base = node.target, node.args[0] if node.args else None
    viewing = target in _IDENTITY_OPS or is_view_op(target)
    return base if viewing and isinstance(base, fx.Node) else None


def _traced(f: Callable[_P, _R], decide: Callable[..., Policy], args: Any, kwargs: Any) -> _R:
    """Run ``f`` inline in the trace and tag the nodes it records: the policy is asked about
    each op as the user wrote it (:class:`_Ask`), before decompositions split it; the nodes
    holding the op's outputs get its decision, those inside its decomposition are recomputed."""
    mode = get_proxy_mode()
    if mode is None:  # evaluating shapes only: nothing to tag
        return f(*args, **kwargs)
    graph: fx.Graph = mode.tracer.graph
    last = graph._root.prev  # the node before the region (the root sentinel if none)
    with _Ask(decide, graph, mode) as asked:
        out = f(*args, **kwargs)
    # the region's outputs belong to the code around it (as in JAX and torch's checkpoint):
    # whether they are saved is decided outside, so they stay untagged. Inner regions tagged
    # their nodes when they ended: those keep their tags.
    tree: Any = out  # any pytree
    outputs = {_node_of(t, mode) for t in optree.tree_leaves(tree, namespace=NAMESPACE)}
    for node in _nodes_after(last, graph):
        if REMAT not in node.meta and node not in outputs:
            tag = asked.tags[node] if node in asked.tags else _decision(node, decide)
            if node in asked.ops:
                node.meta[REMAT_OP] = asked.ops[node]
            if tag is not None:
                node.meta[REMAT] = tag
    return out


def _node_of(t: Any, mode: Any) -> fx.Node | None:
    if not isinstance(t, torch.Tensor):
        return None
    slot = get_proxy_slot(t, mode.tracer, None)
    proxy = getattr(slot, "proxy", None)
    return proxy.node if proxy is not None else None


def _decision(node: fx.Node, decide: Callable[..., Policy]) -> Policy | None:
    """The policy's answer for a node no op call recorded (none seen so far: a fallback); a
    getitem takes its multi-output op's answer."""
    target = node.target
    if node.op != "call_function":
        return None
    if is_getitem(node) and isinstance(node.args[0], fx.Node):
        return node.args[0].meta.get(REMAT)
    if not isinstance(target, torch._ops.OpOverload):
        return None
    a, k = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    return decide(target, *a, **k)


class RematDecorator(Protocol):
    """What ``remat(policy=...)`` (options, no function) returns: a decorator that applies
    :func:`remat` with those options to a module or a function."""

    @overload
    def __call__(self, f: _M, /) -> RematModule: ...
    @overload
    def __call__(self, f: Callable[_P, _R], /) -> Callable[_P, _R]: ...


@overload
def remat(
    f: _M,
    *,
    policy: PolicyLike = ...,
    prevent_cse: bool = ...,
    static_argnums: Sequence[int] = ...,
) -> RematModule: ...
@overload
def remat(
    f: Callable[_P, _R],
    *,
    policy: PolicyLike = ...,
    prevent_cse: bool = ...,
    static_argnums: Sequence[int] = ...,
) -> Callable[_P, _R]: ...
@overload
def remat(
    f: None = None,
    *,
    policy: PolicyLike = ...,
    prevent_cse: bool = ...,
    static_argnums: Sequence[int] = ...,
) -> RematDecorator: ...
def remat(
    f: Callable[..., Any] | None = None,
    *,
    policy: PolicyLike = None,
    prevent_cse: bool = True,
    static_argnums: Sequence[int] = (),
) -> RematModule | Callable[..., Any] | RematDecorator:
    """Rematerialize ``f`` in backward, saving only what ``policy`` says (JAX's ``checkpoint``).

    ``policy=None`` saves nothing inside but the region's inputs. Usable as ``@remat``,
    ``@remat(policy=...)``, ``remat(f, policy=...)`` and on ``nn.Module`` instances; on a
    function it keeps the function's signature, on a module it is a :class:`RematModule`.
    ``policy`` is a :class:`~functrans.policies.PolicyFn` or anything
    :data:`~functrans.policies.PolicyLike` names.
    ``prevent_cse`` and ``static_argnums`` are accepted for JAX compatibility: functrans graphs
    are never CSE'd across regions, and non-tensor arguments are passed through unchanged.
    ``static_argnums`` must name positional parameters of ``f`` (checked when ``remat`` is
    called where the signature says; negative ones count from the end), and a call that passes
    a tensor at a static position raises :class:`~functrans.InvalidArgumentError` naming it.
    A policy that is none of these raises :class:`~functrans.policies.InvalidPolicyError` when
    ``remat`` is called.

    In eager mode a saved output is the op's own tensor, not a copy; if the region later writes
    to it in place (directly or through a view), backward recomputes that op instead of serving
    it, so gradients equal those without ``remat``.

    >>> import torch, functrans as ft
    >>> from functrans import policies
    >>> f = ft.remat(lambda x, w: torch.tanh(x @ w).sum(), policy=policies.dots_saveable)
    >>> p = ft.partition(ft.joint(f)(torch.ones(4, 4), torch.ones(4, 4)), "default")
    >>> sorted(s.name for s in p.saved)
    ['mm', 'primals_1', 'primals_2']
    """
    statics = _check_options(f, prevent_cse, static_argnums)
    if f is None:
        policies.normalize(policy)  # a bad policy is refused here, not at the first call
        # mypy sees partial(remat) through remat's first overload only
        decorate = functools.partial(
            remat, policy=policy, prevent_cse=prevent_cse, static_argnums=static_argnums
        )
        return cast(RematDecorator, decorate)
    if isinstance(f, torch.nn.Module):
        return RematModule(f, policy=policy)
    return _remat_function(f, policy, statics=statics)


def _check_options(f: object, prevent_cse: object, static_argnums: object) -> tuple[int, ...]:
    """``remat``'s own arguments, checked when ``remat`` is called; ``static_argnums`` must
    name positional parameters of ``f`` (of a module's ``forward``) where its signature says
    (where it cannot, each call checks them). Returns ``static_argnums`` as a tuple."""
    from functrans._core.validate import (
        check_bool,
        check_callable,
        check_static_argnums,
        check_static_signature,
    )

    if f is not None:
        check_callable("remat", "f", f)
    check_bool("remat", "prevent_cse", prevent_cse)
    statics = check_static_argnums("remat", static_argnums)
    if callable(f):
        check_static_signature("remat", f, statics)
    return statics


def _remat_function(
    f: Callable[_P, _R],
    policy: PolicyLike,
    options: Mapping[str, Any] | None = None,
    *,
    statics: tuple[int, ...] = (),
) -> Callable[_P, _R]:
    decide = (
        _SAVE_NOTHING if policy in (None, policies.nothing_saveable) else policies.normalize(policy)
    )
    check_statics = _statics_check(f, statics)

    name = fn_name(f)  # read here: Dynamo reads function attributes its own way

    @functools.wraps(f)
    def wrapped(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if compiling():  # torch.compile or torch.export around this call
            refuse_export("remat", name)
            if options and options.get("debug"):  # torch's debug trace: eager, a graph break
                result: _R = outside_dynamo(here, args, kwargs)
                return result
            return _compiled_checkpoint(f, decide, args, kwargs, options)
        return here(*args, **kwargs)

    def here(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if check_statics is not None:
            check_statics(args)
        with transform_frame("remat", f):
            if is_tracing():
                return _traced(f, decide, args, kwargs)
            if _under_functorch_autodiff():
                return f(*args, **kwargs)
            # decided here, once: the body runs once per call (and once per recomputation).
            # functrans's reverse-mode transforms inside it set the region's saved-tensor
            # hooks aside while they run (torch.func's refuse them), so nothing is retried
            try:
                return _eager(f, decide, args, kwargs, options)
            except RuntimeError as e:
                if not _hooks_refused(e):
                    raise
                raise UnsupportedOpError(
                    f"remat({fn_name(f)}): the region calls torch.func's reverse mode "
                    "(torch.func.grad, vjp, jacrev or hessian) directly, which refuses the "
                    "saved-tensor hooks eager remat runs the region under. Call functrans's "
                    "own (ft.grad, ft.vjp, ft.jacrev, ft.hessian: they set the hooks aside "
                    "while they run) or move the call out of the region."
                ) from e

    return wrapped


def _statics_check(
    f: Callable[..., Any], statics: tuple[int, ...]
) -> Callable[[tuple[Any, ...]], None] | None:
    """What each call checks of ``static_argnums``: that they name arguments the call has
    (where ``f``'s signature could not say when ``remat`` was called) and hold no tensor (a
    static argument is a Python value; a tensor there would be differentiated as any input).
    None where there is nothing to check."""
    if not statics:
        return None
    from functrans._core.validate import (
        check_static_range,
        check_static_values,
        positional_parameters,
    )

    found = positional_parameters(f)
    settled = found is not None and found[1] is not None  # checked when remat was called

    def check(args: tuple[Any, ...]) -> None:
        if not settled:
            check_static_range("remat", statics, len(args))
        check_static_values("remat", f, args, statics)

    return check


class RematModule(ModuleView):
    """``remat(module)``: the module's forward, rematerialized. Otherwise it is the module (a
    :class:`~functrans._core.module_view.ModuleView`): same ``state_dict`` keys, parameter names and
    attributes, so checkpoints load between remat'd and plain models."""

    _derived = ("_call",)

    def __init__(self, module: torch.nn.Module, *, policy: PolicyLike = None) -> None:
        super().__init__(module)
        self.__dict__["_policy"] = policy
        self._derive()

    def _derive(self) -> None:
        module = self._wrapped

        def run(*a: Any, **k: Any) -> Any:
            return module(*a, **k)

        run.__qualname__ = type(module).__name__  # errors name the module, not this function
        call = remat(run, policy=self.__dict__["_policy"])
        self.__dict__["_call"] = call

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__["_call"](*args, **kwargs)
