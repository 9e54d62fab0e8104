# ruff: noqa: F811  (the fixtures imported from _report_fixtures are test arguments)
"""The memory report in a real headless Chromium (Debian's package; ``make unit`` installs it
and sets FUNCTRANS_REQUIRE_BROWSER=1, so a missing browser fails there instead of skipping):
the page loads without console errors, every saved value has an SVG node, screenshots are
not blank and nothing runs off the page."""

import json
import os
import re
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser

import numpy as np
import pytest
import torch
from _report_fixtures import block, gpt, offload_parts, parts  # noqa: F401  # fixtures

import functrans as ft
from functrans.viz._charts import CHAR_W, LINE
from functrans.viz._svg import COLOURS

CHROMIUM = shutil.which("chromium")
TIMEOUT = 60


def _chromium(*args):
    """Run headless Chromium; returns (stdout, stderr)."""
    if CHROMIUM is None:
        if os.environ.get("FUNCTRANS_REQUIRE_BROWSER"):
            pytest.fail("FUNCTRANS_REQUIRE_BROWSER is set but `chromium` is not on PATH")
        pytest.skip(
            "chromium is not installed (apt-get install -y --no-install-recommends chromium)"
        )
    with tempfile.TemporaryDirectory() as profile:
        flags = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
        ]
        done = subprocess.run(
            [CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=TIMEOUT
        )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout, done.stderr


def _console(url):
    """The DOM Chromium rendered at ``url`` and the page's console messages (errors thrown
    by scripts are logged as ``"Uncaught ..."`` CONSOLE lines)."""
    dom, err = _chromium("--enable-logging=stderr", "--v=0", "--dump-dom", url)
    lines = [ln for ln in err.splitlines() if "CONSOLE" in ln or "Uncaught" in ln]
    return dom, lines


class _Nodes(HTMLParser):
    def __init__(self):
        super().__init__()
        self.nodes, self.svgs = {}, 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.svgs += tag == "svg"
        if tag == "g" and "data-node" in a:
            self.nodes[a["data-node"]] = a.get("class")


def _colours(png):
    import matplotlib.image

    img = (matplotlib.image.imread(png)[..., :3] * 255).round().astype(int)
    packed = np.unique((img[..., 0] << 16) | (img[..., 1] << 8) | img[..., 2])
    return img, {(int(c) >> 16, (int(c) >> 8) & 255, int(c) & 255) for c in packed}


def _hex(colour):
    return tuple(int(colour[i : i + 2], 16) for i in (1, 3, 5))


def test_report_renders_in_headless_chromium(parts, tmp_path):
    page = ft.viz.report(parts, tmp_path / "report.html")
    url = page.resolve().as_uri()
    dom, console = _console(url)
    assert console == []
    found = _Nodes()
    found.feed(dom)
    assert found.svgs >= 2 + len(parts)  # timeline, front, a cut per partition
    for p in parts.values():
        for v in p.saved:
            assert v.name in found.nodes
    assert found.nodes["exp"] == "offloaded"  # the last section is the offloading one
    # what a reader sees first: the summary and the timeline, non-blank and in colour
    _chromium("--screenshot=" + str(tmp_path / "top.png"), "--window-size=1200,900", url)
    img, colours = _colours(tmp_path / "top.png")
    assert img.shape[:2] == (900, 1200) and len(colours) > 50
    assert (img.sum(axis=2) < 600).mean() > 0.01  # more than 1% of pixels are not near-white
    # the whole page: every node colour of the cuts is painted
    _chromium("--screenshot=" + str(tmp_path / "all.png"), "--window-size=1200,6000", url)
    _, colours = _colours(tmp_path / "all.png")
    for kind, colour in COLOURS.items():
        assert _hex(colour) in colours, kind


#: run in a copy of a report: open every <details>, then log the page's width, every pair of
#: Pareto labels whose rendered boxes overlap, and the labels' widest character and height
_PROBE = """<script>
for (const d of document.querySelectorAll("details")) d.open = true;
const box = (e) => e.getBoundingClientRect(), overlaps = [];
const texts = [...document.querySelectorAll("svg.pareto g.point text")];
texts.forEach((a, i) => texts.slice(i + 1).forEach((b) => {
  const p = box(a), q = box(b);
  if (p.left < q.right && q.left < p.right && p.top < q.bottom && q.top < p.bottom)
    overlaps.push(a.textContent + " | " + b.textContent);
}));
const perChar = Math.max(...texts.map((t) => box(t).width / t.textContent.length));
const height = Math.max(...texts.map((t) => box(t).height));
console.log("PROBE " + JSON.stringify({scroll: document.documentElement.scrollWidth,
  inner: window.innerWidth, labels: texts.length, overlaps, perChar, height}));
</script>"""


def _probe(page, width):
    probe = page.with_name("probe.html")
    probe.write_text(page.read_text().replace("</body>", _PROBE + "</body>"))
    args = ("--enable-logging=stderr", "--v=0", f"--window-size={width},800", "--dump-dom")
    _, err = _chromium(*args, probe.resolve().as_uri())
    console = [line for line in err.splitlines() if "CONSOLE" in line]
    found = [json.loads(m) for line in console for m in re.findall(r'PROBE (\{.*\})"', line)]
    assert len(found) == 1, console
    return found[0]


def test_gpt_report_fits_the_page_and_the_cut_is_not_blank(gpt, tmp_path):
    """At 1000 px: nothing runs off sideways (the inputs, the cut, the saved values; a long
    argument path too), the Pareto labels (two partitions on one spot) do not overlap, and
    the first screenful of the cut is boxes, not blank scroll area."""
    parts = {**gpt, "min_cut again": gpt["min_cut"]}
    page = ft.viz.report(parts, tmp_path / "gpt.html")
    seen = _probe(page, 1000)
    assert seen["scroll"] <= seen["inner"] and seen["labels"] == len(parts), seen
    assert seen["overlaps"] == [], seen
    # place_labels' estimates hold in a real browser, so its tested placements do not overlap
    assert seen["perChar"] <= CHAR_W and seen["height"] <= LINE, seen
    arg = {"w_" + "x" * 300: torch.ones(3)}
    long = ft.partition(
        ft.joint(lambda a, x: (x.exp() * next(iter(a.values()))).sum())(arg, torch.ones(3)),
        "default",
    )
    seen = _probe(ft.viz.report(long, tmp_path / "long.html"), 1000)
    assert seen["scroll"] <= seen["inner"], seen
    cut = ft.viz.report(gpt["min_cut"], tmp_path / "cut.html")
    _chromium(
        f"--screenshot={tmp_path / 'cut.png'}", "--window-size=1000,2000", cut.resolve().as_uri()
    )
    img, _ = _colours(tmp_path / "cut.png")
    lower = img[1000:].reshape(-1, 3)  # below the summary and the timeline: the cut
    kinds = ("op", "input", "saved", "recomputed")
    boxes = sum((lower == _hex(COLOURS[k])).all(axis=1).mean() for k in kinds)
    assert boxes > 0.1, boxes  # about 0.23; the old layout's wide top row of inputs: 0.007


def test_console_check_sees_script_errors(tmp_path):
    """The console check above is not vacuous: a page that throws is caught."""
    bad = tmp_path / "bad.html"
    bad.write_text("<!doctype html><body><script>throw new Error('boom')</script></body>")
    _, console = _console(bad.resolve().as_uri())
    assert any("Uncaught Error: boom" in line for line in console)
