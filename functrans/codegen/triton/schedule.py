"""Regions in an order that runs: every region after the regions it reads from.

Kernels read free views through their roots and index-only values through what those read, so
a region depends on the regions that produce what it loads. Random extern calls keep their
relative order, so a graph draws the same random numbers as the eager program it came from.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable

import torch.fx as fx

from functrans.extend import is_random

from .regions import Access, Extern, Kernel, Region, View, is_view_op

__all__ = ["order"]


def order(
    nodes: list[fx.Node],
    member: dict[fx.Node, Kernel],
    access: dict[fx.Node, Access],
    needs_tensor: set[fx.Node],
    inline: frozenset[fx.Node],
) -> list[Region]:
    """Regions in an order where every region's inputs are ready (a topological sort)."""
    region_of: dict[fx.Node, Region] = {}
    for n in nodes:
        if n in needs_tensor and n in access and access[n].root is not n:
            region_of[n] = View(n)  # a free view some extern or the output needs as a tensor
        elif n in member:
            region_of[n] = member[n]
        elif n.target is operator.getitem and n.args[0] in member:
            region_of[n] = member[n.args[0]]  # type: ignore[index]  # fx types args as Argument; here it is a Node
        elif is_view_op(n) and n in access and access[n].root is not n:
            pass  # read in place by the kernels that use it
        else:
            region_of[n] = Extern(n)
    regions = list(dict.fromkeys(region_of.values()))  # a kernel is the region of all its nodes
    deps: dict[Region, set[Region]] = {r: set() for r in regions}

    def producers(n: fx.Node, own: Kernel | None) -> Iterable[fx.Node]:
        for a in n.all_input_nodes:
            if own is not None and member.get(a) is own:
                continue  # computed inside the same kernel
            if a in member and a in access and access[a].root is not a:
                yield from producers(a, None)  # another kernel's view of memory: read in place
                if access[a].root in region_of:
                    yield access[a].root
            elif a in region_of:
                yield a
            elif a in inline:
                yield from producers(a, None)  # recomputed by the reader: its inputs count
            elif a in access and access[a].root is not a:
                yield from producers(a, None)  # a free view: what its root depends on
                if access[a].root in region_of:
                    yield access[a].root

    for n, r in region_of.items():
        own = r if isinstance(r, Kernel) else None
        for m in r.nodes if isinstance(r, Kernel) else [n]:
            for p in producers(m, own):
                pr = region_of[p]
                if pr is not r:
                    deps[r].add(pr)
    random = [r for r in regions if isinstance(r, Extern) and is_random(r.node)]
    for a, b in itertools.pairwise(random):  # random ops keep their order: same draws
        deps[b].add(a)
    ordered: list[Region] = []
    done: set[Region] = set()
    pending = list(regions)
    while pending:
        progress = [r for r in pending if deps[r] <= done]
        if not progress:
            stuck = [_describe(r) for r in pending]
            raise AssertionError(f"fusion produced a cycle among {stuck}")
        for r in progress:
            ordered.append(r)
            done.add(r)
        pending = [r for r in pending if r not in done]
    return ordered


def _describe(r: Region) -> str:
    return str([n.name for n in r.nodes][:3]) if isinstance(r, Kernel) else r.node.name
