"""Traced regions as JSON: what a stored joint trace whose region ops were kept
(``ft.jit``'s default, :mod:`functrans._jit.outline`) needs to compile them again.

A :class:`~functrans._trace.regions.graph.Region` is its joint graph (stored as a graph,
:mod:`functrans._jit.disk.graph_json`) and lists of that graph's nodes, stored by name, with
its output structure as torch's pytree JSON. A region that was not one (``None``: its block was
traced inline) stays ``None``.

>>> import torch, functrans as ft
>>> from functrans._trace.regions.graph import trace_region
>>> from torch._subclasses.fake_tensor import FakeTensorMode
>>> x = FakeTensorMode().from_tensor(torch.ones(3)).requires_grad_()
>>> r = trace_region(lambda xs: (xs[0].sin(),), [x], None)
>>> back = load([json.loads(json.dumps(d)) for d in dump([r, None])])
>>> [n.name for n in back[0].outputs], [n.name for n in back[0].tangents], back[1]
(['sin'], ['late_input'], None)
"""

from __future__ import annotations

import json
from typing import Any

import torch.fx as fx
import torch.utils._pytree as pytree

from functrans._core.graph import Graph
from functrans._core.pytree import flatten
from functrans._trace.regions.graph import Region

from . import graph_json
from .tree_json import CorruptEntry, NotStorable

__all__ = ["check_round_trip", "dump", "load"]


def _graph(r: Region) -> Graph:
    placeholders = [n for n in r.gm.graph.nodes if n.op == "placeholder"]
    vals = [n.meta.get("val") for n in placeholders]
    return Graph(r.gm, flatten(vals)[1], flatten([])[1])


def _names(nodes: list[fx.Node]) -> list[str]:
    return [n.name for n in nodes]


def dump(regions: list[Region | None]) -> list[Any]:
    """``regions`` as JSON-ready data; raises :class:`NotStorable`."""
    docs: list[Any] = []
    for r in regions:
        if r is None:
            docs.append(None)
            continue
        try:
            spec = pytree.treespec_dumps(r.out_spec)
        except Exception as e:  # an output type torch's pytree cannot write
            raise NotStorable(f"a region's output structure: {e}") from e
        docs.append(
            {
                "graph": graph_json.dump(_graph(r)),
                "primals": _names(r.primals),
                "tangents": _names(r.tangents),
                "forward": _names(r.forward),
                "backward": _names(r.backward),
                "outputs": _names(r.outputs),
                "read": _names(r.read),
                "grads": [[i, g.name] for i, g in r.grads],
                "differentiable": list(r.differentiable),
                "out_spec": spec,
                "writes": list(r.writes),
            }
        )
    return docs


def load(docs: list[Any], *, verify: bool = True) -> list[Region | None]:
    """The regions :func:`dump` described; raises :class:`CorruptEntry`."""
    regions: list[Region | None] = []
    for doc in docs:
        if doc is None:
            regions.append(None)
            continue
        gm = graph_json.load(doc["graph"], None, verify=verify).graph_module
        by_name = {n.name: n for n in gm.graph.nodes}

        def node(name: Any, by_name: dict[str, fx.Node] = by_name) -> fx.Node:
            try:
                return by_name[str(name)]
            except KeyError as e:
                raise CorruptEntry(f"a region names a node it does not hold: {e}") from e

        def nodes(key: str, doc: Any = doc) -> list[fx.Node]:
            return [node(name) for name in doc[key]]

        regions.append(
            Region(
                gm=gm,
                primals=nodes("primals"),
                tangents=nodes("tangents"),
                forward=nodes("forward"),
                backward=nodes("backward"),
                outputs=nodes("outputs"),
                read=nodes("read"),
                grads=[(int(i), node(g)) for i, g in doc["grads"]],
                differentiable=[bool(d) for d in doc["differentiable"]],
                out_spec=pytree.treespec_loads(str(doc["out_spec"])),
                writes=[int(i) for i in doc.get("writes", [])],
            )
        )
    return regions


def check_round_trip(docs: list[Any], regions: list[Region | None]) -> None:
    """Raise :class:`NotStorable` unless each region's graph decodes as it is (see
    :func:`functrans._jit.disk.graph_json.check_round_trip`)."""
    for doc, r in zip(json.loads(json.dumps(docs)), regions, strict=True):
        if r is not None:
            graph_json.check_round_trip(doc["graph"], _graph(r))
