"""Reads at shifted indices, the part of the kernel emitter behind ``cat``, ``slice_scatter``
and slices of recomputed values (``render._Emitter`` provides the rest).

Inside :meth:`ShiftedReads.shifted` a space dim's index is replaced by an expression (the
piece's or slice's own index) and, for a concat piece, loads are masked to where the piece is
valid. Values computed there are not shared with the rest of the kernel.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.fx as fx

from .layout import FDims
from .lowering import concat_pieces
from .reduce import _tl
from .regions import slice_params
from .traced import first_output

__all__ = ["ShiftedReads"]


class ShiftedReads:
    """Concat pieces and slices, each read where its values sit in the kernel's space."""

    one: str
    shift: dict[int, str]  # space dim -> index expression, inside a piece or slice
    piece_mask: str | None  # where the current concat piece is valid
    top: dict[Any, str]
    loop: dict[Any, str] | None

    def index(self, d: int) -> str:
        raise NotImplementedError

    def read(self, n: fx.Node, fd: FDims, a: fx.Node) -> str:
        raise NotImplementedError

    def inline_value(self, a: fx.Node, fa: FDims) -> str:
        raise NotImplementedError

    def top_line(self, expr: str) -> str:
        raise NotImplementedError

    @contextmanager
    def shifted(self, f: int | None, expr: str, mask: str | None = None) -> Iterator[None]:
        """Read with space dim ``f`` at index ``expr`` (and loads masked by ``mask``)."""
        outer = (self.shift, self.piece_mask, self.top, self.loop)
        if f is not None:
            self.shift = {**self.shift, f: expr}
        if mask is not None:
            self.piece_mask = mask if outer[1] is None else f"{outer[1]} & {mask}"
        self.top, self.loop = {}, None  # values at shifted indices are not shared
        try:
            yield
        finally:
            self.shift, self.piece_mask, self.top, self.loop = outer

    def concat(self, n: fx.Node, fd: FDims) -> str:
        """``cat`` / ``slice_scatter``: each piece read at the index shifted by its start,
        where it is valid; elsewhere the next piece (or the base)."""
        dim, pieces, base = concat_pieces(n)
        f = fd[dim]
        idx = "0" if f is None else self.index(f)
        parts: list[tuple[str, str]] = []
        for a, start, size in pieces:
            if size == 0:
                continue  # an empty piece places nothing
            cond = f"(({idx} >= {start}) & ({idx} < {start + size}))"
            with self.shifted(f, f"({idx} - {start})" if start else idx, cond):
                parts.append((cond, self.read(n, fd, a)))
        if base is not None:
            expr = self.read(n, fd, base)
        elif parts:
            expr = parts.pop()[1]
        else:  # every piece is empty, and so is the result
            expr = f"tl.full({self.one}, 0, {_tl(first_output(n).dtype)})"
        for cond, v in reversed(parts):
            expr = f"tl.where({cond}, {v}, {expr})"
        return self.top_line(expr)

    def sliced(self, n: fx.Node, fd: FDims) -> str:
        """A slice of an inline value: the value computed at the index the slice starts and
        steps from (inside its bounds, so no mask)."""
        params, src = slice_params(n), n.args[0]
        assert params is not None and isinstance(src, fx.Node), f"{n.name}: not a slice"
        dim, start, step = params
        f = fd[dim]
        assert f is not None, f"{n.name}: slices a dim with no place in the kernel"
        idx = self.index(f) if step == 1 else f"{self.index(f)} * {step}"
        with self.shifted(f, f"({idx} + {start})" if start else idx):
            value = self.inline_value(src, fd)
        return self.top_line(value)
