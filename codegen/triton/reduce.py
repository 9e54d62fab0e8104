"""Reductions inside a kernel, the part of rendering that spans a row.

A kernel with reductions runs one program per ``XBLOCK`` rows. When a row fits in one block the
kernel is *persistent*: the row's values are computed once and each reduction is one
``tl.sum``/``tl.max`` over the block. Otherwise each reduction loops over the row in ``RBLOCK``
chunks with an accumulator, recomputing the row values it needs from memory in every loop
(row-independent values are emitted once, before the loop: :meth:`Reductions.prepare`).
``var``/``var_mean`` take two passes (mean, then squared deviations), which is exact where
one-pass formulas cancel.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from .layout import FDims
from .lowering import LOWERINGS, REDUCTIONS, compute_dtype, literal, triton_dtype
from .regions import Kernel
from .traced import first_output

__all__ = ["Reductions"]


def _tl(dtype: torch.dtype) -> str:
    return triton_dtype(compute_dtype(dtype))


def as_dtype(expr: str, dtype: torch.dtype) -> str:
    """``expr`` as a value of ``dtype``, held in its compute dtype. Half types are rounded to
    ``dtype`` first, as eager rounds every op's result: a recomputed value must equal the
    stored one bit for bit (``eq`` against a saved ``amax``, a clamp at its bound)."""
    if compute_dtype(dtype) != dtype:
        return f"({expr}).to({triton_dtype(dtype)}).to({_tl(dtype)})"
    return f"({expr}).to({_tl(dtype)})"


def _correction(n: fx.Node) -> float:
    corr: Any = n.kwargs.get("correction", 1)
    return 1.0 if corr is None else float(corr)


class Reductions:
    """The reduction half of the kernel emitter (``render._Emitter`` provides the rest)."""

    k: Kernel
    members: set[fx.Node]
    inline: frozenset[fx.Node]
    top: dict[Any, str]
    loop: dict[Any, str] | None
    persistent: bool
    reduce: bool
    rnumel: int
    rdims: list[int]

    def fresh(self) -> str:
        raise NotImplementedError

    def emit(self, line: str) -> None:
        raise NotImplementedError

    def value(self, n: fx.Node) -> str:
        raise NotImplementedError

    def operand(self, n: fx.Node, src: fx.Node) -> str:
        raise NotImplementedError

    def operand_fdims(self, n: fx.Node, a: fx.Node) -> FDims:
        raise NotImplementedError

    def level(self, fdims: FDims) -> tuple[bool, bool]:
        raise NotImplementedError

    def index_lines(self, dims: list[int], base: str) -> list[str]:
        raise NotImplementedError

    def value_parts(self, n: fx.Node) -> list[str]:
        """The outputs of reduction ``n`` (var_mean has two), computed at the top level."""
        key = ("parts", n)
        if key in self.top:
            return self.top[key]  # type: ignore[return-value]
        _, combine = REDUCTIONS[n.target]
        src = n.args[0]
        assert isinstance(src, fx.Node)
        acc_t = _tl(first_output(n).dtype)
        parts: list[str]
        if not self.reduce:  # reduces only size-1 dims: each output is its one input element
            v = self.operand(n, src)
            var = self.top_line(f"({v} - {v}) / {literal(float(1 - _correction(n)))}")
            parts = {"var_mean": [var, v], "var": [var]}.get(combine, [v])
            self.top[key] = parts  # type: ignore[assignment]
            return parts
        if combine in ("max", "min"):
            self.top[key] = [self.extreme(n, src, combine, acc_t)]  # type: ignore[assignment]
            return self.top[key]  # type: ignore[return-value]
        total = self.sum_rows(n, src, lambda v: v, acc_t)
        if combine in ("sum", "mean"):
            parts = [total if combine == "sum" else self.top_line(f"{total} / {self.rnumel}")]
        else:  # var_mean / var: two passes, mean then squared deviations
            mean = self.top_line(f"{total} / {self.rnumel}")
            m2 = self.sum_rows(n, src, lambda v: f"({v} - {mean}) * ({v} - {mean})", acc_t)
            var = self.top_line(f"{m2} / {literal(float(self.rnumel - _correction(n)))}")
            parts = [var, mean] if combine == "var_mean" else [var]
        dtype = first_output(n).dtype
        if compute_dtype(dtype) != dtype:  # rounded like eager's result
            parts = [self.top_line(as_dtype(p, dtype)) for p in parts]
        self.top[key] = parts  # type: ignore[assignment]
        return parts

    def top_line(self, expr: str) -> str:
        name = self.fresh()
        self.emit(f"{name} = {expr}")
        return name

    def sum_rows(self, n: fx.Node, src: fx.Node, f: Any, acc_t: str) -> str:
        return self.row_reduce(n, src, lambda v: f(v), "0", "tl.sum", "{a} + {v}", acc_t)

    def extreme(self, n: fx.Node, src: fx.Node, kind: str, acc_t: str) -> str:
        fill = 'float("-inf")' if kind == "max" else 'float("inf")'
        fn = "tl.maximum" if kind == "max" else "tl.minimum"
        return self.row_reduce(n, src, lambda v: v, fill, f"tl.{kind}", fn + "({a}, {v})", acc_t)

    def row_reduce(
        self, n: fx.Node, src: fx.Node, f: Any, fill: str, reduce: str, combine: str, acc_t: str
    ) -> str:
        shape = "[XBLOCK, RBLOCK]"
        if self.persistent:
            v = f(self.operand(n, src))
            masked = self.top_line(f"tl.where(rmask, tl.broadcast_to({v}, {shape}), {fill})")
            return self.top_line(f"{reduce}({masked}, 1)[:, None]")
        self.prepare(src)
        acc = self.top_line(f"tl.full({shape}, {fill}, {acc_t})")
        self.open_loop()
        v = f(self.operand(n, src))
        step = combine.format(a=acc, v=f"tl.broadcast_to({v}, {shape})")
        self.emit(f"{acc} = tl.where(rmask, {step}, {acc})")
        self.loop = None
        return self.top_line(f"{reduce}({acc}, 1)[:, None]")

    def open_loop(self) -> None:
        self.emit(f"for roffset in range(0, {self.rnumel}, RBLOCK):")
        self.loop = {}
        self.emit("rindex = roffset + rbase")
        self.emit(f"rmask = rindex < {self.rnumel}")
        for line in self.index_lines(self.rdims, "rindex"):
            self.emit(line)

    def prepare(self, n: fx.Node) -> None:
        """Emit at the top level every row-independent value a loop over ``n`` will need."""
        if n not in self.members:
            return
        _, rs = self.level(self.k.fdims[n])
        if not rs or n.target in REDUCTIONS or n.target is operator.getitem:
            self.value(n)
            return
        src = n.args[0]
        if LOWERINGS[n.target].kind == "reshape" and src not in self.members | self.inline:
            return  # loaded itself, inside the loop
        for a in n.all_input_nodes:
            if a in self.members:
                self.prepare(a)
            else:
                fd = self.operand_fdims(n, a)
                if not self.level(fd)[1]:
                    self.operand(n, a)
