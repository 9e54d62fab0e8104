"""Dynamic shapes: which input dimensions a trace keeps symbolic, and the guards that follow.

``trace``, ``joint`` and ``jit`` take ``dynamic=``: ``False`` (every size is baked in), ``True``
(every dimension of every tensor input symbolic) or a mapping from argument names to the
dimensions to keep symbolic, ``{"x": {0: "batch", 1: "seq"}, "mask": {0: "batch"}}`` (a
dimension named twice is one symbol: the trace may rely on the two being equal, and a call where
they differ is refused by name) or ``{"x": (0,)}`` (a symbol of its own each). A name is an
argument (``x``), a path into one (``params['w']``), or a pytree argument whose every tensor
gets those dimensions.

The symbolic inputs are fake tensors of one :class:`~torch.fx.experimental.symbolic_shapes.
ShapeEnv`: whatever the traced program assumes about their sizes (``s0 >= 2`` for the size-0/1
specialisation torch applies, ``s1 % 8 == 0`` for a ``view`` that splits a dimension) is a guard
that the shape environment records, and :class:`ShapeGuard` checks on every call. Sizes of 0 and
1 are never symbolic (torch specialises them: a size-1 batch gets an entry of its own). Duck
sizing is off: two dimensions share a symbol only when the program or the names relate them.

>>> import torch
>>> dims = resolve({"x": {0: "batch"}}, ["x", "w"], [torch.ones(4, 3), torch.ones(3, 3)])
>>> dims
({0: 'batch'}, {})
>>> fakes = symbolic_fakes([torch.ones(4, 3), torch.ones(3, 3)], dims)
>>> [tuple(f.shape) for f in fakes]
[(s0, 3), (3, 3)]
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import re
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias, cast

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.symbolic_shapes import (
    DimDynamic,
    ShapeEnv,
    StatelessSymbolicContext,
    free_unbacked_symbols,
)

from .errors import InvalidArgumentError, TraceError
from .fake_rules import SymbolicFakeMode
from .guard_text import check_guard_text
from .torch_compat import optimization_hint

__all__ = [
    "Dims",
    "Dynamic",
    "DynamicSpecError",
    "EveryInput",
    "JitDynamic",
    "ShapeGuard",
    "SizeConstants",
    "check_dynamic",
    "check_guard_text",
    "dimension_names",
    "guard_parts",
    "hint",
    "is_symbolic",
    "planned_sizes",
    "resolve",
    "restore_guards",
    "shape_env_of",
    "sizes_at",
    "symbolic_fakes",
]

#: Per flat tensor input: ``{dimension: symbol name, or None for a symbol of its own}``.
Dims: TypeAlias = tuple[Mapping[int, str | None], ...]

#: What ``dynamic=`` accepts on ``trace`` and ``joint`` (``jit`` also takes ``"auto"``; a
#: :data:`Dims` is what ``jit`` hands them, already resolved).
Dynamic: TypeAlias = bool | Mapping[str, Mapping[int, str | None] | Sequence[int]] | Dims | None


@dataclass(frozen=True)
class EveryInput:
    """``dynamic=True`` on a module's compiled call: every dimension of every tensor input is
    symbolic except under the paths ``static`` (its parameters and buffers: a weight's sizes are
    the model's, not the data's, as ``torch.compile(dynamic=True)`` treats them).

    >>> spec = EveryInput(static=("params",))
    >>> resolve(spec, ["params['w']", "args[0]"], [torch.ones(3, 3), torch.ones(4, 3)])
    ({}, {0: None, 1: None})
    """

    static: tuple[str, ...]


#: What ``jit``'s ``dynamic=`` accepts (defined after :class:`EveryInput`, not through a
#: string: ``typing.get_type_hints`` of ``jit`` resolves it in another module)
JitDynamic: TypeAlias = bool | Literal["auto"] | Mapping[str, Any] | EveryInput


class DynamicSpecError(TraceError):
    """The inputs break what ``dynamic=`` declares (two dimensions named alike differ)."""


def check_dynamic(dynamic: Any) -> JitDynamic:
    """``jit``'s ``dynamic=`` checked (mappings are checked against the arguments at the
    first call)."""
    if dynamic is True or dynamic is False or dynamic == "auto" or isinstance(dynamic, Mapping):
        return cast(JitDynamic, dynamic)  # a bool, "auto" or a mapping: tested above
    if isinstance(dynamic, EveryInput):
        return dynamic
    raise TraceError(
        f"jit: dynamic={dynamic!r}: expected False, True, 'auto' or a mapping from argument "
        "names to dimensions, e.g. {'x': {0: 'batch', 1: 'seq'}}"
    )


def resolve(dynamic: Any, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> Dims | None:
    """``dynamic=`` as :data:`Dims` over the flat tensor inputs (``names``: their paths), or
    None where nothing is symbolic. Errors name the argument, the value and what is accepted."""
    if dynamic is False or dynamic is None:
        return None
    if isinstance(dynamic, tuple):  # already resolved (jit passes its own)
        return dynamic if any(dynamic) else None
    if dynamic is True:
        return tuple({d: None for d in range(t.dim())} for t in tensors)
    if isinstance(dynamic, EveryInput):
        every = tuple(
            {} if any(_under(n, k) for k in dynamic.static) else dict.fromkeys(range(t.dim()))
            for n, t in zip(names, tensors, strict=True)
        )
        return every if any(every) else None
    if not isinstance(dynamic, Mapping):
        raise TraceError(
            f"dynamic={dynamic!r}: expected False, True, 'auto' (jit only) or a mapping from "
            "argument names to dimensions, e.g. {'x': {0: 'batch', 1: 'seq'}}"
        )
    out: list[dict[int, str | None]] = [{} for _ in tensors]
    for key, spec in dynamic.items():
        hits = [i for i, n in enumerate(names) if _under(n, key)]
        if not hits:
            raise TraceError(
                f"dynamic={{{key!r}: ...}}: no tensor argument is named {key!r}; the tensor "
                f"inputs are {', '.join(names) or '(none)'}"
            )
        dims = _dims(key, spec)
        for i in hits:
            for d, name in dims.items():
                ndim = tensors[i].dim()
                if not -ndim <= d < ndim:
                    raise TraceError(
                        f"dynamic={{{key!r}: ...}}: {names[i]} has {ndim} dimensions, so it "
                        f"has no dimension {d}"
                    )
                out[i][d % ndim] = name
    return tuple(out) if any(out) else None


def _under(name: str, key: str) -> bool:
    return name == key or (name.startswith(key) and name[len(key)] in "[.")


def _dims(key: str, spec: Any) -> dict[int, str | None]:
    if isinstance(spec, Mapping):
        items = dict(spec)
    elif isinstance(spec, Sequence) and not isinstance(spec, str):
        items = dict.fromkeys(spec)
    else:
        raise TraceError(
            f"dynamic={{{key!r}: {spec!r}}}: expected the dimensions as a mapping "
            "{dim: 'symbol name'} or a sequence of dims, e.g. {0: 'batch'} or (0, 1)"
        )
    for d, name in items.items():
        if type(d) is not int or not (name is None or isinstance(name, str)):
            raise TraceError(
                f"dynamic={{{key!r}: ...}}: {d!r}: {name!r} is not a dimension (an int) and a "
                "symbol name (a str or None)"
            )
    return items


def symbolic_fakes(
    tensors: Sequence[torch.Tensor], dims: Dims, names: Sequence[str] | None = None
) -> list[torch.Tensor]:
    """Fake tensors of one fresh shape environment, symbolic in ``dims``; dimensions given the
    same name are one symbol (a call where their sizes differ raises, naming both)."""
    env = ShapeEnv(duck_shape=False)
    # symbols named s0, s1, ... in the order of the inputs' dimensions (torch names them by a
    # hash of their source: s26, s49), so graphs and guards read like the function's inputs
    counter = itertools.count()
    env._generate_unique_id = lambda _name: next(counter)  # type: ignore[method-assign,assignment]  # torch has no hook for symbol names
    mode = SymbolicFakeMode(shape_env=env, allow_non_fake_inputs=True)
    # rebuilding outputs from the fake-tensor cache redoes the symbolic stride arithmetic the
    # cache exists to skip: without it a GPT's symbolic joint trace takes 3.3 s instead of 4.3
    mode.cache_enabled = False
    fakes: list[torch.Tensor] = []
    for t, ds in zip(tensors, dims, strict=True):
        kinds = [DimDynamic.DYNAMIC if d in ds else DimDynamic.STATIC for d in range(t.dim())]
        ctx: Any = StatelessSymbolicContext(dynamic_sizes=kinds)
        fakes.append(mode.from_tensor(t.detach(), symbolic_context=ctx))
    named: dict[str, tuple[str, Any]] = {}
    known = _NAMES.setdefault(env, {})
    for i, (fake, ds) in enumerate(zip(fakes, dims, strict=True)):
        for d, name in ds.items():
            where = f"{names[i] if names else f'input {i}'}.shape[{d}]"
            size = fake.shape[d]
            if isinstance(size, torch.SymInt):
                known[where] = size.node.expr
                if name is not None:
                    known.setdefault(name, size.node.expr)
            if name is None:
                continue
            if name not in named:
                named[name] = (where, size)
                continue
            first, other = named[name]
            if hint(other) != hint(size):
                raise DynamicSpecError(
                    f"dynamic: {first} and {where} are both named {name!r}, so they must be "
                    f"equal, but they are {hint(other)} and {hint(size)}"
                )
            if isinstance(size, torch.SymInt) or isinstance(other, torch.SymInt):
                bool(size == other)  # a guard and a replacement: one symbol from here on
    return fakes


def shape_env_of(vals: Sequence[Any]) -> ShapeEnv | None:
    """The shape environment of the first symbolic fake tensor among ``vals`` (None: static)."""
    for v in vals:
        if isinstance(v, torch.Tensor) and is_symbolic(v):
            mode = getattr(v, "fake_mode", None)
            return getattr(mode, "shape_env", None)
    return None


#: tensor types whose ``_has_symbolic_sizes_strides`` flag tells whether their sizes, strides
#: or storage offset are symbolic (a subclass may keep its sizes elsewhere)
_FLAGGED = (torch.Tensor, torch.nn.Parameter, FakeTensor)


def _flagged_static(val: Any) -> bool:
    """Whether the C flag of a tensor says its sizes, strides and offset are all plain ints
    (reading the sizes themselves inside a trace costs about 4 us); False where it cannot
    tell."""
    return type(val) in _FLAGGED and not val._has_symbolic_sizes_strides


def is_symbolic(val: Any) -> bool:
    """Whether a tensor's sizes or strides, or an int-like value, are symbolic."""
    if isinstance(val, torch.Tensor):
        if _flagged_static(val):
            return False
        return any(isinstance(s, torch.SymInt) for s in (*val.shape, *val.stride()))
    return isinstance(val, torch.SymInt | torch.SymFloat | torch.SymBool)


def hint(x: Any) -> int:
    """The value of an int or SymInt at the trace's example sizes (or at the sizes
    :func:`sizes_at` plans for), without adding a guard (``int(symint)`` would specialise the
    shape).

    >>> import functrans as ft
    >>> g = ft.trace(lambda x: x * 2, dynamic=True)(torch.ones(6))
    >>> n = g.placeholders()[0].meta["val"].numel()
    >>> n, hint(n), hint(7)
    (s0, 6, 7)
    """
    if isinstance(x, torch.SymInt):
        at = _AT.get()
        if at is None:
            return int(optimization_hint(x))
        env = x.node.shape_env
        expr = env.replace(x.node.expr)
        values = {s: at.get(s, env.backed_var_to_val.get(s)) for s in expr.free_symbols}
        return int(expr.xreplace(values))
    return int(x)


# the sizes cost estimates are taken at, by symbol (None: the trace's example sizes)
_AT: contextvars.ContextVar[dict[Any, int] | None] = contextvars.ContextVar(
    "functrans_sizes_at", default=None
)
# the names a symbolic trace gave its dimensions (``batch``, ``x.shape[1]``), per shape env
_NAMES: weakref.WeakKeyDictionary[ShapeEnv, dict[str, Any]] = weakref.WeakKeyDictionary()


def dimension_names(vals: Sequence[Any]) -> dict[str, Any]:
    """The symbolic dimensions of a trace over inputs ``vals``: by the name ``dynamic=`` gave
    them and by ``path.shape[d]``, each to its size symbol.

    >>> import functrans as ft
    >>> g = ft.trace(lambda x: x * 2, dynamic={"x": {0: "batch"}})(torch.ones(6, 2))
    >>> dimension_names([n.meta["val"] for n in g.placeholders()])
    {'x.shape[0]': s0, 'batch': s0}
    """
    env = shape_env_of(vals)
    if env is None:
        return {}
    return {k: env.replace(v) for k, v in _NAMES.get(env, {}).items()}


@contextlib.contextmanager
def sizes_at(vals: Sequence[Any], sizes: Mapping[str, int] | None) -> Iterator[None]:
    """Within the block, bytes and FLOPs of a symbolic trace over inputs ``vals`` are taken
    with the named dimensions at ``sizes`` (``{"batch": 64, "seq": 4096}``) instead of at the
    example sizes: a budget planned at the example sizes can be exceeded far from them.

    >>> import functrans as ft
    >>> from functrans.extend import nbytes
    >>> g = ft.trace(lambda x: x * 2, dynamic={"x": {0: "batch"}})(torch.ones(6, 2))
    >>> vals = [n.meta["val"] for n in g.placeholders()]
    >>> with sizes_at(vals, {"batch": 1000}):
    ...     print(nbytes(vals[0]))
    8000
    >>> nbytes(vals[0])
    48
    """
    if not sizes:
        yield
        return
    names = dimension_names(vals)
    names.update({str(v): v for v in list(names.values())})  # the symbols themselves: s0
    if not names:
        raise InvalidArgumentError(
            f"at={dict(sizes)!r}: this graph has static shapes; sizes to plan at apply to "
            "graphs traced with dynamic=..."
        )
    subs = {}
    for name, value in sizes.items():
        if name not in names:
            raise InvalidArgumentError(
                f"at={{{name!r}: ...}}: no symbolic dimension is named {name!r}; the graph's "
                f"are {', '.join(sorted(names))}"
            )
        if type(value) is not int or value < 0:
            raise InvalidArgumentError(f"at={{{name!r}: {value!r}}}: a size must be an int >= 0")
        subs[names[name]] = value
    token = _AT.set(subs)
    try:
        yield
    finally:
        _AT.reset(token)


def planned_sizes() -> tuple[tuple[str, int], ...]:
    """The sizes :func:`sizes_at` currently plans at (a stamp for caches of cost figures)."""
    at = _AT.get()
    return () if at is None else tuple(sorted((str(k), v) for k, v in at.items()))


def has_unbacked(val: Any) -> bool:
    """Whether a value's shape depends on tensor values (an unbacked symbol)."""
    if _flagged_static(val):
        return False  # no symbol at all, unbacked ones included
    return bool(free_unbacked_symbols(val))


@dataclass(frozen=True)
class ShapeGuard:
    """The conditions a dynamic entry was compiled under, checked on each call: every static
    size and stride (by torch's C++ ``TensorGuards``, symbolic ones skipped) and the shape
    environment's guards on the symbolic ones (one compiled Python expression).

    ``sizes``/``strides``: per input, an int where static, None where symbolic."""

    sizes: tuple[tuple[int | None, ...], ...]
    strides: tuple[tuple[int | None, ...], ...]
    expression: str
    check_expr: Callable[[Sequence[torch.Tensor]], bool]
    #: the guards ``expression`` joins (what the disk cache stores)
    parts: tuple[str, ...] = ()

    @classmethod
    def of(cls, fakes: Sequence[torch.Tensor], env: ShapeEnv) -> ShapeGuard:
        """The guards of a finished trace over its symbolic inputs ``fakes`` (for a graph
        loaded from the disk cache, the guards its trace recorded: :func:`restore_guards`)."""
        sizes = tuple(
            tuple(_static(s, env) for s in f.shape) if isinstance(f, torch.Tensor) else ()
            for f in fakes
        )
        strides = tuple(
            tuple(_static(s, env) for s in f.stride()) if isinstance(f, torch.Tensor) else ()
            for f in fakes
        )
        restored = _restored(fakes, env)
        if restored is not None and restored[1] and len(fakes) == len(restored[0].sizes):
            return restored[0]
        parts = guard_parts(fakes, env)
        if restored is not None:
            # the loaded graph was partitioned and compiled on a shape environment of its own:
            # what that added (and what other inputs need) is checked besides the trace's
            stored = restored[0]
            extra = [p for p in parts if p not in stored.parts]
            return cls._compiled(sizes, strides, [*stored.parts, *extra])
        return cls._compiled(sizes, strides, parts)

    @classmethod
    def restore(
        cls,
        sizes: Sequence[Sequence[int | None]],
        strides: Sequence[Sequence[int | None]],
        parts: Sequence[str],
    ) -> ShapeGuard:
        """The guard :meth:`of` made, from its stored sizes, strides and guard texts (each
        checked to be the arithmetic on ``L['t<i>']`` sizes torch writes, else ValueError).

        >>> g = ShapeGuard.restore([[None, 3]], [[3, 1]], ["2 <= L['t0'].size()[0]"])
        >>> g.matches([torch.ones(4, 3)]), g.matches([torch.ones(1, 3)])
        (True, False)
        >>> ShapeGuard.restore([[None]], [[1]], ["__import__('os')"])
        Traceback (most recent call last):
        ValueError: a guard that is not size arithmetic: __import__('os')
        """
        n = len(sizes)
        if len(strides) != n or any(len(a) != len(b) for a, b in zip(sizes, strides, strict=True)):
            raise ValueError("guard sizes and strides of different ranks")
        for p in parts:
            check_guard_text(p, n)
        return cls._compiled(sizes, strides, parts)

    @classmethod
    def _compiled(
        cls,
        sizes: Sequence[Sequence[int | None]],
        strides: Sequence[Sequence[int | None]],
        parts: Sequence[str],
    ) -> ShapeGuard:
        """The guard of torch's guard texts ``parts`` (checked by the caller)."""
        from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

        code = " and ".join(f"({p})" for p in parts) or "True"
        fn = eval(f"lambda L: {code}", dict(SYMPY_INTERP))  # torch's guard texts
        return cls(
            tuple(tuple(None if s is None else int(s) for s in row) for row in sizes),
            tuple(tuple(None if s is None else int(s) for s in row) for row in strides),
            " and ".join(parts) or "True",
            _checker(fn, len(sizes)),
            tuple(parts),
        )

    @property
    def symbolic(self) -> list[set[int]]:
        """Per input, its symbolic dimensions."""
        return [{d for d, s in enumerate(sizes) if s is None} for sizes in self.sizes]

    def matches(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether ``tensors`` pass every guard (static sizes and strides, then symbolic)."""
        for t, sizes, strides in zip(tensors, self.sizes, self.strides, strict=True):
            if not isinstance(t, torch.Tensor):
                continue
            if t.dim() != len(sizes):
                return False
            if any(s is not None and s != a for s, a in zip(sizes, t.shape, strict=True)):
                return False
            if t.numel() and any(
                s is not None and s != a and n != 1
                for s, a, n in zip(strides, t.stride(), t.shape, strict=True)
            ):  # an empty tensor's strides mean nothing, nor do a size-one dimension's
                return False
        return self.check_expr(tensors)


def _static(s: Any, env: ShapeEnv) -> int | None:
    """A size or stride as a static int, None where it is symbolic. A symbol the trace
    specialised (``Eq(s0, 7)``: a split's last chunk of size one) is static: torch's guard text
    leaves such sizes out as static, so they must be checked here."""
    if not isinstance(s, torch.SymInt):
        return int(s)
    expr = env.replace(s.node.expr)
    return int(expr) if expr.is_number else None


def _checker(
    fn: Callable[[dict[str, Any]], Any], n: int
) -> Callable[[Sequence[torch.Tensor]], bool]:
    names = [f"t{i}" for i in range(n)]

    def check(tensors: Sequence[torch.Tensor]) -> bool:
        return bool(fn(dict(zip(names, tensors, strict=True))))

    return check


def guard_parts(fakes: Sequence[Any], env: ShapeEnv) -> list[str]:
    """The shape environment's guards on inputs ``fakes`` (named ``L['t0']``, ...), as the
    Python expressions torch writes (``produce_guards_expression`` joins them with ``and``)."""
    from torch._dynamo.source import LocalSource

    sources = [LocalSource(f"t{i}") for i in range(len(fakes))]
    return list(env.produce_guards(list(fakes), sources, ignore_static=True))


# guards restored from the disk cache, per shape environment of a loaded graph: the guard, the
# inputs it is over (weakly), and how many guards the environment held when it was restored
_RESTORED: weakref.WeakKeyDictionary[
    ShapeEnv, tuple[ShapeGuard, tuple[weakref.ref[torch.Tensor], ...], int]
] = weakref.WeakKeyDictionary()


def restore_guards(fakes: Sequence[torch.Tensor], guard: ShapeGuard) -> None:
    """Make ``guard`` (stored by the disk cache with a graph traced over inputs like
    ``fakes``) the guard of inputs ``fakes``: the shape environment of a loaded graph only
    knows what re-running the graph on them assumed, not the conditions of the user's code
    (``if x.shape[0] > 8:``) the trace recorded. :meth:`ShapeGuard.of` of these inputs returns
    it (with whatever the environment learns later added)."""
    env = shape_env_of(fakes)
    assert env is not None
    _RESTORED[env] = (guard, tuple(weakref.ref(f) for f in fakes), len(env.guards))


def _restored(fakes: Sequence[Any], env: ShapeEnv) -> tuple[ShapeGuard, bool] | None:
    """The restored guard of inputs that start with the ones it was restored for, and
    whether the environment is unchanged since."""
    found = _RESTORED.get(env)
    if found is None:
        return None
    guard, refs, count = found
    if len(fakes) < len(refs) or any(r() is not f for r, f in zip(refs, fakes, strict=False)):
        return None
    return guard, len(env.guards) == count


_SYM = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _has_symbols(data: Any) -> bool:
    if isinstance(data, _SYM):
        return True
    return isinstance(data, list | tuple) and any(_has_symbols(d) for d in data)


class SizeConstants(torch.overrides.TorchFunctionMode):
    """While a symbolic trace runs: ``torch.tensor(x.shape[0])`` (``as_tensor``, ``asarray``,
    ``Tensor.new_tensor``) of symbolic sizes is traced as an op on the size (torch would bake
    the example's value in as a constant: silently wrong at every other size). Scalars and flat
    lists become ``scalar_tensor`` ops; deeper nesting is a :class:`TraceError`."""

    _CONSTRUCTORS = frozenset({torch.tensor, torch.as_tensor, torch.asarray})

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        new_tensor = func is torch.Tensor.new_tensor
        if (func in self._CONSTRUCTORS or new_tensor) and args:
            data = args[1] if new_tensor else args[0]
            if _has_symbols(data):
                like = args[0] if new_tensor else None
                return _size_tensor(data, kwargs, like)
        return func(*args, **kwargs)


def _size_tensor(data: Any, kwargs: dict[str, Any], like: torch.Tensor | None) -> torch.Tensor:
    dtype = kwargs.get("dtype")
    device = kwargs.get("device", like.device if like is not None else None)
    items = list(data) if isinstance(data, list | tuple) else [data]
    if any(isinstance(d, list | tuple) for d in items):
        raise TraceError(
            "torch.tensor of a nested list holding symbolic sizes: with dynamic shapes a size is "
            "not a constant; build it with torch.stack of torch.scalar_tensor(size) instead"
        )
    if dtype is None:
        if like is not None:
            dtype = like.dtype
        elif any(isinstance(d, float | torch.SymFloat) for d in items):
            dtype = torch.get_default_dtype()
        elif all(isinstance(d, bool | torch.SymBool) for d in items):
            dtype = torch.bool
        else:
            dtype = torch.int64
    scalars = [torch.scalar_tensor(d, dtype=dtype, device=device) for d in items]
    out = torch.stack(scalars) if isinstance(data, list | tuple) else scalars[0]
    return out.requires_grad_(bool(kwargs.get("requires_grad", False)))


def refuse_size_outputs(f: Any, leaves: Sequence[Any]) -> None:
    """A symbolic trace whose function returns a size (``x.shape``, ``x.numel() / 2``) is a
    :class:`TraceError`: the graph would hand back the example's value. ``jit`` then compiles
    an entry per shape (where sizes are constants)."""
    found = next((x for x in leaves if _has_symbols(x) or _symbolic_size(x)), None)
    if found is not None:
        raise TraceError(
            f"{getattr(f, '__qualname__', f)} returns {found!r}, a size computed from symbolic "
            "dimensions: with dynamic shapes it is not a constant. Return it as a tensor "
            "(torch.tensor(x.shape[0]) is traced) or compute it outside the traced function."
        )


def _symbolic_size(x: Any) -> bool:
    return isinstance(x, torch.Size) and _has_symbols(tuple(x))


_GUARD_INPUT = re.compile(r"L\['t(\d+)'\](\.size\(\)\[(\d+)\]|\.stride\(\)\[(\d+)\])?")


def readable(expression: str, names: Sequence[str]) -> str:
    """torch's guard text with the inputs by name: ``L['t0'].size()[1]`` -> ``x.shape[1]``.

    >>> readable("2 <= L['t0'].size()[0] and L['t1'] == L['t0'].stride()[0]", ["x", "n"])
    '2 <= x.shape[0] and n == x.stride(0)'
    """

    def name(m: re.Match[str]) -> str:
        i = int(m[1])
        base = names[i] if i < len(names) else f"input {i}"
        if m[3] is not None:
            return f"{base}.shape[{m[3]}]"
        if m[4] is not None:
            return f"{base}.stride({m[4]})"
        return base

    return _GUARD_INPUT.sub(name, expression)


def legend(vals: Sequence[Any]) -> str | None:
    """``s0 = batch (x.shape[0]), s1 = x.shape[1]``: what each size symbol of a trace over
    inputs ``vals`` stands for (None where its sizes are static)."""
    names = dimension_names(vals)
    if not names:
        return None
    by_symbol: dict[str, list[str]] = {}
    for name, sym in names.items():
        by_symbol.setdefault(str(sym), []).append(name)
    parts = []
    for sym, labels in sorted(by_symbol.items(), key=lambda kv: kv[0]):
        named = [x for x in labels if ".shape[" not in x]
        paths = [x for x in labels if ".shape[" in x]
        text = named[0] + (f" ({', '.join(paths)})" if paths else "") if named else ", ".join(paths)
        parts.append(f"{sym} = {text}")
    return ", ".join(parts)
