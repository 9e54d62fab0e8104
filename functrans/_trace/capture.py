"""Tensors and modules a function reaches without taking them as arguments.

A function closing over a tensor (``w`` in ``lambda x: x @ w``), a global, or a module it calls
reads state the trace would otherwise bake in as a constant: replaced later (``w =
torch.randn(...)``), the graph would keep the old one; a parameter requiring grad would get no
gradient. :func:`reach` walks from the function to what it can read (closure cells, the
globals its code names, the attributes of imported modules its code names (``helpers.SCALE``,
``helpers.apply`` and, through it, that module's globals), ``self`` of bound methods,
``functools.partial`` arguments, module parameters, buffers and submodules, containers and
plain objects' attributes) and records a :class:`Path` to each tensor and module. ``jit`` lifts
the captured tensors its trace actually used to graph inputs, re-reads them through their
paths on every call (so a replaced or updated tensor is seen, and gradients reach captured
parameters), and guards the ``training`` flags of the modules found (everything else a trace
reads is guarded by :mod:`functrans._trace.reads`).

>>> import torch
>>> w = torch.ones(2)
>>> found = reach(lambda x: x * w)
>>> [(p.name, p.read(found.root) is w) for paths in found.tensors.values() for p in paths]
[('w', True)]
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from functrans._core.errors import UnsupportedOpError
from functrans._core.graph import SOURCE

__all__ = [
    "Path",
    "Reach",
    "Reader",
    "captured_constants",
    "carry_rebinding",
    "reach",
    "swapped",
]

# a step from one object to the next: (kind, key); kinds are the rows of _READ
PathStep = tuple[str, Any]

_READ: dict[str, Callable[[Any, Any], Any]] = {
    "cell": lambda f, i: f.__closure__[i].cell_contents,
    "global": lambda f, name: f.__globals__[name],
    "forward_global": lambda m, name: type(m).forward.__globals__[name],
    "self": lambda m, _: m.__self__,
    "func": lambda m, _: m.__func__ if isinstance(m, types.MethodType) else m.func,
    "item": lambda c, k: c[k],  # dict, list, tuple
    "partial_arg": lambda p, i: p.args[i],
    "default": lambda f, i: f.__defaults__[i],
    "kwdefault": lambda f, k: f.__kwdefaults__[k],
    "partial_kw": lambda p, k: p.keywords[k],
    "attr": lambda o, name: o.__dict__[name],
    "param": lambda m, name: m._parameters[name],
    "buffer": lambda m, name: m._buffers[name],
    "child": lambda m, name: m._modules[name],
}


def _set_cell(f: Any, i: int, v: Any) -> None:
    f.__closure__[i].cell_contents = v


def _set_global(f: Any, name: str, v: Any) -> None:
    f.__globals__[name] = v


def _set_partial_arg(p: functools.partial[Any], i: int, v: Any) -> None:
    args = list(p.args)
    args[i] = v
    p.__setstate__((p.func, tuple(args), p.keywords, p.__dict__ or None))  # type: ignore[attr-defined]  # partial's state hook: typeshed leaves it out


def _set_partial_kw(p: functools.partial[Any], k: str, v: Any) -> None:
    p.keywords[k] = v


def _set_forward_global(m: Any, name: str, v: Any) -> None:
    type(m).forward.__globals__[name] = v


def _set_item(c: Any, k: Any, v: Any) -> None:
    c[k] = v


def _set_attr(o: Any, name: str, v: Any) -> None:
    o.__dict__[name] = v


def _set_param(m: Any, name: str, v: Any) -> None:
    m._parameters[name] = v


def _set_buffer(m: Any, name: str, v: Any) -> None:
    m._buffers[name] = v


# how the last step of a path is written (swapped during tracing); tuples have no row
_WRITE: dict[str, Callable[[Any, Any, Any], None]] = {
    "cell": _set_cell,
    "global": _set_global,
    "forward_global": _set_forward_global,
    "item": _set_item,
    "partial_arg": _set_partial_arg,
    "partial_kw": _set_partial_kw,
    "attr": _set_attr,
    "param": _set_param,
    "buffer": _set_buffer,
}


@dataclass(frozen=True)
class Path:
    """How to reach one object from the root function, and its readable name."""

    steps: tuple[PathStep, ...]
    name: str
    writable: bool  # the last container can be written (not a tuple, not a method's self)

    def read(self, root: Any) -> Any:
        obj = root
        for kind, key in self.steps:
            obj = _READ[kind](obj, key)
        return obj

    def write(self, root: Any, value: Any) -> None:
        parent = root
        for kind, key in self.steps[:-1]:
            parent = _READ[kind](parent, key)
        kind, key = self.steps[-1]
        _WRITE[kind](parent, key, value)


@dataclass
class Reach:
    """What :func:`reach` found: each tensor's paths by its ``id`` (every path: a tensor tied
    into two modules is read, and swapped, at both), shortest first; each module with the
    shortest path to it."""

    root: Any
    tensors: dict[int, list[Path]] = field(default_factory=dict)
    modules: list[tuple[Path, torch.nn.Module]] = field(default_factory=list)


# Bounds on the walk: state hidden deeper than this is not found (and a trace that uses such a
# tensor is told so); they keep the walk to milliseconds on large models.
_MAX_DEPTH = 16
_MAX_OBJECTS = 50_000
_MAX_ITEMS = 4_096  # items looked at per container

_ATOMS = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device)
_MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__) | {"_compiled_call_impl"}


def _library(obj: Any) -> bool:
    """Objects of torch's (and Python's) own types, which hold no user state worth walking."""
    module = getattr(type(obj), "__module__", "") or ""
    return module.split(".", 1)[0] in _LIBRARIES


_LIBRARIES = frozenset({"torch", "builtins", "numpy", "optree", "functrans"})


def reach(f: Any) -> Reach:
    """Walk breadth-first from ``f`` to the tensors and modules it can read (see the module
    docstring); the first path found to an object is the shortest."""
    found = Reach(f)
    seen: set[int] = {id(f)}
    frontier: list[tuple[Any, tuple[PathStep, ...], str]] = [(f, (), "")]
    budget = _MAX_OBJECTS
    home = getattr(f, "__globals__", None)  # the root's own globals: named unqualified
    for _ in range(_MAX_DEPTH):
        nxt: list[tuple[Any, tuple[PathStep, ...], str]] = []
        for obj, steps, name in frontier:
            for step, child, child_name, child_writable in _children(obj, name, home):
                if isinstance(child, torch.Tensor):
                    to_tensor = Path((*steps, step), child_name, child_writable)
                    found.tensors.setdefault(id(child), []).append(to_tensor)
                    continue
                if isinstance(child, _ATOMS):
                    continue
                if id(child) in seen:
                    continue
                seen.add(id(child))
                budget -= 1
                path = (*steps, step)
                if isinstance(child, torch.nn.Module):
                    found.modules.append((Path(path, child_name, child_writable), child))
                nxt.append((child, path, child_name))
        frontier = nxt
        if not frontier or budget <= 0:
            break
    return found


_Child = tuple[PathStep, Any, str, bool]


def _children(obj: Any, name: str, home: Any = None) -> Iterator[_Child]:
    """The objects one step from ``obj``: (step, child, child's name, writable); ``home``: the
    root function's globals (names read there stay unqualified)."""
    if isinstance(obj, types.FunctionType):
        yield from _function_children(obj, name, home)
    elif isinstance(obj, _ModuleView):
        yield from _module_attrs(obj, name)
    elif isinstance(obj, types.MethodType):
        yield ("self", None), obj.__self__, name.rpartition(".")[0] or "self", False
        yield ("func", None), obj.__func__, name, False
    elif isinstance(obj, functools.partial):
        yield ("func", None), obj.func, name, False
        for i, value in enumerate(obj.args[:_MAX_ITEMS]):  # bound: swapped like a closure's
            yield ("partial_arg", i), value, f"{name}.args[{i}]", True
        for key, value in list(obj.keywords.items())[:_MAX_ITEMS]:
            yield ("partial_kw", key), value, f"{name}.keywords[{key!r}]", True
    elif isinstance(obj, torch.nn.Module):
        yield from _module_children(obj, name, home)
    elif isinstance(obj, (dict, list)):
        yield from _items(obj, name, writable=True)
    elif isinstance(obj, tuple):
        yield from _items(obj, name, writable=False)
    elif not isinstance(obj, type | types.ModuleType) and not _library(obj):
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict):
            for key, value in list(attrs.items())[:_MAX_ITEMS]:
                yield ("attr", key), value, f"{name}.{key}", True


def _function_children(f: types.FunctionType, name: str, home: Any) -> Iterator[_Child]:
    code = f.__code__
    for i, (var, cell) in enumerate(zip(code.co_freevars, f.__closure__ or (), strict=True)):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell: the variable is not bound yet
            continue
        if isinstance(value, types.ModuleType):  # a module imported inside the enclosing code
            if _walked_module(value):
                yield ("cell", i), _ModuleView(value, _global_names(code)), var, True
            continue
        yield ("cell", i), value, var, True
    # ``def loss(x, m=model)``: what a default holds is reached (a module's tensors are
    # swapped in its own tables); a default itself is not written (its tuple is guarded whole)
    for i, value in enumerate(f.__defaults__ or ()):
        yield ("default", i), value, f"{name}.__defaults__[{i}]", False
    for key, value in (f.__kwdefaults__ or {}).items():
        yield ("kwdefault", key), value, f"{name}.__kwdefaults__[{key!r}]", False
    yield from _globals_read("global", f.__globals__, _global_names(code), home)


def _globals_read(
    kind: str, glb: dict[str, Any], names: tuple[str, ...], home: Any
) -> Iterator[_Child]:
    """The globals ``names`` of the module dict ``glb`` (a function's, a module's forward's);
    an imported module among them stands for the attributes of it that the code names
    (``helpers.SCALE``, ``helpers.apply``: see :class:`_ModuleView`)."""
    prefix = "" if glb is home else f"{glb.get('__name__', '?')}."
    for var in names:
        if var not in glb:
            continue
        value = glb[var]
        if isinstance(value, types.ModuleType):
            if _walked_module(value):
                yield (kind, var), _ModuleView(value, names), prefix + var, True
            continue
        yield (kind, var), value, prefix + var, True


@dataclass(frozen=True, eq=False)
class _ModuleView:
    """An imported module as the walk sees it: only the attributes the code that reached it
    names (``helpers.apply(x)`` names ``apply``), not everything the module holds. Its path
    step leads to the module itself; the steps after it are ``attr`` steps into the module's
    ``__dict__`` (so a replaced ``helpers.SCALE`` is read anew, and swapped while tracing)."""

    module: types.ModuleType
    names: tuple[str, ...]


def _walked_module(m: types.ModuleType) -> bool:
    """Modules whose globals may be user state: not Python's, torch's or functrans' own."""
    top = str(getattr(m, "__name__", "")).partition(".")[0]
    return top not in sys.stdlib_module_names and top not in _LIBRARIES


def _module_attrs(view: _ModuleView, name: str) -> Iterator[_Child]:
    attrs = vars(view.module)
    for key in view.names:
        if key not in attrs:
            continue
        value = attrs[key]
        if isinstance(value, types.ModuleType):  # ``pkg.sub.X``
            if _walked_module(value):
                yield ("attr", key), _ModuleView(value, view.names), f"{name}.{key}", True
            continue
        yield ("attr", key), value, f"{name}.{key}", True


@functools.lru_cache(maxsize=4096)
def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """Names a code object (and the functions, lambdas and comprehensions inside it) may look
    up as globals."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.extend(_global_names(const))
    return tuple(dict.fromkeys(names))


def _module_children(m: torch.nn.Module, name: str, home: Any) -> Iterator[_Child]:
    prefix = f"{name}." if name else ""
    for key, p in m._parameters.items():
        if p is not None:
            yield ("param", key), p, prefix + key, True
    for key, b in m._buffers.items():
        if b is not None:
            yield ("buffer", key), b, prefix + key, True
    for key, child in m._modules.items():
        if child is not None:
            yield ("child", key), child, prefix + key, False
    for key, value in m.__dict__.items():
        if key not in _MODULE_INTERNALS:
            yield ("attr", key), value, prefix + key, True
    forward = type(m).forward
    if isinstance(forward, types.FunctionType) and not _library(m):
        # the globals a user module's forward reads (a module-level tensor, say)
        names = _global_names(forward.__code__)
        yield from _globals_read("forward_global", forward.__globals__, names, home)


def _items(c: Any, name: str, *, writable: bool) -> Iterator[_Child]:
    pairs = c.items() if isinstance(c, dict) else enumerate(c)
    for n, (key, value) in enumerate(pairs):
        if n >= _MAX_ITEMS:
            return
        yield ("item", key), value, f"{name}[{key!r}]", writable


class Reader:
    """Reads the objects at many paths at once, walking each shared prefix once (a model's
    modules share most of their paths).

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(1, 1))
    >>> found = reach(lambda x: net(x))
    >>> Reader([p for p, _ in found.modules]).read(found.root) == (net, net[0])
    True
    """

    def __init__(self, paths: Sequence[Path]) -> None:
        self.paths = tuple(paths)
        self.size = len(paths)
        trie: dict[Any, Any] = {}
        for i, p in enumerate(paths):
            node = trie
            for step in p.steps:
                node = node.setdefault(step, {})
            node.setdefault(None, []).append(i)
        self._plan = _plan(trie)

    def readable(self, root: Any) -> Reader:
        """The same reader without the paths that lead nowhere now."""
        kept = []
        for p in self.paths:
            try:
                p.read(root)
            except _GONE:
                continue
            kept.append(p)
        return self if len(kept) == self.size else Reader(kept)

    def read(self, root: Any) -> tuple[Any, ...] | None:
        """The objects at the paths now, or None when one of them no longer exists."""
        if not self.size:
            return ()
        out: list[Any] = [None] * self.size
        try:
            _visit(self._plan, root, out)
        except _GONE:
            return None
        return tuple(out)


# what reading a path that no longer leads anywhere raises
_GONE = (LookupError, AttributeError, ValueError, TypeError)


class _Read(NamedTuple):
    """One step of a :class:`Reader`'s plan: ``read(obj, key)``, put the result at ``leaves``
    of the output, and go on from it with ``children`` (a tuple: destructured on every read)."""

    read: Callable[[Any, Any], Any]
    key: Any
    leaves: list[int]
    children: list[_Read]


_Plan = list[_Read]


def _plan(trie: dict[Any, Any]) -> _Plan:
    plan = []
    for step, node in trie.items():
        if step is not None:  # None holds the leaves that end at this node
            kind, key = step
            plan.append(_Read(_READ[kind], key, node.get(None, []), _plan(node)))
    return plan


def _visit(plan: _Plan, obj: Any, out: list[Any]) -> None:
    for read, key, leaves, children in plan:
        child = read(obj, key)
        for i in leaves:
            out[i] = child
        if children:
            _visit(children, child, out)


@contextlib.contextmanager
def swapped(paths: Sequence[Path], root: Any, values: Sequence[Any]) -> Iterator[None]:
    """Temporarily put ``values`` where ``paths`` lead (the trace then reads its own inputs
    there, as ``torch.func.functional_call`` does for module parameters); restored after. A
    slot the body rebinds is written into its value first (:func:`carry_rebinding`)."""
    old = [p.read(root) for p in paths]
    done: list[tuple[Path, Any]] = []
    try:
        for p, v, o in zip(paths, values, old, strict=True):
            p.write(root, v)
            done.append((p, o))
        yield
        put = {id(v) for v in values}  # a slot now holding another stand-in: torch's caches
        for p, v in zip(paths, values, strict=True):
            now = p.read(root)
            if id(now) not in put:
                carry_rebinding(p.name, v, now)
    finally:
        for p, o in reversed(done):
            p.write(root, o)


def carry_rebinding(name: str, put: Any, now: Any) -> None:
    """The traced body rebound the slot ``name``, where its input ``put`` stood, to ``now``
    (``self.ema = 0.9 * self.ema + 0.1 * x.mean(0)`` in a forward): eager leaves the new
    tensor there, and the trace's slot is restored after it. (A slot rebound to another of
    the swapped-in tensors is not this: an RNN refreshing ``_flat_weights`` from its
    parameters; the caller skips it.) The new value is written into
    ``put`` in place instead, an input write the caller writes back (``ft.jit`` copies it
    into the real buffer): the buffer holds eager's value after the call, though not a new
    tensor object. A value of another shape, dtype or device cannot be written so: refused,
    naming the slot."""
    if now is put or not isinstance(put, torch.Tensor) or not isinstance(now, torch.Tensor):
        return
    same = (now.shape, now.dtype, now.device) == (put.shape, put.dtype, put.device)
    if not same:
        raise UnsupportedOpError(
            f"the traced function rebinds {name} (a {put.dtype} tensor of shape "
            f"{tuple(put.shape)}) to a {now.dtype} tensor of shape {tuple(now.shape)} on "
            f"{now.device}: a compiled call writes a rebound tensor back into the one it "
            "replaced, which needs the same shape, dtype and device. Keep them, or pass the "
            "tensor in and return the new one"
        )
    with torch.no_grad():
        put.copy_(now)


def captured_constants(gm: Any) -> list[tuple[torch.Tensor, str]]:
    """Tensors a trace baked into ``gm`` as constants that it read from outside (not the fresh
    ones ``torch.tensor(...)`` makes while tracing, which ``make_fx`` copies through
    ``lift_fresh_copy``), each once, with where the trace first used it (`` at file:line``)."""
    fresh = torch.ops.aten.lift_fresh_copy.default
    out: list[tuple[torch.Tensor, str]] = []
    seen: set[int] = set()
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value = getattr(gm, node.target, None)
        if not isinstance(value, torch.Tensor) or id(value) in seen:
            continue
        if node.users and all(u.target is fresh for u in node.users):
            continue
        seen.add(id(value))
        source = next((u.meta.get(SOURCE) for u in node.users), None)
        out.append((value, f" at {source}" if source else ""))
    return out
