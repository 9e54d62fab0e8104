"""The kernel body as it is written: names, index arithmetic, loads, and the scope lines go into.

A kernel iterates over its space in blocks (:class:`Geometry`). The :class:`Emitter` appends
lines to the body and remembers what it has computed, in its current :class:`Scope`: values in
the kernel's top block, row values of the loop over the reduced dims that is open (if any), and
the index expressions of a read at a shifted index (a concat piece, a slice). Opening a loop or
a shifted read replaces the scope; values are reused only within the scope that computed them.

Which values to compute, and how, is decided by :mod:`.render` (values and stores),
:mod:`.reduce` (reductions) and :mod:`.shifted` (concat pieces and slices), all plain functions
of an :class:`Emitter`.

>>> k = Kernel([], (4, 3000), frozenset({1}))
>>> em = Emitter(k, {}, frozenset(), geometry(k, persistent_limit=1024, max_block=1024))
>>> em.geo.persistent, em.geo.xblock, em.geo.rblock
(False, 4, 128)
>>> em.open_loop()
>>> em.assign("tl.sum(x, 1)")
'tmp0'
>>> print("\\n".join(em.lines))
    for roffset in range(0, 3000, RBLOCK):
        rindex = roffset + rbase
        rmask = rindex < 3000
        r1 = rindex
        tmp0 = tl.sum(x, 1)
"""

from __future__ import annotations

import math
from collections import ChainMap
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch.fx as fx

from .layout import FDims, operand_fdims
from .lowering import compute_dtype, compute_triton_dtype
from .regions import Access, Kernel
from .traced import first_output

__all__ = [
    "Emitter",
    "Extent",
    "Geometry",
    "InlineKey",
    "LoadKey",
    "Read",
    "Scope",
    "ValueKey",
    "geometry",
]


def _pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


@dataclass(frozen=True)
class Geometry:
    """How a kernel's iteration space is cut into programs and blocks.

    One program per ``xblock`` elements of the kept dims ``xdims`` (``xnumel`` in all). With
    reduced dims ``rdims`` (``rnumel`` elements per row) a program holds ``xblock`` rows of
    ``rblock`` elements: a whole row when ``persistent``, else a loop over the row.
    """

    xdims: tuple[int, ...]
    rdims: tuple[int, ...]  # sorted
    xnumel: int
    rnumel: int
    persistent: bool
    xblock: int
    rblock: int

    @property
    def reduce(self) -> bool:
        """Whether the kernel reduces (its blocks are 2-d: rows by row elements)."""
        return bool(self.rdims)

    @property
    def one(self) -> str:
        """The shape of a one-element block of the kernel's rank."""
        return "[1, 1]" if self.reduce else "[1]"


def geometry(k: Kernel, persistent_limit: int, max_block: int) -> Geometry:
    """The blocks of kernel ``k``: rows up to ``persistent_limit`` (rounded up to a power of
    two) fit in one block; a block holds at most ``max_block`` elements per dim.

    >>> g = geometry(Kernel([], (6, 10), frozenset({1})), persistent_limit=1024, max_block=1024)
    >>> g.xdims, g.rdims, g.persistent, g.xblock, g.rblock
    ((0,), (1,), True, 8, 16)
    """
    xdims = tuple(d for d in range(len(k.space)) if d not in k.rdims)
    rdims = tuple(sorted(k.rdims))
    xnumel = math.prod(k.space[d] for d in xdims)
    rnumel = math.prod(k.space[d] for d in rdims)
    reduce = bool(rdims)
    persistent = not reduce or _pow2(rnumel) <= persistent_limit
    rblock = _pow2(rnumel) if persistent else min(128, max_block, _pow2(rnumel))
    if not reduce:
        xblock = min(max_block, _pow2(xnumel))
    elif persistent:
        xblock = max(1, min(_pow2(xnumel), 4096 // rblock, max_block))
    else:
        xblock = min(8, _pow2(xnumel))
    return Geometry(xdims, rdims, xnumel, rnumel, persistent, xblock, rblock)


@dataclass(frozen=True)
class LoadKey:
    """A load: ``root`` 's buffer at element ``offset`` with ``strides``, each dim indexed by
    the space dim in ``fdims`` (None: a dim that does not move the address)."""

    root: fx.Node
    offset: int
    strides: tuple[int, ...]
    fdims: FDims


@dataclass(frozen=True)
class InlineKey:
    """A value recomputed where it is read (:attr:`Plan.inline <.regions.Plan.inline>`), with
    its dims placed on the space dims ``fdims``."""

    node: fx.Node
    fdims: FDims


#: what a computed value is remembered by: a member node, a load, or an inline value
ValueKey = fx.Node | LoadKey | InlineKey


class Extent(NamedTuple):
    """One dim of a load that moves its address."""

    size: int
    stride: int


class Read(NamedTuple):
    """The elements of a buffer one load touches: from ``offset``, along ``extents``."""

    offset: int
    extents: tuple[Extent, ...]


@dataclass(frozen=True)
class Scope:
    """What the next lines may reuse, and at which index they read.

    ``top``: values in the kernel's top block (those that do not vary along a row; every value
    when the kernel is persistent). ``loop``: the row values of the open loop over the reduced
    dims; None when no loop is open, and lines go to the top block. ``reductions``: each
    reduction's outputs. ``shift``: space dims read at another index (inside a concat piece or
    a slice), and ``piece_mask``: where the current concat piece is valid. The tables fill as
    lines are emitted; a loop or a shifted read gets a new scope.
    """

    top: dict[ValueKey, str] = field(default_factory=dict)
    loop: dict[ValueKey, str] | None = None
    reductions: dict[fx.Node, list[str]] = field(default_factory=dict)
    shift: Mapping[int, str] = field(default_factory=dict)
    piece_mask: str | None = None

    def values(self, reduced: bool) -> MutableMapping[ValueKey, str]:
        """Where a value is looked up and kept. Inside a loop, in the loop's table, whether it
        varies along a row (``reduced``) or not: Triton does not see a name made in a loop
        body after that loop, so one made there (a scalar load) is not reused by a later
        loop or the block after it (the interpreter, which runs the kernel as Python, did).
        The top block's values made before the loop are read through."""
        del reduced  # where a value is made decides, not what it varies along
        return self.top if self.loop is None else ChainMap(self.loop, self.top)

    def in_loop(self) -> Scope:
        """This scope inside a new loop over the row (the top block's values stay visible)."""
        return replace(self, loop={})

    def after_loop(self) -> Scope:
        """This scope back in the top block."""
        return replace(self, loop=None)

    def shifted(self, f: int | None, expr: str, mask: str | None) -> Scope:
        """A scope reading space dim ``f`` at index ``expr`` and loading only where ``mask``
        holds. It shares no values: those computed at shifted indices differ. Inside a loop it
        stays inside the loop (a slice read by a looped reduction)."""
        shift = self.shift if f is None else {**self.shift, f: expr}
        piece = self.piece_mask
        if mask is not None:
            piece = mask if piece is None else f"{piece} & {mask}"
        loop: dict[ValueKey, str] | None = None if self.loop is None else {}
        return Scope(loop=loop, shift=shift, piece_mask=piece)


class Emitter:
    """Writes the body of kernel ``k`` (blocks ``geo``) line by line.

    ``access`` says where every value in memory lives; ``inline`` are the values recomputed
    where they are read. ``lines`` is the body so far, ``params`` the buffer parameter of each
    root the body loads or stores, ``reads`` what each loaded buffer's loads touch.
    """

    def __init__(
        self,
        k: Kernel,
        access: Mapping[fx.Node, Access],
        inline: frozenset[fx.Node],
        geo: Geometry,
    ) -> None:
        self.k, self.access, self.inline, self.geo = k, access, inline, geo
        self.members = frozenset(k.nodes)
        self.lines: list[str] = []
        self.params: dict[fx.Node, str] = {}
        self.reads: dict[fx.Node, set[Read]] = {}
        self.scope = Scope()
        self._names = 0

    # -- lines and names -----------------------------------------------------------------------
    def fresh(self) -> str:
        """A new temporary's name."""
        self._names += 1
        return f"tmp{self._names - 1}"

    def emit(self, line: str) -> None:
        """Append ``line`` to the top block, or to the open loop's body."""
        self.lines.append(("        " if self.scope.loop is not None else "    ") + line)

    def assign(self, expr: str) -> str:
        """Emit ``expr`` into a new temporary; returns its name."""
        name = self.fresh()
        self.emit(f"{name} = {expr}")
        return name

    # -- index arithmetic ----------------------------------------------------------------------
    def index(self, d: int) -> str:
        """The index of space dim ``d`` (shifted inside a concat piece or slice)."""
        if d in self.scope.shift:
            return self.scope.shift[d]
        return f"{'r' if d in self.k.rdims else 'x'}{d}"

    def index_lines(self, dims: Sequence[int], base: str) -> list[str]:
        """Lines splitting the flat index ``base`` into the indices of space dims ``dims``."""
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

    def varies_kept(self, fdims: Sequence[int | None]) -> bool:
        """Whether a value with dim map ``fdims`` varies along the kernel's kept dims."""
        return any(f is not None and f not in self.k.rdims for f in fdims)

    def varies_reduced(self, fdims: Sequence[int | None]) -> bool:
        """Whether a value with dim map ``fdims`` varies along a row (the reduced dims)."""
        return any(f is not None and f in self.k.rdims for f in fdims)

    def mask(self, fdims: Sequence[int | None]) -> str | None:
        """The mask of a value with dim map ``fdims`` on the ragged edges (None: one element)."""
        kept = ["xmask"] if self.varies_kept(fdims) else []
        reduced = ["rmask"] if self.varies_reduced(fdims) else []
        return " & ".join(kept + reduced) or None

    def address(self, acc: Access, fdims: Sequence[int | None]) -> str:
        """The element offset in ``acc.root`` 's buffer of a value with dim map ``fdims``."""
        terms = [str(acc.offset)] if acc.offset else []
        for f, size, stride in zip(fdims, acc.shape, acc.strides, strict=True):
            if f is not None and size != 1 and stride != 0:
                terms.append(self.index(f) if stride == 1 else f"{stride} * {self.index(f)}")
        return " + ".join(terms) or "0"

    def operand_fdims(self, n: fx.Node, a: fx.Node) -> FDims:
        """How the value ``a`` from outside the kernel maps onto the space where ``n`` reads
        it."""
        fa = operand_fdims(a, n, self.k.fdims[n], self.k.space)
        assert fa is not None, f"{a.name} has no place in {n.name}'s iteration space"
        return fa

    # -- memory --------------------------------------------------------------------------------
    def param(self, root: fx.Node, prefix: str) -> str:
        """The pointer parameter of ``root`` 's buffer (``in_ptr0``, ``out_ptr1``, ...)."""
        if root not in self.params:
            count = sum(p.startswith(prefix) for p in self.params.values())
            self.params[root] = f"{prefix}_ptr{count}"
        return self.params[root]

    def values(self, fdims: Sequence[int | None]) -> MutableMapping[ValueKey, str]:
        """The table of the current scope a value with dim map ``fdims`` belongs in."""
        return self.scope.values(self.varies_reduced(fdims))

    def load(self, a: fx.Node, fdims: FDims) -> str:
        """Load the value ``a`` (in memory, per ``access``) with dim map ``fdims``, in its
        compute dtype; a load already made in this scope is reused."""
        acc = self.access[a]
        fdims = tuple(  # only dims that move the address index the load (and mask it)
            f if s != 1 and st != 0 else None
            for f, s, st in zip(fdims, acc.shape, acc.strides, strict=True)
        )
        key = LoadKey(acc.root, acc.offset, acc.strides, fdims)
        cache = self.values(fdims)
        if key in cache:
            return cache[key]
        ptr = self.param(acc.root, "in")
        used = tuple(
            Extent(s, st)
            for f, s, st in zip(fdims, acc.shape, acc.strides, strict=True)
            if f is not None
        )
        self.reads.setdefault(acc.root, set()).add(Read(acc.offset, used))
        mask, piece = self.mask(fdims), self.scope.piece_mask
        if piece is not None:
            mask = piece if mask is None else f"{mask} & {piece}"
        dtype = first_output(a).dtype
        other = "" if mask is None else f", {mask}, other=0"
        name = self.fresh()
        address = self.address(acc, fdims)
        if piece is not None and all(f is None for f in fdims):
            address += " + 0 * xindex"  # a block of pointers for the piece's block mask
        expr = f"tl.load({ptr} + ({address}){other})"
        if compute_dtype(dtype) != dtype:
            expr += f".to({compute_triton_dtype(dtype)})"
        self.emit(f"{name} = {expr}")
        cache[key] = name
        return name

    # -- scopes --------------------------------------------------------------------------------
    def open_loop(self) -> None:
        """Start a loop over the row in ``RBLOCK`` chunks; lines go into its body."""
        self.emit(f"for roffset in range(0, {self.geo.rnumel}, RBLOCK):")
        self.scope = self.scope.in_loop()
        self.emit("rindex = roffset + rbase")
        self.emit(f"rmask = rindex < {self.geo.rnumel}")
        for line in self.index_lines(self.geo.rdims, "rindex"):
            self.emit(line)

    def close_loop(self) -> None:
        """End the open loop (if any): lines go to the top block again."""
        self.scope = self.scope.after_loop()

    @contextmanager
    def shifted(self, f: int | None, expr: str, mask: str | None = None) -> Iterator[None]:
        """Inside: space dim ``f`` is read at index ``expr`` and loads are masked by ``mask``
        (see :meth:`Scope.shifted`)."""
        outer = self.scope
        self.scope = outer.shifted(f, expr, mask)
        try:
            yield
        finally:
            self.scope = outer
