"""Write a copy where its reader wants it: a pure pass run before fusion.

``clone(view(permute(v)))`` makes the permuted ``v`` contiguous, usually so that a matmul can
read it. When ``v`` is computed by a kernel, a separate kernel that only copies it is a waste:
the kernel computing ``v`` can write it once with the strides that make the view chain
contiguous. So the clone becomes ``copy_strided(v, strides)`` (a pointwise copy that fuses into
``v``'s kernel and stores with those strides) followed by the same views, which are now free.

>>> import torch, functrans as ft
>>> g = ft.trace(lambda x: (x * 2).transpose(0, 1).contiguous())(torch.ones(2, 3))
>>> [n.target.__name__ for n in relayout(g.graph_module).graph.nodes if n.op == "call_function"]
['mul.Tensor', 'copy_strided.default', 'permute.default']
"""

from __future__ import annotations

import torch
import torch.fx as fx

from functrans.codegen._fastcall import copy_module
from functrans.codegen._peephole import permutation

from .fusion import lowerable
from .regions import is_view_op
from .traced import traced_value

__all__ = ["relayout"]

aten, prims = torch.ops.aten, torch.ops.prims
_PERMUTES = (aten.permute.default, aten.transpose.int, aten.t.default)
_RESHAPES = (
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.unsqueeze.default,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
)


def _chain(clone: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """``(v, [views from v to the clone's input])`` when the clone copies views of ``v``."""
    chain: list[fx.Node] = []
    x = clone.args[0]
    while isinstance(x, fx.Node) and x.target in (*_PERMUTES, *_RESHAPES):
        chain.append(x)
        x = x.args[0]
    if not chain or not isinstance(x, fx.Node) or not lowerable(x) or is_view_op(x):
        return None
    return x, list(reversed(chain))


def _strides(clone: fx.Node, v: fx.Node, chain: list[fx.Node]) -> list[int] | None:
    """Strides for ``v`` under which the views make it the clone's contiguous layout: undo the
    chain on a contiguous tensor of the clone's shape; None when a step cannot be undone."""
    cur = torch.empty(tuple(traced_value(clone).shape), device="meta")
    for view, src in zip(reversed(chain), reversed([v, *chain[:-1]]), strict=True):
        try:
            if view.target in _PERMUTES:
                order = permutation(view)
                assert order is not None, f"{view.name}: a permute of unknown rank"
                cur = cur.permute(sorted(range(len(order)), key=order.__getitem__))
            else:
                cur = cur.view(tuple(traced_value(src).shape))
        except RuntimeError:  # a reshape that splits dims the permutes interleaved
            return None
    out = torch.empty_strided(tuple(traced_value(v).shape), cur.stride(), device="meta")
    for view in chain:  # check: replaying the views gives the clone's contiguous layout
        args = [out, *view.args[1:]]
        out = view.target(*args, **view.kwargs)  # type: ignore[operator]  # fx types target as str | Callable; here it is an op
    want = traced_value(clone)
    if tuple(out.shape) != tuple(want.shape) or tuple(out.stride()) != tuple(want.stride()):
        return None
    return list(cur.stride())


def _alias_views(base: fx.Node) -> None:
    """Recompute the traced values of views of ``base`` (views of views, ...) from its value,
    so that they alias its storage as the real tensors will (fusion reads views in place)."""
    todo = [u for u in base.users if is_view_op(u) and u.args[0] is base]
    while todo:
        view = todo.pop()
        args = [traced_value(a) if isinstance(a, fx.Node) else a for a in view.args]
        view.meta["val"] = view.target(*args, **view.kwargs)  # type: ignore[operator]  # fx types target as str | Callable; here it is an op
        todo.extend(u for u in view.users if is_view_op(u) and u.args[0] is view)


def relayout(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with each contiguous copy of views of a computed value replaced by that value
    written in the copy's layout and viewed (``gm`` itself when nothing changes)."""
    todo = []
    for c in gm.graph.nodes:
        if c.op != "call_function" or c.target is not aten.clone.default:
            continue
        if not isinstance(traced_value(c), torch.Tensor) or not traced_value(c).is_contiguous():
            continue
        found = _chain(c)
        if found is not None and (strides := _strides(c, *found)) is not None:
            todo.append((c, found[0], found[1], strides))
    rewritten = {c for c, *_ in todo}  # a copy of a copy stays a copy: its source is a view
    todo = [t for t in todo if t[1] not in rewritten]
    if not todo:
        return gm
    env: dict[fx.Node, fx.Node] = {}
    out = copy_module(gm, env)
    graph = out.graph
    for c, v, chain, strides in todo:
        c, v, chain = env[c], env[v], [env[n] for n in chain]
        with graph.inserting_before(c):
            x = graph.call_function(prims.copy_strided.default, (v, strides))
            x.meta = {**c.meta, "val": prims.copy_strided.default(traced_value(v), strides)}
            for view in chain:
                y = graph.call_function(view.target, (x, *view.args[1:]), dict(view.kwargs))  # type: ignore[arg-type]  # fx's Argument type does not admit a tuple of Any
                val = view.target(traced_value(x), *view.args[1:], **view.kwargs)  # type: ignore[operator]  # fx types target as str | Callable; here it is an op
                y.meta = {**c.meta, "val": val}
                x = y
        c.replace_all_uses_with(x)
        graph.erase_node(c)
        _alias_views(x)
        for view in reversed(chain):  # the old views, when nothing else reads them
            if not view.users:
                graph.erase_node(view)
    out.recompile()
    return out
