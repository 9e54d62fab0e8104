"""One fused :class:`~functrans.codegen.triton.regions.Kernel` -> Triton source text.

Pointwise kernels run one program per ``XBLOCK`` elements of their iteration space. Kernels with
reductions run one program per ``XBLOCK`` rows: when a row fits in one block (``RBLOCK`` >= the
reduced size, up to ``persistent_limit``) the kernel is *persistent* and computes each value
once; otherwise each reduction loops over the row in ``RBLOCK`` chunks, recomputing the
row-shaped values it needs from memory in every loop. Every load and store is masked on the
ragged edge. Floating values are computed in float32 (float64 stays float64) and stored in the
value's own dtype. Index arithmetic uses the strides the trace recorded, so views, permutes and
broadcasts cost nothing.

This module walks the kernel's values: each member is computed from its operands (members,
loads of values in memory, or inline values recomputed where read) and the values other regions
read are stored. The lines go through an :class:`~.emitter.Emitter`; reductions are written by
:mod:`.reduce` and concat pieces and slices by :mod:`.shifted`.

>>> import torch, functrans as ft
>>> from functrans.codegen.triton.fusion import fuse
>>> g = ft.trace(lambda x: (x * 2).sum(-1))(torch.ones(4, 8))
>>> plan = fuse(g.graph_module.graph)
>>> out = render(plan.regions[0], plan.access, 0, plan.inline)
>>> out.name, out.grid, out.constexprs
('ft_red_mul_sum_0', (1,), {'XBLOCK': 4, 'RBLOCK': 8})
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from functrans.extend import nbytes

from .emitter import Emitter, InlineKey, Read, geometry
from .layout import FDims, operand_fdims
from .lowering import (
    LOWERINGS,
    REDUCTIONS,
    as_dtype,
    compute_dtype,
    compute_triton_dtype,
    literal,
    pointer_type,
    triton_dtype,
)
from .reduce import reduction
from .regions import Access, Kernel, is_slice
from .shifted import concat, sliced
from .traced import first_output

__all__ = ["Rendered", "render"]

_TL = "import triton.language as tl\n"
#: imported by kernels that call a libdevice function (others keep the plain header)
_LIBDEVICE = "from triton.language.extra import libdevice\n"
_HEADER = f"import triton\n{_TL}\n\n@triton.jit\n"


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


def render(
    k: Kernel,
    access: Mapping[fx.Node, Access],
    index: int,
    inline: frozenset[fx.Node] = frozenset(),
    persistent_limit: int = 1024,
    max_block: int = 1024,
) -> Rendered:
    """Triton source for kernel ``k`` (the ``index`` th of its graph): rows up to
    ``persistent_limit`` reduce in one block, blocks hold at most ``max_block`` elements per
    dim."""
    geo = geometry(k, persistent_limit, max_block)
    em = Emitter(k, access, inline, geo)
    _prologue(em)
    for n in k.nodes:  # reductions first, in order: their loops sit at the top level
        if n.target in REDUCTIONS:
            reduction_parts(em, n)
    rows = [s for s in k.stores if em.varies_reduced(k.fdims[s])]
    for s in k.stores:
        if s not in rows:
            store(em, s)
    if rows:
        if not geo.persistent:
            for s in rows:
                prepare(em, s)
            em.open_loop()
        for s in rows:
            store(em, s)
        em.close_loop()
    name = _name(k, index)
    inputs = tuple(r for r, p in em.params.items() if p.startswith("in"))
    outputs = tuple(r for r, p in em.params.items() if p.startswith("out"))
    params = [em.params[r] for r in (*inputs, *outputs)]
    constexprs = {"XBLOCK": geo.xblock} | ({"RBLOCK": geo.rblock} if geo.reduce else {})
    head = ", ".join([*params, *(f"{c}: tl.constexpr" for c in constexprs)])
    body = "\n".join(em.lines)
    header = _HEADER if "libdevice." not in body else _HEADER.replace(_TL, _TL + _LIBDEVICE)
    source = f"{header}def {name}({head}):\n{body}\n"
    signature = {em.params[r]: pointer_type(first_output(r).dtype) for r in (*inputs, *outputs)}
    grid = ((geo.xnumel + geo.xblock - 1) // geo.xblock,)
    read = sum(_read_bytes(r, em.reads[r]) for r in inputs)
    written = sum(nbytes(first_output(o)) for o in outputs)
    return Rendered(name, source, signature, constexprs, inputs, outputs, grid, read, written)


def _prologue(em: Emitter) -> None:
    """The program's rows (and, when persistent, row elements) and their masks and indices."""
    geo = em.geo
    if geo.reduce:
        em.emit("xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:, None]")
        em.emit(f"xmask = xindex < {geo.xnumel}")
        em.emit("rbase = tl.arange(0, RBLOCK)[None, :]")
        if geo.persistent:
            em.emit("rindex = rbase")
            em.emit(f"rmask = rindex < {geo.rnumel}")
    else:
        em.emit("xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)")
        em.emit(f"xmask = xindex < {geo.xnumel}")
    for line in em.index_lines(geo.xdims, "xindex"):
        em.emit(line)
    if geo.reduce and geo.persistent:
        for line in em.index_lines(geo.rdims, "rindex"):
            em.emit(line)


# -- values ----------------------------------------------------------------------------------


def value(em: Emitter, n: fx.Node) -> str:
    """Member ``n`` of the kernel, computed once per scope."""
    fd = em.k.fdims[n]
    cache = em.values(fd)
    if n in cache:
        return cache[n]
    if n.target is operator.getitem:  # one output of a reduction
        name = reduction_parts(em, n.args[0])[int(n.args[1])]  # type: ignore[arg-type]  # getitem's args: a Node and an int
        cache[n] = name
        return name
    low = LOWERINGS[n.target]
    if low.kind == "reduction":
        return reduction_parts(em, n)[0]
    src = n.args[0]
    if low.kind == "concat":
        name = concat(em, n, fd, lambda a: read(em, n, fd, a))
    elif low.kind == "reshape" and src not in em.members and src not in em.inline:
        name = em.load(n, fd)  # a view of a value in memory: read in place
    else:
        name = compute(em, n, fd, lambda a: operand(em, n, a))
    cache[n] = name
    return name


def reduction_parts(em: Emitter, n: fx.Node) -> list[str]:
    """The outputs of reduction ``n``, computed once (at the top level)."""
    parts = em.scope.reductions.get(n)
    if parts is None:
        src = n.args[0]
        assert isinstance(src, fx.Node)
        parts = reduction(em, n, lambda: operand(em, n, src), lambda: prepare(em, src))
        em.scope.reductions[n] = parts
    return parts


def compute(em: Emitter, n: fx.Node, fd: FDims, get: Callable[[fx.Node], str]) -> str:
    """Emit pointwise/index node ``n`` (dim map ``fd``) from its operands, named by ``get``."""
    low = LOWERINGS[n.target]
    out_dtype = first_output(n).dtype
    args: list[Any] = []
    tensor_pos = 0
    for a in n.args:
        if isinstance(a, fx.Node):
            v = get(a)
            cast = low.cast == "out" or (low.cast == "values" and tensor_pos > 0)
            if cast and compute_dtype(first_output(a).dtype) != compute_dtype(out_dtype):
                v = f"{v}.to({compute_triton_dtype(out_dtype)})"
            elif low.cast == "promote":
                v = f"{v}.to({compute_triton_dtype(_promote(n))})"
            tensor_pos += 1
            args.append(v)
        else:
            args.append(a)
    if "alpha" in n.kwargs:
        args.append(n.kwargs["alpha"])
    expr = _index_value(em, n, fd, args) if low.kind == "index" else low.render(args)
    if low.kind == "reshape":
        return em.assign(expr)
    return em.assign(as_dtype(expr, out_dtype))


def inline_value(em: Emitter, a: fx.Node, fa: FDims) -> str:
    """A value recomputed where it is read (an ``arange`` chain, a concat's piece, ...)."""
    cache = em.values(fa)
    key = InlineKey(a, fa)
    if key not in cache:
        if is_slice(a):
            cache[key] = sliced(em, a, fa, lambda b, fb: inline_value(em, b, fb))
        elif LOWERINGS[a.target].kind == "concat":
            cache[key] = concat(em, a, fa, lambda b: read(em, a, fa, b))
        else:
            cache[key] = compute(em, a, fa, lambda b: read(em, a, fa, b))
    return cache[key]


def read(em: Emitter, n: fx.Node, fd: FDims, a: fx.Node) -> str:
    """Operand ``a`` of ``n`` (dim map ``fd``) from outside the kernel's members."""
    fa = operand_fdims(a, n, fd, em.k.space)
    assert fa is not None, f"{a.name} has no place in {n.name}'s iteration space"
    return inline_value(em, a, fa) if a in em.inline else em.load(a, fa)


def operand(em: Emitter, n: fx.Node, src: fx.Node) -> str:
    """Operand ``src`` of member ``n``: a member, an inline value or a load."""
    if src in em.members:
        return value(em, src)
    if src in em.inline:
        return inline_value(em, src, em.operand_fdims(n, src))
    return em.load(src, em.operand_fdims(n, src))


def prepare(em: Emitter, n: fx.Node) -> None:
    """Emit at the top level every row-independent value a loop over ``n`` will need."""
    if n not in em.members:
        return
    row = em.varies_reduced(em.k.fdims[n])
    if not row or n.target in REDUCTIONS or n.target is operator.getitem:
        value(em, n)  # computed once at the top level
        return
    src = n.args[0]
    if LOWERINGS[n.target].kind == "reshape" and src not in em.members | em.inline:
        return  # loaded itself, inside the loop
    for a in n.all_input_nodes:
        if a in em.members:
            prepare(em, a)
        elif not em.varies_reduced(em.operand_fdims(n, a)):
            operand(em, n, a)


def store(em: Emitter, n: fx.Node) -> None:
    """Store member ``n`` to its buffer, in its own dtype."""
    acc = em.access[n]
    ptr = em.param(n, "out")
    v = value(em, n)
    fd = em.k.fdims[n]
    mask = em.mask(fd)
    address = em.address(acc, fd)
    if mask is None:  # one element: a block of pointers to it, so block values store
        address, mask = f"{address} + 0 * xindex", "xmask"
    dtype = triton_dtype(first_output(n).dtype)
    em.emit(f"tl.store({ptr} + ({address}), {v}.to({dtype}), {mask})")


def _index_value(em: Emitter, n: fx.Node, fd: FDims, args: list[Any]) -> str:
    """A value made from the iteration index (``arange``) or a constant block (``full``)."""
    dtype = compute_triton_dtype(first_output(n).dtype)
    if n.target is torch.ops.aten.arange.start_step:
        f = fd[0]
        if f is None:  # one element: the start
            return f"tl.full({em.geo.one}, {literal(args[0])}, {dtype})"
        step = literal(args[2] if len(args) > 2 else 1)
        return f"({literal(args[0])} + {em.index(f)} * {step})"
    return f"tl.full({em.geo.one}, {LOWERINGS[n.target].render(args)}, {dtype})"


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


def _read_bytes(root: fx.Node, reads: set[Read]) -> int:
    """Bytes of ``root`` the loads touch: each read's distinct elements (broadcast dims once),
    summed over reads and capped at the buffer's size."""
    v = first_output(root)
    total = 0
    for r in reads:
        total += math.prod(e.size for e in r.extents if e.stride != 0 and e.size != 1)
    return min(total, int(v.numel())) * int(v.element_size())
