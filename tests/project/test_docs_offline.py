"""The docs site as ``make docs`` leaves it, opened as files (issue 52: nav links pointed at
folders and showed directory listings, and search never got past "Initializing search").

``make test`` builds ``site/`` before the unit tests; where it is missing (``make unit``)
these skip. The search test runs Debian's headless Chromium (installed by ``make``; with
FUNCTRANS_REQUIRE_BROWSER=1 a missing browser fails instead of skipping).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

SITE = Path(__file__).resolve().parents[2] / "site"


def _site() -> Path:
    if not (SITE / "index.html").is_file():
        pytest.skip("site/ is not built (make docs)")
    return SITE


def test_every_link_of_the_built_pages_is_a_file() -> None:
    site = _site()
    pages = sorted(p for p in site.rglob("*.html") if p.name != "404.html")  # a server's page
    assert len(pages) > 10
    for page in pages:
        for href in re.findall(r'href="([^"#:]+)(?:#[^"]*)?"', page.read_text()):
            target = (page.parent / href).resolve()
            assert target.is_file(), f"{page.relative_to(site)} links to {href}: not a file"


def test_no_page_loads_a_script_from_the_network() -> None:
    site = _site()
    for page in site.rglob("*.html"):
        remote = re.findall(r'<script[^>]+src="(https?://[^"]+)"', page.read_text())
        assert not remote, f"{page.relative_to(site)} loads {remote}"


def _dom(url: str) -> str:
    """The DOM headless Chromium renders at ``url`` once its scripts have run."""
    chromium = shutil.which("chromium")
    if chromium is None:
        if os.environ.get("FUNCTRANS_REQUIRE_BROWSER"):
            pytest.fail("FUNCTRANS_REQUIRE_BROWSER is set but `chromium` is not on PATH")
        pytest.skip("chromium is not installed")
    with tempfile.TemporaryDirectory() as profile:
        done = subprocess.run(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                f"--user-data-dir={profile}",
                "--virtual-time-budget=20000",
                "--dump-dom",
                url,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_the_api_reference_opens_from_the_home_page() -> None:
    site = _site()
    home = _dom((site / "index.html").as_uri())
    link = re.search(r'href="(api/functrans\.html)"', home)
    assert link, "the home page's navigation has no link to the API reference"
    page = _dom((site / link.group(1)).as_uri())
    assert "functrans.jit" in page and "Index of" not in page  # a page, not a folder listing


def test_search_finds_pages_opened_from_files() -> None:
    site = _site()
    dom = _dom((site / "index.html").as_uri() + "?q=partition")
    found = re.search(r'class="md-search-result__meta">(\d+) matching document', dom)
    assert found and int(found.group(1)) > 0, "search did not answer 'partition'"
