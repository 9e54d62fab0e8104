"""The IR: :class:`Graph` (a traced ATen FX graph with pytree calling convention) and
:class:`JointGraph` (forward+backward in one graph), node roles and phases, ``verify``.

Roles and phases live under namespaced meta keys; nothing in functrans matches on node names.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from .describe import describe
from .dtypes import differentiable as is_differentiable
from .errors import FunctransError
from .format import format_graph
from .ops import is_view_op
from .pytree import Flat, check_matches, unflatten
from .shapes import ShapeGuard, readable, shape_env_of

__all__ = [
    "PHASE",
    "RECOMPUTED",
    "ROLE",
    "SOURCE",
    "Attachment",
    "Graph",
    "GraphError",
    "JointGraph",
    "Phase",
    "Role",
    "check_tensors",
    "copy_joint",
    "lazy_module",
    "verify",
]

ROLE = "functrans.role"  # placeholder role: Role
PHASE = "functrans.phase"  # node phase in a joint graph: Phase
RECOMPUTED = "functrans.recomputed"  # True on forward nodes re-emitted in a backward graph
SOURCE = "functrans.source"  # "file:line: code" of the user line that produced the node
PATH = "functrans.path"  # placeholder: the user's argument path, e.g. "x" or "params['w']"
#: on a result of an outlined block call (:mod:`functrans._jit.outline`): the op that made the
#: value inside the block, for reports ("aten.addmm.default")
MADE_BY = "functrans.made_by"
#: on a call of a compiled graph of its own (an outlined block): True where the backend's
#: program hands the call its inputs (:data:`functrans.extend.HANDOVER_OPS`), so those whose
#: last use it is die inside it; else the dispatcher holds them until it returns
HANDED_OVER = "functrans.handed_over"
#: on a forward node of a joint graph whose value autograd did not record though an input
#: requires grad (an op under ``torch.no_grad()``, a ``detach``): True. The joint's backward
#: already holds no gradient through it; a transform that differentiates the forward again
#: (a step compiled in stages) must detach its inputs there
NO_GRAD = "functrans.no_grad"
#: on a forward node: the positions (among its node arguments, args then kwargs, in order)
#: whose argument reached it through a ``detach`` the trace dropped as a rename (the
#: gradient stops on that edge only); absent where none did
STOPPED = "functrans.stopped"


def argument_nodes(node: fx.Node) -> list[fx.Node]:
    """The nodes ``node`` reads, in the order of its arguments (args, then kwargs), each as
    often as it appears: the positions :data:`STOPPED` counts."""
    found: list[fx.Node] = []

    def visit(a: fx.Node) -> fx.Node:
        found.append(a)
        return a

    fx.node.map_arg((node.args, node.kwargs), visit)
    return found


_T = TypeVar("_T")


class Attachment(Generic[_T]):
    """A typed value a higher layer keeps on a :class:`JointGraph`, declared once (named,
    typed, with a default) by the module that owns it: the regions a trace's region ops call
    (:mod:`functrans._trace.regions`), the cut regions an outlined step calls
    (:mod:`functrans._jit.outline`), a value derived from the graph (the cut problem). The
    core knows none of their types. ``copied``: :func:`copy_joint` carries it to the copy
    (what the graph's ops refer to); otherwise it is this graph's alone (derived from its
    nodes, it lives and dies with them: a module-level cache keyed weakly by the graph, whose
    value refers to the graph, would keep every graph alive).

    >>> import torch, functrans as ft
    >>> note = Attachment("doctest note", 0, copied=True)
    >>> jg = ft.joint(lambda x: x.sin().sum())(torch.ones(2))
    >>> jg.attached(note)
    0
    >>> jg.attach(note, 3)
    >>> jg.attached(note), copy_joint(jg).attached(note)
    (3, 3)
    """

    __slots__ = ("copied", "default", "name")

    def __init__(self, name: str, default: _T, *, copied: bool = False) -> None:
        self.name, self.default, self.copied = name, default, copied

    def __repr__(self) -> str:
        return f"Attachment({self.name!r})"


def lazy_module(root: torch.nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """An ``fx.GraphModule`` of ``graph`` (constants from ``root``) whose Python code is
    generated when it is first run or its code read, not now: most graphs a trace makes go
    through a pass or two and are never run, and code generation costs as much as a pass (a
    16-block GPT's joint graph: 0.08 s each time).

    >>> import torch, torch.fx as fx
    >>> g = fx.Graph()
    >>> x = g.placeholder("x")
    >>> _ = g.output(g.call_function(torch.neg, (x,)))
    >>> lazy_module(torch.nn.Module(), g)(torch.ones(2))
    tensor([-1., -1.])
    """
    return _LazyGraphModule(root, graph)


class Role(enum.Enum):
    """What a placeholder holds, stored under ``node.meta[ROLE]``.

    >>> import torch, functrans as ft
    >>> from functrans.extend import ROLE
    >>> jg = ft.joint(lambda x: x.sin().sum())(torch.ones(3))
    >>> [(n.name, n.meta[ROLE]) for n in jg.placeholders()]
    [('primals_1', <Role.PRIMAL: 'primal'>), ('tangents_1', <Role.TANGENT: 'tangent'>)]
    """

    PRIMAL = "primal"  # an input of the user's function
    TANGENT = "tangent"  # an incoming gradient (cotangent) of a forward output
    SAVED = "saved"  # a forward value handed to a backward graph


class Phase(enum.Enum):
    """Which half of the joint computation a node belongs to, decided by data flow; stored
    under ``node.meta[PHASE]``.

    >>> import torch, functrans as ft
    >>> from functrans.extend import PHASE, Phase
    >>> jg = ft.joint(lambda x: x.sin().sum())(torch.ones(3))
    >>> [n.name for n in jg.ops() if n.meta[PHASE] is Phase.BACKWARD]
    ['expand', 'mul']
    """

    FORWARD = "forward"  # depends on no tangent
    BACKWARD = "backward"  # depends on some tangent


class GraphError(FunctransError):
    """A graph that breaks an IR invariant (raised by :func:`verify`)."""


class Graph:
    """A traced function: an ATen ``fx.GraphModule`` plus its pytree calling convention.

    Calling it runs it with the same arguments the traced function took; static (non-tensor)
    leaves, shapes and dtypes must match what was traced.

    >>> import torch, functrans as ft
    >>> g = ft.trace(lambda x: x.sin() * 2)(torch.ones(3))
    >>> print(g)
    def forward(x: "f32[3]"):
        sin: "f32[3]" = aten.sin.default(x)
        mul: "f32[3]" = aten.mul.Tensor(sin, 2)
        return (mul,)
    >>> g(torch.zeros(3))
    tensor([0., 0., 0.])
    """

    def __init__(
        self,
        graph: fx.GraphModule | fx.Graph,
        in_flat: Flat,
        out_flat: Flat,
        *,
        root: torch.nn.Module | None = None,
    ) -> None:
        if not isinstance(graph, (fx.GraphModule, fx.Graph)):
            raise GraphError(
                f"{type(self).__name__}: graph={describe(graph)} is not accepted; graph must be "
                "a torch.fx.GraphModule or torch.fx.Graph"
            )
        # A bare fx.Graph (plus the module holding its constants) is compiled to Python only
        # when first run: partitions that are only inspected never pay for code generation.
        self._gm = graph if isinstance(graph, fx.GraphModule) else None
        self._graph = graph.graph if isinstance(graph, fx.GraphModule) else graph
        self._root = root
        self._in = in_flat
        self._out = out_flat

    @property
    def graph_module(self) -> fx.GraphModule:
        if self._gm is None:
            self._gm = lazy_module(self._root or torch.nn.Module(), self._graph)
        return self._gm

    @property
    def fx_graph(self) -> fx.Graph:
        return self._graph

    @property
    def in_flat(self) -> Flat:
        """How call arguments ``(args, kwargs)`` flatten into the graph's inputs."""
        return self._in

    @property
    def out_flat(self) -> Flat:
        """How the graph's flat outputs rebuild the result pytree."""
        return self._out

    @property
    def in_spec(self) -> Any:
        return self._in.spec

    @property
    def out_spec(self) -> Any:
        return self._out.spec

    def placeholders(self) -> list[fx.Node]:
        return [n for n in self._graph.nodes if n.op == "placeholder"]

    def output_nodes(self) -> list[Any]:
        """The flat values the graph returns (nodes, or None)."""
        out = next(n for n in reversed(self._graph.nodes) if n.op == "output")
        return list(out.args[0])

    def ops(self) -> Iterator[fx.Node]:
        return (n for n in self._graph.nodes if n.op == "call_function")

    def run_flat(self, *tensors: torch.Tensor) -> list[Any]:
        """Run on flat tensor inputs (one per placeholder, with the shapes and dtypes it was
        traced with), return flat outputs (no pytree handling)."""
        placeholders = self.placeholders()
        what = f"{type(self).__name__}.run_flat"
        if len(tensors) != len(placeholders):
            raise GraphError(
                f"{what}: got {len(tensors)} inputs; the graph takes {len(placeholders)} "
                f"({', '.join(n.name for n in placeholders)})"
            )
        for node, t in zip(placeholders, tensors, strict=True):
            if not isinstance(t, (torch.Tensor, int)):
                raise GraphError(f"{what}: input {node.name} is {describe(t)}; expected a tensor")
        return list(self.graph_module(*check_tensors(placeholders, list(tensors), what)))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tensors = check_matches(self._in, (args, kwargs), type(self).__name__)
        tensors = check_tensors(self.placeholders(), tensors, type(self).__name__)
        return unflatten(self._out, list(self.graph_module(*tensors)))

    def __str__(self) -> str:
        marks = {n: "recomputed" for n in self._graph.nodes if n.meta.get(RECOMPUTED)}
        return format_graph(self._graph, marks)

    def __repr__(self) -> str:
        n = sum(1 for _ in self.ops())
        return f"<{type(self).__name__} with {len(self.placeholders())} inputs and {n} ops>"

    def verify(self) -> None:
        """Check the graph's invariants; raise :class:`GraphError` on the first violation."""
        verify(self)


class JointGraph(Graph):
    """Forward and backward in one graph: ``(primals, tangents) -> (outputs, grads)``.

    ``primals`` is the tuple of the function's positional arguments, ``tangents`` a tuple with one
    cotangent per floating-point output leaf (in flattening order). ``grads`` holds one gradient
    per floating-point tensor leaf of the differentiated arguments (None for other leaves).
    ``differentiable`` says, per flat forward output, whether it required grad when traced (as
    eager autograd would set ``requires_grad``): False for integer outputs and for outputs made
    under ``torch.no_grad()`` or detached inside the function; their tangents go unused.

    >>> import torch, functrans as ft
    >>> jg = ft.joint(lambda x: x.sin().sum())(torch.ones(3))
    >>> [n.name for n in jg.primals()], [n.name for n in jg.tangents()], jg.num_outputs
    (['primals_1'], ['tangents_1'], 1)
    >>> jg.differentiable
    (True,)
    >>> jg((torch.zeros(3),), (torch.tensor(1.0),))  # (outputs, grads): d sum(sin x) = cos x
    (tensor(0.), (tensor([1., 1., 1.]),))
    """

    def __init__(
        self,
        graph_module: fx.GraphModule,
        in_flat: Flat,
        out_flat: Flat,
        *,
        fn_in: Flat,
        fn_out: Flat,
        grads_flat: Flat,
        num_outputs: int,
        argnums: tuple[int, ...],
        differentiable: tuple[bool, ...] | None = None,
    ) -> None:
        super().__init__(graph_module, in_flat, out_flat)
        self.fn_in = fn_in  # the user function's (args, kwargs)
        self.fn_out = fn_out  # the user function's outputs
        self.grads_flat = grads_flat  # structure of the grads result
        self.num_outputs = num_outputs  # flat forward outputs; the rest of the outputs are grads
        self.argnums = argnums
        if differentiable is None:  # every floating-point or complex output
            vals = [getattr(n, "meta", {}).get("val") for n in self.forward_outputs()]
            differentiable = tuple(is_differentiable(v) for v in vals)
        self.differentiable = differentiable
        #: what higher layers keep on it (:class:`Attachment`), by their declared keys
        self._attached: dict[Attachment[Any], Any] = {}

    def attached(self, key: Attachment[_T]) -> _T:
        """The value ``key``'s owner attached (its default where none)."""
        value: _T = self._attached.get(key, key.default)
        return value

    def attach(self, key: Attachment[_T], value: _T) -> None:
        """Attach ``value`` under ``key`` (replacing what was)."""
        self._attached[key] = value

    def primals(self) -> list[fx.Node]:
        return [n for n in self.placeholders() if n.meta[ROLE] is Role.PRIMAL]

    def tangents(self) -> list[fx.Node]:
        return [n for n in self.placeholders() if n.meta[ROLE] is Role.TANGENT]

    def forward_outputs(self) -> list[Any]:
        return self.output_nodes()[: self.num_outputs]

    def grad_outputs(self) -> list[Any]:
        return self.output_nodes()[self.num_outputs :]

    def forward_nodes(self) -> list[fx.Node]:
        return [n for n in self._graph.nodes if n.meta.get(PHASE) is Phase.FORWARD]

    def backward_nodes(self) -> list[fx.Node]:
        return [n for n in self._graph.nodes if n.meta.get(PHASE) is Phase.BACKWARD]

    def absent_grads(self) -> tuple[int, ...]:
        """Indices (into :meth:`grad_outputs`) of the gradients no output depends on: zeros
        filled without a tangent (a gradient is linear in the tangents, so one computed from
        none is structurally zero). Eager autograd leaves them ``None``; ``jit`` does too.

        >>> import torch, functrans as ft
        >>> jg = ft.joint(lambda a, b: a.sin().sum(), argnums=(0, 1))(torch.ones(3), torch.ones(2))
        >>> jg.absent_grads()
        (1,)
        """
        return tuple(i for i, g in enumerate(self.grad_outputs()) if _zero_fill(g))

    def grad_tangents(self) -> tuple[frozenset[int], ...]:
        """Per gradient output, the tangents (indices into :meth:`tangents`) it is computed
        from: a gradient is linear in the tangents, so with all of those zero it is zero, and
        eager autograd, which finds the input unreachable from those outputs, leaves it None.

        >>> import torch, functrans as ft
        >>> jg = ft.joint(lambda a, b: (a.sin().sum(), b.cos().sum()), argnums=(0, 1))(
        ...     torch.ones(3), torch.ones(2)
        ... )
        >>> jg.grad_tangents()
        (frozenset({0}), frozenset({1}))
        """
        tangents = {n: i for i, n in enumerate(self.tangents())}
        reached: dict[fx.Node, frozenset[int]] = {}
        empty: frozenset[int] = frozenset()
        for node in self._graph.nodes:
            if node in tangents:
                reached[node] = frozenset((tangents[node],))
            else:
                parents = [reached[a] for a in node.all_input_nodes if reached.get(a)]
                reached[node] = frozenset().union(*parents) if parents else empty
        return tuple(
            reached.get(g, empty) if isinstance(g, fx.Node) else empty for g in self.grad_outputs()
        )


def copy_joint(jg: JointGraph) -> JointGraph:
    """A copy of ``jg`` with a graph of its own: the nodes copied (their meta shallowly, the
    values shared), the rest of its record the same, and the attachments its ops refer to
    (those declared ``copied``); what was derived from its nodes is not carried (what a pass
    that rewrites a joint graph starts from: passes are pure).

    >>> import torch, functrans as ft
    >>> jg = ft.joint(lambda x: x.sin().sum())(torch.ones(2))
    >>> copy_joint(jg).fx_graph is not jg.fx_graph, str(copy_joint(jg)) == str(jg)
    (True, True)
    """
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(jg.fx_graph, env, return_output_node=True)
    assert isinstance(out, tuple)
    result, old = out
    graph._codegen = jg.fx_graph._codegen  # how its code takes and returns pytrees
    new = graph.output(result, type_expr=getattr(old, "type", None))
    new.meta = dict(old.meta)
    gm = fx.GraphModule(jg.graph_module, graph)
    copy = JointGraph(
        gm,
        jg.in_flat,
        jg.out_flat,
        fn_in=jg.fn_in,
        fn_out=jg.fn_out,
        grads_flat=jg.grads_flat,
        num_outputs=jg.num_outputs,
        argnums=jg.argnums,
        differentiable=jg.differentiable,
    )
    copy._attached = {k: v for k, v in jg._attached.items() if k.copied}
    return copy


_ZERO_FILLS = frozenset(
    {
        torch.ops.aten.full_like.default,
        torch.ops.aten.zeros_like.default,
        torch.ops.aten.full.default,
        torch.ops.aten.zeros.default,
        torch.ops.aten.new_zeros.default,
    }
)


def _zero_fill(node: Any) -> bool:
    """A forward-phase node (no tangent reaches it) that fills zeros, through views."""
    while isinstance(node, fx.Node) and node.meta.get(PHASE) is Phase.FORWARD:
        if node.target in _ZERO_FILLS:
            fill = node.args[1] if node.target in _FILL_VALUE and len(node.args) > 1 else 0
            return isinstance(fill, (int, float)) and fill == 0
        if not is_view_op(node):
            return False
        node = node.args[0]
    return False


_FILL_VALUE = frozenset({torch.ops.aten.full_like.default, torch.ops.aten.full.default})


def check_tensors(
    placeholders: list[fx.Node], tensors: list[torch.Tensor], what: str = "graph"
) -> list[torch.Tensor]:
    """Check shapes and dtypes; hand over inputs in the memory layout they were traced with
    (views in the graph may depend on it)."""
    vals = [n.meta.get("val") for n in placeholders]
    env = shape_env_of(vals)
    if env is not None:
        return _check_symbolic(placeholders, vals, tensors, env)
    out = []
    for node, t in zip(placeholders, tensors, strict=True):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and (val.shape != t.shape or val.dtype != t.dtype):
            where = node.meta.get(PATH, node.name)
            raise FunctransError(
                f"{what}: input {where} was traced as {_short(val)} but got {_short(t)}; graphs "
                "are specialized to shapes and dtypes: trace again for new ones."
            )
        out.append(restride(t, val) if isinstance(val, torch.Tensor) else t)
    return out


def _check_symbolic(
    placeholders: list[fx.Node], vals: list[Any], tensors: list[torch.Tensor], env: Any
) -> list[torch.Tensor]:
    """:func:`check_tensors` for a graph with symbolic sizes: dtypes, then the guards its
    trace recorded (static sizes and strides, relations between the symbolic ones)."""
    out = []
    for node, val, t in zip(placeholders, vals, tensors, strict=True):
        if isinstance(val, torch.Tensor):
            if val.dtype != t.dtype or val.dim() != t.dim():
                where = node.meta.get(PATH, node.name)
                raise FunctransError(
                    f"input {where} was traced as {val.dtype} with {val.dim()} dimensions but "
                    f"got {_short(t)}"
                )
            if t.numel() == 0:  # strides of an empty tensor vary: give it the usual ones
                t = t.new_empty(t.shape)
            elif val.is_contiguous() and not t.is_contiguous():
                t = t.contiguous()
        out.append(t)
    guard = ShapeGuard.of(vals, env)
    if not guard.matches(out):
        names = [n.meta.get(PATH, n.name) for n in placeholders]
        shapes = ", ".join(
            f"{name}: {list(t.shape)}"
            for name, t in zip(names, out, strict=True)
            if isinstance(t, torch.Tensor)
        )
        fixed = [
            f"{name}.shape[{d}] == {size}"
            for name, sizes in zip(names, guard.sizes, strict=True)
            for d, size in enumerate(sizes)
            if size is not None
        ]
        conditions = " and ".join([*fixed, readable(guard.expression, names)])
        raise FunctransError(
            f"these inputs ({shapes}) break the conditions the graph was traced under: "
            f"{conditions}; trace again for them."
        )
    return out


def restride(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` with ``like``'s strides (a copy only when they differ)."""
    if t.stride() == like.stride() or t.numel() <= 1:
        return t
    if like.is_contiguous():
        return t.contiguous()
    return torch.empty_strided(t.shape, like.stride(), dtype=t.dtype, device=t.device).copy_(t)


def _short(t: torch.Tensor) -> str:
    return f"{t.dtype} {list(t.shape)}"


def assign_phases(graph: fx.Graph) -> None:
    """Tag every node FORWARD or BACKWARD by data flow: BACKWARD iff it depends on a tangent."""
    for node in graph.nodes:
        if node.op == "output":
            continue
        backward = node.meta.get(ROLE) is Role.TANGENT or any(
            a.meta.get(PHASE) is Phase.BACKWARD for a in node.all_input_nodes
        )
        node.meta[PHASE] = Phase.BACKWARD if backward else Phase.FORWARD


def verify(graph: Graph) -> None:
    """Check FX well-formedness plus functrans invariants.

    - the FX graph lints and every value node carries ``meta["val"]``;
    - every placeholder has a role;
    - in a joint graph, phases agree with data flow (a node is BACKWARD iff it depends on a
      tangent); a backward graph never takes primals.

    >>> import torch, functrans as ft
    >>> ft.joint(lambda x: x.exp().sum())(torch.ones(2)).verify()
    """
    if not isinstance(graph, Graph):
        raise GraphError(
            f"verify: graph={describe(graph)} is not accepted; graph must be a functrans Graph "
            "(what ft.trace, ft.joint or ft.partition produce)"
        )
    g = graph.fx_graph
    try:
        g.lint()
    except Exception as e:  # fx raises bare RuntimeError
        raise GraphError(f"FX lint failed: {e}") from e
    for node in g.nodes:
        if node.op != "output" and "val" not in node.meta:
            raise GraphError(f"node {node.name} ({node.target}) has no meta['val']")
        if node.op == "placeholder" and not isinstance(node.meta.get(ROLE), Role):
            raise GraphError(f"placeholder {node.name} has no {ROLE!r} meta")
    if isinstance(graph, JointGraph):
        _verify_phases(g.nodes)


def _verify_phases(nodes: Iterable[fx.Node]) -> None:
    for node in nodes:
        if node.op == "output":
            continue
        expect = node.meta.get(ROLE) is Role.TANGENT or any(
            a.meta.get(PHASE) is Phase.BACKWARD for a in node.all_input_nodes
        )
        got = node.meta.get(PHASE)
        if got is not (Phase.BACKWARD if expect else Phase.FORWARD):
            raise GraphError(f"node {node.name} has phase {got}, but data flow says otherwise")


def ancestors(
    roots: Iterable[Any],
    stop: set[fx.Node],
    inputs: Callable[[fx.Node], Iterable[fx.Node]] | None = None,
) -> set[fx.Node]:
    """All nodes reachable backwards from ``roots`` through inputs, not crossing ``stop`` (the
    ``stop`` nodes reached are included, their inputs are not). ``inputs(node)``: the inputs
    to follow (a node's ``all_input_nodes`` by default).

    >>> import torch, functrans as ft
    >>> g = ft.trace(lambda x: x.sin().exp() + x.cos())(torch.ones(3))
    >>> nodes = {n.name: n for n in g.fx_graph.nodes}
    >>> sorted(n.name for n in ancestors([nodes["add"]], stop={nodes["sin"]}))
    ['add', 'cos', 'exp', 'sin', 'x']
    >>> sorted(n.name for n in ancestors([nodes["exp"]], stop={nodes["sin"]}))
    ['exp', 'sin']
    """
    seen: set[fx.Node] = set()
    todo = [r for r in roots if isinstance(r, fx.Node)]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n not in stop:
            todo.extend(n.all_input_nodes if inputs is None else inputs(n))
    return seen
