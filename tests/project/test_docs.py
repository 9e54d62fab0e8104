"""Every ```python block of README.md and docs/*.md runs.

The blocks of one page run in order in one namespace, so a page reads as one script. A block
opts out only through an HTML comment on the line above its fence, ``<!-- no-run: why -->``,
which must say why (a GPU, several processes); those are listed by ``test_no_run_blocks_are_few``.
Fences tagged ``python`` with anything after the tag are refused, so a marker cannot be misspelt
into a block that silently never runs.
"""

from __future__ import annotations

import pathlib
import re
from dataclasses import dataclass

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(\s*)```(\S*)(.*)$")
NO_RUN = re.compile(r"^\s*<!--\s*no-run:(.*?)-->\s*$")
MAX_NO_RUN = 8  # across all pages: skipped blocks are the exception


@dataclass(frozen=True)
class Block:
    page: pathlib.Path
    line: int  # 1-based line of the first code line
    source: str
    no_run: str | None  # the reason, for a skipped block


def blocks(page: pathlib.Path) -> list[Block]:
    """The fenced ```python blocks of ``page``, in order."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang, rest = m.groups()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith("```"):
            end += 1
        if lang in ("python", "py"):
            rel = page.relative_to(ROOT)
            assert not rest.strip(), (
                f"{rel}:{i + 1}: ```{lang}{rest}: write a skip as '<!-- no-run: why -->' on the "
                "line above a plain ```python fence"
            )
            prev = lines[i - 1] if i else ""
            skip = NO_RUN.match(prev)
            code = "\n".join(line.removeprefix(indent) for line in lines[i + 1 : end])
            found.append(Block(page, i + 2, code, skip.group(1).strip() if skip else None))
        i = end + 1
    return found


PAGES_WITH_CODE = [p for p in PAGES if blocks(p)]


def test_pages_have_code():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES_WITH_CODE}
    assert "README.md" in names
    assert len(names) >= 10, names


def test_no_run_blocks_are_few():
    skipped = [b for p in PAGES for b in blocks(p) if b.no_run is not None]
    for b in skipped:
        assert len(b.no_run) >= 10, f"{b.page.relative_to(ROOT)}:{b.line}: say why it cannot run"
    assert len(skipped) <= MAX_NO_RUN, [(b.page.name, b.line, b.no_run) for b in skipped]


@pytest.mark.parametrize(
    "page", PAGES_WITH_CODE, ids=lambda p: p.relative_to(ROOT).as_posix().removesuffix(".md")
)
def test_page_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # files a page writes (plots, reports) land here
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    torch.manual_seed(0)
    for block in blocks(page):
        if block.no_run is not None:
            continue
        # padded so a traceback's line numbers are the page's
        code = compile("\n" * (block.line - 1) + block.source, str(page), "exec")
        exec(code, namespace)


def test_api_reference_has_every_public_name():
    """Each name ``functrans`` exports (other than its submodules) has an entry in its API page."""
    import types

    import functrans

    page = (ROOT / "docs" / "api" / "functrans.md").read_text()
    names = getattr(functrans, "__all__", None) or [n for n in dir(functrans) if n[0] != "_"]
    public = [n for n in names if not isinstance(getattr(functrans, n), types.ModuleType)]
    missing = [n for n in public if f"::: functrans.{n}\n" not in page]
    assert not missing, f"docs/api/functrans.md has no '::: functrans.NAME' entry for {missing}"
