"""Symbolic traces (``jit(dynamic=...)``) in the on-disk trace cache
(:mod:`functrans._jit.disk.store`).

A symbolic trace is a function of the inputs' metadata *except* the sizes of its symbolic
dimensions, and holds only under the conditions its shape environment recorded (its guards):
those of torch's meta functions (``s0 % 8 == 0`` for a view) and those of the user's code
(``if x.shape[0] > 8:``). Re-running the stored graph on fake tensors derives the former again,
never the latter. So an entry stores, besides the graph:

- in its *key*, the dimensions made symbolic (``dims``) and each input as the trace's fake
  input sees it (:func:`key_tensors`): static sizes, sizes 0 and 1 (never symbolic), symbolic
  sizes by symbol (``s0``: a new batch size is the same key), strides and offset as
  expressions of them. Symbols are named in input order, so equal inputs give equal text;
- the trace's guard (:class:`~functrans._core.shapes.ShapeGuard`: torch's guard texts over
  ``L['t0']``..., the static sizes and strides), checked on load against this call's inputs (a
  failure is a miss: the other branch of the user's ``if`` is traced and stored beside it) and
  restored as the loaded graph's guard (:func:`~functrans._core.shapes.restore_guards`), so ``jit``
  checks on every call exactly what the trace assumed. Guard texts are compiled only after
  :func:`~functrans._core.shapes.check_guard_text` finds them to be size arithmetic;
- the named-dimension table (``batch``, ``x.shape[0]``), compared with the one the fake
  inputs made on load (``memory_budget(at=...)`` reads it).

On load the graph's inputs are :func:`~functrans._core.shapes.symbolic_fakes` of this call's
tensors, every value is derived again and compared with the stored one as text (a symbol the
user's code specialised gives other text: the entry is ignored and traced again).
"""

from __future__ import annotations

from typing import Any

from functrans._core.graph import Graph, JointGraph
from functrans._core.shapes import (
    _NAMES,
    ShapeGuard,
    check_guard_text,
    restore_guards,
    shape_env_of,
    symbolic_fakes,
)

from . import graph_json as graph_json
from .fingerprint import Unhashable

__all__ = ["dims_doc", "key_tensors", "load", "shape_doc"]


def dims_doc(dims: Any) -> list[list[list[Any]]]:
    """``dims`` (per input, ``{dim: name or None}``) as sorted, hashable data."""
    return [sorted([int(d), None if n is None else str(n)] for d, n in ds.items()) for ds in dims]


def key_tensors(tensors: tuple[Any, ...], dims: Any, names: tuple[str, ...]) -> list[Any]:
    """Per input, its sizes, strides and offset as the trace's symbolic fake input has them
    (ints where static, the text of a symbolic expression where not)."""
    try:
        fakes = symbolic_fakes(tensors, dims, names)
    except Exception as e:  # named dimensions that differ: the trace says so
        raise Unhashable(f"symbolic inputs ({type(e).__name__}: {e})") from e
    return [
        (
            [graph_json.size_text(s) for s in f.shape],
            [graph_json.size_text(s) for s in f.stride()],
            graph_json.size_text(f.storage_offset()),
        )
        for f in fakes
    ]


def _inputs(g: Graph) -> list[Any]:
    """The values of the graph's inputs ``jit`` guards (a joint graph's primals)."""
    nodes = g.primals() if isinstance(g, JointGraph) else g.placeholders()
    return [n.meta.get("val") for n in nodes]


def _names_doc(env: Any) -> dict[str, str]:
    return {k: str(v) for k, v in _NAMES.get(env, {}).items()}


def shape_doc(g: Graph) -> dict[str, Any]:
    """What a symbolic entry stores besides its graph: the trace's guard and dimension names;
    raises :class:`~functrans._jit.disk.graph_json.NotStorable` where they cannot be restored
    exactly."""
    vals = _inputs(g)
    env = shape_env_of(vals)
    if env is None:
        raise graph_json.NotStorable("a trace with symbolic dimensions that came out static")
    guard = ShapeGuard.of(vals, env)
    try:
        for part in guard.parts:
            check_guard_text(part, len(vals))
    except ValueError as e:
        raise graph_json.NotStorable(str(e)) from e
    return {
        "sizes": [list(s) for s in guard.sizes],
        "strides": [list(s) for s in guard.strides],
        "guards": list(guard.parts),
        "names": _names_doc(env),
    }


def load(doc: dict[str, Any], key: Any) -> Graph | None:
    """The symbolic graph stored in entry ``doc`` for a call with key ``key``, its guard
    restored; None where this call's inputs fail that guard (a miss). Raises where the entry
    cannot be rebuilt as stored."""
    shape = doc["shape"]
    try:
        guard = ShapeGuard.restore(shape["sizes"], shape["strides"], shape["guards"])
    except (ValueError, TypeError) as e:
        raise graph_json.CorruptEntry(f"its guard: {e}") from e
    if len(guard.sizes) != len(key.tensors) or not guard.matches(key.tensors):
        return None
    fakes = symbolic_fakes(key.tensors, key.dims, key.names)
    g = graph_json.load(doc["graph"], key.fn, inputs=fakes)
    vals = _inputs(g)
    if len(vals) != len(fakes) or any(v is not f for v, f in zip(vals, fakes, strict=False)):
        raise graph_json.CorruptEntry("its inputs are not the symbolic inputs")
    env = shape_env_of(fakes)
    if env is None:
        raise graph_json.CorruptEntry("static inputs for a symbolic entry")
    for f, sizes, strides in zip(fakes, guard.sizes, guard.strides, strict=True):
        for got, want in zip([*f.shape, *f.stride()], [*sizes, *strides], strict=True):
            text = graph_json.size_text(got)
            if text != want and not (want is None and isinstance(text, str)):
                raise graph_json.CorruptEntry("its static sizes and strides are not its inputs'")
    if _names_doc(env) != shape["names"]:
        raise graph_json.CorruptEntry("its dimension names differ from its inputs'")
    restore_guards(fakes, guard)
    return g
