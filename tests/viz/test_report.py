# ruff: noqa: F811  (the fixtures imported from _report_fixtures are test arguments)
"""The memory report: layout, table, escaping, charts, plot_memory and ``explain --html``
(the page in a real browser: tests/viz/test_report_browser.py)."""

import random
import re
import shutil
from html.parser import HTMLParser

import numpy as np
import pytest
import torch
from _report_fixtures import block, gpt, offload_parts, parts  # noqa: F401  # fixtures

import functrans as ft
from functrans.viz._charts import CHAR_W, pareto_svg, place_labels, points, series
from functrans.viz._report import saved_table
from functrans.viz._svg import (
    BOX_W,
    COLS,
    GAP_X,
    cut_svg,
    forward_layout,
    layered_layout,
    node_kinds,
)

CHROMIUM = shutil.which("chromium")
TIMEOUT = 60


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


def test_cut_of_a_gpt_block_is_compact(gpt):
    """The review saw a top row of every input and a wide, mostly blank drawing: inputs now sit
    just above their nearest user, rows wrap at COLS boxes, and boxes fill the drawing."""
    p = gpt["default"]
    lay, forward = forward_layout(p.joint), p.joint.forward_nodes()
    assert 100 <= len(forward) <= 200
    assert lay.width <= COLS * (BOX_W + GAP_X) < 1000  # fits the page, no sideways scroll
    assert (
        max(sum(b.y == y for b in lay.boxes.values()) for y in {b.y for b in lay.boxes.values()})
        <= COLS
    )
    area = sum(b.w * b.h for b in lay.boxes.values())
    assert area / (lay.width * lay.height) > 0.2, (lay.width, lay.height)
    assert sum(b.y + b.h <= 900 for b in lay.boxes.values()) >= 40  # the first screenful
    top = [n for n, b in lay.boxes.items() if b.layer == 0]
    assert sum(n.op == "placeholder" for n in top) <= 3
    for n in p.joint.primals():
        users = [lay.boxes[u].layer for u in n.users if u in lay.boxes]
        assert not users or lay.boxes[n].layer == min(users) - 1, n


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


class _Cells(HTMLParser):
    """The rows of an HTML table as lists of cell texts, with each row's class."""

    def __init__(self):
        super().__init__()
        self.rows, self._cell = [], None

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append((dict(attrs).get("class"), []))
        elif tag in ("td", "th"):
            self._cell = ""

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.rows[-1][1].append(self._cell)
            self._cell = None


def _saved_rows(p):
    cells = _Cells()
    cells.feed(saved_table(p))
    head, *rows, (total_kind, total) = cells.rows
    assert head[1][4:7] == ["activation bytes", "host bytes", "not counted"]
    assert total_kind == "total"
    return rows, total


def test_saved_table_lists_each_saved_value_and_where_it_lives(parts):
    p = parts["offload"]
    table = saved_table(p)
    assert table.count("<tr") == len(p.saved) + 2  # the header and the totals
    assert '<tr class="host"><td>exp</td><td>exp</td><td>[4, 8]</td><td>float32</td>' in table
    assert "<td>float32</td><td></td><td>128</td><td></td>" in table  # host bytes column
    assert "<td>tanh</td>" in table and "(input)</td>" in table
    assert "primals_3 = params[&#x27;w&#x27;]" in table  # an input under its argument path


def test_saved_table_bytes_add_up_to_the_summary(parts, offload_parts):
    """Inputs (and views of them) show their bytes as not counted, so the activation column
    adds up to activation_bytes and the host column to offloaded_bytes, as the totals say."""
    for p in [*parts.values(), *offload_parts.values()]:
        rows, total = _saved_rows(p)
        kinds = {v.name: k for v, (k, _) in zip(p.saved, rows, strict=True)}
        column = [[int(r[i].split(" = ")[-1]) for _, r in rows if r[i]] for i in (4, 5)]
        assert sum(column[0]) == p.activation_bytes == int(total[2])
        assert sum(column[1]) == p.offloaded_bytes == int(total[3])
        for v, (kind, r) in zip(p.saved, rows, strict=True):
            if v.is_input and kind != "host" and v.node not in p.shared_storage():
                assert kind == "input" and r[6] == f"{v.storage_bytes} (input)" and not r[4]
        assert sum(k == "input" for k in kinds.values()) > 0


def _pareto_points(svg):
    """``{label: (class, dominated, title, label text)}`` of a Pareto panel's points."""
    found = re.findall(
        r'<g class="point (\w+)" data-partition="([^"]*)" data-dominated="(\w+)"><title>([^<]*)'
        r"</title>.*?<text[^>]*>([^<]*)</text></g>",
        svg,
    )
    return {label: (kind, dom, title, text) for kind, label, dom, title, text in found}


def test_pareto_does_not_let_offloading_dominate(offload_parts, parts):
    """Offloading everything (0 device bytes, host bytes and copies instead) must not make
    full_remat look dominated: points are compared on device bytes, FLOPs, host and copies."""
    items = list(offload_parts.items())
    pts = {q.label: q for q in points(items)}
    off, remat = pts["mb0+offload"], pts["full_remat"]
    assert off.offloads and off.device == remat.device == 0 and off.flops < remat.flops
    assert not off.dominates(remat) and not remat.dominates(off)
    svg = pareto_svg(items)
    drawn = _pareto_points(svg)
    assert drawn["full_remat"][:2] == ("device", "no")
    kind, dominated, title, text = drawn["mb0+offload"]
    assert (kind, dominated) == ("offload", "no") and "<polygon" in svg
    assert "host peak" in title and "copied" in title and "host" in text and "copied" in text
    assert "never hides one that does not" in svg  # the caption says how points compare
    # among partitions that keep everything on the device, domination is the usual one
    drawn = _pareto_points(
        pareto_svg([(k, parts[k]) for k in ("default", "min_cut", "full_remat")])
    )
    assert {k: v[1] for k, v in drawn.items()} == {
        "default": "no",
        "min_cut": "no",
        "full_remat": "no",
    }
    worse = pareto_svg(
        [("a", parts["min_cut"]), ("b", parts["full_remat"]), ("c", parts["min_cut"])]
    )
    assert 'data-partition="a" data-dominated="no"' in worse  # equal points do not dominate


def _boxes(spots, placed):
    for (_, _, text), (x, y, anchor) in zip(spots, placed, strict=True):
        width = CHAR_W * len(text)
        left = x if anchor == "start" else x - width
        yield (left, y - 11, left + width, y + 3)


def test_pareto_labels_at_one_spot_do_not_overlap():
    """Two partitions on (nearly) one spot used to print as one string ("mb0+offloadfull_remat")."""
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randrange(1, 7)
        spots = [
            (
                rng.choice([92, 95, 300, 690]),
                rng.choice([40, 42, 200, 330]),
                "x" * rng.randrange(2, 40),
            )
            for _ in range(n)
        ]
        boxes = list(_boxes(spots, place_labels(spots, 720, 380)))
        for i, a in enumerate(boxes):
            assert a[0] >= 0 and a[2] <= 720 and a[1] >= 0 and a[3] <= 380, (spots, a)
            for b in boxes[i + 1 :]:
                assert not (a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]), spots


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


def test_the_timeline_has_ticks_counting_each_passes_ops(parts):
    """Issue 52: the memory timeline had no x-axis ticks."""
    import re

    from functrans.viz._charts import timeline_svg

    items = list(parts.items())
    svg = timeline_svg(items)
    ticks = [int(t) for t in re.findall(r'<text class="xtick"[^>]*>(\d+)</text>', svg)]
    forward = int(series(items)[0].boundary - 0.5)
    assert ticks[:3] == [0, round(forward / 2), forward] and len(ticks) == 5
