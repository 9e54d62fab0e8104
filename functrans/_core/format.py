"""Stable, readable text for FX graphs of ATen ops (golden tests depend on it).

One line per node: ``name: "f32[64, 64]" = aten.mm.default(a, b)``; placeholders are the
function's parameters and the output is a flat tuple.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from .ops import is_getitem

__all__ = ["format_graph", "format_value_type", "op_name"]

_DTYPE_ABBR = {
    torch.float64: "f64",
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
    torch.complex64: "c64",
    torch.complex128: "c128",
}


def format_value_type(val: Any) -> str:
    """``f32[64, 64]`` for a tensor, ``Sym(s0)`` for a SymInt, the type name otherwise."""
    if isinstance(val, torch.Tensor):
        dtype = _DTYPE_ABBR.get(val.dtype, str(val.dtype).replace("torch.", ""))
        return f"{dtype}[{', '.join(str(s) for s in val.shape)}]"
    if isinstance(val, (tuple, list)):
        return "(" + ", ".join(format_value_type(v) for v in val) + ")"
    if isinstance(val, torch.SymInt):
        return f"Sym({val})"
    return type(val).__name__


def op_name(target: Any) -> str:
    """``aten.mm.default`` for an OpOverload; the qualified name for other callables."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}.{target._overloadname}"
    mod = getattr(target, "__module__", None) or ""
    name = getattr(target, "__name__", repr(target))
    return name if mod in ("", "builtins", "_operator", "operator") else f"{mod}.{name}"


def _arg(a: Any) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, (torch.dtype, torch.layout, torch.memory_format)):
        return str(a)
    if isinstance(a, torch.device):
        return f"device({str(a)!r})"
    return repr(a)


def _call(node: fx.Node) -> str:
    if node.op == "get_attr":
        return f"self.{node.target}"
    parts = [_arg(a) for a in node.args]
    parts += [f"{k}={_arg(v)}" for k, v in node.kwargs.items()]
    if is_getitem(node) and len(node.args) == 2:
        return f"{_arg(node.args[0])}[{_arg(node.args[1])}]"
    return f"{op_name(node.target)}({', '.join(parts)})"


def format_graph(graph: fx.Graph, comments: dict[fx.Node, str] | None = None) -> str:
    """Render ``graph`` as Python-like code; ``comments`` adds ``# ...`` to chosen lines."""
    comments = comments or {}
    params: list[str] = []
    body: list[str] = []
    for node in graph.nodes:
        note = f"  # {comments[node]}" if node in comments else ""
        if node.op == "placeholder":
            params.append(f'{node.name}: "{format_value_type(node.meta.get("val"))}"')
        elif node.op == "output":
            body.append(f"    return {_arg(tuple(node.args[0]))}{note}")
        else:
            typ = format_value_type(node.meta.get("val"))
            body.append(f'    {node.name}: "{typ}" = {_call(node)}{note}')
    return f"def forward({', '.join(params)}):\n" + "\n".join(body)
