"""Global state a trace reads besides its arguments, as one comparable value.

A traced graph bakes in more than its inputs: autocast inserts casts, grad mode decides whether
a backward exists, the default dtype types every ``torch.zeros(3)``, a module's ``training`` flag
picks dropout or not. :func:`capture` reads all of it in one tuple (a few C calls) so a cache
can compare it on every call; :func:`describe` names what changed between two captures for the
recompile log. State deliberately *not* captured, with the reason:

- ``torch.backends.*`` math flags (TF32, reduced-precision reductions): read by kernels when the
  compiled graph runs, never by the trace, so a compiled graph follows them like eager does.
- ``torch.use_deterministic_algorithms``: captured, though the aten backend only reads it at
  run time, because decompositions and generated kernels may pick an algorithm by it.
- RNG state: graphs draw from the caller's generator at run time (see ``run_traced``).

>>> s = capture(())
>>> with torch.no_grad():
...     describe(s, capture(()))
['grad mode True -> False']
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch

__all__ = [
    "AUTOCAST_DEVICES",
    "GLOBAL_HOOKS",
    "EagerOnly",
    "GlobalHooks",
    "ModuleFlags",
    "State",
    "autocast_off",
    "capture",
    "describe",
    "eager_fast_path",
    "global_hooks",
    "hooked",
    "hooks_of",
    "module_state",
    "no_autocast",
]

#: Device types whose autocast state is part of every capture.
AUTOCAST_DEVICES = ("cpu", "cuda")

# the readable names of the process-wide (thread-local) flags, in State's order
_FLAGS = ("grad mode", "inference mode", "default dtype", "deterministic algorithms")


def _autocast(device: str) -> torch.dtype | None:
    """The autocast dtype for ``device``, or None when autocast is off there."""
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


#: ``(module, (module.training, (), its hooks))`` for every module a function reaches, in walk
#: order (see :func:`module_state`), then :data:`GLOBAL_HOOKS`. What a trace reads of a module's
#: other attributes is guarded by the reads it recorded (:mod:`functrans._trace.reads`).
ModuleFlags = tuple[tuple[Any, tuple[bool, tuple[Any, ...], tuple[Any, ...]]], ...]


class GlobalHooks:
    """The pseudo module whose hooks are ``torch.nn``'s global module hooks: the last of every
    jitted function's module flags, so registering one compiles anew."""

    def __repr__(self) -> str:
        return "GLOBAL_HOOKS"


GLOBAL_HOOKS = GlobalHooks()


def module_state(
    m: torch.nn.Module | GlobalHooks,
) -> tuple[bool, tuple[Any, ...], tuple[Any, ...]]:
    """What every call compares of module ``m`` besides what its traces read: ``training``
    and its hooks (the handles of its forward, forward-pre, backward and backward-pre hooks;
    ``()`` for none). Changing one compiles anew (a hook makes calls run as written). The
    middle field is kept empty: the attributes a trace reads (a dropout's ``p``, a config
    flag) are guarded by the reads it recorded, and the others are not guarded at all.

    >>> drop = torch.nn.Dropout(0.1)
    >>> module_state(drop)
    (True, (), ())
    >>> handle = drop.register_forward_hook(lambda mod, args, out: None)
    >>> module_state(drop)[2] != ()
    True
    """
    if isinstance(m, GlobalHooks):
        return True, (), global_hooks()
    d = m.__dict__
    return m.training, (), hooks_of(d)


_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def hooks_of(d: dict[str, Any]) -> tuple[Any, ...]:
    """The hook handles of a module's ``__dict__`` ``d``, per kind (``()``: none at all)."""
    tables = [d.get(k) for k in _HOOKS]
    if not any(tables):
        return ()
    return tuple(tuple(t) if t else () for t in tables)


def global_hooks() -> tuple[Any, ...]:
    """The handles of ``torch.nn``'s global module hooks (``register_module_forward_hook``
    and its kin), per kind (``()``: none)."""
    return hooks_of(dict(zip(_HOOKS, _global_tables(), strict=True)))


def hooked(flags: ModuleFlags) -> str | None:
    """The first module of ``flags`` with hooks a trace may not stand in for, described (or
    the global hooks), or None. torch.distributed's own hooks (tensor parallelism's layout
    changes, FSDP2's) compute on tensors only and are traced; any other hook may do what a
    graph cannot (count, cache activations for a probe, print)."""
    for m, state in flags:
        if len(state) < 3 or not state[2]:
            continue
        own = isinstance(m, GlobalHooks)
        tables = _global_tables() if own else [m.__dict__[k] for k in _HOOKS]
        kinds = [
            k.strip("_").replace("_", " ")
            for k, table in zip(_HOOKS, tables, strict=True)
            if any(not _traced_hook(fn) for fn in table.values())
        ]
        if kinds and isinstance(m, GlobalHooks):
            return f"torch.nn has global module {' and '.join(kinds)}"
        if kinds:
            return f"a {type(m).__name__} has {' and '.join(kinds)}"
    return None


class EagerOnly(NamedTuple):
    """A module call a trace cannot stand in for: why, and how to make it compilable."""

    why: str
    fix: str


def eager_fast_path(flags: ModuleFlags) -> EagerOnly | None:
    """The first module of ``flags`` whose eager forward takes a path a trace cannot follow
    or whose results differ from the traced path's, described, or None. A BatchNorm in
    training mode with ``momentum=None`` reads its batch counter as a Python number.
    ``nn.TransformerEncoder`` in
    eval mode with ``enable_nested_tensor=True``, with autograd off, runs on nested tensors
    when given a ``src_key_padding_mask``: its padded positions come back as zeros, which the
    traced (padded) path does not give.

    >>> enc = torch.nn.TransformerEncoder(
    ...     torch.nn.TransformerEncoderLayer(8, 2, batch_first=True), 1, enable_nested_tensor=True
    ... ).eval()
    >>> with torch.no_grad():
    ...     print(eager_fast_path(((enc, (False, (), ())),)).fix)
    Build it with enable_nested_tensor=False to compile it (its results are the padded path's)
    """
    for m, _ in flags:
        if (
            isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
            and m.training
            and m.track_running_stats
            and m.momentum is None
        ):
            return EagerOnly(
                f"a {type(m).__name__} in training mode with momentum=None (a cumulative "
                "average, as torch.optim.swa_utils.update_bn sets it): its update divides by "
                "its batch counter as a Python number",
                "Give it a momentum to compile it (update_bn's statistics pass runs eagerly "
                "either way)",
            )
    if torch.is_grad_enabled():
        return None
    for m, _ in flags:
        if (
            isinstance(m, torch.nn.TransformerEncoder)
            and not m.training
            and getattr(m, "use_nested_tensor", False)
        ):
            return EagerOnly(
                "an nn.TransformerEncoder in eval mode with enable_nested_tensor=True, under "
                "no_grad: eager runs it on nested tensors when given a padding mask (padded "
                "positions come back as zeros)",
                "Build it with enable_nested_tensor=False to compile it (its results are the "
                "padded path's)",
            )
    return None


#: hooks known to compute on tensors only, by the module that defines them and their name:
#: Hugging Face's ``enable_input_require_grads`` hook (``output.requires_grad_(True)``, which
#: ``gradient_checkpointing_enable`` registers on the input embeddings)
_TRACED_HOOKS = (
    (
        "transformers.",
        "PreTrainedModel.enable_input_require_grads.<locals>.make_inputs_require_grads",
    ),
)


def _traced_hook(fn: Any) -> bool:
    """A hook a trace may run once for every call: torch.distributed's (a parallel layout's
    input/output redistribution) and those of :data:`_TRACED_HOOKS`."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    module = str(getattr(fn, "__module__", "") or "")
    if module.startswith("torch.distributed"):
        return True
    name = str(getattr(fn, "__qualname__", "") or "")
    return any(module.startswith(m) and name == n for m, n in _TRACED_HOOKS)


def _global_tables() -> list[Any]:
    from torch.nn.modules import module as nn_module

    return [
        nn_module._global_forward_pre_hooks,
        nn_module._global_forward_hooks,
        nn_module._global_backward_pre_hooks,
        nn_module._global_backward_hooks,
    ]


class State(NamedTuple):
    """One capture of the global state a trace reads (a tuple: hashed and compared on every
    jitted call; built by :func:`capture`)."""

    grad: bool
    inference: bool
    default_dtype: torch.dtype
    deterministic: bool
    autocast_cpu: torch.dtype | None  # the autocast dtype, None when autocast is off
    autocast_cuda: torch.dtype | None
    modules: ModuleFlags

    @property
    def autocast(self) -> tuple[torch.dtype | None, torch.dtype | None]:
        """Autocast per device of :data:`AUTOCAST_DEVICES`."""
        return (self.autocast_cpu, self.autocast_cuda)


_any_autocast = torch._C._is_any_autocast_enabled
_grad = torch.is_grad_enabled
_inference = torch.is_inference_mode_enabled
_default_dtype = torch.get_default_dtype
_deterministic = torch.are_deterministic_algorithms_enabled


# tuple.__new__ skips NamedTuple's Python-level __new__ (0.13 us instead of 0.33 us a call):
# capture() runs on every jitted call and takes about 0.4 us either way
_new_state: Any = tuple.__new__


def capture(module_flags: ModuleFlags) -> State:
    """Everything global a trace depends on, right now (``module_flags``: see
    :data:`ModuleFlags`). About half a microsecond: it runs on every call of a jitted function.
    """
    if _any_autocast():
        cpu, cuda = _autocast("cpu"), _autocast("cuda")
    else:
        cpu = cuda = None
    state: State = _new_state(
        State, (_grad(), _inference(), _default_dtype(), _deterministic(), cpu, cuda, module_flags)
    )
    return state


def grad_enabled(state: State) -> bool:
    return state.grad


def describe(old: State, new: State, names: Sequence[str] = ()) -> list[str]:
    """What changed from ``old`` to ``new``, one phrase per difference (``names``: the module
    names of the module flags, in :data:`ModuleFlags` order)."""
    flags = len(_FLAGS)  # the first fields of State
    out = [
        f"{name} {_fmt(a)} -> {_fmt(b)}"
        for name, a, b in zip(_FLAGS, old[:flags], new[:flags], strict=True)
        if a != b
    ]
    for device, a, b in zip(AUTOCAST_DEVICES, old.autocast, new.autocast, strict=True):
        if a != b:
            out.append(f"autocast({device!r}) {_fmt_autocast(a)} -> {_fmt_autocast(b)}")
    before, after = old.modules, new.modules
    if len(before) != len(after) or any(
        m is not n for (m, _), (n, _) in zip(before, after, strict=True)
    ):
        out.append("the module tree changed (a submodule was added, removed or replaced)")
    else:
        for i, ((m, was), (_, now)) in enumerate(zip(before, after, strict=True)):
            name = (names[i] if i < len(names) else f"module {i}") or "the module"
            if isinstance(m, GlobalHooks):
                name = "torch.nn's global module"
            if was[0] != now[0]:
                out.append(f"{name}.training {was[0]} -> {now[0]}")
            if len(was) > 2 and was[2] != now[2]:
                out.append(f"{name} hooks {_hook_count(was[2])} -> {_hook_count(now[2])}")
    return out


def _hook_count(hooks: tuple[Any, ...]) -> str:
    return f"{sum(len(h) for h in hooks)} registered"


def _fmt(v: Any) -> str:
    return str(v).replace("torch.", "")


def _fmt_autocast(v: torch.dtype | None) -> str:
    return "off" if v is None else _fmt(v)


def autocast_off() -> contextlib.AbstractContextManager[None]:
    """:func:`no_autocast` for the state right now."""
    return no_autocast(capture(()))


@contextlib.contextmanager
def no_autocast(state: State) -> Iterator[None]:
    """Run a compiled graph without autocast: the graph already holds the casts its trace
    recorded, and autocast applied again at run time would change a float32 graph's results."""
    with contextlib.ExitStack() as stack:
        for device, dtype in zip(AUTOCAST_DEVICES, state.autocast, strict=True):
            if dtype is not None:
                stack.enter_context(torch.autocast(device, enabled=False))
        yield
