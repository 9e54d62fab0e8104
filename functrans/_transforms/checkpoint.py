"""``checkpoint(fn, *args, policy=...)``: a drop-in for ``torch.utils.checkpoint.checkpoint``
built on :func:`~functrans.remat`, and ``torch.utils.checkpoint`` regions inside traces.

- :func:`checkpoint` takes torch's keyword arguments and a functrans remat ``policy``; it is
  ``remat(fn, policy=policy)(*args, **kwargs)``: torch's non-reentrant checkpoint with our
  caching modes in eager mode, a tagged remat region inside every trace (``ft.jit``,
  ``ft.grad``, ``ft.vmap``...). torch's selective-checkpoint ``context_fn``
  (``create_selective_checkpoint_contexts(policy_fn)``) is translated to that policy.
- While functrans traces, a call of ``torch.utils.checkpoint.checkpoint`` (Hugging Face's
  gradient checkpointing, ``checkpoint_wrapper``, ``checkpoint_sequential``) is routed to the
  same place: the region runs inline in the trace as a remat region, so what it reads (a
  module's parameters under ``functional_call``) is the trace's own, where torch's checkpoint
  would rerun it in the trace's backward, after ``functional_call`` restored the module's
  real parameters (which the trace cannot lift), or refuse ``autograd.grad`` (reentrant).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import optree
import torch
import torch.utils.checkpoint as torch_checkpoint

from functrans._core.errors import InvalidArgumentError, UnsupportedOpError
from functrans._core.pytree import NAMESPACE
from functrans._core.tags import PolicyLike
from functrans._trace import trace as _trace
from functrans._trace.extensions import TraceExtension, register_trace_extension

from . import remat as _remat

__all__ = ["checkpoint"]

_R = TypeVar("_R")

#: what torch's ``determinism_check`` accepts (``"default"`` compares the recomputed tensors'
#: shapes, dtypes and devices with the forward's, ``"none"`` does not)
_DETERMINISM_CHECKS = tuple(torch_checkpoint._allowed_determinism_checks_to_fns)

#: torch's own warning when a reentrant checkpoint's inputs need no gradient
_NO_GRAD_INPUTS = "None of the inputs have requires_grad=True. Gradients will be None"


def checkpoint(
    function: Callable[..., _R],
    *args: Any,
    policy: PolicyLike = None,
    use_reentrant: bool | None = False,
    context_fn: Callable[[], Any] = torch_checkpoint.noop_context_fn,
    determinism_check: str = torch_checkpoint._DEFAULT_DETERMINISM_MODE,
    debug: bool = False,
    early_stop: bool = True,
    preserve_rng_state: bool = True,
    **kwargs: Any,
) -> _R:
    """Run ``function(*args, **kwargs)`` as a remat region: a drop-in for
    ``torch.utils.checkpoint.checkpoint`` that takes a functrans remat ``policy``.

    ``policy`` is anything :func:`~functrans.remat` takes; the default, ``None``, saves nothing
    inside the region and recomputes it all in backward, as torch's checkpoint does. The same
    policy decides in eager mode and inside every transform (``ft.jit``, ``ft.grad``,
    ``ft.vmap``...). torch's keyword arguments are accepted:

    - ``context_fn``: torch's selective checkpointing,
      ``functools.partial(create_selective_checkpoint_contexts, policy_fn_or_ops)``, is
      translated to that policy (give it or ``policy=``, not both); any other context function
      is refused (functrans cannot see what its modes do).
    - ``use_reentrant=True`` runs the same (non-reentrant) mechanism and keeps reentrant's
      visible contract: when no tensor argument requires grad the result requires none (torch
      warns the same way) and parameters inside get no gradient. ``None`` means ``False``.
    - ``preserve_rng_state``, ``determinism_check``, ``debug``, ``early_stop`` go to torch's
      checkpoint in eager mode; a traced region replays its random ops exactly, checks
      nothing at run time and stops nothing early, so there they change nothing.
    - Other keyword arguments are passed to ``function``.

    ``function`` may be a module (``checkpoint_wrapper(module, checkpoint_fn=ft.checkpoint)``,
    Hugging Face's ``_set_gradient_checkpointing(gradient_checkpointing_func=ft.checkpoint)``).
    Bad options raise :class:`~functrans.InvalidArgumentError` naming them.

    >>> import torch, functrans as ft
    >>> from functrans import policies
    >>> w = torch.ones(3, 3, requires_grad=True)
    >>> loss = ft.checkpoint(lambda x: torch.tanh(x @ w).sum(), torch.ones(2, 3),
    ...                      policy=policies.dots_saveable)
    >>> loss.backward()
    >>> w.grad.shape
    torch.Size([3, 3])
    """
    reentrant = _flag("use_reentrant", use_reentrant, default=False)
    options = _Options.check(
        preserve_rng_state=preserve_rng_state,
        determinism_check=determinism_check,
        debug=debug,
        early_stop=early_stop,
    )
    policy = _policy(policy, context_fn)
    return _run(function, args, kwargs, policy, reentrant, options)


class _Options:
    """torch's checkpoint keywords, checked; :attr:`eager` is what the eager path passes on."""

    def __init__(self, eager: Mapping[str, Any]) -> None:
        self.eager = eager

    @classmethod
    def check(
        cls, *, preserve_rng_state: Any, determinism_check: Any, debug: Any, early_stop: Any
    ) -> _Options:
        if determinism_check not in _DETERMINISM_CHECKS:
            raise InvalidArgumentError(
                f"checkpoint: determinism_check={determinism_check!r} is not one of "
                f"{', '.join(map(repr, _DETERMINISM_CHECKS))} (torch's accepted values)"
            )
        eager = {
            "preserve_rng_state": _flag("preserve_rng_state", preserve_rng_state, True),
            "determinism_check": determinism_check,
            "debug": _flag("debug", debug, False),
        }
        stop = _flag("early_stop", early_stop, True)
        # early_stop is a keyword of torch's checkpoint from 2.3 on; the default needs no pass
        return cls(eager if stop else {**eager, "early_stop": stop})


def _flag(name: str, value: Any, default: bool) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidArgumentError(
            f"checkpoint: {name}={value!r} ({type(value).__name__}) is not a bool; pass True "
            "or False"
        )
    return value


def _policy(policy: PolicyLike, context_fn: Callable[[], Any]) -> PolicyLike:
    """The remat policy: ``policy``, or the one torch's selective-checkpoint ``context_fn``
    wraps."""
    if context_fn is torch_checkpoint.noop_context_fn:
        return policy
    translated = _selective_policy(context_fn)
    if policy is not None:
        raise InvalidArgumentError(
            f"checkpoint: both policy={policy!r} and a selective-checkpoint context_fn were "
            "given; pass one of them (policy= takes the same policy functions)"
        )
    return translated


def _selective_policy(context_fn: Callable[[], Any]) -> PolicyLike:
    """The policy of ``create_selective_checkpoint_contexts(policy)``: its caching mode holds
    it (for a list of ops, the function torch made of the list: the same decisions)."""
    if not callable(context_fn):
        raise InvalidArgumentError(
            f"checkpoint: context_fn={context_fn!r} is not callable; pass "
            "functools.partial(torch.utils.checkpoint.create_selective_checkpoint_contexts, "
            "policy), or policy= directly"
        )
    contexts = context_fn()
    caching = getattr(torch_checkpoint, "_CachingTorchDispatchMode", None)
    if (
        isinstance(contexts, tuple)
        and len(contexts) == 2
        and caching is not None
        and isinstance(contexts[0], caching)
    ):
        found: PolicyLike = contexts[0].policy_fn
        return found
    raise UnsupportedOpError(
        f"checkpoint: context_fn={context_fn!r} returns {contexts!r}, not torch's "
        "selective-checkpoint contexts; functrans cannot see what other contexts do to the "
        "region's ops, in eager mode or in a trace. Pass the policy as policy= (any remat "
        "policy, torch's policy_fn(ctx, op, ...) included), or "
        "context_fn=functools.partial(create_selective_checkpoint_contexts, policy_fn)"
    )


def _run(
    function: Callable[..., _R],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    policy: PolicyLike,
    reentrant: bool,
    options: _Options,
) -> _R:
    if not callable(function):
        raise InvalidArgumentError(
            f"checkpoint: function={function!r} ({type(function).__name__}) is not callable; "
            "pass the function or module to run"
        )
    # a module runs through __call__ (its hooks), as torch's checkpoint calls it
    target: Callable[..., _R] = (
        function.__call__ if isinstance(function, torch.nn.Module) else function
    )
    region = _remat._remat_function(target, policy, options.eager)
    if reentrant and torch.is_grad_enabled() and not _any_requires_grad((args, kwargs)):
        # reentrant checkpoint is an autograd.Function of its tensor arguments: with none
        # requiring grad its result requires none, and nothing inside gets a gradient (torch
        # warns when it runs; a trace runs once, for every later call: no warning there)
        if not _trace.is_tracing():
            warnings.warn(_NO_GRAD_INPUTS, stacklevel=3)
        with torch.no_grad():
            return region(*args, **kwargs)
    return region(*args, **kwargs)


def _any_requires_grad(tree: Any) -> bool:
    leaves = optree.tree_leaves(tree, namespace=NAMESPACE)
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves)


# ---------------------------------------------------------------------------------------------
# torch.utils.checkpoint inside a trace


def _torch_entry() -> Callable[..., Any] | None:
    """torch's undecorated ``checkpoint``, whose decorator (``torch._disable_dynamo``) calls
    what ``fn.__dynamo_disable`` holds: the one place every caller's binding passes through
    (Hugging Face and ``checkpoint_wrapper`` bind ``checkpoint`` itself before any trace).
    None if this torch's checkpoint is not built that way: its calls then run as torch's
    non-reentrant checkpoint does (re-run in the trace's backward)."""
    public = torch_checkpoint.checkpoint
    inner = getattr(public, "__wrapped__", None)
    code = getattr(public, "__code__", None)
    cells = getattr(public, "__closure__", None) or ()
    if inner is None or code is None or "__dynamo_disable" not in code.co_names:
        return None
    if not any(c.cell_contents is inner for c in cells):
        return None
    found: Callable[..., Any] = inner
    return found


_ATTR = "__dynamo_disable"


@contextlib.contextmanager
def _torch_checkpoint_as_remat(_traced: Any = None) -> Iterator[None]:
    """While a trace runs, ``torch.utils.checkpoint.checkpoint`` calls become remat regions
    (:func:`_as_remat`); restored after (nested traces restore what the outer one set)."""
    inner = _torch_entry()
    if inner is None:
        yield
        return
    before = inner.__dict__.get(_ATTR)
    inner.__dict__[_ATTR] = functools.partial(_as_remat, inner)
    try:
        yield
    finally:
        if before is None:
            inner.__dict__.pop(_ATTR, None)
        else:
            inner.__dict__[_ATTR] = before


def _as_remat(
    torch_fn: Callable[..., Any],
    function: Callable[..., Any],
    *args: Any,
    use_reentrant: bool | None = None,
    context_fn: Callable[[], Any] = torch_checkpoint.noop_context_fn,
    determinism_check: str = torch_checkpoint._DEFAULT_DETERMINISM_MODE,
    debug: bool = False,
    early_stop: bool = True,
    **kwargs: Any,
) -> Any:
    """A ``torch.utils.checkpoint.checkpoint`` call while a trace runs: the same region as a
    remat region (its selective-checkpoint policy, if any), refusing what torch refuses."""
    every = {
        "use_reentrant": use_reentrant,
        "context_fn": context_fn,
        "determinism_check": determinism_check,
        "debug": debug,
        "early_stop": early_stop,
    }
    if not _trace.is_tracing():  # another thread, while this one traces: torch's own
        return torch_fn(function, *args, **every, **kwargs)
    preserve = kwargs.pop("preserve_rng_state", True)
    reentrant = True if use_reentrant is None else _flag("use_reentrant", use_reentrant, True)
    if reentrant and kwargs:  # what torch's reentrant checkpoint raises in eager mode
        raise InvalidArgumentError(
            "torch.utils.checkpoint.checkpoint(use_reentrant=True): unexpected keyword "
            f"arguments {', '.join(kwargs)}; the reentrant variant takes positional arguments "
            "only (pass use_reentrant=False)"
        )
    if reentrant and (context_fn is not torch_checkpoint.noop_context_fn or debug):
        raise InvalidArgumentError(
            "torch.utils.checkpoint.checkpoint(use_reentrant=True): context_fn and debug are "
            "only supported with use_reentrant=False (as in eager torch)"
        )
    options = _Options.check(
        preserve_rng_state=preserve,
        determinism_check=determinism_check,
        debug=debug,
        early_stop=early_stop,
    )
    return _run(function, args, kwargs, _policy(None, context_fn), reentrant, options)


register_trace_extension(
    TraceExtension(
        "torch.utils.checkpoint as remat",
        55,
        _torch_checkpoint_as_remat,
        doc="torch's checkpoint calls (HF, checkpoint_wrapper) are remat regions",
    )
)
