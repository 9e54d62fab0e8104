"""``trace(f)(*args)``: a Python function on pytrees of tensors -> a functional ATen :class:`Graph`.

Tracing runs ``f`` once under ``make_fx`` in fake mode (no real compute), with decompositions
down to core ATen. A second pass through functionalization removes in-place ops on
intermediates; in-place mutation of an *input* is rejected with a :class:`TraceError` naming the
op and the argument. How one ``make_fx`` run is set up (the lock, the modes inside the traced
function, the errors it translates) is :mod:`functrans._trace.trace_run`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx

from functrans._core.context import is_tracing, user_frame
from functrans._core.describe import check_numpy_leaves
from functrans._core.errors import InvalidArgumentError, TraceError, UnsupportedOpError
from functrans._core.format import op_name
from functrans._core.graph import SOURCE, Graph, Role
from functrans._core.logs import log
from functrans._core.marks import read
from functrans._core.ops import is_view_op
from functrans._core.pytree import NAMESPACE, Flat, Wrapper, flatten, unflatten
from functrans._core.shapes import (
    Dynamic,
    SizeConstants,
    has_unbacked,
    is_symbolic,
    refuse_size_outputs,
    resolve,
    symbolic_fakes,
)
from functrans._core.stack import current_stack, describe_stack
from functrans._core.state import autocast_off
from functrans._core.validate import (
    check_bool,
    check_callable,
    check_static_argnums,
    check_static_range,
)
from functrans._core.zero_tensors import views_reach_fake_modes

from .decomp import Decompositions, decomposition_table
from .escape import refuse_escapes
from .extensions import active
from .passes import InputSpec, canonicalize, identifier, out_of_place
from .record import inputs_first, inputs_recorded, known_inputs
from .trace_run import TRACE_LOCK, in_traced_function, lazy_modules, run_traced

__all__ = [
    "ArgPaths",
    "Decompositions",
    "InputMutation",
    "arg_names",
    "check_inputs",
    "flatten_args",
    "in_traced_function",
    "is_tracing",
    "trace",
    "trace_module",
    "user_frame",
]

# a view of forward mode's zero tangent must stay a fake tensor in every trace (and retrace)
views_reach_fake_modes()


@dataclass(frozen=True)
class ArgPaths:
    """Left on a function whose arguments a transform re-packed (``jit`` traces its function
    through flat tensor tuples): the readable paths of its tensor leaves, in order, that
    :func:`arg_names` answers instead of the function's own parameter names."""

    paths: tuple[str, ...]


def arg_names(f: Callable[..., Any], flat: Flat, *, every_leaf: bool = False) -> list[str]:
    """Readable paths (``x``, ``params['w']``) for the tensor leaves of ``(args, kwargs)``
    (for all leaves with ``every_leaf``)."""
    given = read(f, ArgPaths)  # left by transforms that re-pack arguments
    if given is not None and not every_leaf:
        return list(given.paths)
    try:
        params = list(inspect.signature(f).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    star = next((p.name for p in params if p.kind is p.VAR_POSITIONAL), "args")
    out = []
    for path in flat.paths if every_leaf else flat.tensor_paths():
        # paths look like "[0][1]..." (args) or "[1]['key']..." (kwargs)
        head, _, rest = path[1:].partition("]")
        index, _, tail = rest[1:].partition("]")
        tail = tail if not tail or tail.startswith(("[", ".")) else "." + tail
        if head == "0":
            i = int(index)
            name = positional[i] if i < len(positional) else f"{star}[{i - len(positional)}]"
        else:
            name = index.strip("'\"")
        out.append(name + tail)
    return out


def flatten_args(
    f: Callable[..., Any], tree: Any, static_argnums: tuple[int, ...] = ()
) -> tuple[list[torch.Tensor], Flat]:
    """:func:`flatten` of ``(args, kwargs)``; a tensor subclass functrans cannot take apart is
    an :class:`UnsupportedOpError` naming the argument."""
    try:
        return flatten(tree, static_argnums=static_argnums)
    except InvalidArgumentError:  # a numpy array: name the argument
        leaves, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
        flat = Flat(spec, tuple(False for _ in leaves), tuple(leaves))
        names = arg_names(f, flat, every_leaf=True)
        frames = current_stack()
        where = describe_stack(frames) if frames else getattr(f, "__qualname__", str(f))
        check_numpy_leaves(where, leaves, lambda i: f"input {names[i]}")
        raise
    except UnsupportedOpError as e:
        leaves, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
        flat = Flat(spec, tuple(False for _ in leaves), tuple(leaves))
        names = arg_names(f, flat, every_leaf=True)
        for name, leaf in zip(names, leaves, strict=True):
            if isinstance(leaf, torch.Tensor) and not _takes_apart(leaf):
                raise UnsupportedOpError(
                    f"{getattr(f, '__qualname__', f)}: input {name}: {e}"
                ) from e
        raise


def _takes_apart(t: torch.Tensor) -> bool:
    """Whether :class:`Wrapper` can take ``t`` apart (plain tensors: trivially)."""
    try:
        Wrapper.of(t)
    except UnsupportedOpError:
        return False
    return True


def check_inputs(f: Callable[..., Any], tensors: Sequence[torch.Tensor], flat: Flat) -> None:
    """Raise UnsupportedOpError for tensor inputs functrans cannot trace (sparse, mkldnn...)."""
    for i, t in enumerate(tensors):
        if t.layout != torch.strided:
            where = arg_names(f, flat)[i]
            raise UnsupportedOpError(
                f"{getattr(f, '__qualname__', f)}: input {where} is a {t.layout} tensor; "
                "functrans traces dense (strided) tensors only. Pass a dense tensor "
                "(`x.to_dense()`)."
            )


class InputMutation(TraceError):
    """A traced function writes in place to its inputs or to tensors it captures: which
    (``inputs``: positions among the graph's placeholders; ``captured``: the captured tensors
    themselves). ``jit`` takes such functions anyway: it traces again with the written inputs
    copied first, returns their final values and writes them back after each call, as
    AOTAutograd does; ``trace`` and ``joint``, whose graphs are pure functions, refuse them."""

    def __init__(
        self, message: str, inputs: tuple[int, ...], captured: tuple[torch.Tensor, ...]
    ) -> None:
        super().__init__(message)
        self.inputs, self.captured = inputs, captured


def check_no_input_mutation(gm: fx.GraphModule, paths: Sequence[str]) -> None:
    """Raise :class:`InputMutation` if an op writes to a placeholder or to a view of one, or
    to a captured tensor (named by the first such op)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    where = dict(zip(placeholders, paths, strict=False))
    position = {n: i for i, n in enumerate(placeholders)}
    written: dict[int, None] = {}
    captured: dict[int, torch.Tensor] = {}
    first = ""
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        for i, arg in enumerate(target._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            base = view_base(value)
            is_captured = isinstance(base, fx.Node) and base.op == "get_attr"
            if base not in where and not is_captured:
                continue
            if base in where:
                written[position[base]] = None
            else:
                held = getattr(gm, str(base.target), None)
                if isinstance(held, torch.Tensor):
                    captured.setdefault(id(held), held)
            if not first:
                src = node.meta.get(SOURCE) or _src(node)
                what = (
                    f"input {where[base]}"
                    if base in where
                    else "a tensor the function captures (a closure, global or module "
                    "attribute, not an argument)"
                )
                first = _batch_norm_update(node, src) or (
                    f"`{op_name(target)}` mutates {what} in place"
                    f"{f' at {src}' if src else ''}. functrans traces pure functions: use the "
                    "out-of-place op (e.g. `y = x.add(1)` instead of `x.add_(1)`, "
                    "`torch.where`/`index_put` instead of item assignment) and return the "
                    "result (ft.jit takes such functions: it writes the inputs back after "
                    "each call)."
                )
    if first:
        raise InputMutation(first, tuple(written), tuple(captured.values()))


def _batch_norm_update(node: fx.Node, src: str | None) -> str | None:
    """Why a write made by a BatchNorm's own running-statistics update (its module code is
    the innermost frame) is refused, and what to do: not the user's code to rewrite."""
    frames = str(node.meta.get("stack_trace") or "").strip().splitlines()
    files = [f for f in frames if f.lstrip().startswith("File ")]
    if not files or "torch/nn/modules/batchnorm.py" not in files[-1].replace("\\", "/"):
        return None
    return (
        "a BatchNorm in training mode updates its running statistics and batch counter in "
        f"place{f' (called at {src})' if src else ''}, and a functrans transform is pure: it "
        "cannot write them. ft.jit writes buffers back after each call (jit the step or the "
        "model, and take gradients through it); otherwise call the model in eval mode, build "
        "its norms with track_running_stats=False, or use "
        "torch.func.replace_all_batch_norm_modules_(model)"
    )


def check_static_shapes(gm: fx.GraphModule) -> None:
    """Raise TraceError if an op produced a shape that depends on tensor values (symbolic
    input sizes, see :mod:`functrans._core.shapes`, are fine)."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and has_unbacked(val):
            src = node.meta.get(SOURCE) or _src(node)
            raise TraceError(
                f"`{op_name(node.target)}` returns a tensor whose shape depends on tensor values"
                f"{f' at {src}' if src else ''}. functrans graphs have static shapes: use a "
                "fixed-size formulation (masks with torch.where instead of boolean indexing)."
            )


def _src(node: fx.Node) -> str | None:
    from .passes import source_of

    return source_of(node.meta.get("stack_trace"))


def view_base(value: Any) -> Any:
    """The value a chain of view ops starting at ``value`` (an FX argument) reads from."""
    while isinstance(value, fx.Node) and value.op == "call_function" and is_view_op(value):
        value = value.args[0]
    return value


def _has_mutation(gm: fx.GraphModule) -> bool:
    return any(
        n.op == "call_function"
        and isinstance(n.target, torch._ops.OpOverload)
        and n.target._schema.is_mutable
        for n in gm.graph.nodes
    )


def functionalize(gm: fx.GraphModule, table: Mapping[Any, Callable[..., Any]]) -> fx.GraphModule:
    """Retrace ``gm`` through functionalization: in-place ops on intermediates become pure.

    Our namespaced node meta (remat tags, ...) rides through the retrace in ``meta["custom"]``,
    which make_fx copies from the node being interpreted to the nodes it produces.
    """
    if not _has_mutation(gm):
        return gm
    rewritten = out_of_place(gm)
    if rewritten is not None:
        return rewritten
    return retrace(gm, table, functional=True)


def retrace(
    gm: fx.GraphModule, table: Mapping[Any, Callable[..., Any]], *, functional: bool = False
) -> fx.GraphModule:
    """Trace ``gm`` again through ``table`` (and functionalization when ``functional``),
    keeping our namespaced node meta (see :func:`functionalize`). ``gm`` is not modified.

    >>> import torch, functrans as ft
    >>> from functrans.extend import decomposition_table_all
    >>> g = ft.trace(torch.nn.functional.silu, decompositions="minimal")(torch.randn(3))
    >>> silu = torch.ops.aten.silu.default
    >>> gm = retrace(g.graph_module, {silu: decomposition_table_all()[silu]})
    >>> [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    ['aten.sigmoid.default', 'aten.mul.Tensor']
    """
    vals = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    carrier = _carrying_ours(gm.graph)

    def run(*args: Any) -> Any:
        return fx.Interpreter(gm, graph=carrier).run(*args)

    pure = torch.func.functionalize(run, remove="mutations") if functional else run
    # autocast off: the graph already holds the casts its first trace recorded, and casting
    # its ops again would round an op eager runs in float32 (SDPA's math path) to bfloat16
    with TRACE_LOCK, autocast_off(), fx_traceback.preserve_node_meta(), lazy_modules():
        out: fx.GraphModule = make_fx(pure, table, tracing_mode="fake", record_stack_traces=True)(
            *vals
        )
    for n in out.graph.nodes:
        custom = n.meta.get("custom") or {}
        n.meta.update(custom.pop(_OURS, {}))
        if not custom:
            n.meta.pop("custom", None)
    return out


_OURS = "functrans."


def _carrying_ours(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` (node meta copied shallowly) whose nodes also carry our namespaced
    meta in ``meta["custom"]``, which make_fx copies to the nodes it produces; ``graph`` and its
    nodes' meta dicts are left as they were."""
    carrier = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = carrier.graph_copy(graph, env)
    carrier.output(out)
    for old, new in env.items():
        ours = {k: v for k, v in old.meta.items() if k.startswith(_OURS)}
        if ours:
            new.meta["custom"] = {**old.meta.get("custom", {}), _OURS: ours}
    return carrier


def fake_inputs(tensors: Sequence[torch.Tensor], mode: Any) -> list[torch.Tensor]:
    return [mode.from_tensor(t) for t in tensors]


def trace_module(
    flat_fn: Callable[..., Any],
    inputs: Sequence[torch.Tensor],
    *,
    user_fn: Callable[..., Any],
    table: Mapping[Any, Callable[..., Any]],
    input_paths: Sequence[str],
) -> fx.GraphModule:
    """make_fx ``flat_fn`` on fake ``inputs``, reject input mutation, functionalize."""
    if any(isinstance(t, torch.Tensor) and is_symbolic(t) for t in inputs):
        plain_fn = flat_fn

        def flat_fn(*args: Any) -> Any:
            with SizeConstants():  # torch.tensor(x.shape[0]) traced, not baked in
                return plain_fn(*args)

    recorded: Sequence[torch.Tensor] = ()
    body, handed = in_traced_function(flat_fn), list(inputs)
    if known_inputs(inputs):
        body, handed, recorded = inputs_recorded(body, inputs), list(inputs[:1]), inputs[1:]
    traced = make_fx(
        body,
        table,
        tracing_mode="fake",
        record_stack_traces=False,  # on inside the traced function: in_traced_function
        _allow_non_fake_inputs=True,
    )
    gm: fx.GraphModule = run_traced(lambda: traced(*handed), user_fn)
    for t in recorded:  # the graph's values are detached, as make_fx records them
        if t.is_leaf:
            t.requires_grad_(False)
        else:  # written in place from a value with a gradient: the write is refused below
            t.detach_()
    inputs_first(gm)
    for extension in active():
        if extension.graph_pass is not None:
            gm = extension.graph_pass(gm)
    check_no_input_mutation(gm, input_paths)
    check_static_shapes(gm)
    return functionalize(gm, table)


def trace(
    f: Callable[..., Any],
    *,
    decompositions: Decompositions = "core",
    static_argnums: Sequence[int] = (),
    cse: bool = True,
    dynamic: Dynamic = False,
) -> Callable[..., Graph]:
    """Trace ``f`` on example arguments to a functional ATen :class:`Graph`.

    Tensor leaves of the arguments (any optree pytree) become graph inputs; all other leaves,
    and the arguments listed in ``static_argnums``, are static: baked into the graph and
    checked when the graph is called. ``cse=False`` keeps repeated computations apart (a
    function that recomputes on purpose, as a partitioned backward does). ``dynamic`` keeps
    input dimensions symbolic (``True``: all; ``{"x": {0: "batch"}}``: those named; see
    :mod:`functrans._core.shapes`): the graph then runs at other sizes too.

    >>> import torch, functrans as ft
    >>> print(ft.trace(lambda x: x.sum(0) * 2, dynamic=True)(torch.ones(4, 3)))
    def forward(x: "f32[s0, s1]"):
        sum_1: "f32[s1]" = aten.sum.dim_IntList(x, [0])
        mul: "f32[s1]" = aten.mul.Tensor(sum_1, 2)
        return (mul,)

    >>> import torch, functrans as ft
    >>> def f(x, cfg):
    ...     return {"y": torch.relu(x) * cfg["scale"]}
    >>> g = ft.trace(f)(torch.ones(2), {"scale": 3.0})
    >>> print(g)
    def forward(x: "f32[2]"):
        relu: "f32[2]" = aten.relu.default(x)
        mul: "f32[2]" = aten.mul.Tensor(relu, 3.0)
        return (mul,)
    >>> g(torch.tensor([-1.0, 2.0]), {"scale": 3.0})
    {'y': tensor([0., 6.])}
    """
    check_callable("trace", "f", f)
    statics = check_static_argnums("trace", static_argnums)
    check_bool("trace", "cse", cse)
    table = decomposition_table(decompositions)

    def traced(*args: Any, **kwargs: Any) -> Graph:
        check_static_range("trace", statics, len(args))
        tensors, in_flat = flatten_args(f, (args, kwargs), statics)
        check_inputs(f, tensors, in_flat)
        names = arg_names(f, in_flat)
        out_box: list[Flat] = []

        def flat_fn(*leaves: torch.Tensor) -> list[torch.Tensor]:
            a, kw = unflatten(in_flat, leaves)
            out_leaves, out_flat = flatten(f(*a, **kw))
            refuse_closure_outputs(f, out_flat.static)
            if dims is not None:
                refuse_size_outputs(f, [*out_flat.static, *out_leaves])
            out_box.append(out_flat)
            return out_leaves

        dims = resolve(dynamic, names, tensors)
        inputs = (
            [t.detach() for t in tensors] if dims is None else symbolic_fakes(tensors, dims, names)
        )
        gm = trace_module(flat_fn, inputs, user_fn=f, table=table, input_paths=names)
        every = lambda: arg_names(f, in_flat, every_leaf=True)  # noqa: E731
        refuse_escapes(
            f,
            gm,
            "trace",
            statics=in_flat.static,
            static_names=every,
            input_names=names,
            real_inputs=tensors,
        )
        specs = [InputSpec(identifier(n), Role.PRIMAL, n) for n in names]
        graph = Graph(canonicalize(gm, specs, cse=cse), in_flat, out_box[-1])
        log("trace", f"graph of {getattr(f, '__qualname__', f)}", lambda: str(graph))
        return graph

    return traced


def refuse_closure_outputs(f: Any, statics: Any) -> None:
    """A traced function returning a closure (an ``ft.vjp`` function, a lambda over its
    tensors) is a :class:`TraceError`: the closure holds the trace's fake tensors, and a
    compiled graph would hand back the first call's closure every time."""
    import types

    found = next((x for x in statics if isinstance(x, types.FunctionType) and x.__closure__), None)
    if found is not None:
        raise TraceError(
            f"{getattr(f, '__qualname__', f)} returns the function "
            f"{getattr(found, '__qualname__', found)}, which closes over values of the trace; "
            "a traced (jit) function can return tensors and constants only. Call it inside "
            "(e.g. return vjp_fn(cotangent) rather than vjp_fn)"
        )
