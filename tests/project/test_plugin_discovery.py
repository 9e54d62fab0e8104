"""Plugin discovery: registries load their package's public modules and their entry point
group's plugins on first use, and a broken plugin is named, not a crash.

Plugins come from throwaway distributions written into ``tmp_path``: a package plus a
``*.dist-info`` directory whose ``entry_points.txt`` declares them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from functrans.extend import PluginError, PluginRegistry, PluginWarning

ROOT = Path(__file__).resolve().parents[2]


def _distribution(root: Path, name: str, files: dict[str, str], entry_points: str) -> None:
    """Write package files and ``name-0.1.dist-info`` (METADATA, entry_points.txt) into root."""
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    info = root / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))


# ------------------------------------------------------------------------------------------
# PluginRegistry on its own: a throwaway package of built-ins and a throwaway group


@pytest.fixture
def things(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[PluginRegistry[object]]:
    _distribution(
        tmp_path,
        "thing_plugins",
        {
            "builtin_things/__init__.py": "REG = None  # set by the test\n",
            "builtin_things/alpha.py": "from . import REG\nREG.register('alpha', 'A')\n",
            "builtin_things/_helper.py": "raise AssertionError('private modules are not loaded')\n",
            "thing_plugins.py": "BETA = 'B'\nNOT_A_THING = 42\n",
            "thing_module.py": "from builtin_things import REG\nREG.register('gamma', 'G')\n",
        },
        """
        [functrans.test_things]
        beta = thing_plugins:BETA
        gamma_module = thing_module
        alpha = thing_plugins:BETA
        missing = no_such_module_anywhere:thing
        rejected = thing_plugins:NOT_A_THING
        """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    def adopt(name: str, obj: object) -> object:
        if not isinstance(obj, str):
            raise TypeError(f"a thing must be a str, got {obj!r}")
        return registry.register(name, obj)

    registry: PluginRegistry[object] = PluginRegistry(
        "thing", package="builtin_things", group="functrans.test_things", adopt=adopt
    )
    import builtin_things

    builtin_things.REG = registry  # type: ignore[attr-defined]
    yield registry
    for mod in ("builtin_things", "builtin_things.alpha", "thing_plugins", "thing_module"):
        sys.modules.pop(mod, None)


def test_registry_discovers_on_first_lookup(things: PluginRegistry[object]) -> None:
    assert "builtin_things.alpha" not in sys.modules  # constructing it loads nothing
    with pytest.warns(PluginWarning) as record:
        assert things.names() == ["alpha", "beta", "gamma"]
    assert (things.get("alpha"), things.get("beta"), things.get("gamma")) == ("A", "B", "G")
    messages = "\n".join(str(w.message) for w in record)
    # a name a built-in already took: the entry point is ignored, and said so
    assert "'alpha = thing_plugins:BETA'" in messages and "already registered" in messages
    assert "no_such_module_anywhere" in messages and "'rejected = " in messages


def test_broken_plugin_is_named_on_lookup(things: PluginRegistry[object]) -> None:
    with pytest.warns(PluginWarning):
        things.discover()
    with pytest.raises(PluginError, match=r"'missing = no_such_module_anywhere:thing'") as e:
        things.get("missing")
    assert isinstance(e.value.__cause__, ModuleNotFoundError)
    assert "of distribution 'thing_plugins'" in str(e.value)
    with pytest.raises(PluginError, match=r"thing must be a str, got 42"):
        things.get("rejected")
    assert sorted(things.broken()) == ["missing", "rejected"]
    things.register("missing", "fixed")  # registering the name by hand clears the error
    assert things.get("missing") == "fixed"


def test_registrations_before_discovery_take_precedence(things: PluginRegistry[object]) -> None:
    things.register("alpha", "mine")
    with pytest.warns(PluginWarning, match="'alpha' found by discovery is not registered"):
        assert things.get("alpha") == "mine"
    with pytest.raises(ValueError, match="already registered"):
        things.register("alpha", "other")  # after discovery: replace=True, as ever


# ------------------------------------------------------------------------------------------
# The real registries, through installed entry points (a fresh interpreter: first use there)

_PLUGIN = """
import torch
from functrans.extend import JointGraph


def save_inputs(joint: JointGraph, **options):
    return list(joint.primals())


class EagerBackend:
    def compile(self, graph, example_inputs):
        return lambda *args: list(graph.graph_module(*args))


BACKEND = EagerBackend()
"""

_PLUGIN_MODULE = """
from functrans import partitioners
from demo_ft_plugin import save_inputs

partitioners.register("demo_module", save_inputs, examples=({"level": 1}, {"level": 2}))
"""

_ENTRY_POINTS = """
[functrans.partitioners]
demo_inputs = demo_ft_plugin:save_inputs
demo_modules = demo_ft_plugin.registers
demo_broken = demo_ft_plugin_missing:save_inputs

[functrans.backends]
demo_eager = demo_ft_plugin:BACKEND
demo_class = demo_ft_plugin:EagerBackend
"""

_SCRIPT = """
import json, sys, warnings
import torch
import functrans as ft
from functrans import codegen, partitioners
from functrans.extend import PluginError, PluginWarning

out = {"loaded_at_import": sorted(m for m in sys.modules if m.startswith("demo_ft_plugin")
                                  or m.startswith("functrans.partitioners.")
                                  or m.startswith("functrans.codegen."))}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out["strategies"] = partitioners.names()
    out["backends"] = codegen.names()
out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, PluginWarning)]
jg = ft.joint(lambda x: x.sin().sum())(torch.ones(3))
out["saved"] = [s.name for s in ft.partition(jg, "demo_inputs").saved]
out["examples"] = partitioners.examples("demo_module")
x = torch.ones(3)
run = codegen.get_backend("demo_eager").compile(ft.trace(torch.sin)(x), [x])
out["compiled"] = run(x)[0].tolist()
for lookup, name in ((partitioners.get, "demo_broken"), (codegen.get_backend, "demo_class")):
    try:
        lookup(name)
    except PluginError as e:
        out[name] = str(e)
print(json.dumps(out))
"""


def test_entry_point_plugins_of_the_real_registries(tmp_path: Path) -> None:
    _distribution(
        tmp_path,
        "demo_ft_plugin",
        {"demo_ft_plugin/__init__.py": _PLUGIN, "demo_ft_plugin/registers.py": _PLUGIN_MODULE},
        _ENTRY_POINTS,
    )
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["loaded_at_import"] == []  # importing the packages loads no plugin
    assert {"default", "min_cut", "demo_inputs", "demo_module"} <= set(out["strategies"])
    assert "demo_broken" not in out["strategies"] and "demo_modules" not in out["strategies"]
    assert {"aten", "demo_eager"} <= set(out["backends"]) and "demo_class" not in out["backends"]
    assert out["saved"] == ["primals_1"]
    assert out["examples"] == [{"level": 1}, {"level": 2}]
    assert out["compiled"] == pytest.approx([0.8414709848] * 3)
    assert "'demo_broken = demo_ft_plugin_missing:save_inputs'" in out["demo_broken"]
    assert "ModuleNotFoundError" in out["demo_broken"]
    assert "an instance, not a class" in out["demo_class"]
    assert len(out["warnings"]) == 2 and all("could not be loaded" in w for w in out["warnings"])
