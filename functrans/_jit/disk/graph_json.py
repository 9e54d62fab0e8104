"""Traced graphs as JSON, for the on-disk trace cache: no pickle, nothing executed on load.

:func:`dump` writes a :class:`Graph` or :class:`JointGraph` as plain JSON: each node's op,
target (an ATen op by its qualified name, or ``operator.getitem``), arguments (node references,
numbers, strings, dtypes, devices, tuples and lists, tagged), its value's metadata and our
namespaced meta (roles, phases, paths, source lines, remat tags: enums by name), plus the
pytree specs of inputs and outputs (tuples, lists, dicts, None, namedtuples and torch's
structseqs of classes already imported). Tensor constants a function creates (``torch.tensor``
literals) are stored by value when small; captured tensors baked into a graph are stored as the
path from the function to them (:mod:`functrans._trace.capture`) and read again on load. Anything
else raises :class:`NotStorable`.

:func:`load` rebuilds the graph: targets are looked up in ``torch.ops`` (or the allow-list),
types among imported modules, and every ``meta["val"]`` is derived again by running the graph
on fake tensors made from the stored input metadata; a value whose shape, strides, dtype or
device differs from the stored one makes the entry invalid (:class:`CorruptEntry`). A symbolic
graph (``dynamic=``) stores its sizes as the text of their expressions (``s0``, ``2*s0``) and
its size-valued nodes (``sym_size``, ``operator.mul``) alike; it is loaded on symbolic fake
inputs its caller makes (:mod:`functrans._jit.disk.shapes`) and compared by that text.

>>> import torch, functrans as ft
>>> g = ft.trace(lambda x: x.sin() * 2)(torch.ones(3))
>>> str(load(json.loads(json.dumps(dump(g))), root_fn=None)) == str(g)
True
"""

from __future__ import annotations

import json
import math
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from functrans._core.fakes import fake_empty
from functrans._core.graph import (
    NO_GRAD,
    PATH,
    PHASE,
    RECOMPUTED,
    ROLE,
    SOURCE,
    STOPPED,
    Graph,
    JointGraph,
    Phase,
    Role,
)
from functrans._core.pytree import plain
from functrans._core.state import autocast_off
from functrans._core.tags import REMAT, REMAT_OP, Policy, RematOp
from functrans._trace.capture import Path, reach

from .tree_json import CorruptEntry, NotStorable, decode, encode, flat_doc, flat_of, torch_value

__all__ = ["CorruptEntry", "NotStorable", "check_round_trip", "dump", "load", "size_text"]

_MAX_CONSTANT = 4096  # elements of a fresh tensor constant stored by value


_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "operator.getitem": operator.getitem,
    # size arithmetic of symbolic traces (sizes handed from forward to backward)
    **{
        f"operator.{name}": getattr(operator, name)
        for name in (
            "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos",
            "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "not_",
        )
    },
    **{f"torch.{name}": getattr(torch, name) for name in (
        "sym_max", "sym_min", "sym_float", "sym_int", "sym_not", "sym_sqrt", "sym_ite"
    )},
}  # fmt: skip
_FUNCTION_NAMES = {id(f): name for name, f in _FUNCTIONS.items()}


def _target(target: Any) -> Any:
    if isinstance(target, torch._ops.OpOverload):
        return [target.namespace, target._opname, target._overloadname]
    name = _FUNCTION_NAMES.get(id(target))
    if name is None:
        raise NotStorable(f"a call to {target!r}")
    return name


def _untarget(doc: Any) -> Any:
    if isinstance(doc, str):
        if doc not in _FUNCTIONS:
            raise CorruptEntry(f"an unknown function {doc!r}")
        return _FUNCTIONS[doc]
    try:
        ns, name, overload = doc
        op = getattr(getattr(getattr(torch.ops, ns), name), overload)
    except (AttributeError, RuntimeError, TypeError, ValueError) as e:
        raise CorruptEntry(f"no op {doc!r} in torch.ops") from e
    if not isinstance(op, torch._ops.OpOverload):
        raise CorruptEntry(f"{doc!r} is not an op")
    return op


def size_text(s: Any) -> Any:
    """A size, stride or offset: an int, or a symbolic one as its expression's text."""
    if type(s) is int:
        return s
    if isinstance(s, torch.SymInt) and not free_unbacked_symbols(s):
        expr = s.node.expr
        # a symbol the trace specialised (a guard made it 16): the trace's values hold 16
        return int(expr) if expr.is_number else str(expr)
    raise NotStorable(f"a size {s!r} that depends on tensor values")


def _val(v: Any) -> Any:
    """A node value's metadata (tensors, or tuples and lists of them; symbolic sizes and
    size-valued nodes by their expressions' text)."""
    if isinstance(v, torch.Tensor):
        return {
            "tensor": [
                [size_text(s) for s in v.shape],
                [size_text(s) for s in v.stride()],
                str(v.dtype).removeprefix("torch."),
                str(v.device),
                size_text(v.storage_offset()),
                bool(v.requires_grad),
            ]
        }
    if isinstance(v, (tuple, list)):
        return {type(v).__name__: [_val(x) for x in v]}
    if v is None:
        return None
    if isinstance(v, _SYM_KINDS) and not free_unbacked_symbols(v):
        return {"sym": [type(v).__name__, str(v.node.expr)]}
    raise NotStorable(f"a node value of type {type(v).__qualname__}")


_SYM_KINDS = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _symbolic(doc: Any) -> bool:
    """Whether stored metadata (of :func:`_val`) holds a symbolic size."""
    if not isinstance(doc, dict):
        return False
    if "tensor" in doc:
        shape, stride, _, _, offset, _ = doc["tensor"]
        return any(type(s) is not int for s in (*shape, *stride, offset))
    parts = doc.get("tuple", doc.get("list"))
    return "sym" in doc or (parts is not None and any(map(_symbolic, parts)))


# -- graphs ------------------------------------------------------------------------------------


def _meta(node: fx.Node) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in node.meta.items():
        if not key.startswith("functrans."):
            continue
        if key in (ROLE, PHASE, REMAT):
            out[key] = value.name
        elif (key in (SOURCE, PATH) and isinstance(value, str)) or (
            key in (RECOMPUTED, NO_GRAD) and isinstance(value, bool)
        ):
            out[key] = value
        elif key == STOPPED and isinstance(value, tuple):
            out[key] = [int(i) for i in value]
        elif key == REMAT_OP and isinstance(value, RematOp):
            out[key] = [_target(value.op), bool(value.holds_output)]
        else:
            raise NotStorable(f"node meta {key!r} = {value!r}")
    return out


_PLAIN_META = (SOURCE, PATH, RECOMPUTED, NO_GRAD)
_ENUMS: dict[str, Any] = {ROLE: Role, PHASE: Phase, REMAT: Policy}


def _unmeta(doc: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if key in _ENUMS:
            out[key] = _ENUMS[key][value]
        elif key in _PLAIN_META:
            out[key] = value
        elif key == REMAT_OP:
            out[key] = RematOp(_untarget(value[0]), bool(value[1]))
        elif key == STOPPED and isinstance(value, list):
            out[key] = tuple(int(i) for i in value)
        else:
            raise CorruptEntry(f"node meta {key!r}")
    return out


def dump(g: Graph, root: Any = None, *, symbolic: bool = False) -> dict[str, Any]:
    """``g`` as JSON-ready data (see the module docstring); raises :class:`NotStorable`.
    ``root``: the function whose captured tensors a graph may hold (found by path);
    ``symbolic``: whether symbolic sizes may be stored (a trace with ``dynamic=``)."""
    nodes = []
    gm = g.graph_module
    for n in g.fx_graph.nodes:
        doc: dict[str, Any] = {"name": n.name, "op": n.op}
        if n.op == "call_function":
            doc["target"] = _target(n.target)
            doc["args"] = encode(tuple(n.args))
            doc["kwargs"] = {k: encode(v) for k, v in n.kwargs.items()}
        elif n.op == "output":
            doc["args"] = encode(tuple(n.args))
        elif n.op == "get_attr":
            if not str(n.target).isidentifier():
                raise NotStorable(f"a constant at {n.target!r}")
            doc["target"] = str(n.target)
            doc["constant"] = _constant(n, getattr(gm, str(n.target), None), root)
        elif n.op != "placeholder":
            raise NotStorable(f"a {n.op} node")
        if n.op != "output":
            doc["val"] = _val(n.meta.get("val"))
            if not symbolic and _symbolic(doc["val"]):
                raise NotStorable("a value with a symbolic shape")
        doc["meta"] = _meta(n)
        nodes.append(doc)
    out: dict[str, Any] = {
        "nodes": nodes,
        "in_flat": flat_doc(g.in_flat),
        "out_flat": flat_doc(g.out_flat),
    }
    if isinstance(g, JointGraph):
        out["joint"] = {
            "fn_in": flat_doc(g.fn_in),
            "fn_out": flat_doc(g.fn_out),
            "grads_flat": flat_doc(g.grads_flat),
            "num_outputs": g.num_outputs,
            "argnums": list(g.argnums),
            "differentiable": list(g.differentiable),
        }
    return out


def _constant(node: fx.Node, value: Any, root: Any) -> Any:
    """A tensor constant: by value if the function made it (``torch.tensor(...)``, which
    tracing copies through ``lift_fresh_copy``), else by its path from ``root``."""
    if not plain(value) or value.layout != torch.strided:
        raise NotStorable("a constant that is not a plain tensor")
    fresh = node.users and all(
        u.target is torch.ops.aten.lift_fresh_copy.default for u in node.users
    )
    if fresh:
        if value.numel() > _MAX_CONSTANT or value.is_complex() or value.device.type != "cpu":
            raise NotStorable("a large, complex or non-CPU tensor literal")
        data = [x if math.isfinite(x) else repr(x) for x in value.flatten().tolist()]
        return {"value": [list(value.shape), str(value.dtype).removeprefix("torch."), data]}
    if root is None:
        raise NotStorable("a captured tensor constant")
    for p in reach(root).tensors.get(id(value), []):
        steps = [[kind, key] for kind, key in p.steps]
        if all(type(k) in (str, int) for _, k in steps):
            return {"path": [steps, p.name, p.writable]}
    raise NotStorable("a captured tensor constant without a path functrans can follow")


def _unconstant(doc: Any, root: Any) -> torch.Tensor:
    if "value" in doc:
        shape, dtype, data = doc["value"]
        values = [float(x) if isinstance(x, str) else x for x in data]
        return torch.tensor(values, dtype=torch_value(dtype, torch.dtype)).reshape(shape)
    steps, name, writable = doc["path"]
    path = Path(tuple((str(k), key) for k, key in steps), str(name), bool(writable))
    try:
        value = path.read(root)
    except (LookupError, AttributeError, ValueError, TypeError) as e:
        raise CorruptEntry(f"captured tensor {name} is gone") from e
    if not plain(value):
        raise CorruptEntry(f"captured {name} is not a plain tensor")
    tensor: torch.Tensor = value
    return tensor


def load(
    doc: dict[str, Any],
    root_fn: Any,
    inputs: list[torch.Tensor] | None = None,
    *,
    verify: bool = True,
) -> Graph:
    """The graph :func:`dump` described, ``meta["val"]`` derived again on fake tensors;
    raises :class:`CorruptEntry` where it cannot be rebuilt as stored. ``root_fn``: the
    function captured tensors are read from. ``inputs``: for a symbolic graph, the fake
    tensors of its first inputs (:func:`~functrans._core.shapes.symbolic_fakes`); its other
    inputs (tangents) are made from sizes its values computed before they are read.
    ``verify=False`` (a static graph whose document is known to be what :func:`dump` wrote
    from a trace): the values are made from the stored metadata instead, without running
    the graph."""
    graph, root, vals = _rebuild(doc, root_fn)
    if inputs is None:
        (_propagate if verify else _stored_values)(graph, root, vals)
    else:
        _propagate_symbolic(graph, root, vals, inputs)
    return _wrap(doc, fx.GraphModule(root, graph))


def check_round_trip(doc: dict[str, Any], g: Graph) -> None:
    """Raise :class:`NotStorable` unless ``doc`` (:func:`dump` of ``g``, through JSON text)
    decodes to ``g``'s nodes as they are (names, ops, targets, arguments of the same types
    and values, node references, namespaced meta, constants stored by value) and to the same
    calling convention. Compared node by node on the decoded values, without building a graph
    (a few ms per thousand nodes); the names' validity as FX names is checked on load, which
    rebuilds the graph."""
    try:
        nodes = list(g.fx_graph.nodes)
        docs = doc["nodes"]
        if len(docs) != len(nodes):
            raise NotStorable(f"{len(docs)} nodes stored of {len(nodes)}")
        by_name = {n.name: n for n in nodes}
        gm = g.graph_module
        for n, nd in zip(nodes, docs, strict=True):
            why = _node_differs(n, nd, by_name, gm)
            if why is not None:
                raise NotStorable(f"the graph does not round-trip: node {n.name} {why}")
        flats = [(doc["in_flat"], g.in_flat), (doc["out_flat"], g.out_flat)]
        joint = doc.get("joint")
        if isinstance(g, JointGraph):
            if joint is None:
                raise NotStorable("the graph does not round-trip: a joint graph stored plain")
            flats += [(joint["fn_in"], g.fn_in), (joint["fn_out"], g.fn_out)]
            flats += [(joint["grads_flat"], g.grads_flat)]
            same_joint = (
                joint["num_outputs"] == g.num_outputs
                and tuple(joint["argnums"]) == tuple(g.argnums)
                and tuple(joint["differentiable"]) == tuple(g.differentiable)
            )
            if not same_joint:
                raise NotStorable("the graph does not round-trip: its joint fields differ")
        elif joint is not None:
            raise NotStorable("the graph does not round-trip: a plain graph stored joint")
        for d, f in flats:
            back = flat_of(d)
            same = back.spec == f.spec and back.is_tensor == f.is_tensor
            if not (same and flat_doc(back) == flat_doc(f)):
                raise NotStorable("the graph does not round-trip: its calling convention")
    except (CorruptEntry, KeyError, TypeError, ValueError) as e:
        raise NotStorable(f"the graph does not round-trip: {e}") from e


def _node_differs(
    n: fx.Node, nd: dict[str, Any], by_name: dict[str, fx.Node], gm: fx.GraphModule
) -> str | None:
    """How node ``n`` differs from what its stored document ``nd`` decodes to (None: not)."""
    if nd["name"] != n.name or nd["op"] != n.op:
        return f"comes back as {nd['op']} {nd['name']}"
    if n.op == "call_function":
        if _untarget(nd["target"]) is not n.target:
            return "calls another target"
        if not _same(decode(nd["args"], by_name), n.args):
            return "has other arguments"
        kwargs = {k: decode(v, by_name) for k, v in nd["kwargs"].items()}
        if kwargs.keys() != n.kwargs.keys() or not all(
            _same(kwargs[k], n.kwargs[k]) for k in kwargs
        ):
            return "has other keyword arguments"
    elif n.op == "output":
        if not _same(decode(nd["args"], by_name), n.args):
            return "returns other values"
    elif n.op == "get_attr":
        if nd["target"] != n.target:
            return "reads another attribute"
        constant = nd["constant"]
        if "value" in constant:
            value = getattr(gm, str(n.target))
            back = _unconstant(constant, None)
            same = back.dtype == value.dtype and back.shape == value.shape
            if not (same and torch.equal(_bits(back), _bits(value))):
                return "holds another constant"
    ours = {k: v for k, v in n.meta.items() if k.startswith("functrans.")}
    if _unmeta(nd["meta"]) != ours:
        return "has other meta"
    return None


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (``-0.0`` is not ``0.0``, a NaN is itself)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(a: Any, b: Any) -> bool:
    """Whether decoded argument ``a`` is ``b``: the same types (a list and FX's immutable list
    alike), nodes by identity, floats and complex numbers by ``repr`` (``-0.0``, ``nan``)."""
    ta, tb = type(a), type(b)
    if ta is fx.Node or tb is fx.Node:
        return a is b
    if (ta in _LISTS and tb in _LISTS) or ta is tb is tuple:
        return len(a) == len(b) and all(map(_same, a, b))
    if ta is not tb:
        return False
    if ta is float or ta is complex:
        return repr(a) == repr(b)
    return bool(a == b)


_LISTS = (list, fx.immutable_collections.immutable_list)


def _wrap(doc: dict[str, Any], gm: fx.GraphModule) -> Graph:
    in_flat, out_flat = flat_of(doc["in_flat"]), flat_of(doc["out_flat"])
    joint = doc.get("joint")
    if joint is None:
        return Graph(gm, in_flat, out_flat)
    return JointGraph(
        gm,
        in_flat,
        out_flat,
        fn_in=flat_of(joint["fn_in"]),
        fn_out=flat_of(joint["fn_out"]),
        grads_flat=flat_of(joint["grads_flat"]),
        num_outputs=int(joint["num_outputs"]),
        argnums=tuple(int(i) for i in joint["argnums"]),
        differentiable=tuple(bool(d) for d in joint["differentiable"]),
    )


def _rebuild(
    doc: dict[str, Any], root_fn: Any
) -> tuple[fx.Graph, torch.nn.Module, list[tuple[fx.Node, Any]]]:
    graph = fx.Graph()
    root = torch.nn.Module()
    nodes: dict[str, fx.Node] = {}
    vals: list[tuple[fx.Node, Any]] = []
    constants: dict[str, Any] = {}
    for nd in doc["nodes"]:
        op, name = nd["op"], nd["name"]
        if op == "placeholder":
            n = graph.placeholder(name)
        elif op == "call_function":
            args = decode(nd["args"], nodes)
            kwargs = {k: decode(v, nodes) for k, v in nd["kwargs"].items()}
            n = graph.create_node(op, _untarget(nd["target"]), args, kwargs, name=name)
        elif op == "get_attr":
            attr = str(nd["target"])
            if not attr.isidentifier() or (attr in constants and constants[attr] != nd["constant"]):
                raise CorruptEntry(f"a constant at {attr!r}")
            if attr not in constants:  # several nodes may read one constant
                value = _unconstant(nd["constant"], root_fn)
                setattr(root, attr, value)
                constants[attr] = nd["constant"]
            n = graph.create_node(op, attr, name=name)
        elif op == "output":
            n = graph.output(decode(nd["args"], nodes)[0])
        else:
            raise CorruptEntry(f"a {op!r} node")
        if n.name != name:
            raise CorruptEntry(f"node {name!r} came back as {n.name!r}")
        n.meta.update(_unmeta(nd["meta"]))
        nodes[name] = n
        if op != "output":
            vals.append((n, nd["val"]))
    return graph, root, vals


def _fake_input(mode: FakeTensorMode, doc: Any, syms: dict[str, Any] | None = None) -> torch.Tensor:
    if type(doc) is not dict or "tensor" not in doc:
        raise CorruptEntry(f"a placeholder value {doc!r}")
    shape, stride, dtype, device, offset, requires_grad = doc["tensor"]
    kind = torch_value(dtype, torch.dtype)
    if syms is not None and _symbolic(doc):
        shape, stride = [_unsize(s, syms) for s in shape], [_unsize(s, syms) for s in stride]
        if offset != 0:
            raise CorruptEntry(f"a symbolic value at offset {offset!r}")
    if any(isinstance(s, torch.SymInt) for s in (*shape, *stride)):
        with mode:
            t = torch.empty_strided(shape, stride, dtype=kind, device=device)
    else:
        t = fake_empty(mode, shape, stride, kind, device, offset=offset)
    return t.requires_grad_(True) if requires_grad else t


def _unsize(s: Any, syms: dict[str, Any]) -> Any:
    """A stored size: an int, or the symbolic size of that text a value computed before."""
    if type(s) is int:
        return s
    if isinstance(s, str) and s in syms:
        return syms[s]
    raise CorruptEntry(f"a size {s!r} no value computes")


def _fake_value(mode: FakeTensorMode, doc: Any, syms: dict[str, Any] | None = None) -> Any:
    """A fake value made from stored metadata (tensors, tuples and lists of them)."""
    if isinstance(doc, dict) and ("tuple" in doc or "list" in doc):
        parts: list[Any] = doc["tuple"] if "tuple" in doc else doc["list"]
        items = [_fake_value(mode, d, syms) for d in parts]
        return tuple(items) if "tuple" in doc else items
    if isinstance(doc, dict) and "sym" in doc:
        return _unsize(doc["sym"][1], syms or {})
    return None if doc is None else _fake_input(mode, doc, syms)


def _stored_values(graph: fx.Graph, root: torch.nn.Module, vals: list[tuple[fx.Node, Any]]) -> None:
    """Set every node's ``meta["val"]`` to a fake tensor made from its stored metadata (a
    constant's from the tensor itself, checked against the stored metadata). Running the ops
    again (:func:`_propagate`) costs a fake-tensor dispatch per node, about 0.4 ms each: most
    of a load."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with autocast_off(), torch.no_grad():
        for n, stored in vals:
            if n.op == "get_attr":
                value = mode.from_tensor(getattr(root, str(n.target)).detach())
                got = _val(value)
                if json.dumps(got) != json.dumps(stored):
                    raise CorruptEntry(f"constant {n.name} is now {got}, stored as {stored}")
            else:
                value = _fake_value(mode, stored)
            n.meta["val"] = value


def _propagate(graph: fx.Graph, root: torch.nn.Module, vals: list[tuple[fx.Node, Any]]) -> None:
    """Set every node's ``meta["val"]`` by running the graph on fake tensors; check each
    against the stored metadata."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    env: dict[fx.Node, Any] = {}
    with autocast_off(), torch.no_grad():
        for n, stored in vals:
            if n.op == "placeholder":
                value = _fake_input(mode, stored)
            elif n.op == "get_attr":
                value = mode.from_tensor(getattr(root, str(n.target)).detach())
            else:
                args, kwargs = fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
                try:
                    with mode:
                        value = n.target(*args, **kwargs)  # type: ignore[operator]  # fx types target as str | Callable; here it is an op
                except Exception:  # an op fake tensors cannot run (as traced: bernoulli.p)
                    value = _fake_value(mode, stored)
            got = _val(value)
            if json.dumps(got) != json.dumps(stored):
                raise CorruptEntry(f"node {n.name} now gives {got}, stored as {stored}")
            n.meta["val"] = value
            env[n] = value


def _propagate_symbolic(
    graph: fx.Graph, root: torch.nn.Module, vals: list[tuple[fx.Node, Any]], inputs: list[Any]
) -> None:
    """:func:`_propagate` for a symbolic graph: its first placeholders take ``inputs``, the
    others are made when first read, from the symbolic sizes the values before computed
    (what a joint graph's tangents have: its outputs' sizes). Values are compared with the
    stored ones by the text of their sizes' expressions."""
    mode = getattr(inputs[0], "fake_mode", None) if inputs else None
    if mode is None or getattr(mode, "shape_env", None) is None:
        raise CorruptEntry("symbolic inputs without a shape environment")
    stored = dict(vals)
    env: dict[fx.Node, Any] = {}
    pool: list[torch.SymInt] = []  # every symbolic size computed so far
    given = iter(inputs)
    pending: set[fx.Node] = set()

    def syms() -> dict[str, Any]:  # by their text now (later guards may rename a symbol)
        return {str(s.node.expr): s for s in pool}

    def done(n: fx.Node, value: Any) -> None:
        n.meta["val"] = value
        env[n] = value
        pool.extend(_sizes_of(value))

    def read(n: fx.Node) -> Any:
        if n in pending:  # a tangent: made from sizes computed by now
            pending.discard(n)
            done(n, _fake_input(mode, stored[n], syms()))
        return env[n]

    with autocast_off(), torch.no_grad():
        for n, doc in vals:
            if n.op == "placeholder":
                t = next(given, None)
                if t is None:
                    pending.add(n)
                    continue
                if type(doc) is not dict or "tensor" not in doc:
                    raise CorruptEntry(f"a placeholder value {doc!r}")
                value = t.requires_grad_(bool(doc["tensor"][5]))
            elif n.op == "get_attr":
                value = _static_fake(mode, getattr(root, str(n.target)).detach())
            else:
                args, kwargs = fx.node.map_arg((n.args, n.kwargs), read)
                try:
                    with mode:
                        value = n.target(*args, **kwargs)  # type: ignore[operator]  # fx types target as str | Callable; here it is an op
                except Exception:  # an op fake tensors cannot run (as traced: bernoulli.p)
                    value = _fake_value(mode, doc, syms())
            done(n, value)
        if next(given, None) is not None:
            raise CorruptEntry("more symbolic inputs than placeholders")
        for n in [n for n, _ in vals if n in pending]:
            read(n)
    # compared at the end, as stored: a guard met later (x @ w: w.shape[0] == x.shape[1])
    # renames symbols in the values before it
    for n, doc in vals:
        got = _val(env[n])
        if json.dumps(got) != json.dumps(doc):
            raise CorruptEntry(f"node {n.name} now gives {got}, stored as {doc}")


def _sizes_of(value: Any) -> list[torch.SymInt]:
    if isinstance(value, torch.Tensor):
        found = [*value.shape, *value.stride(), value.storage_offset()]
    elif isinstance(value, (tuple, list)):
        return [s for v in value for s in _sizes_of(v)]
    else:
        found = [value]
    return [s for s in found if isinstance(s, torch.SymInt)]


def _static_fake(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    """A fake of a constant in a symbolic mode: static sizes (as tracing gave it)."""
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    ctx: Any = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.STATIC] * t.dim())
    return mode.from_tensor(t, symbolic_context=ctx)
