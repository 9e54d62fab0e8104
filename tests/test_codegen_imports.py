"""The plugin surface holds for codegen: backends import only ``functrans.extend`` and the public
``functrans`` API (besides torch, numpy, scipy, triton and the standard library), never the
core's private modules, so the core can change underneath them."""

import ast
from pathlib import Path

CODEGEN = Path(__file__).resolve().parent.parent / "codegen"
ALLOWED = ("functrans", "functrans.extend")


def _functrans_imports(path: Path) -> list[str]:
    """Absolute ``functrans`` modules ``path`` imports (relative ones stay inside codegen)."""
    depth = len(path.relative_to(CODEGEN).parts) - 1  # packages between codegen/ and the file
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "functrans"]
        elif isinstance(node, ast.ImportFrom):
            if node.level > depth + 1:  # climbs out of codegen/ into the core
                found.append("." * node.level + (node.module or ""))
            elif node.level == 0 and (node.module or "").split(".")[0] == "functrans":
                found.append(node.module or "")
    return found


def test_codegen_imports_only_the_plugin_surface():
    bad = [
        f"{path.relative_to(CODEGEN)}: {mod}"
        for path in sorted(CODEGEN.rglob("*.py"))
        for mod in _functrans_imports(path)
        if mod not in ALLOWED and not mod.startswith("functrans.codegen")
    ]
    assert not bad, f"codegen reaches past functrans.extend: {bad}"
