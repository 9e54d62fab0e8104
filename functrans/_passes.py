"""Small pure passes over FX graphs: canonicalize traced graphs, dead-code elimination.

Each pass returns a new ``GraphModule`` and leaves its input untouched.
"""

from __future__ import annotations

import contextlib
import gc
import operator
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ._cost import is_collective, is_random
from ._graph import PATH, ROLE, SOURCE, Role
from ._tags import REMAT

__all__ = ["InputSpec", "canonicalize", "no_gc", "source_of"]


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
    m = frames[-1]
    return f"{m['file']}:{m['line']}: {m['code'].strip()}"


def canonicalize(
    gm: fx.GraphModule, inputs: Sequence[InputSpec], *, cse: bool = True
) -> fx.GraphModule:
    """Rename and tag placeholders, drop identity ops, merge common subexpressions (unless
    ``cse`` is False: a graph that recomputes on purpose), remove dead code, record source
    lines."""
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
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "call_function" and node.target in _IDENTITY_OPS:
            env[node] = env[node.args[0]]
            continue
        key = cse_key(node, env) if cse else None
        if key is not None and key in seen:
            env[node] = seen[key]
            continue
        copied = new.node_copy(node, lambda n: env[n])
        if key is not None:
            seen[key] = copied
        src = source_of(node.meta.get("stack_trace"))
        if src is not None:
            copied.meta[SOURCE] = src
        env[node] = copied
    eliminate_dead_code(new)
    return fx.GraphModule(gm, new)  # keeps gm's attributes (constants) that new refers to


def _frozen(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    hash(value)  # raises TypeError for anything we cannot key on
    return (type(value), value)


def cse_key(node: fx.Node, env: dict[fx.Node, Any]) -> Any:
    """Key under which ``node`` is interchangeable with an earlier node (common-subexpression
    elimination), or None. Random and mutating ops are never merged; neither are ops that a
    remat policy tagged differently (JAX's prevent_cse across remat boundaries)."""
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
        return (target, _frozen(args), _frozen(kwargs), node.meta.get(REMAT))
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
