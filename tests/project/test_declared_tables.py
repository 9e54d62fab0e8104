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
from functrans._trace.extensions import (
    TraceExtension,
    active,
    register_trace_extension,
    trace_extensions,
)
from functrans._trace.options import TraceOptions

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
        if _item_write(node, imported):
            yield node


def _item_write(node: ast.AST, names: set[str]) -> bool:
    """Whether ``node`` assigns to an item of one of ``names`` (``TABLE[k] = v``, ``+=``)."""
    targets = (
        node.targets
        if isinstance(node, ast.Assign)
        else [node.target]
        if isinstance(node, ast.AugAssign)
        else []
    )
    return any(isinstance(t, ast.Subscript) and _base(t) in names for t in targets)


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
    assert len(lines) == len(names) >= 4
    assert all(name in line for name, line in zip(names, lines, strict=True))
    orders = [e.order for e in trace_extensions()]
    assert orders == sorted(orders) and len(set(orders)) == len(orders)
    assert "regions" in names
    assert "torch.utils.checkpoint as remat" in names


def _registrations(tree: ast.Module) -> list[ast.stmt]:
    """Top-level statements that call ``register_trace_extension``."""
    return [
        node
        for node in _top_level(tree.body)
        if any(
            isinstance(call, ast.Call)
            and getattr(call.func, "id", None) == "register_trace_extension"
            for call in ast.walk(node)
        )
    ]


def test_the_region_machinery_is_one_trace_extension() -> None:
    """Block finding, plain functions and the expansion pass are one extension, declared in
    one module of the regions folder: a trace with regions off enters none of it."""
    folder = ROOT / "_trace" / "regions"
    found = {
        path.name: len(_registrations(ast.parse(path.read_text())))
        for path in sorted(folder.glob("*.py"))
    }
    assert {name: n for name, n in found.items() if n} == {"extension.py": 1}, found
    on = {e.name for e in active(TraceOptions(regions="compiled"))}
    off = {e.name for e in active(TraceOptions(regions="off"))}
    assert on - off == {"regions"}
    (regions,) = (e for e in trace_extensions() if e.name == "regions")
    assert regions.context is not None and regions.graph_pass is not None


def test_a_name_registered_again_at_another_order_is_refused() -> None:
    first = trace_extensions()[0]
    again = TraceExtension(first.name, first.order + 1)
    with pytest.raises(InvalidArgumentError, match="registered already at order"):
        register_trace_extension(again)
    assert trace_extensions()[0] is first


def _context_variables(tree: ast.Module) -> Iterator[ast.stmt]:
    """Top-level statements that make a ``ContextVar`` (``contextvars.ContextVar(...)`` or an
    imported ``ContextVar(...)``)."""
    for node in _top_level(tree.body):
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign, ast.Expr)) else None
        if isinstance(value, ast.Call):
            func = value.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name == "ContextVar":
                yield node


def test_the_trace_session_is_the_only_context_variable_of_trace() -> None:
    """What a trace keeps while it runs lives in its session (:mod:`functrans._trace.session`):
    each extension's state a typed ``Slot`` of it, not an ambient variable of its own."""
    trace_dir = ROOT / "_trace"
    found = [
        str(path.relative_to(ROOT))
        for path in sorted(trace_dir.rglob("*.py"))
        for node in _context_variables(ast.parse(path.read_text()))
    ]
    assert found == ["_trace/session.py"], found


def test_the_context_variable_check_sees_both_spellings() -> None:
    source = (
        "import contextvars\n"
        "from contextvars import ContextVar\n"
        "A = contextvars.ContextVar('a')\n"
        "B: ContextVar[int] = ContextVar('b', default=0)\n"
        "C = Slot('c', None)\n"
    )
    assert [n.lineno for n in _context_variables(ast.parse(source))] == [3, 4]


def test_a_slot_reset_out_of_order_restores_that_slot_alone() -> None:
    """As separate context variables would: the session's slots are independent."""
    from functrans._trace.session import Slot, current

    a, b = Slot("test a", 0), Slot("test b", 0)
    ta = a.set(1)
    tb = b.set(2)
    a.reset(ta)
    assert (a.get(), b.get()) == (0, 2)
    b.reset(tb)
    assert (a.get(), b.get()) == (0, 0)
    assert "test a" not in current() and "test b" not in current()
    with pytest.raises(ValueError, match="token given to"):
        a.reset(b.set(3))


_RUNTIME_MUTATORS = MUTATORS | {"remove", "pop", "clear", "discard"}


def _tables_written_anywhere(tree: ast.Module) -> Iterator[ast.AST]:
    """Writes, anywhere in a module (a function body too), to a table it imports from
    functrans by name (an upper-case name: ``TABLE.append(...)``, ``TABLE[k] = v``)."""
    tables = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and (node.level > 0 or (node.module or "").startswith("functrans"))
        for alias in node.names
        if (alias.asname or alias.name).isupper()
    }
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _RUNTIME_MUTATORS
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id in tables
        ):
            yield node
        if _item_write(node, tables):
            yield node


def test_no_module_writes_a_table_it_imports_even_at_run_time() -> None:
    """What a trace sees while it runs is the trace session's (a ``Slot`` its owner declares
    and binds, e.g. ``trace_run.watching``), never a list another module appends to and
    removes from (``TORCH_CALL_WATCHERS`` was one: the code recorder's watcher, shared by every
    thread)."""
    found = [
        f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}: {ast.unparse(node)[:80]}"
        for path in sorted(ROOT.rglob("*.py"))
        for node in _tables_written_anywhere(ast.parse(path.read_text()))
    ]
    assert not found, "bind the owner's slot, or call its register_* function:\n" + "\n".join(found)


def test_the_run_time_check_sees_a_write_inside_a_function() -> None:
    source = (
        "from functrans._trace.trace_run import WATCHERS\n"
        "def enter(w):\n"
        "    WATCHERS.append(w)\n"
        "def leave(w):\n"
        "    WATCHERS.remove(w)\n"
        "    local = []\n"
        "    local.append(w)\n"
    )
    assert [n.lineno for n in _tables_written_anywhere(ast.parse(source))] == [3, 5]
