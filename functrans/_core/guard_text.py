"""Which stored guard texts may be compiled: the size arithmetic torch's guard printer writes.

The on-disk trace cache stores a symbolic trace's guards as the Python text torch produces
(``produce_guards``: ``2 <= L['t0'].size()[0] and L['t0'].size()[0] <= 8``) and compiles it on
load. Entries are JSON and must never run code of their own, so a text is compiled only if its
syntax tree holds nothing but comparisons, arithmetic, the calls that printer uses and sizes,
strides and offsets of the inputs ``L['t0']`` .. ``L['t<n-1>']``.

>>> check_guard_text("(L['t0'].size()[0] % 8) == 0 and max(1, L['t1'].stride()[0]) >= 2", 2)
>>> check_guard_text("L['t0'].__class__", 1)
Traceback (most recent call last):
ValueError: a guard that is not size arithmetic: L['t0'].__class__
"""

from __future__ import annotations

import ast
import functools

__all__ = ["check_guard_text"]

# what a guard may call: torch's guard printer writes size arithmetic with these
_GUARD_CALLS = frozenset(
    {"max", "min", "abs", "int", "float", "round", "IsNonOverlappingAndDenseIndicator"}
)
_GUARD_MODULE_CALLS = {
    "math": frozenset({"floor", "ceil", "trunc", "sqrt", "log2", "exp", "log", "pow"}),
    "torch": frozenset({"sym_max", "sym_min", "sym_float", "sym_int", "sym_not", "sym_sqrt"}),
}
_TENSOR_CALLS = frozenset({"size", "stride", "storage_offset"})
_GUARD_OPS = (
    ast.And, ast.Or, ast.Not, ast.USub, ast.UAdd, ast.Add, ast.Sub, ast.Mult, ast.Div,
    ast.FloorDiv, ast.Mod, ast.Pow, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE,
)  # fmt: skip


def check_guard_text(text: str, n: int) -> None:
    """Raise ValueError unless ``text`` is size arithmetic on inputs ``L['t0']`` ..
    ``L['t<n-1>']`` (what :func:`guard_parts` writes): comparisons, arithmetic, the calls
    torch's guard printer uses, ``.size()[d]``, ``.stride()[d]``, ``.storage_offset()``.
    A stored guard is compiled only after this check: nothing else in it can run."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"a guard that does not parse: {text[:200]}") from e
    if not _guard_node(tree.body, n):
        raise ValueError(f"a guard that is not size arithmetic: {text[:200]}")


def _guard_node(node: ast.AST, n: int) -> bool:
    ok = functools.partial(_guard_node, n=n)
    if isinstance(node, ast.Constant):
        return type(node.value) in (int, float, bool)
    if isinstance(node, ast.BoolOp):
        return isinstance(node.op, _GUARD_OPS) and all(map(ok, node.values))
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, _GUARD_OPS) and ok(node.operand)
    if isinstance(node, ast.BinOp):
        return isinstance(node.op, _GUARD_OPS) and ok(node.left) and ok(node.right)
    if isinstance(node, ast.Compare):
        ops_ok = all(isinstance(o, _GUARD_OPS) for o in node.ops)
        return ops_ok and ok(node.left) and all(map(ok, node.comparators))
    if isinstance(node, ast.Subscript):  # L['t0'].size()[1]
        index = node.slice
        if not (isinstance(index, ast.Constant) and type(index.value) is int):
            return False
        call = node.value
        return isinstance(call, ast.Call) and _tensor_call(call, n, ("size", "stride"))
    if isinstance(node, ast.Call):
        if node.keywords:
            return False
        if _tensor_call(node, n, ("storage_offset",)):
            return True
        f = node.func
        known = (isinstance(f, ast.Name) and f.id in _GUARD_CALLS) or (
            isinstance(f, ast.Attribute)
            and isinstance(f.value, ast.Name)
            and f.attr in _GUARD_MODULE_CALLS.get(f.value.id, ())
        )
        return known and all(map(ok, node.args))
    return False


def _tensor_call(call: ast.Call, n: int, methods: tuple[str, ...]) -> bool:
    """``L['t<i>'].<method>()`` with i < n."""
    f = call.func
    if call.args or call.keywords or not isinstance(f, ast.Attribute) or f.attr not in methods:
        return False
    t = f.value
    if not (isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == "L"):
        return False
    key = t.slice
    if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
        return False
    name = key.value
    return (
        name[:1] == "t" and name[1:].isdigit() and int(name[1:]) < n and name == f"t{int(name[1:])}"
    )
