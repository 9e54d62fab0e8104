"""What other modules add to a table is declared through its owner, never written into it.

A module's import used to append to other modules' lists and tables (``TRACE_CONTEXTS``,
``TRACE_PASSES``, the outlined ops' scratch, recompute, handover and FLOP rules), so what a
trace did depended on which modules happened to be imported. Now each table's owner has a
``register_*`` function, trace extensions are named and ordered
(:mod:`functrans._trace.extensions`, listed by ``python -m functrans explain --trace``), and
this test holds the rule over every library module's top level.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import functrans
from functrans.__main__ import main
from functrans._core.errors import InvalidArgumentError
from functrans._trace.extensions import TraceExtension, register_trace_extension, trace_extensions

ROOT = Path(functrans.__file__).parent
MUTATORS = frozenset({"append", "extend", "insert", "update", "add", "setdefault", "__setitem__"})


def _top_level(statements: list[ast.stmt]) -> Iterator[ast.stmt]:
    """A module's statements run at import (through ``for``, ``if``, ``with`` and ``try``)."""
    for node in statements:
        yield node
        if isinstance(node, (ast.For, ast.If, ast.With, ast.Try)):
            for field in ("body", "orelse", "finalbody"):
                yield from _top_level(getattr(node, field, None) or [])


def _base(expr: ast.expr) -> str | None:
    while isinstance(expr, (ast.Attribute, ast.Subscript)):
        expr = expr.value
    return expr.id if isinstance(expr, ast.Name) else None


def _writes_to_imported(tree: ast.Module) -> Iterator[ast.stmt]:
    imported: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported |= {a.asname or a.name for a in node.names}
    for node in _top_level(tree.body):
        call = node.value if isinstance(node, ast.Expr) else None
        if (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.func.attr in MUTATORS
            and _base(call.func.value) in imported
        ):
            yield node
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AugAssign)
            else []
        )
        if any(isinstance(t, ast.Subscript) and _base(t) in imported for t in targets):
            yield node


def test_no_module_writes_another_modules_table_at_import_time() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:80]}"
        for path in sorted(ROOT.rglob("*.py"))
        for node in _writes_to_imported(ast.parse(path.read_text()))
    ]
    assert not found, "register through the table's owner instead:\n" + "\n".join(found)


def test_the_check_sees_an_append_and_an_item_write() -> None:
    """The rule's own test: it finds both forms, in a loop too, and passes a call to an
    owner's ``register_*`` function."""
    source = (
        "from .trace import TABLE, register\n"
        "import other\n"
        "TABLE.append(1)\n"
        "for k in ():\n"
        "    other.RULES[k] = k\n"
        "register(TABLE)\n"
    )
    assert [n.lineno for n in _writes_to_imported(ast.parse(source))] == [3, 5]


def test_trace_extensions_are_listed_in_order(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--trace"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [e.name for e in trace_extensions()]
    assert len(lines) == len(names) >= 6
    assert all(name in line for name, line in zip(names, lines, strict=True))
    orders = [e.order for e in trace_extensions()]
    assert orders == sorted(orders) and len(set(orders)) == len(orders)
    assert "blocks found in module containers" in names
    assert "torch.utils.checkpoint as remat" in names


def test_a_name_registered_again_at_another_order_is_refused() -> None:
    first = trace_extensions()[0]
    again = TraceExtension(first.name, first.order + 1)
    with pytest.raises(InvalidArgumentError, match="registered already at order"):
        register_trace_extension(again)
    assert trace_extensions()[0] is first
