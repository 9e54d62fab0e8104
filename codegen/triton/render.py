"""One fused :class:`~functrans.codegen.triton.regions.Kernel` -> Triton source text.

Pointwise kernels run one program per ``XBLOCK`` elements of their iteration space. Kernels with
reductions run one program per ``XBLOCK`` rows: when a row fits in one block (``RBLOCK`` >= the
reduced size, up to ``persistent_limit``) the kernel is *persistent* and computes each value
once; otherwise each reduction loops over the row in ``RBLOCK`` chunks, recomputing the
row-shaped values it needs from memory in every loop. Every load and store is masked on the
ragged edge. Floating values are computed in float32 (float64 stays float64) and stored in the
value's own dtype. Index arithmetic uses the strides the trace recorded, so views, permutes and
broadcasts cost nothing.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from functrans.extend import nbytes

from .layout import FDims, operand_fdims
from .lowering import (
    LOWERINGS,
    REDUCTIONS,
    compute_dtype,
    literal,
    pointer_type,
    triton_dtype,
)
from .reduce import Reductions, _tl, as_dtype
from .regions import Access, Kernel, is_slice
from .shifted import ShiftedReads
from .traced import first_output

__all__ = ["Rendered", "render"]

_HEADER = "import triton\nimport triton.language as tl\n\n\n@triton.jit\n"


@dataclass(frozen=True)
class Rendered:
    """Source and launch facts of one kernel."""

    name: str
    source: str
    signature: dict[str, str]
    constexprs: dict[str, int]
    inputs: tuple[fx.Node, ...]  # roots whose buffers are passed, in parameter order
    outputs: tuple[fx.Node, ...]
    grid: tuple[int, ...]
    read_bytes: int  # estimated global-memory traffic: distinct elements loaded ...
    write_bytes: int  # ... and stored


def _pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


class _Emitter(Reductions, ShiftedReads):
    def __init__(
        self,
        k: Kernel,
        access: dict[fx.Node, Access],
        inline: frozenset[fx.Node],
        persistent_limit: int,
        max_block: int,
    ) -> None:
        self.k, self.access, self.inline = k, access, inline
        self.members = set(k.nodes)
        self.xdims = [d for d in range(len(k.space)) if d not in k.rdims]
        self.rdims = sorted(k.rdims)
        self.xnumel = math.prod(k.space[d] for d in self.xdims)
        self.rnumel = math.prod(k.space[d] for d in self.rdims)
        self.reduce = bool(self.rdims)
        self.persistent = not self.reduce or _pow2(self.rnumel) <= persistent_limit
        small = min(128, max_block, _pow2(self.rnumel))
        self.rblock = _pow2(self.rnumel) if self.persistent else small
        if not self.reduce:
            self.xblock = min(max_block, _pow2(self.xnumel))
        elif self.persistent:
            self.xblock = max(1, min(_pow2(self.xnumel), 4096 // self.rblock, max_block))
        else:
            self.xblock = min(8, _pow2(self.xnumel))
        self.lines: list[str] = []
        self.params: dict[fx.Node, str] = {}
        self.top: dict[Any, str] = {}  # x-level values (and everything when persistent)
        self.loop: dict[Any, str] | None = None  # row-level values of the current loop
        self.counter = 0
        self.reads: dict[fx.Node, set[tuple[Any, ...]]] = {}
        self.one = "[1, 1]" if self.reduce else "[1]"  # a one-element block of the kernel's rank
        self.shift: dict[int, str] = {}  # space dim -> index expression, in a concat piece
        self.piece_mask: str | None = None  # where the current concat piece is valid

    # -- names and index arithmetic ----------------------------------------------------------
    def fresh(self) -> str:
        self.counter += 1
        return f"tmp{self.counter - 1}"

    def emit(self, line: str) -> None:
        self.lines.append(
            ("        " if self.loop is not None and not self.persistent else "    ") + line
        )

    def index(self, d: int) -> str:
        if d in self.shift:  # inside a concat piece: read at the shifted index
            return self.shift[d]
        return f"{'r' if d in self.k.rdims else 'x'}{d}"

    def index_lines(self, dims: list[int], base: str) -> list[str]:
        out, stride = [], 1
        sizes = {d: self.k.space[d] for d in dims}
        for pos, d in reversed(list(enumerate(dims))):
            if sizes[d] != 1:
                expr = base if stride == 1 else f"({base} // {stride})"
                if pos > 0:
                    expr = f"{expr} % {sizes[d]}"
                out.append(f"{self.index(d)} = {expr}")
            stride *= sizes[d]
        return list(reversed(out))

    def level(self, fdims: Sequence[int | None]) -> tuple[bool, bool]:
        """(depends on x, depends on r)."""
        xs = any(f is not None and f not in self.k.rdims for f in fdims)
        rs = any(f is not None and f in self.k.rdims for f in fdims)
        return xs, rs

    def mask(self, fdims: Sequence[int | None]) -> str | None:
        xs, rs = self.level(fdims)
        parts = (["xmask"] if xs else []) + (["rmask"] if rs else [])
        return " & ".join(parts) or None

    def address(self, acc: Access, fdims: Sequence[int | None]) -> str:
        terms = [str(acc.offset)] if acc.offset else []
        for f, size, stride in zip(fdims, acc.shape, acc.strides, strict=True):
            if f is not None and size != 1 and stride != 0:
                terms.append(self.index(f) if stride == 1 else f"{stride} * {self.index(f)}")
        return " + ".join(terms) or "0"

    def param(self, root: fx.Node, prefix: str) -> str:
        if root not in self.params:
            self.params[root] = (
                f"{prefix}_ptr{sum(p.startswith(prefix) for p in self.params.values())}"
            )
        return self.params[root]

    # -- values ------------------------------------------------------------------------------
    def cache_for(self, fdims: Sequence[int | None]) -> dict[Any, str]:
        _, rs = self.level(fdims)
        return self.loop if (rs and self.loop is not None) else self.top

    def load(self, a: fx.Node, fdims: tuple[int | None, ...]) -> str:
        acc = self.access[a]
        fdims = tuple(  # only dims that move the address index the load (and mask it)
            f if s != 1 and st != 0 else None
            for f, s, st in zip(fdims, acc.shape, acc.strides, strict=True)
        )
        key = (acc.root, acc.offset, acc.strides, fdims)
        cache = self.cache_for(fdims)
        if key in cache:
            return cache[key]
        ptr = self.param(acc.root, "in")
        used = [
            (s, st) for f, s, st in zip(fdims, acc.shape, acc.strides, strict=True) if f is not None
        ]
        self.reads.setdefault(acc.root, set()).add((acc.offset, tuple(used)))
        mask = self.mask(fdims)
        if self.piece_mask is not None:
            mask = self.piece_mask if mask is None else f"{mask} & {self.piece_mask}"
        dtype = first_output(a).dtype
        other = "" if mask is None else f", {mask}, other=0"
        name = self.fresh()
        address = self.address(acc, fdims)
        if self.piece_mask is not None and all(f is None for f in fdims):
            address += " + 0 * xindex"  # a block of pointers for the piece's block mask
        expr = f"tl.load({ptr} + ({address}){other})"
        if compute_dtype(dtype) != dtype:
            expr += f".to({_tl(dtype)})"
        self.emit(f"{name} = {expr}")
        cache[key] = name
        return name

    def operand_fdims(self, n: fx.Node, a: fx.Node) -> tuple[int | None, ...]:
        """How the external value ``a`` maps onto the space where ``n`` reads it."""
        fa = operand_fdims(a, n, self.k.fdims[n], self.k.space)
        assert fa is not None, f"{a.name} has no place in {n.name}'s iteration space"
        return fa

    def value(self, n: fx.Node) -> str:
        fd = self.k.fdims[n]
        cache = self.cache_for(fd)
        if n in cache:
            return cache[n]
        if n.target is operator.getitem:
            name = self.value_parts(n.args[0])[int(n.args[1])]  # type: ignore[arg-type, call-overload]
            cache[n] = name
            return name
        low = LOWERINGS[n.target]
        if low.kind == "reduction":
            return self.value_parts(n)[0]
        if low.kind == "concat":
            name = self.concat(n, fd)
            cache[n] = name
            return name
        src = n.args[0]
        if low.kind == "reshape" and src not in self.members and src not in self.inline:
            name = self.load(n, fd)  # a view of a value in memory: read in place
            cache[n] = name
            return name
        name = self.compute(n, fd, lambda a: self.operand(n, a))
        cache[n] = name
        return name

    def compute(self, n: fx.Node, fd: FDims, get: Any) -> str:
        """Emit pointwise/index node ``n`` (dim map ``fd``) from its operands' names."""
        low = LOWERINGS[n.target]
        out_dtype = first_output(n).dtype
        args: list[Any] = []
        tensor_pos = 0
        for a in n.args:
            if isinstance(a, fx.Node):
                v = get(a)
                cast = low.cast == "out" or (low.cast == "values" and tensor_pos > 0)
                if cast and compute_dtype(first_output(a).dtype) != compute_dtype(out_dtype):
                    v = f"{v}.to({_tl(out_dtype)})"
                elif low.cast == "promote":
                    v = f"{v}.to({_tl(_promote(n))})"
                tensor_pos += 1
                args.append(v)
            else:
                args.append(a)
        if "alpha" in n.kwargs:
            args.append(n.kwargs["alpha"])
        expr = self.index_value(n, fd, args) if low.kind == "index" else low.render(args)
        name = self.fresh()
        if low.kind == "reshape":
            self.emit(f"{name} = {expr}")
        else:
            self.emit(f"{name} = {as_dtype(expr, out_dtype)}")
        return name

    def inline_value(self, a: fx.Node, fa: FDims) -> str:
        """A value recomputed where it is read (an ``arange`` chain, a concat's piece, ...)."""
        cache = self.cache_for(fa)
        key = ("inline", a, fa)
        if key not in cache and is_slice(a):
            cache[key] = self.sliced(a, fa)
        if key not in cache and LOWERINGS[a.target].kind == "concat":
            cache[key] = self.concat(a, fa)
        if key not in cache:
            cache[key] = self.compute(a, fa, lambda b: self.read(a, fa, b))
        return cache[key]

    def read(self, n: fx.Node, fd: FDims, a: fx.Node) -> str:
        """Operand ``a`` of ``n`` (dim map ``fd``) from outside the kernel's members."""
        fa = operand_fdims(a, n, fd, self.k.space)
        assert fa is not None, f"{a.name} has no place in {n.name}'s iteration space"
        return self.inline_value(a, fa) if a in self.inline else self.load(a, fa)

    def index_value(self, n: fx.Node, fd: FDims, args: list[Any]) -> str:
        dtype = _tl(first_output(n).dtype)
        if n.target is torch.ops.aten.arange.start_step:
            f = fd[0]
            if f is None:  # one element: the start
                return f"tl.full({self.one}, {literal(args[0])}, {dtype})"
            step = literal(args[2] if len(args) > 2 else 1)
            return f"({literal(args[0])} + {self.index(f)} * {step})"
        return f"tl.full({self.one}, {LOWERINGS[n.target].render(args)}, {dtype})"

    def operand(self, n: fx.Node, src: fx.Node) -> str:
        if src in self.members:
            return self.value(src)
        if src in self.inline:
            return self.inline_value(src, self.operand_fdims(n, src))
        return self.load(src, self.operand_fdims(n, src))

    def store(self, n: fx.Node) -> None:
        acc = self.access[n]
        ptr = self.param(n, "out")
        v = self.value(n)
        fd = self.k.fdims[n]
        mask = self.mask(fd)
        address = self.address(acc, fd)
        if mask is None:  # one element: a block of pointers to it, so block values store
            address, mask = f"{address} + 0 * xindex", "xmask"
        dtype = triton_dtype(first_output(n).dtype)
        self.emit(f"tl.store({ptr} + ({address}), {v}.to({dtype}), {mask})")


def _promote(n: fx.Node) -> torch.dtype:
    vals: list[Any] = [a.meta["val"] if isinstance(a, fx.Node) else a for a in n.args]
    dtype = torch.result_type(vals[0], vals[1]) if len(vals) >= 2 else vals[0].dtype
    return compute_dtype(dtype)


def _name(k: Kernel, index: int) -> str:
    ops: list[str] = []
    for n in k.nodes:
        op = getattr(n.target, "__name__", "").split(".")[0]
        if op and op not in ops and op not in ("view", "unsqueeze", "expand", "squeeze"):
            ops.append(op)
    kind = "red" if k.rdims else "poi"
    return f"ft_{kind}_{'_'.join(ops[:3]) or 'copy'}_{index}"


def render(
    k: Kernel,
    access: dict[fx.Node, Access],
    index: int,
    inline: frozenset[fx.Node] = frozenset(),
    persistent_limit: int = 1024,
    max_block: int = 1024,
) -> Rendered:
    """Triton source for kernel ``k`` (the ``index`` th of its graph): rows up to
    ``persistent_limit`` reduce in one block, blocks hold at most ``max_block`` elements per
    dim."""
    e = _Emitter(k, access, inline, persistent_limit, max_block)
    if e.reduce:
        e.emit("xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:, None]")
        e.emit(f"xmask = xindex < {e.xnumel}")
        e.emit("rbase = tl.arange(0, RBLOCK)[None, :]")
        if e.persistent:
            e.emit("rindex = rbase")
            e.emit(f"rmask = rindex < {e.rnumel}")
    else:
        e.emit("xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)")
        e.emit(f"xmask = xindex < {e.xnumel}")
    for line in e.index_lines(e.xdims, "xindex"):
        e.emit(line)
    if e.reduce and e.persistent:
        for line in e.index_lines(e.rdims, "rindex"):
            e.emit(line)
    for n in k.nodes:  # reductions first, in order: their loops sit at the top level
        if n.target in REDUCTIONS:
            e.value_parts(n)
    rows = [s for s in k.stores if e.level(k.fdims[s])[1]]
    for s in k.stores:
        if s not in rows:
            e.store(s)
    if rows:
        if not e.persistent:
            for s in rows:
                e.prepare(s)
            e.open_loop()
        for s in rows:
            e.store(s)
        e.loop = None
    name = _name(k, index)
    inputs = tuple(r for r, p in e.params.items() if p.startswith("in"))
    outputs = tuple(r for r, p in e.params.items() if p.startswith("out"))
    params = [e.params[r] for r in (*inputs, *outputs)]
    constexprs = {"XBLOCK": e.xblock} | ({"RBLOCK": e.rblock} if e.reduce else {})
    head = ", ".join([*params, *(f"{c}: tl.constexpr" for c in constexprs)])
    body = "\n".join(e.lines)
    source = f"{_HEADER}def {name}({head}):\n{body}\n"
    signature = {e.params[r]: pointer_type(first_output(r).dtype) for r in (*inputs, *outputs)}
    grid = ((e.xnumel + e.xblock - 1) // e.xblock,)
    read = sum(_read_bytes(r, e.reads[r]) for r in inputs)
    written = sum(nbytes(first_output(o)) for o in outputs)
    return Rendered(name, source, signature, constexprs, inputs, outputs, grid, read, written)


def _read_bytes(root: fx.Node, accesses: set[tuple[Any, ...]]) -> int:
    """Bytes of ``root`` the loads touch: each access's distinct elements (broadcast dims
    once), summed over accesses and capped at the buffer's size."""
    v = first_output(root)
    total = 0
    for _, dims in accesses:
        total += math.prod(s for s, st in dims if st != 0 and s != 1)
    return min(total, int(v.numel())) * int(v.element_size())
