"""Nothing a trace makes leaves it: values a traced function stores where they outlive the call.

``grad``, ``vjp``, ``jit``, ``trace``, ``joint`` and ``eval_shape`` run the user's function on
fake tensors. A tensor the function stores outside itself (appends to a list, puts in a dict,
assigns to a global, a ``nonlocal`` variable, an attribute of an object or of a module it
reaches: ``self.last_attn = attn``) would leave the transform as a ``FakeTensor`` with no data,
and fail later far from its cause, or silently hold nothing. ``vmap`` run eagerly has the same
hole: a batched tensor of a finished ``vmap`` fails on first use.

After each trace, :func:`refuse_escapes` walks what the function reaches (the walk of
:func:`~functrans._trace.capture.reach`: closure cells, the globals its code names, attributes
of modules, objects and ``nn.Module`` tables, containers; plus module hooks and the objects
passed to the function as static arguments) and, for each value of the trace it finds:

- an input stored as it came in (``seen.append(x)``, ``self.last_input = x``), outside
  ``jit``: the transform has the real tensor, and puts it there, as running the function would
  have (``jit`` runs the Python code only while tracing: later calls would store nothing);
- anything else is refused: a :class:`TraceError` names the transform, the path the value
  escaped to, the user's line that computed it and what to do instead. No transform computes
  such a value for real where it could hand it over (``grad`` runs only the graph's outputs
  and the values its partition saves; ``jit`` does not run the Python code again). The value
  is left where the function stored it: nothing is put back silently.

Only values of *this* trace count (fake tensors of its fake mode, symbolic sizes of its shape
environment, and functorch wrappers or tensor subclasses around them): fake tensors the caller
made in a fake mode of their own are theirs. Torch's own caches, which torch checks before each
use, are not walked: the private attributes of torch's modules (an RNN's ``_flat_weights``) and
attributes torch's forward pre-hooks set (the deprecated ``weight_norm``'s ``weight``).

The walk costs 50-150 us for a 4-layer MLP on a shared 2-core CPU, under 0.3% of an un-jitted
``ft.grad`` call of it (60-200 ms), and is bounded as ``reach`` is on large models.

>>> import torch, functrans as ft
>>> out = []
>>> def f(x):
...     y = x.sin()
...     out.append(y)
...     return y.sum()
>>> try:
...     ft.grad(f)(torch.ones(3))
... except ft.TraceError as e:
...     print(str(e).splitlines()[0])
grad(f): a tensor of the trace escaped to `out[0]` (an item of a list), computed at ...
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from functrans._core.errors import TraceError
from functrans._core.graph import SOURCE
from functrans._core.pytree import Flat, _Static
from functrans._core.stack import current_stack, describe_stack, fn_name

from .capture import (
    _ATOMS,
    _MAX_DEPTH,
    _MAX_OBJECTS,
    _WRITE,
    _children,
    _library,
    _ModuleView,
)
from .passes import source_of

__all__ = ["Escape", "escapes", "refuse_batched_escapes", "refuse_escapes", "trace_modes"]

_functorch = torch._C._functorch
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)
_MORE = 3  # escapes named in one message; the rest are counted


@dataclass(frozen=True)
class Escape:
    """One value found where it outlives the call: its readable ``path`` (``out[0]``,
    ``model.cache``), the value, and how it is held: the last step of the path (``kind``, a
    row of :mod:`~functrans._trace.capture`'s steps, and ``key``), the object holding it, and
    whether that slot can be written.

    >>> import types
    >>> box = types.SimpleNamespace(h=1)
    >>> e = Escape("box.h", 1, "attr", "h", box, True)
    >>> e.where(), e.put(2), box.h
    ('an attribute of a SimpleNamespace object', True, 2)
    """

    path: str
    value: Any
    kind: str
    key: Any
    holder: Any
    writable: bool

    def where(self) -> str:
        """What holds the value, in words (``an item of a list``)."""
        holder, kind = self.holder, self.kind
        owner = type(holder).__name__
        if kind == "cell":
            return "a variable the function closes over (nonlocal)"
        if kind in ("global", "forward_global"):
            return "a global variable"
        if kind in ("param", "buffer"):
            return f"a {'parameter' if kind == 'param' else 'buffer'} of the {owner} module"
        if kind == "item":
            return f"an item of a {owner}"
        if isinstance(holder, _ModuleView):
            return f"an attribute of module {holder.module.__name__}"
        if isinstance(holder, torch.nn.Module):
            return f"an attribute of the {owner} module"
        return f"an attribute of a {owner} object"

    def put(self, value: Any) -> bool:
        """Put ``value`` where this one was found; False where that slot cannot be written."""
        if not self.writable or self.kind not in _WRITE:
            return False
        holder = self.holder.module if isinstance(self.holder, _ModuleView) else self.holder
        _WRITE[self.kind](holder, self.key, value)
        return True


_Step = tuple[str, Any, Any, str, bool]  # kind, key, child, child's name, writable


def _walked(obj: Any, name: str, home: Any) -> Iterator[_Step]:
    """The steps one object further from ``obj``, as ``reach`` walks, and also: to the hooks
    of a module (an activation-capturing forward hook's dict), through functrans' own
    wrappers (``jit(f)``, ``jit(module)``) to what they wrap, and from a call's flattened
    arguments (``jit``'s flat function holds them) to the objects passed in. Not to torch's own
    caches (see the module docstring)."""
    torch_module = isinstance(obj, torch.nn.Module) and _library(obj)
    rewritten = _rewritten(obj) if torch_module else ()
    for (kind, key), child, child_name, writable in _children(obj, name, home):
        if torch_module and kind == "attr" and (str(key).startswith("_") or key in rewritten):
            continue
        yield kind, key, child, child_name, writable
    if isinstance(obj, Flat):  # a call's arguments, flattened (jit's): objects passed in
        for i, leaf in enumerate(obj.static):
            value = leaf.value if isinstance(leaf, _Static) else leaf
            if _object(value):
                yield "item", i, value, _argument(obj.paths[i]), False
    elif isinstance(obj, torch.nn.Module):
        for table in _HOOKS:
            for key, hook in list(obj.__dict__.get(table, {}).items()):
                if not _library_hook(hook):
                    yield "hook", key, hook, f"{name}.{table}", False
    elif _library(obj) and not isinstance(obj, types.FunctionType):
        wrapped = getattr(obj, "__dict__", {}).get("__wrapped__")
        if wrapped is not None:
            yield "attr", "__wrapped__", wrapped, name, False


def _object(value: Any) -> bool:
    """Whether an argument leaf is an object the function may store into (not a constant)."""
    return value is not None and not isinstance(value, (*_ATOMS, torch.Tensor, types.ModuleType))


def _argument(path: str) -> str:
    """A leaf path of ``(args, kwargs)`` (``[0][1]``, ``[1]['box']``) as ``args[1]``,
    ``box``."""
    if path.startswith("[0]"):
        return "args" + path[3:]
    if not path.startswith("[1]["):
        return f"argument {path}"
    key, _, tail = path[4:].partition("]")
    return key.strip("'\"") + tail


def _rewritten(module: torch.nn.Module) -> tuple[str, ...]:
    """The attributes torch's own forward pre-hooks set before every call (the deprecated
    ``weight_norm``'s and ``spectral_norm``'s ``weight``): a value left there is never read."""
    hooks = module.__dict__.get("_forward_pre_hooks", {})
    return tuple(
        str(getattr(h, "name", ""))
        for h in hooks.values()
        if _library_hook(h) and isinstance(getattr(h, "name", None), str)
    )


#: a module's hooks that run while it is called (and so inside a trace)
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _global_hooks() -> list[tuple[Any, str]]:
    """The hooks registered for every module (``register_module_forward_hook``)."""
    from torch.nn.modules import module

    tables = (
        module._global_forward_pre_hooks,
        module._global_forward_hooks,
        module._global_backward_pre_hooks,
        module._global_backward_hooks,
    )
    return [(h, "") for table in tables for h in list(table.values()) if not _library_hook(h)]


def _library_hook(hook: Any) -> bool:
    """A hook of torch's or functrans' own (functrans' trace machinery, weight_norm's)."""
    code = isinstance(hook, types.FunctionType | types.MethodType)
    module = getattr(hook, "__module__", None) if code else type(hook).__module__
    return str(module or "").partition(".")[0] in ("torch", "functrans")


def escapes(
    roots: Sequence[tuple[Any, str]], caught: Callable[[Any], bool], *, home: Any = None
) -> list[Escape]:
    """Where the tensors (and symbolic sizes) for which ``caught`` is true are held, among
    those reachable from ``roots`` (pairs of an object and the name paths through it start
    with; ``""`` for a function, whose variables name themselves), shortest paths first; a
    value held in two places is found at both. ``home``: the globals dict whose names stay
    unqualified (the user's function's).

    >>> import torch
    >>> held = {"a": torch.ones(1), "b": [torch.zeros(1)]}
    >>> f = lambda x: x + held["a"]
    >>> [e.path for e in escapes([(f, "")], lambda t: not t.any(), home=f.__globals__)]
    ["held['b'][0]"]
    """
    found: list[Escape] = []
    seen: set[int] = {id(obj) for obj, _ in roots}
    clean: set[int] = set()  # tensors looked at and not caught
    frontier = list(roots)
    budget = _MAX_OBJECTS
    for _ in range(_MAX_DEPTH):
        nxt: list[tuple[Any, str]] = []
        for obj, name in frontier:
            for kind, key, child, child_name, writable in _walked(obj, name, home):
                if isinstance(child, (torch.Tensor, *_SYMBOLIC)):
                    if id(child) in clean:
                        continue
                    if caught(child):
                        found.append(Escape(child_name, child, kind, key, obj, writable))
                    else:
                        clean.add(id(child))
                    continue
                if isinstance(child, _ATOMS) or id(child) in seen:
                    continue
                seen.add(id(child))
                budget -= 1
                nxt.append((child, child_name))
        frontier = nxt
        if not frontier or budget <= 0:
            break
    return found


def _bases(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors ``t`` stands for: through functorch's wrappers (live or dead) and tensor
    subclasses (DTensor) to the tensors that hold (or fake) the data."""
    while _functorch.is_functorch_wrapped_tensor(t):
        t = _functorch.get_unwrapped(t)
    if isinstance(t, FakeTensor) or not is_traceable_wrapper_subclass(t):
        return [t]
    attrs, _ = t.__tensor_flatten__()
    inner = [getattr(t, a) for a in attrs]
    return [b for x in inner if isinstance(x, torch.Tensor) for b in _bases(x)]


def trace_modes(traced: fx.GraphModule | FakeTensorMode) -> tuple[FakeTensorMode, ...]:
    """The fake mode a trace ran in (read from its graph's values), or ``()`` where the graph
    holds no fake value (nothing of it can have escaped then).

    >>> import torch, functrans as ft
    >>> g = ft.trace(lambda x: x.sin())(torch.ones(2))
    >>> len(trace_modes(g.graph_module))
    1
    """
    if isinstance(traced, FakeTensorMode):
        return (traced,)
    for node in traced.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, FakeTensor):
            return (val.fake_mode,)
    return ()


def _of(modes: tuple[FakeTensorMode, ...]) -> Callable[[Any], bool]:
    """Whether a value belongs to a trace in ``modes``: one of its fake tensors (or a wrapper
    around one), or a symbolic size of its shape environment."""
    envs = [m.shape_env for m in modes if m.shape_env is not None]

    def caught(x: Any) -> bool:
        if isinstance(x, FakeTensor):  # the common case, without the walk through wrappers
            return any(x.fake_mode is m for m in modes)
        if isinstance(x, torch.Tensor):
            if type(x) in _PLAIN and not _functorch.is_functorch_wrapped_tensor(x):
                return False
            return any(isinstance(b, FakeTensor) and caught(b) for b in _bases(x))
        env = getattr(x.node, "shape_env", None)
        return any(env is e for e in envs) and not x.node.is_constant()

    return caught


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _roots(f: Any) -> tuple[list[tuple[Any, str]], Any]:
    """``f`` and the functions it wraps (``functools.wraps`` layers: ``jit``'s flat function
    wraps the user's), the hooks every module runs, and the globals of the innermost function
    (whose names stay unqualified)."""
    roots: list[tuple[Any, str]] = []
    home = None
    seen: set[int] = set()
    while f is not None and id(f) not in seen:
        seen.add(id(f))
        roots.append((f, ""))
        home = getattr(f, "__globals__", home)
        f = getattr(f, "__dict__", {}).get("__wrapped__")
    return roots + _global_hooks(), home


def _static_roots(statics: Sequence[Any]) -> list[tuple[Any, str]]:
    """The objects among the static leaves of a call's arguments (named ``\\0i\\0`` until a
    message needs their names): passed by reference, what the function stores in them stays."""
    out = []
    for i, leaf in enumerate(statics):
        value = leaf.value if isinstance(leaf, _Static) else leaf
        if _object(value):
            out.append((value, f"\0{i}\0"))
    return out


def _layout(t: torch.Tensor) -> tuple[Any, ...]:
    """What tells a fake tensor from the others of its trace: storage, view and dtype (a
    stored input and the graph's value for it share them; a view of it does not)."""
    return (
        t.untyped_storage()._cdata,
        str(tuple(t.shape)),
        str(t.stride()),
        str(t.storage_offset()),
        t.dtype,
    )


def _reals(
    traced: fx.GraphModule | FakeTensorMode,
    real_inputs: Sequence[torch.Tensor],
    stand_ins: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> dict[tuple[Any, ...], torch.Tensor]:
    """The real tensor each input's fake stands for, by :func:`_layout`: the graph's inputs
    (``real_inputs``, in order) and the ``(fake, real)`` pairs of ``stand_ins``."""
    pairs = list(stand_ins)
    if isinstance(traced, fx.GraphModule) and real_inputs:
        placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
        for node, real in zip(placeholders, real_inputs, strict=False):
            pairs.append((node.meta.get("val"), real))
    return {_layout(fake): real for fake, real in pairs if isinstance(fake, FakeTensor)}


def refuse_escapes(
    f: Callable[..., Any],
    traced: fx.GraphModule | FakeTensorMode,
    transform: str,
    *,
    statics: Sequence[Any] = (),
    static_names: Callable[[], Sequence[str]] | None = None,
    input_names: Sequence[str] = (),
    real_inputs: Sequence[torch.Tensor] = (),
    stand_ins: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
) -> None:
    """Check what ``f`` (and the objects among ``statics``, the static leaves of the
    arguments it was called with, named by ``static_names()``) reaches once the trace
    ``traced`` (its graph, or the fake mode it ran in) has returned: an input of the trace
    stored as it came in gets the real tensor (``real_inputs``: the graph's, in order;
    ``stand_ins``: ``(fake, real)`` pairs), outside ``jit``; any other value of the trace is
    a :class:`TraceError`. ``transform`` names the transform where no transform frame runs
    (a direct ``ft.trace``); ``input_names``: the names of the graph's first inputs.

    >>> import torch, functrans as ft
    >>> CACHE = {}
    >>> def f(x):
    ...     CACHE["input"] = x  # an input stored as it came in: the real one is put there
    ...     CACHE["h"] = x.exp()
    ...     return x
    >>> x = torch.ones(2)
    >>> try:
    ...     ft.trace(f)(x)
    ... except ft.TraceError as e:
    ...     print(str(e).splitlines()[0])
    trace(f): a tensor of the trace escaped to `CACHE['h']` (an item of a dict), computed at ...
    >>> CACHE["input"] is x
    True
    """
    modes = trace_modes(traced)
    if not modes:
        return
    roots, home = _roots(f)
    roots += _static_roots(statics)
    found = escapes(roots, _of(modes), home=home)
    if not found:
        return
    frames = current_stack()
    # jit runs the Python code only while it traces: a stored input would go stale
    reals: dict[tuple[Any, ...], torch.Tensor] | None = None
    if any(fr.transform == "jit" for fr in frames):
        reals = {}
    left = []
    for e in found:
        if type(e.value) is FakeTensor:
            if reals is None:
                reals = _reals(traced, real_inputs, stand_ins)
            real = reals.get(_layout(e.value))
            if real is not None and e.put(real):
                continue
        left.append(e)
    if not left:
        return
    # refused: no fake stays in the caller's objects where the real tensor it stood for is
    # known (eager's state after the call; jit's staleness does not arise, nothing is cached)
    known = _reals(traced, real_inputs, stand_ins)
    for e in left:
        real = known.get(_layout(e.value)) if type(e.value) is FakeTensor else None
        if real is not None:
            e.put(real)
    names = list(static_names()) if static_names is not None and statics else []
    graph = traced if isinstance(traced, fx.GraphModule) else None
    raise TraceError(_message(f, left, transform, names, graph, input_names))


def refuse_batched_escapes(func: Callable[..., Any], transform: str = "vmap") -> None:
    """Raise :class:`TraceError` where a batched tensor of a finished ``vmap`` level (one that
    ``vmap`` just left) is reachable from ``func``: torch would fail on its first use.

    >>> import torch, functrans as ft
    >>> seen = []
    >>> def f(x):
    ...     seen.append(x * 2)
    ...     return x
    >>> try:
    ...     ft.vmap(f)(torch.ones(2, 3))
    ... except ft.TraceError as e:
    ...     print(str(e).splitlines()[0])
    vmap(f): a batched tensor of vmap escaped to `seen[0]` (an item of a list).
    """
    level = _functorch.maybe_current_level() or 0

    def caught(x: Any) -> bool:
        while isinstance(x, torch.Tensor) and _functorch.is_functorch_wrapped_tensor(x):
            if _functorch.is_batchedtensor(x) and _functorch.maybe_get_level(x) > level:
                return True
            x = _functorch.get_unwrapped(x)
        return False

    roots, home = _roots(func)
    found = escapes(roots, caught, home=home)
    if found:
        raise TraceError(_message(func, found, transform, [], None, (), batched=True))


def _message(
    f: Callable[..., Any],
    found: list[Escape],
    transform: str,
    static_names: Sequence[str],
    graph: fx.GraphModule | None,
    input_names: Sequence[str],
    *,
    batched: bool = False,
) -> str:
    frames = tuple(fr for fr in current_stack() if fr.shown)
    name = fn_name(f)
    # trace and joint build for the transform that called them (grad, jit): the innermost
    # frame still running once the trace has returned
    outer = frames[-1].transform if frames and transform in ("trace", "joint") else transform
    if len(frames) >= 2 and frames[-1].transform == outer:
        head = ""  # leaving the frames, the error gets "inside jit(grad(f)): " in front
    elif frames and outer == frames[-1].transform:
        head = f"{describe_stack(frames)}: "
    else:
        head = f"{transform}({name}): "
    first = found[0]
    what = "a batched tensor of vmap" if batched else _what(first.value)
    lines = [
        f"{head}{what} escaped to `{_named(first.path, static_names)}` "
        f"({first.where()}){_computed(first.value, graph, input_names)}."
    ]
    for e in found[1:_MORE]:
        lines.append(f"  also `{_named(e.path, static_names)}` ({e.where()})")
    if len(found) > _MORE:
        lines.append(f"  and {len(found) - _MORE} more")
    lines.append(_why(outer, name, batched) + " " + _advice(outer, name, found))
    return "\n".join(lines)


def _what(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "a tensor of the trace"
    return f"a symbolic size of the trace ({value})"


def _named(path: str, static_names: Sequence[str]) -> str:
    """``path`` with a static argument's placeholder (see :func:`_static_roots`) named."""
    if not path.startswith("\0"):
        return path
    i, _, rest = path[1:].partition("\0")
    index = int(i)
    head = static_names[index] if index < len(static_names) else f"argument leaf {index}"
    return head + rest


def _computed(value: Any, graph: fx.GraphModule | None, input_names: Sequence[str]) -> str:
    """Where the trace computed ``value``: `` computed at file:line: code``, `` (it is the
    traced input x, stored as it came in)``, or empty. Found by storage: the graph's values
    alias the tensors the trace handed out."""
    if graph is None or not isinstance(value, torch.Tensor):
        return ""
    bases = [b for b in _bases(value) if isinstance(b, FakeTensor)]
    if not bases:
        return ""
    storage = bases[0].untyped_storage()._cdata
    inputs = 0
    for node in graph.graph.nodes:
        val = node.meta.get("val")
        same = isinstance(val, FakeTensor) and val.untyped_storage()._cdata == storage
        if node.op == "placeholder":
            inputs += 1
            if same:
                i = inputs - 1
                what = input_names[i] if i < len(input_names) else "of the function"
                return f" (it is the traced input {what}, stored as it came in)"
        elif same:
            src = node.meta.get(SOURCE) or source_of(node.meta.get("stack_trace"))
            return f", computed at {src}" if src else ""
    return ""


def _why(outer: str, name: str, batched: bool) -> str:
    if batched:
        return (
            "Outside vmap it has no meaning: torch fails on its first use ('your tensor may "
            "have escaped from inside a function being vmapped')."
        )
    if outer == "jit" or any(fr.transform == "jit" for fr in current_stack()):
        return (
            f"{outer} traces {name} on fake tensors once (per input signature) and then runs "
            "the compiled graph without its Python code, so what is stored there holds no "
            f"data (a FakeTensor, left where {name} stored it) and later calls would not store "
            "anything."
        )
    return (
        f"{outer} traces {name} on fake tensors, so what is stored there holds no data (a "
        f"FakeTensor, left where {name} stored it)."
    )


def _advice(outer: str, name: str, found: list[Escape]) -> str:
    if outer in ("grad", "value_and_grad", "vjp", "joint"):
        out = (
            f"Return it instead: with has_aux=True, {name} returns (output, aux) and {outer} "
            "hands aux back as real tensors."
        )
    elif outer == "eval_shape":
        out = "Return it instead: eval_shape gives the shape of every output."
    elif outer == "vmap":
        out = "Return it as an output instead: vmap stacks it along out_dims."
    else:
        out = "Return it as one more output instead."
    if any(isinstance(e.holder, torch.nn.Module) for e in found):
        out += (
            " A module attribute set in forward (`self.cache = h`) is not set with real values "
            "by the transformed call: return the value from forward, or compute it outside."
        )
    return (
        f"{out} Storing tensors computed outside the transform, and reading stored ones, is fine."
    )
