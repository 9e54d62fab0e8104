"""Griffe extensions for the API reference (mkdocs.yml names them).

:class:`DoctestFences`: the library's docstrings are plain text with ``>>>`` examples (run by
pytest's doctest) and reST roles; it shows the examples as fenced ``pycon`` blocks and the roles
as code, so Markdown renders them as written.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):`~?([^`]+)`")


def fence_doctests(text: str) -> str:
    """Wrap each run of ``>>>`` lines (with their ``...`` continuations and output, up to a
    blank line) in a ``pycon`` fence, keeping its indentation."""
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith(">>>"):
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}```pycon")
            while i < len(lines) and lines[i].strip():
                out.append(lines[i])
                i += 1
            out.append(f"{indent}```")
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def to_markdown(text: str) -> str:
    text = _ROLE.sub(r"`\1`", text)
    text = re.sub(r"(\S)::\n", r"\1:\n", text)  # a reST literal-block marker
    return fence_doctests(text)


class DoctestFences(griffe.Extension):
    """Rewrite every docstring griffe loads with :func:`to_markdown`."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = to_markdown(obj.docstring.value)
