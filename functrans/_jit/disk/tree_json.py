"""Values and pytree specs as JSON, for the on-disk trace cache
(:mod:`functrans._jit.disk.graph_json`).

:func:`encode` writes an FX argument or static value as JSON (numbers, strings, dtypes, devices,
tuples and lists, tagged; floats by ``repr``, exact); :func:`flat_doc` writes a
:class:`~functrans._core.pytree.Flat` (its spec described by building the tree it stands for:
tuples, lists, dicts, None, namedtuples and structseqs of classes already imported, torch pytree
specs of ``jit(module)`` outputs), checked to rebuild the same spec. Anything else raises
:class:`NotStorable`; :func:`flat_of` and :func:`decode` raise :class:`CorruptEntry` for what
they cannot rebuild, and never import a module or unpickle anything.

>>> import json
>>> from functrans._core.pytree import flatten
>>> _, flat = flatten(((1.5, {"b": None, "a": (2, "x")}), {}))
>>> back = flat_of(json.loads(json.dumps(flat_doc(flat))))
>>> back.spec == flat.spec and back.static == flat.static
True
"""

from __future__ import annotations

import collections
import sys
from typing import Any

import optree
import torch
import torch.fx as fx
import torch.utils._pytree as torch_pytree

from functrans._core.pytree import NAMESPACE, Flat, OutputAliases, TorchSpec

__all__ = [
    "CorruptEntry",
    "NotStorable",
    "decode",
    "encode",
    "flat_doc",
    "flat_of",
    "spec_doc",
    "torch_value",
]


class NotStorable(Exception):  # control flow: the graph is not stored
    """A graph (or part of it) the JSON format cannot hold exactly."""


class CorruptEntry(Exception):  # control flow: the entry is ignored
    """A stored entry that cannot be rebuilt as it was stored."""


# -- values ------------------------------------------------------------------------------------


def encode(a: Any) -> Any:
    t = type(a)
    if a is None or t in (bool, int, str):
        return a
    if t is float:
        return {"float": repr(a)}
    if t is fx.Node:
        return {"node": a.name}
    if t is list or t is fx.immutable_collections.immutable_list:
        return [encode(x) for x in a]
    if t is tuple:
        return {"tuple": [encode(x) for x in a]}
    if t is torch.dtype:
        return {"dtype": str(a).removeprefix("torch.")}
    if t is torch.device:
        return {"device": str(a)}
    if t is torch.layout:
        return {"layout": str(a).removeprefix("torch.")}
    if t is torch.memory_format:
        return {"memory_format": str(a).removeprefix("torch.")}
    if t is complex:
        return {"complex": [repr(a.real), repr(a.imag)]}
    raise NotStorable(f"an argument of type {t.__qualname__}")


def torch_value(name: Any, kind: type) -> Any:
    value = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(value, kind):
        raise CorruptEntry(f"no torch {kind.__name__} {name!r}")
    return value


def decode(a: Any, nodes: dict[str, fx.Node]) -> Any:
    if a is None or type(a) in (bool, int, str):
        return a
    if type(a) is list:
        return [decode(x, nodes) for x in a]
    if type(a) is not dict or len(a) != 1:
        raise CorruptEntry(f"an argument {a!r}")
    (tag, v), *_ = a.items()
    if tag == "node":
        if v not in nodes:
            raise CorruptEntry(f"a reference to an unknown node {v!r}")
        return nodes[v]
    if tag == "tuple":
        return tuple(decode(x, nodes) for x in v)
    if tag == "float":
        return float(v)
    if tag == "complex":
        return complex(float(v[0]), float(v[1]))
    kinds = {"dtype": torch.dtype, "layout": torch.layout, "memory_format": torch.memory_format}
    if tag in kinds:
        return torch_value(v, kinds[tag])
    if tag == "device":
        return torch.device(v)
    raise CorruptEntry(f"an argument tagged {tag!r}")


# -- pytree specs ------------------------------------------------------------------------------


class _Leaf:
    """Stands for a leaf while a spec is described."""


_LEAF = _Leaf()


def spec_doc(spec: Any) -> Any:
    tree = optree.tree_unflatten(spec, [_LEAF] * spec.num_leaves)
    doc = _describe(tree)
    if _spec_of(doc) != spec or _describe(_build(doc, _LEAF)) != doc:
        raise NotStorable(f"a pytree spec that does not round-trip: {spec}")
    return doc


def _describe(x: Any) -> Any:
    t = type(x)
    if x is _LEAF:
        return "*"
    if x is None:
        return None
    if t is tuple or t is list:
        return {t.__name__: [_describe(c) for c in x]}
    if t is dict or t is collections.OrderedDict:
        items = [[encode(k), _describe(v)] for k, v in x.items()]
        if not all(type(k) in (str, int) for k in x):
            raise NotStorable("a dict key that is not a str or int")
        return {t.__name__: items}
    if isinstance(x, tuple) and (hasattr(t, "_fields") or hasattr(t, "n_fields")):
        if _find_type(t.__module__, t.__qualname__) is not t:
            raise NotStorable(f"a {t.__qualname__} that cannot be found by its name")
        return {"struct": [t.__module__, t.__qualname__, [_describe(c) for c in x]]}
    raise NotStorable(f"a pytree node of type {t.__qualname__}")


def _find_type(module: str, qualname: str) -> Any:
    """The class ``module.qualname`` among the modules already imported (none imported)."""
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def _build(doc: Any, leaf: Any = 0) -> Any:
    if doc == "*":
        return leaf
    if doc is None:
        return None
    if type(doc) is not dict or len(doc) != 1:
        raise CorruptEntry(f"a pytree node {doc!r}")
    (tag, v), *_ = doc.items()
    if tag in ("tuple", "list"):
        return (tuple if tag == "tuple" else list)(_build(c, leaf) for c in v)
    if tag in ("dict", "OrderedDict"):
        kind = dict if tag == "dict" else collections.OrderedDict
        return kind((decode(k, {}), _build(c, leaf)) for k, c in v)
    if tag == "struct":
        module, qualname, children = v
        t = _find_type(module, qualname)
        if not (isinstance(t, type) and issubclass(t, tuple)):
            raise CorruptEntry(f"no tuple type {module}.{qualname} imported")
        built = [_build(c, leaf) for c in children]
        return t(built) if hasattr(t, "n_fields") else t(*built)
    raise CorruptEntry(f"a pytree node tagged {tag!r}")


def _spec_of(doc: Any) -> Any:
    return optree.tree_structure(_build(doc), namespace=NAMESPACE)


def flat_doc(flat: Flat) -> Any:
    if flat.wrappers:
        raise NotStorable("tensor subclass inputs or outputs")
    static = [None if t else _static(s) for s, t in zip(flat.static, flat.is_tensor, strict=True)]
    return {
        "spec": spec_doc(flat.spec),
        "is_tensor": list(flat.is_tensor),
        "static": static,
        "static_argnums": list(flat.static_argnums),
    }


def _static(s: Any) -> Any:
    if type(s) is OutputAliases:  # jit(module): which outputs are the caches passed in
        return {"static_pairs": [list(pair) for pair in s.value]}
    if type(s) is TorchSpec:
        try:
            text = torch_pytree.treespec_dumps(s.spec)
            same = torch_pytree.treespec_loads(text) == s.spec
        except Exception as e:  # a type torch cannot serialize
            raise NotStorable(f"a torch pytree spec: {e}") from e
        if not same:
            raise NotStorable(f"a torch pytree spec that does not round-trip: {s.spec}")
        return {"torch_spec": text}
    if type(s) not in (bool, int, str, float, complex, torch.dtype, torch.device):
        raise NotStorable(f"a static value of type {type(s).__qualname__}")
    return encode(s)


def _unstatic(doc: Any) -> Any:
    if type(doc) is dict and "static_pairs" in doc:
        return OutputAliases(tuple((int(j), int(i)) for j, i in doc["static_pairs"]))
    if type(doc) is dict and "torch_spec" in doc:
        return TorchSpec(torch_pytree.treespec_loads(doc["torch_spec"]))
    return decode(doc, {})


def flat_of(doc: Any) -> Flat:
    is_tensor = tuple(bool(t) for t in doc["is_tensor"])
    static = tuple(
        None if t else _unstatic(s) for s, t in zip(doc["static"], is_tensor, strict=True)
    )
    spec = _spec_of(doc["spec"])
    if spec.num_leaves != len(is_tensor):
        raise CorruptEntry("a pytree spec whose leaves do not match its flags")
    return Flat(spec, is_tensor, static, tuple(int(i) for i in doc["static_argnums"]))
