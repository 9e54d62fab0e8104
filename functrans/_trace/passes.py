"""Small pure passes over FX graphs: canonicalize traced graphs, dead-code elimination.

Each pass returns a new ``GraphModule`` and leaves its input untouched.
"""

from __future__ import annotations

import contextlib
import gc
import operator
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch
import torch.fx as fx

from functrans._core.graph import (
    NO_GRAD,
    PATH,
    ROLE,
    SOURCE,
    STOPPED,
    Role,
    argument_nodes,
    lazy_module,
)
from functrans._core.ops import cancelled_transposes, is_collective, is_random, is_view_op
from functrans._core.tags import REMAT

__all__ = [
    "InputSpec",
    "WrittenOut",
    "canonicalize",
    "no_gc",
    "out_of_place",
    "source_of",
    "writes_out_of_place",
]


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while building big graphs.

    FX nodes form reference cycles by design, so every collection pass walks the whole graph:
    with tens of thousands of nodes being created, the collector's passes make graph building
    quadratic (2.2 s instead of 0.9 s to partition a 30k-node joint graph). Nothing built here
    becomes garbage, so pausing it is free; it is re-enabled on exit.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


aten = torch.ops.aten

# Ops that return their input's value unchanged; in a functional graph they are plain renames.
_IDENTITY_OPS = frozenset({aten.alias.default, aten.detach.default})


@dataclass(frozen=True)
class InputSpec:
    """How to name and tag one placeholder."""

    name: str
    role: Role
    path: str


def identifier(text: str) -> str:
    """A valid, readable Python identifier for an argument path like ``params['w'][0]``."""
    s = re.sub(r"\W+", "_", text).strip("_")
    return s if s and not s[0].isdigit() else f"arg_{s}"


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in \S+\n\s*(?P<code>.*)')


def source_of(stack_trace: str | None) -> str | None:
    """``file:line: code`` of the innermost frame recorded in an FX ``stack_trace``."""
    if not stack_trace:
        return None
    frames = list(_FRAME.finditer(stack_trace))
    if not frames:
        return None
    # the user's line: torch's and functrans' own frames (nn.Linear's F.linear, jit(module)'s
    # call) sit inside it; a stack of library frames only names the innermost
    users = [m for m in frames if not m["file"].startswith(_LIBRARY_DIRS)]
    m = (users or frames)[-1]
    return f"{m['file']}:{m['line']}: {m['code'].strip()}"


_LIBRARY_DIRS = tuple(
    os.path.dirname(path) + os.sep
    for path in (torch.__file__, optree.__file__, contextlib.__file__, __file__)
    if path
)


def canonicalize(
    gm: fx.GraphModule, inputs: Sequence[InputSpec], *, cse: bool = True
) -> fx.GraphModule:
    """Rename and tag placeholders, drop identity ops and transpose pairs that cancel, merge
    common subexpressions (unless ``cse`` is False: a graph that recomputes on purpose), remove
    dead code, record source lines."""
    new = fx.Graph()
    env: dict[fx.Node, Any] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise ValueError(f"{len(placeholders)} placeholders but {len(inputs)} input specs")
    for node, spec in zip(placeholders, inputs, strict=True):
        p = new.placeholder(spec.name)
        p.meta.update(node.meta)
        p.meta[ROLE] = spec.role
        p.meta[PATH] = spec.path
        env[node] = p
    seen: dict[Any, fx.Node] = {}
    outputs = set(next(n for n in reversed(gm.graph.nodes) if n.op == "output").all_input_nodes)
    returned = {_through_identities(n) for n in outputs}
    cut: set[fx.Node] = set()  # dropped renames that went through a detach autograd saw
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "call_function" and node.target in _IDENTITY_OPS:
            env[node] = env[node.args[0]]
            if node.meta.get(NO_GRAD) or node.args[0] in cut:
                cut.add(node)
            continue
        base = cancelled_transposes(node)
        if base is not None and not (env[base].op == "placeholder" and node in outputs):
            env[node] = env[base]  # t(t(w)) in a linear's backward: w itself
            continue
        # a returned value is a tensor of its own, as in eager: merged with another, the
        # other's users would be on its autograd path (``return loss, h`` with h computed
        # twice, the loss from the first: the gradient of the loss at h is None in eager)
        stopped = frozenset(i for i, a in enumerate(argument_nodes(node)) if a in cut)
        key = cse_key(node, env, stopped) if cse and node not in returned else None
        if key is not None and key in seen:
            env[node] = seen[key]
            continue
        copied = new.node_copy(node, lambda n: env[n])
        if stopped:
            copied.meta[STOPPED] = tuple(sorted(stopped))
        if key is not None:
            seen[key] = copied
        src = source_of(node.meta.get("stack_trace"))
        if src is not None:
            copied.meta[SOURCE] = src
        env[node] = copied
    eliminate_dead_code(new)
    return lazy_module(gm, new)  # keeps gm's attributes (constants) that new refers to


def _through_identities(node: fx.Node) -> fx.Node:
    """The value ``node`` is through identity ops (``alias``): what a returned alias returns."""
    while node.op == "call_function" and node.target in _IDENTITY_OPS:
        node = node.args[0]  # type: ignore[assignment]  # an identity op's argument is a Node
    return node


def _frozen(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    hash(value)  # raises TypeError for anything we cannot key on
    return (type(value), value)


def cse_key(node: fx.Node, env: dict[fx.Node, Any], stopped: frozenset[int] = frozenset()) -> Any:
    """Key under which ``node`` is interchangeable with an earlier node (common-subexpression
    elimination), or None. Random and mutating ops are never merged; neither are ops that a
    remat policy tagged differently (JAX's prevent_cse across remat boundaries), nor ops that
    autograd records differently (one under ``no_grad`` or reading a detached argument, the
    other not: ``stopped``, the positions of its arguments that came through a detach)."""
    target = node.target
    if node.op != "call_function" or not (
        target is operator.getitem or isinstance(target, torch._ops.OpOverload)
    ):
        return None
    if isinstance(target, torch._ops.OpOverload) and (
        target._schema.is_mutable or is_random(node) or is_collective(node)
    ):
        return None  # each collective is a message the other ranks expect: never merged
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
    try:
        grad = (bool(node.meta.get(NO_GRAD)), stopped)
        return (target, _frozen(args), _frozen(kwargs), node.meta.get(REMAT), grad)
    except TypeError:
        return None


def eliminate_dead_code(graph: fx.Graph, keep: Callable[[fx.Node], bool] | None = None) -> None:
    """Remove every op whose value nothing uses (in place, on a graph this pass owns)."""
    for node in reversed(list(graph.nodes)):
        if node.op in ("placeholder", "output") or node.users or is_collective(node):
            continue  # an unused collective is still a message the other ranks wait for
        if keep is not None and keep(node):
            continue
        graph.erase_node(node)


def out_of_place(gm: fx.GraphModule) -> fx.GraphModule | None:
    """``gm`` with every in-place op on a fresh buffer replaced by its functional variant
    (``empty_like(x).bernoulli_(p).div_(q)``, what dropout decomposes to), or None where some
    mutation is of another kind (then the caller functionalizes the whole graph again).

    A fresh buffer is the value of a non-view op that nothing views: writing to it in place
    changes nothing another value can see, so later readers of the buffer read the functional
    op's result instead. This spares the retrace through functionalization, which on a
    symbolic trace costs as much as the trace itself (3.2 s of a 2-layer GPT's 8.9 s).
    ``gm`` is not modified.
    """
    done = _functional(gm, inputs=False)
    return None if done is None else done.gm


@dataclass(frozen=True)
class WrittenOut:
    """A graph whose writes to its inputs were made functional: the graph, and per written
    input (by placeholder name) the node holding its final value."""

    gm: fx.GraphModule
    written: dict[str, fx.Node]


def writes_out_of_place(gm: fx.GraphModule) -> WrittenOut | None:
    """:func:`out_of_place`, where an input that nothing views may be written too (a batch
    norm's running statistics, ``copy_(running_mean, new)``): its writes become functional
    ops, later reads read their results, and its final value is returned by name, for the
    caller to write back (None where some mutation is of another kind). ``gm`` is not
    modified.

    >>> import torch
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> def f(x, stat):
    ...     stat.mul_(0.9).add_(x.mean() * 0.1)
    ...     return x * 2
    >>> done = writes_out_of_place(make_fx(f)(torch.ones(3), torch.zeros(())))
    >>> {k: v.target.__name__ for k, v in done.written.items()}
    {'stat_1': 'add.Tensor'}
    """
    return _functional(gm, inputs=True)


def _functional(gm: fx.GraphModule, inputs: bool) -> WrittenOut | None:
    mutating = [n for n in gm.graph.nodes if _mutates(n)]
    if not mutating:
        return WrittenOut(gm, {})
    functional: dict[fx.Node, Any] = {}
    for m in mutating:
        op = _functional_variant(m.target)
        buffer = m.args[0] if m.args else None
        if op is None or not isinstance(buffer, fx.Node) or not _fresh(buffer, functional, inputs):
            return None
        functional[m] = op
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    latest: dict[fx.Node, fx.Node] = {}  # buffer -> the new node holding its value now

    def read(a: fx.Node) -> fx.Node:  # an alias of a buffer reads the buffer's value now
        root = _root(a, functional)
        return latest.get(root, env[a])

    for node in gm.graph.nodes:
        if node in functional:
            op = functional[node]
            args, kwargs = fx.node.map_arg((_with_defaults(node), node.kwargs), read)
            # named after the functional op, as functionalization names it (``bernoulli``)
            copied = new.create_node(
                "call_function", op, args, kwargs, name=op.overloadpacket.__name__
            )
            copied.meta.update(node.meta)
            root = _root(node, functional)
            if root.op == "placeholder":  # a new value, not the input's storage written
                copied.meta["val"] = _unaliased(node.meta.get("val"))
            latest[root] = copied
        else:
            copied = new.node_copy(node, read)
        env[node] = copied
    written = {root.name: value for root, value in latest.items() if root.op == "placeholder"}
    return WrittenOut(lazy_module(gm, new), written)


def _unaliased(val: Any) -> Any:
    """A fake value like ``val`` on a storage of its own."""
    mode = getattr(val, "fake_mode", None)
    if mode is None:
        return val
    with mode:
        return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)


def _with_defaults(node: fx.Node) -> tuple[Any, ...]:
    """``node``'s positional arguments with the schema's defaults filled in (the functional
    variant may not default them: ``bernoulli_(x)`` means ``bernoulli(x, 0.5)``)."""
    formals = [a for a in node.target._schema.arguments if not a.kwarg_only]  # type: ignore[union-attr]  # a call_function target here is an OpOverload
    args = list(node.args)
    for formal in formals[len(args) :]:
        if formal.name in node.kwargs or not formal.has_default_value():
            break
        args.append(formal.default_value)
    return tuple(args)


def _mutates(node: fx.Node) -> bool:
    return (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and node.target._schema.is_mutable
    )


def _functional_variant(op: Any) -> Any:
    """``aten.div_.Scalar`` -> ``aten.div.Scalar``: the out-of-place op with the same
    arguments, for an op that writes its first argument only and returns it."""
    schema = op._schema
    args = schema.arguments
    writes = [a for a in args if a.alias_info is not None and a.alias_info.is_write]
    if len(writes) != 1 or writes[0] is not args[0] or not schema.name.endswith("_"):
        return None
    namespace, _, name = schema.name.partition("::")
    packet = getattr(getattr(torch.ops, namespace), name[:-1], None)
    if packet is None:
        return None
    # the same overload name first (div_.Scalar -> div.Scalar), else any overload taking the
    # same arguments (bernoulli_.float -> bernoulli.p)
    names = [schema.overload_name or "default", *packet.overloads()]
    for overload in names:
        variant = getattr(packet, overload, None)
        if variant is None or variant._schema.is_mutable:
            continue
        theirs = variant._schema.arguments
        if len(theirs) == len(args) and all(
            a.name == b.name and str(a.type) == str(b.type)
            for a, b in zip(args, theirs, strict=True)
        ):
            return variant
    return None


def _root(node: fx.Node, functional: dict[fx.Node, Any]) -> fx.Node:
    """The buffer an in-place op's result aliases (through chains of in-place ops)."""
    while node in functional:
        node = node.args[0]  # type: ignore[assignment]  # an in-place op's first argument is a Node
    return node


def _fresh(buffer: fx.Node, functional: dict[fx.Node, Any], inputs: bool = False) -> bool:
    """Whether ``buffer`` is a value no other value aliases: made by a non-view op (or, with
    ``inputs``, a placeholder) and never viewed (nor is anything in the chain of in-place ops
    writing to it)."""
    root = _root(buffer, functional)
    if not (inputs and root.op == "placeholder"):
        if root.op != "call_function" or not isinstance(root.target, torch._ops.OpOverload):
            return False
        if is_view_op(root) or _mutates(root):
            return False
    chain = [root, *[n for n in functional if _root(n, functional) is root]]
    return not any(is_view_op(u) for n in chain for u in n.users)
