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


def _dom(url: str, *flags: str) -> str:
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
                *flags,
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


#: A page that opens the site's home page in a frame, clicks the navigation's link to the API
#: reference, then types a query into the search box of the page that opened, and writes what
#: it saw: a reader's clicks, from files (Chromium lets file pages script each other only with
#: --allow-file-access-from-files).
_CLICKER = """<!doctype html><html><body>
<iframe id="site" src="HOME" style="width:1280px;height:900px"></iframe>
<pre id="seen"></pre>
<script>
const seen = (line) => { document.getElementById("seen").textContent += line + "\\n"; };
const frame = document.getElementById("site");
let step = 0;
frame.addEventListener("load", () => {
  const doc = frame.contentDocument;
  if (doc === null) { seen("NO ACCESS"); return; }
  if (step === 0) {
    step = 1;
    const link = [...doc.querySelectorAll("nav a")].find(
      (a) => (a.getAttribute("href") || "").endsWith("api/functrans.html"));
    if (!link) { seen("NO LINK"); return; }
    link.click();
    return;
  }
  if (step !== 1) return;
  step = 2;
  const path = frame.contentWindow.location.pathname;
  seen("OPENED " + path.slice(path.lastIndexOf("/api/")));
  seen("HAS JIT " + doc.body.textContent.includes("functrans.jit"));
  const box = doc.querySelector("input.md-search__input");
  if (!box) { seen("NO SEARCH BOX"); return; }
  box.focus();
  box.value = "partition";
  box.dispatchEvent(new Event("focus", { bubbles: true }));
  box.dispatchEvent(new Event("input", { bubbles: true }));
  box.dispatchEvent(new KeyboardEvent("keyup", { bubbles: true, key: "n" }));
  setTimeout(() => {
    const meta = doc.querySelector(".md-search-result__meta");
    seen("SEARCH " + (meta ? meta.textContent.trim() : "no answer"));
  }, 8000);
});
</script></body></html>
"""


def test_a_reader_clicks_to_the_api_and_searches_from_files(tmp_path: Path) -> None:
    site = _site()
    clicker = tmp_path / "clicker.html"
    clicker.write_text(_CLICKER.replace("HOME", (site / "index.html").as_uri()))
    dom = _dom(clicker.as_uri(), "--allow-file-access-from-files")
    seen = re.search(r'<pre id="seen">(.*?)</pre>', dom, re.S)
    assert seen, dom[-2000:]
    lines = seen.group(1).splitlines()
    assert "OPENED /api/functrans.html" in lines, lines
    assert "HAS JIT true" in lines, lines
    found = [line for line in lines if line.startswith("SEARCH ")]
    assert found and re.match(r"SEARCH (\d+) matching document", found[0]), lines
    assert int(found[0].split()[1]) > 0, lines
