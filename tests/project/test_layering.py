"""The layers are enforced, not described: every import runs down the order of the folders.

``functrans/`` holds five private layers, each importing only the ones before it::

    _core < _trace < _cut < _transforms < _jit

``_jit/disk`` (the on-disk cache) is narrower: it imports only ``_core`` and ``_trace`` (and
itself), nothing else of ``_jit``. The public faces (``functrans/__init__``, ``extend``,
``policies``, ``viz``, ``distributed``, ``testing``, ``__main__``) may import any layer; no
private module imports a face or a plugin package (``partitioners``, ``codegen``: the core owns
their registries). Every import counts: at any depth, under ``TYPE_CHECKING``, and
``importlib.import_module("constant")``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from test_plugin_surface import ROOT, _files, _module_name, imports

#: The private layers, lowest first.
LAYERS = ("_core", "_trace", "_cut", "_transforms", "_jit")
#: A sub-layer with a narrower rule: it may import only these layers (and itself).
NARROWER = {"functrans._jit.disk": ("_core", "_trace")}
#: Public modules and packages: they may import anything.
FACES = ("functrans", "functrans.extend", "functrans.policies")
FACE_PACKAGES = (
    "functrans.viz",
    "functrans.testing",
    "functrans.distributed",
    "functrans.__main__",
)
PLUGINS = ("functrans.partitioners", "functrans.codegen")


@dataclass(frozen=True)
class Kind:
    """Where a module sits: a layer (with its index), a face, a plugin, or outside."""

    what: str  # "layer", "face", "plugin", "other"
    layer: int = -1
    narrower: str | None = None  # the NARROWER key the module lives in


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def kind_of(name: str) -> Kind:
    """The :class:`Kind` of the dotted module ``name``.

    >>> kind_of("functrans._cut.split"), kind_of("functrans.viz._svg").what
    (Kind(what='layer', layer=2, narrower=None), 'face')
    """
    if name in FACES or any(_within(name, p) for p in FACE_PACKAGES):
        return Kind("face")
    if any(_within(name, p) for p in PLUGINS):
        return Kind("plugin")
    parts = name.split(".")
    if parts[0] == "functrans" and len(parts) > 1 and parts[1] in LAYERS:
        narrower = next((k for k in NARROWER if _within(name, k)), None)
        return Kind("layer", LAYERS.index(parts[1]), narrower)
    return Kind("other")


def _module_of(dotted: str, known: set[str]) -> str | None:
    """The longest known module ``dotted`` names (``functrans._core.graph.Graph``: the module)."""
    while dotted and dotted not in known:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def violation(source: str, target: str) -> str | None:
    """Why ``source`` may not import ``target`` (None: it may).

    >>> violation("functrans._core.graph", "functrans._cut.split")
    'runs up from _core to _cut'
    >>> violation("functrans._jit.disk.store", "functrans._jit.jitted")
    'functrans._jit.disk imports only _core, _trace'
    >>> violation("functrans._cut.partition", "functrans.partitioners")
    'a private module imports plugin functrans.partitioners'
    >>> violation("functrans._jit.api", "functrans._trace.trace") is None
    True
    """
    src, dst = kind_of(source), kind_of(target)
    if src.what != "layer":
        return None
    if dst.what in ("face", "plugin"):
        return f"a private module imports {dst.what} {target}"
    if dst.what != "layer":
        return None
    if dst.layer > src.layer:
        return f"runs up from {LAYERS[src.layer]} to {LAYERS[dst.layer]}"
    if src.narrower is not None and not _within(target, src.narrower):
        allowed = NARROWER[src.narrower]
        if LAYERS[dst.layer] not in allowed:
            return f"{src.narrower} imports only {', '.join(allowed)}"
    return None


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in _files("functrans"):
        name, _ = _module_name(path)
        assert name is not None
        found[name] = path
    return found


def layer_violations() -> list[str]:
    """Every import in ``functrans/`` that runs against the layer order."""
    modules = _modules()
    known = set(modules)
    found = []
    for name, path in modules.items():
        for imp in imports(path):
            targets = [f"{imp.module}.{n}" for n in imp.names] or [imp.module]
            for t in targets:
                module = _module_of(t, known)
                if module is None or module == name:
                    continue
                why = violation(name, module)
                if why:
                    found.append(f"{imp}  ({why})")
    return sorted(set(found))


def test_every_private_module_sits_in_a_layer() -> None:
    loose = [n for n in _modules() if kind_of(n).what == "other"]
    assert not loose, f"modules outside the layers and faces (move them into one): {loose}"


def test_imports_run_down_the_layers() -> None:
    found = layer_violations()
    assert not found, "imports against the layer order:\n  " + "\n  ".join(found)


@pytest.mark.parametrize("layer", LAYERS)
def test_each_layer_says_what_it_is(layer: str) -> None:
    doc = (ROOT / "functrans" / layer / "__init__.py").read_text()
    assert doc.startswith('"""') and len(doc.splitlines()) <= 3, (
        f"functrans/{layer}/__init__.py: a one-line docstring stating the layer's purpose"
    )


def test_the_checker_sees_an_import_running_up(tmp_path: Path) -> None:
    """The check can fail: a lazy import of the cut from the core is found."""
    import test_plugin_surface as surface

    core = tmp_path / "functrans" / "_core"
    core.mkdir(parents=True)
    (tmp_path / "functrans" / "__init__.py").write_text("")
    (core / "__init__.py").write_text('"""x."""\n')
    (core / "graph.py").write_text("def f():\n    from functrans._cut import split\n")
    cut = tmp_path / "functrans" / "_cut"
    cut.mkdir()
    (cut / "__init__.py").write_text('"""x."""\n')
    (cut / "split.py").write_text("from .._core import graph\n")
    old = surface.ROOT
    surface.ROOT = tmp_path
    try:
        found = layer_violations()
    finally:
        surface.ROOT = old
    assert found == [
        "functrans/_core/graph.py:2: from functrans._cut import split  (runs up from _core to _cut)"
    ]
