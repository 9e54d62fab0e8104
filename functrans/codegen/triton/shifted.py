"""Reads at shifted indices: ``cat``, ``slice_scatter`` and slices of recomputed values.

Inside :meth:`Emitter.shifted <.emitter.Emitter.shifted>` a space dim's index is replaced by an
expression (the piece's or slice's own index) and, for a concat piece, loads are masked to where
the piece is valid. Values computed there are not shared with the rest of the kernel.

These are plain functions of an :class:`~.emitter.Emitter`; how to read a piece, or compute a
sliced value, the caller (:mod:`.render`) passes as a function.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.fx as fx

from .emitter import Emitter
from .layout import FDims
from .lowering import compute_triton_dtype, concat_pieces
from .regions import slice_params
from .traced import first_output

__all__ = ["concat", "sliced"]


def concat(em: Emitter, n: fx.Node, fd: FDims, read: Callable[[fx.Node], str]) -> str:
    """``cat`` / ``slice_scatter`` ``n`` (dim map ``fd``): each piece read (by ``read``) at the
    index shifted by its start, where it is valid; elsewhere the next piece (or the base)."""
    cat = concat_pieces(n)
    f = fd[cat.dim]
    idx = "0" if f is None else em.index(f)
    parts: list[tuple[str, str]] = []  # (where the piece is valid, its value)
    for piece in cat.pieces:
        if piece.size == 0:
            continue  # an empty piece places nothing
        start = piece.start
        cond = f"(({idx} >= {start}) & ({idx} < {start + piece.size}))"
        with em.shifted(f, f"({idx} - {start})" if start else idx, cond):
            parts.append((cond, read(piece.node)))
    if cat.base is not None:
        expr = read(cat.base)
    elif parts:
        expr = parts.pop()[1]
    else:  # every piece is empty, and so is the result
        expr = f"tl.full({em.geo.one}, 0, {compute_triton_dtype(first_output(n).dtype)})"
    for cond, v in reversed(parts):
        expr = f"tl.where({cond}, {v}, {expr})"
    return em.assign(expr)


def sliced(
    em: Emitter, n: fx.Node, fd: FDims, inline_value: Callable[[fx.Node, FDims], str]
) -> str:
    """A slice ``n`` (dim map ``fd``) of an inline value: the value computed (by
    ``inline_value``) at the index the slice starts and steps from (inside its bounds, so no
    mask)."""
    params, src = slice_params(n), n.args[0]
    assert params is not None and isinstance(src, fx.Node), f"{n.name}: not a slice"
    f = fd[params.dim]
    assert f is not None, f"{n.name}: slices a dim with no place in the kernel"
    idx = em.index(f) if params.step == 1 else f"{em.index(f)} * {params.step}"
    start = params.start
    with em.shifted(f, f"({idx} + {start})" if start else idx):
        value = inline_value(src, fd)
    return em.assign(value)
