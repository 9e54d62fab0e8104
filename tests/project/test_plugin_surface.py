"""The plugin surface holds: code outside the core imports only functrans' public modules.

Partitioners and codegen backends (ours are plugins like anyone's), benchmarks and examples may
import ``functrans`` and its public modules (``functrans.extend``, ``functrans.testing``,
``functrans.policies``, ``functrans.viz``, ``functrans.partitioners``, ``functrans.codegen`` and
their public submodules), never a private one (a dotted name with a part starting with ``_``),
except their own package's. Partitioners and backends import nothing else but torch, numpy,
scipy, triton and the standard library. And all modules, the core's too, import each other
without cycles (lazy imports included: a cycle is a missing seam, whether or not it bites).
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Folder -> the package it installs as (None: loose scripts).
PACKAGES: dict[str, str | None] = {
    "functrans/codegen": "functrans.codegen",
    "functrans/partitioners": "functrans.partitioners",
    "benchmarks": "benchmarks",
    "examples": None,
}
#: What plugins may import besides functrans and the standard library.
PLUGIN_THIRD_PARTY = frozenset({"torch", "numpy", "scipy", "triton"})
PLUGIN_FOLDERS = ("functrans/codegen", "functrans/partitioners")
#: Every folder holding modules, the core included (the cycle check walks them all).
FOLDERS: dict[str, str | None] = {"functrans": "functrans", **PACKAGES}


def folder_of(path: Path) -> str:
    """The FOLDERS key ``path`` lives in (the longest that contains it)."""
    rel = path.relative_to(ROOT).as_posix()
    return max((f for f in FOLDERS if rel.startswith(f + "/")), key=len)


@dataclass(frozen=True)
class Import:
    """One import statement's target, resolved to an absolute dotted name."""

    path: Path
    line: int
    module: str  # the module imported (for ``from m import a``: ``m``)
    names: tuple[str, ...]  # ``a`` of ``from m import a``; () for ``import m``
    source: str  # the statement as written

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: {self.source}"


def _module_name(path: Path) -> tuple[str | None, bool]:
    """``(dotted module name, is a package __init__)`` of a file under one of PACKAGES."""
    folder = folder_of(path)
    package = FOLDERS[folder]
    if package is None:
        return None, False
    inner = path.relative_to(ROOT / folder).with_suffix("").parts
    parts = [package, *inner]
    is_init = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_init else parts), is_init


def _resolve(node: ast.ImportFrom, module: str | None, is_init: bool) -> str:
    if not node.level:
        return node.module or ""
    assert module is not None, f"relative import in a loose script: {ast.unparse(node)}"
    base = module.split(".") if is_init else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _files(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def imports(path: Path) -> Iterator[Import]:
    """Every import in ``path``: statements at any depth (in functions, under TYPE_CHECKING)
    and ``importlib.import_module("constant")`` calls."""
    module, is_init = _module_name(path)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(path, node.lineno, alias.name, (), ast.unparse(node))
        elif isinstance(node, ast.ImportFrom):
            names = tuple(a.name for a in node.names)
            target = _resolve(node, module, is_init)
            yield Import(path, node.lineno, target, names, ast.unparse(node))
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield Import(path, node.lineno, node.args[0].value, (), ast.unparse(node))


def _is_module(dotted: str) -> bool:
    try:
        return importlib.util.find_spec(dotted) is not None
    except (ImportError, ValueError):
        return False


def private_attributes(path: Path) -> Iterator[str]:
    """``alias._name`` where ``alias`` is bound to a functrans module (``import functrans as
    ft; ft._pytree``): a private module or name reached without an import statement."""
    tree = ast.parse(path.read_text(), str(path))
    modules: dict[str, str] = {}  # local name -> functrans module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "functrans":
                    # ``import functrans.x`` binds functrans; ``import functrans.x as y``, x
                    modules[a.asname or "functrans"] = a.name if a.asname else "functrans"
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full.startswith("functrans.") and _is_module(full):
                    modules[a.asname or a.name] = full
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            rel = path.relative_to(ROOT)
            yield f"{rel}:{node.lineno}: {ast.unparse(node)}  (private: {node.attr!r})"


def _private_part(dotted: str, own: str | None) -> str | None:
    """The first private part of a functrans module path outside ``own``'s package, if any."""
    if dotted != "functrans" and not dotted.startswith("functrans."):
        return None
    if own is not None and (dotted == own or dotted.startswith(own + ".")):
        return None
    return next((p for p in dotted.split(".")[1:] if p.startswith("_")), None)


def boundary_violations(path: Path) -> list[str]:
    """Imports of private functrans modules (or private names from functrans modules) in
    ``path``, and for plugins, imports of anything but functrans, torch, numpy, scipy, triton
    and the standard library."""
    folder = folder_of(path)
    own = FOLDERS[folder]
    found = []
    for imp in imports(path):
        targets = [imp.module, *(f"{imp.module}.{n}" for n in imp.names if n != "*")]
        private = next((p for t in targets if (p := _private_part(t, own))), None)
        if private is not None:
            found.append(f"{imp}  (private: {private!r})")
        top = imp.module.split(".")[0]
        allowed = {"functrans", *PLUGIN_THIRD_PARTY, *sys.stdlib_module_names}
        if folder in PLUGIN_FOLDERS and top not in allowed and not imp.source.startswith("from ."):
            found.append(f"{imp}  (plugins import only functrans, torch, numpy, scipy, triton)")
    found.extend(private_attributes(path))
    return found


@pytest.mark.parametrize("folder", list(PACKAGES))
def test_only_the_public_surface_is_imported(folder: str) -> None:
    found = [v for path in _files(folder) for v in boundary_violations(path)]
    assert not found, (
        f"{folder}/ imports functrans internals; use functrans.extend (add what is missing "
        "there) or another public module:\n  " + "\n  ".join(found)
    )


def test_the_checker_sees_private_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    plugin = tmp_path / "functrans" / "partitioners" / "mine.py"
    plugin.parent.mkdir(parents=True)
    plugin.write_text(
        "import functrans._core.graph\n"
        "from functrans import _split, extend\n"
        "from functrans.codegen._cache import cache_root\n"
        "from functrans.extend import _hidden\n"
        "from . import _ilp\n"  # its own package's private module: fine
        "import importlib\n"
        "import functrans as ft\n"
        "from functrans import codegen\n"
        "def f():\n"
        "    import networkx\n"
        "    ft._pytree.flatten, codegen._cache, ft.__version__, ft.extend\n"
        "    return importlib.import_module('functrans._cut.memory')\n"
    )
    found = boundary_violations(plugin)
    assert [v.split(":")[1] for v in found] == ["1", "2", "3", "4", "10", "12", "11", "11"]
    assert sorted(found[-2:]) == [
        "functrans/partitioners/mine.py:11: codegen._cache  (private: '_cache')",
        "functrans/partitioners/mine.py:11: ft._pytree  (private: '_pytree')",
    ]
    assert "from functrans import _split, extend  (private: '_split')" in found[1]


# ---------------------------------------------------------------------------------------------
# No import cycles among any modules (the core's included)


def _graph() -> dict[str, set[str]]:
    """Module -> the repository modules it imports (any depth, lazy and TYPE_CHECKING too)."""
    paths: dict[str, Path] = {}
    for folder, package in FOLDERS.items():
        if package is not None:
            for path in _files(folder):
                name, _ = _module_name(path)
                assert name is not None
                paths[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        deps: set[str] = set()
        for imp in imports(path):
            # ``from pkg import sub`` depends on the submodule; a package imported on the way to
            # its submodule is no dependency (every submodule import runs its parents)
            subs = [f"{imp.module}.{n}" for n in imp.names]
            named = [s for s in subs if s in paths]
            deps.update(named if len(named) == len(subs) and subs else [imp.module, *named])
        deps &= paths.keys() - {name}
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm, iterative).

    >>> cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}})
    [['a', 'b']]
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def test_no_import_cycles() -> None:
    graph = _graph()
    found = cycles(graph)
    described = [
        " <-> ".join(c) + ": " + "; ".join(f"{m} imports {sorted(graph[m] & set(c))}" for m in c)
        for c in found
    ]
    assert not found, "import cycles (split the shared part into a module both import):\n  " + (
        "\n  ".join(described)
    )


# ---------------------------------------------------------------------------------------------
# Every name of the plugin surface is documented with an example


def _exports() -> dict[str, object]:
    import functrans.extend as extend

    return {
        n: v
        for n, v in vars(extend).items()
        if n.isidentifier() and not n.startswith("_") and not inspect.ismodule(v)
    }


@pytest.mark.parametrize("name", sorted(_exports()))
def test_every_export_has_an_example(name: str) -> None:
    import functrans.extend as extend

    value = _exports()[name]
    if inspect.isclass(value) or inspect.isfunction(value):
        doc = inspect.getdoc(value) or ""
        assert ">>>" in doc, f"functrans.extend.{name} needs a docstring with a >>> example"
    else:  # constants and type aliases carry no docstring: the module's documents them
        doc = extend.__doc__ or ""
        assert f"``{name}``" in doc, f"document functrans.extend.{name} in extend's docstring"
        assert any(name in line for line in doc.splitlines() if line.startswith(">>>")), (
            f"functrans.extend's docstring needs a >>> example using {name}"
        )
