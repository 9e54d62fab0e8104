"""The memory report: layout, table, escaping, plot_memory, ``explain --html``, and the page in
a real headless Chromium (Debian's package; ``make unit`` installs it and sets
FUNCTRANS_REQUIRE_BROWSER=1, so a missing browser fails there instead of skipping)."""

import os
import random
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser

import numpy as np
import pytest
import torch

import functrans as ft
from functrans._report import saved_table, series
from functrans._svg import COLOURS, cut_svg, forward_layout, layered_layout, node_kinds
from functrans.extend import Cut

CHROMIUM = shutil.which("chromium")
TIMEOUT = 60


def block(params, x):
    h = torch.tanh(x @ params["w"])
    h = torch.nn.functional.layer_norm(h, (8,), params["g"], params["b"])
    return (h.exp() * params["g"]).sum()


@pytest.fixture(scope="module")
def parts():
    args = ({"w": torch.randn(8, 8), "g": torch.ones(8), "b": torch.zeros(8)}, torch.randn(4, 8))
    jg = ft.joint(block)(*args)
    return {
        "default": ft.partition(jg, "default"),
        "min_cut": ft.partition(jg, "min_cut"),
        "full_remat": ft.partition(jg, "full_remat"),
        "offload": ft.partition(jg, lambda jg: Cut(saved=("tanh",), offloaded=("exp",))),
    }


def _check_layout(lay, nodes, edges):
    assert set(lay.boxes) == set(nodes)
    boxes = list(lay.boxes.values())
    for i, a in enumerate(boxes):
        assert a.x >= 0 and a.y >= 0
        assert a.x + a.w <= lay.width and a.y + a.h <= lay.height
        assert not any(a.overlaps(b) for b in boxes[i + 1 :])
    for a, b in edges:
        assert lay.boxes[a].y + lay.boxes[a].h < lay.boxes[b].y, (a, b)


def test_layout_places_every_forward_node_apart_with_edges_down(parts):
    for p in parts.values():
        lay = forward_layout(p.joint)
        forward = p.joint.forward_nodes()
        edges = [(a, b) for b in forward for a in b.all_input_nodes if a in set(forward)]
        assert len(lay.edges) == len(edges) > 0
        _check_layout(lay, forward, edges)
    rng = random.Random(0)
    for _ in range(20):  # random DAGs: edges from lower to higher numbers
        n = rng.randrange(1, 30)
        edges = [(a, b) for b in range(n) for a in range(b) if rng.random() < 0.15]
        _check_layout(layered_layout(list(range(n)), edges), range(n), edges)


def test_layout_rejects_cycles_and_repeats():
    with pytest.raises(ft.FunctransError, match="cycle"):
        layered_layout(["a", "b"], [("a", "b"), ("b", "a")])
    with pytest.raises(ft.FunctransError, match="repeat"):
        layered_layout(["a", "a"], [])


def test_cut_svg_has_a_node_per_forward_value_with_its_kind(parts):
    p = parts["offload"]
    kinds = {n.name: k for n, k in node_kinds(p).items()}
    assert kinds["exp"] == "offloaded" and kinds["tanh"] == "saved"
    assert kinds["primals_4"] == "input"
    redone = {n.name for n in parts["full_remat"].recomputed}
    kinds_redone = {k for n, k in node_kinds(parts["full_remat"]).items() if n.name in redone}
    assert redone and kinds_redone == {"recomputed"}
    svg = cut_svg(p)
    for name, kind in kinds.items():
        assert f'<g data-node="{name}" class="{kind}">' in svg
    assert "x" in svg and "params[&#x27;w&#x27;]" in svg  # inputs by the user's names
    assert "h = torch.tanh(x @ params[&quot;w&quot;])" in svg  # source line on hover


def test_saved_table_lists_each_saved_value_and_where_it_lives(parts):
    p = parts["offload"]
    table = saved_table(p)
    assert table.count("<tr") == len(p.saved) + 1
    assert '<tr class="host"><td>exp</td><td>aten.exp.default</td><td>[4, 8]</td>' in table
    assert "<td>float32</td><td>128</td><td>host</td>" in table
    assert "<td>tanh</td>" in table and "device (input)" in table


def hostile(params, x):
    return (x.exp() * params["<img src=x onerror=alert(1)>"]).sum()  # <script>alert("x")</script>


def test_hostile_text_is_escaped(tmp_path):
    arg = {"<img src=x onerror=alert(1)>": torch.ones(3)}
    p = ft.partition(ft.joint(hostile)(arg, torch.ones(3)), "default")
    assert "<script>" in next(s.source for s in p.saved if s.name == "exp")
    page = ft.viz.report({"<b>label</b>": p}, tmp_path / "r.html").read_text()
    assert "<script" not in page and "<img" not in page and "<b>label" not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page
    assert "&lt;b&gt;label&lt;/b&gt;" in page


def test_series_share_the_boundary_and_keep_the_peak(parts):
    lines = series(list(parts.items()))
    assert len({s.boundary for s in lines}) == 1
    for s, p in zip(lines, parts.values(), strict=True):
        assert max(s.device) == p.peak_bytes and max(s.host) == p.host_peak_bytes
        forward = [x for x, st in zip(s.x, p.memory.timeline, strict=True) if st.phase == "forward"]
        assert max(forward) < s.boundary < min(set(s.x) - set(forward))


def test_plot_memory_writes_a_png_with_two_partitions(parts, tmp_path):
    import matplotlib.image

    out = ft.viz.plot_memory([parts["min_cut"], parts["offload"]], tmp_path / "m.png")
    img = matplotlib.image.imread(out)
    assert img.shape[0] > 200 and img.shape[1] > 400
    assert len(np.unique((img[..., :3] * 255).astype(int).reshape(-1, 3), axis=0)) > 20


def test_bad_arguments_name_the_argument_and_what_is_accepted(parts, tmp_path):
    p = parts["default"]
    for call in (ft.viz.report, ft.viz.plot_memory):
        with pytest.raises(ft.FunctransError, match="partitions is empty; expected a Partition"):
            call([], tmp_path / "x.html")
        with pytest.raises(ft.FunctransError, match=r"partitions\[1\]=.*is not a Partition"):
            call([p, "min_cut"], tmp_path / "x.png")
        with pytest.raises(ft.FunctransError, match="folder that does not exist"):
            call(p, tmp_path / "missing" / ("x.html" if call is ft.viz.report else "x.png"))
    with pytest.raises(ft.FunctransError, match=r"path='.*x.png' has suffix '.png'; accepted"):
        ft.viz.report(p, tmp_path / "x.png")
    with pytest.raises(ft.FunctransError, match=r"partitions=.* is not accepted"):
        ft.viz.report(42, tmp_path / "x.html")


def test_explain_html_writes_the_report(tmp_path, capsys):
    from functrans.__main__ import explain

    src = tmp_path / "ex.py"
    src.write_text(
        "import torch\n"
        "def example():\n"
        "    f = lambda x, w: torch.relu(x @ w).sin().sum()\n"
        "    return f, (torch.ones(8, 8), torch.ones(8, 8))\n"
    )
    out = tmp_path / "report.html"
    argv = [f"{src}:example", "--html", str(out), "--compare", "default,full_remat"]
    assert explain(argv) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    page = out.read_text()
    for label in ("min_cut", "default", "full_remat"):
        assert f'<section class="partition" data-partition="{label}">' in page
    assert '<svg class="pareto"' in page and 'data-node="relu"' in page
    with pytest.raises(ft.FunctransError, match="folder that does not exist"):
        explain([f"{src}:example", "--html", str(tmp_path / "no" / "r.html")])


# --- a real browser -------------------------------------------------------------------------


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
    assert found.svgs >= 2 + len(parts)  # timeline, front, legend, a cut per partition
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


def test_console_check_sees_script_errors(tmp_path):
    """The console check above is not vacuous: a page that throws is caught."""
    bad = tmp_path / "bad.html"
    bad.write_text("<!doctype html><body><script>throw new Error('boom')</script></body>")
    _, console = _console(bad.resolve().as_uri())
    assert any("Uncaught Error: boom" in line for line in console)
