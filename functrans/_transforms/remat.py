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
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ParamSpec, Protocol, TypeVar, cast, overload

import optree
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import (
    disable_proxy_modes_tracing,
    get_proxy_mode,
    get_proxy_slot,
)
from torch.utils._python_dispatch import TorchDispatchMode

from functrans._core.context import is_tracing
from functrans._core.dynamo_skip import compiling, outside_dynamo, refuse_export
from functrans._core.errors import UnsupportedOpError
from functrans._core.module_view import ModuleView
from functrans._core.ops import is_getitem, is_view_op
from functrans._core.pytree import NAMESPACE
from functrans._core.stack import fn_name, transform_frame
from functrans._core.tags import REMAT, REMAT_OP, Policy, PolicyLike, RematOp
from functrans._trace.passes import _IDENTITY_OPS

from . import policies as policies
from .remat_eager import (
    SAVE_NOTHING,
    compiled_checkpoint,
    eager,
    hooks_refused,
    under_functorch_autodiff,
)

__all__ = ["RematDecorator", "RematModule", "remat"]

_P = ParamSpec("_P")
_R = TypeVar("_R")
_M = TypeVar("_M", bound=torch.nn.Module)


class _Ask(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's class is untyped
    """Traced region: ask the policy about each op as the user wrote it and remember its
    decision for the graph nodes the call records.

    Pushed above make_fx's proxy mode, it sees ops before the decomposition table splits them
    (``silu`` rather than ``sigmoid`` and ``mul``): the same ops eager remat's recording mode
    sees (:mod:`functrans._transforms.remat_eager`).
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
        SAVE_NOTHING if policy in (None, policies.nothing_saveable) else policies.normalize(policy)
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
            return compiled_checkpoint(f, decide, args, kwargs, options)
        return here(*args, **kwargs)

    def here(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if check_statics is not None:
            check_statics(args)
        with transform_frame("remat", f):
            if is_tracing():
                return _traced(f, decide, args, kwargs)
            if under_functorch_autodiff():
                return f(*args, **kwargs)
            # decided here, once: the body runs once per call (and once per recomputation).
            # functrans's reverse-mode transforms inside it set the region's saved-tensor
            # hooks aside while they run (torch.func's refuse them), so nothing is retried
            try:
                return eager(f, decide, args, kwargs, options)
            except RuntimeError as e:
                if not hooks_refused(e):
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
