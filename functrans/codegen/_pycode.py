"""An FX graph as one flat Python function: the ``"aten"`` backend's executor.

``GraphModule`` code reaches each op through an attribute chain (``torch.ops.aten.mm.default``)
and runs behind ``nn.Module.__call__``; on graphs of hundreds of small ops that overhead is a
visible share of a training step. Here every call target and constant is bound once as a
global of the generated function, ``getitem`` is plain indexing, and each value is deleted
right after its last use, inputs included: the function takes its inputs as one list, which it
empties (the boxed convention of :mod:`functrans.extend`'s ``Boxed``), so a backward frees each
saved value as soon as its last reader ran. An op run by a function that takes its inputs over
(:func:`functrans.extend.handover_call`) gets them in a list of its own, their names deleted
first where it is their last use.

>>> import torch, functrans as ft
>>> g = ft.trace(lambda x: (x.sin() * 2).sum())(torch.ones(3))
>>> run = flat_function(g.graph_module)
>>> print(run.source)
def run(args):
    (a0,) = args
    args.clear()
    v1 = f0(a0)
    del a0
    v2 = f1(v1, 2)
    del v1
    v3 = f2(v2, [])
    del v2
    return [v3]
>>> run(torch.zeros(3))
[tensor(0.)]
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from functrans.extend import RUNNING_NODE, handover_call

__all__ = ["FlatFunction", "flat_function"]

_LITERALS = (int, float, bool, str, type(None))


class _Emitter:
    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.names: dict[fx.Node, str] = {}
        self.globals: dict[str, Any] = {}
        self.ids: dict[int, str] = {}

    def bind(self, value: Any, prefix: str) -> str:
        """A global name for ``value`` (one per distinct object)."""
        key = id(value)
        if key not in self.ids:
            self.ids[key] = f"{prefix}{len(self.ids)}"
            self.globals[self.ids[key]] = value
        return self.ids[key]

    def arg(self, x: Any) -> str:
        if isinstance(x, fx.Node):
            return self.names[x]
        if isinstance(x, list):
            return f"[{', '.join(self.arg(y) for y in x)}]"
        if isinstance(x, tuple):
            return f"({''.join(self.arg(y) + ', ' for y in x)})"
        if isinstance(x, _LITERALS) and not (isinstance(x, float) and not math.isfinite(x)):
            return repr(x)
        return self.bind(x, "c")  # dtypes, devices, inf, ...


def _last_uses(graph: fx.Graph) -> dict[fx.Node, list[fx.Node]]:
    """For each node, the values whose last use it is."""
    last: dict[fx.Node, fx.Node] = {}
    for n in graph.nodes:
        for a in n.all_input_nodes:
            last[a] = n
    dies: dict[fx.Node, list[fx.Node]] = {}
    for a, n in last.items():
        dies.setdefault(n, []).append(a)
    return dies


@dataclass(frozen=True)
class FlatFunction:
    """A graph as one generated Python function of a list of inputs (see the module
    docstring); ``source`` is its code. Called with ``*args`` it runs on a list of them.

    An error an op raises gets a note naming the node that ran it (as the native executor
    adds to its message), which ``jit`` turns into the user's line:

    >>> import torch, functrans as ft
    >>> g = ft.trace(lambda x, i: x.index_select(0, i))(torch.ones(3), torch.tensor([0]))
    >>> try:
    ...     flat_function(g.graph_module)(torch.ones(3), torch.tensor([5]))
    ... except IndexError as e:
    ...     print(e.__notes__)
    ['functrans: while running node index_select']
    """

    run: Callable[[list[Any]], list[Any]]
    source: str
    #: per line of ``source`` (from 1), the node it runs (None: bookkeeping)
    nodes: tuple[str | None, ...] = ()

    def call_boxed(self, args: list[Any]) -> list[Any]:
        try:
            return self.run(args)
        except Exception as e:
            self._name_node(e)
            raise

    def __call__(self, *args: Any) -> list[Any]:
        return self.call_boxed(list(args))

    def _name_node(self, e: BaseException) -> None:
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code is not self.run.__code__:
            tb = tb.tb_next
        if tb is None or not 1 <= tb.tb_lineno <= len(self.nodes):
            return
        name = self.nodes[tb.tb_lineno - 1]
        if name is not None:
            e.add_note(f"{RUNNING_NODE} {name}")


def flat_function(gm: fx.GraphModule) -> FlatFunction:
    """``gm`` as a flat function of a list of its placeholders (which it empties) returning
    its outputs as a list."""
    e = _Emitter(gm)
    params: list[str] = []
    body: list[str] = []
    ran: list[str | None] = []  # per line of body: the node it runs
    dies = _last_uses(gm.graph)
    for i, n in enumerate(gm.graph.nodes):
        if n.op == "placeholder":
            e.names[n] = f"a{len(params)}"
            params.append(e.names[n])
            continue
        if n.op == "output":
            outs = n.args[0]
            seq = outs if isinstance(outs, (list, tuple)) else [outs]
            body.append(f"return [{', '.join(e.arg(o) for o in seq)}]")
            continue
        e.names[n] = f"v{i}"
        ran += [None] * (len(body) - len(ran))
        start = len(body)
        if n.op == "get_attr":
            body.append(f"v{i} = {e.bind(_attr(gm, str(n.target)), 'c')}")
        elif (fn := handover_call(n)) is not None:  # its dying inputs die inside the call
            body.append(f"l{i} = {e.arg(n.args[1])}")
            dead = [e.names[a] for a in dies.get(n, [])]
            body += [f"del {', '.join(dead)}"] if dead else []
            body.append(f"v{i} = {e.bind(_tensors, 't')}({e.bind(fn, 'h')}(l{i}), {n.name!r})")
            body.append(f"del l{i}")
            ran += [n.name] * (len(body) - start)
            continue
        elif n.op == "call_function" and n.target is operator.getitem and not n.kwargs:
            body.append(f"v{i} = {e.arg(n.args[0])}[{e.arg(n.args[1])}]")
        elif n.op == "call_function":
            args = [e.arg(a) for a in n.args]
            args += [f"{k}={e.arg(v)}" for k, v in n.kwargs.items()]
            body.append(f"v{i} = {e.bind(n.target, 'f')}({', '.join(args)})")
        else:
            raise NotImplementedError(f"{n.op} node {n.name} in a flat function")
        ran += [n.name] * (len(body) - start)
        dead = [e.names[a] for a in dies.get(n, [])]
        if dead:
            body.append(f"del {', '.join(dead)}")
    unpack = [f"({''.join(p + ', ' for p in params).rstrip()}) = args"] if params else []
    unused = [e.names[n] for n in gm.graph.nodes if n.op == "placeholder" and not n.users]
    head = [*unpack, "args.clear()", *([f"del {', '.join(unused)}"] if unused else [])]
    lines = [*head, *body]
    source = "def run(args):\n" + "".join(f"    {line}\n" for line in lines)
    namespace = dict(e.globals)
    exec(compile(source, f"<functrans flat {id(gm):x}>", "exec"), namespace)
    ran += [None] * (len(body) - len(ran))
    nodes = (None, *([None] * len(head)), *ran)  # line 1 is the def
    return FlatFunction(namespace["run"], source.rstrip("\n"), nodes)


def _tensors(results: Any, node: str) -> list[torch.Tensor]:
    """A handed-over call's results: a list of tensors, as the native executor requires
    (anything else would reach the next op, or the caller, unchecked)."""
    out = list(results)
    for r in out:
        if not isinstance(r, torch.Tensor):
            raise RuntimeError(f"functrans: node {node} returned a non-tensor: {type(r)}")
    return out


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
