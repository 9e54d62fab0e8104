"""A self-contained HTML page about one or more partitions (:func:`functrans.viz.report`).

Everything is drawn in Python as inline SVG: no network, no JavaScript, no graphviz. The page
holds a summary row per partition, the memory timeline of every partition and, with several
partitions, their device activation bytes against recompute FLOPs (both charts are in
:mod:`functrans.viz._charts`), then per partition its inputs, its cut
(:func:`functrans.viz._svg.cut_svg`) and its saved-values table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch.fx as fx

from functrans._core.errors import InvalidArgumentError
from functrans._core.format import format_value_type
from functrans._core.graph import PATH
from functrans._core.validate import describe
from functrans._cut.partition import Partition, SavedValue, _short_source, format_bytes

from ._charts import pareto_svg, timeline_svg
from ._svg import cut_svg, esc, legend_html

__all__ = ["check_path", "labelled", "page", "saved_table"]

Partitions = Partition | Sequence[Partition] | Mapping[str, Partition]


def labelled(partitions: Partitions, where: str) -> list[tuple[str, Partition]]:
    """``(label, partition)`` pairs: a mapping's keys, else each strategy's name (``#2`` added
    to a repeated name); raises :class:`InvalidArgumentError` on anything else or nothing.

    >>> import torch, functrans as ft
    >>> p = ft.partition(ft.joint(lambda x: x.sin().sum())(torch.ones(2)), "min_cut")
    >>> [label for label, _ in labelled([p, p], "report")]
    ['min_cut', 'min_cut #2']
    """
    accepted = "a Partition, a non-empty sequence of them, or a mapping label -> Partition"
    if isinstance(partitions, Partition):
        items: list[tuple[object, object]] = [(partitions.strategy, partitions)]
    elif isinstance(partitions, Mapping):
        items = list(partitions.items())
    elif isinstance(partitions, Sequence) and not isinstance(partitions, str):
        items = [(getattr(p, "strategy", ""), p) for p in partitions]
    else:
        raise InvalidArgumentError(
            f"{where}: partitions={describe(partitions)} is not accepted; expected {accepted}"
        )
    if not items:
        raise InvalidArgumentError(f"{where}: partitions is empty; expected {accepted}")
    out: list[tuple[str, Partition]] = []
    for i, (label, p) in enumerate(items):
        if not isinstance(p, Partition):
            raise InvalidArgumentError(
                f"{where}: partitions[{label if isinstance(partitions, Mapping) else i!r}]="
                f"{describe(p)} is not a Partition; expected {accepted} (ft.partition(...))"
            )
        name, n = str(label), 2
        while name in {lab for lab, _ in out}:
            name, n = f"{label} #{n}", n + 1
        out.append((name, p))
    return out


def check_path(path: str | Path, suffixes: Sequence[str], where: str) -> Path:
    """``path`` as a Path whose folder exists and whose suffix is one of ``suffixes``."""
    path = Path(path)
    if path.suffix.lower() not in suffixes:
        raise InvalidArgumentError(
            f"{where}: path={str(path)!r} has suffix {path.suffix!r}; accepted: "
            f"{', '.join(suffixes)}"
        )
    if not path.parent.is_dir():
        raise InvalidArgumentError(
            f"{where}: path={str(path)!r} is in a folder that does not exist "
            f"({str(path.parent)!r}); create it first or write to an existing folder"
        )
    return path


def saved_table(p: Partition) -> str:
    """The saved values of ``p`` as an HTML table, every cell escaped: name (inputs with your
    argument path), op, shape, dtype, and each value's bytes in one of three columns (the
    activation bytes on the device, the bytes offloaded to the host, or not counted: an input
    or a view of one, or a value in a storage an earlier row holds), then its source line. A
    last row totals the first two columns: the summary's activation and offloaded bytes.

    >>> import torch, functrans as ft
    >>> p = ft.partition(ft.joint(lambda x: x.sin().exp().sum())(torch.ones(3)), "default")
    >>> table = saved_table(p)
    >>> "<td>exp</td><td>exp</td><td>[3]</td><td>float32</td><td>12</td><td></td>" in table
    True
    >>> "<td>primals_1 = x</td><td>input</td>" in table, "<td>12 (input)</td>" in table
    (True, True)
    >>> table.endswith("<td>12</td><td>0</td><td></td><td></td></tr></table>")
    True
    """
    head = ("name", "op", "shape", "dtype", "activation bytes", "host bytes", "not counted")
    shared, host = p.shared_storage(), {v.node for v in p.offloaded}
    rows = [_saved_row(v, shared, host) for v in p.saved]
    total = f"<td>{p.activation_bytes}</td><td>{p.offloaded_bytes}</td><td></td><td></td>"
    ths = "".join(f"<th>{h}</th>" for h in (*head, "source"))
    return (
        f'<table class="saved"><tr>{ths}</tr>{"".join(rows)}<tr class="total">'
        f'<th>total</th><td colspan="3">the summary\'s activation and offloaded bytes</td>'
        f"{total}</tr></table>"
    )


def _saved_row(v: SavedValue, shared: Mapping[fx.Node, fx.Node], host: set[fx.Node]) -> str:
    """One row of :func:`saved_table`: the column a value's bytes go in mirrors how
    :attr:`Partition.activation_bytes` and :attr:`Partition.offloaded_bytes` count it."""
    size = str(v.storage_bytes) if v.bytes_expr is None else f"{v.bytes_expr} = {v.storage_bytes}"
    cols = ["", "", ""]
    if v.node in host:
        kind, cols[1] = "host", size
    elif v.node in shared:
        kind, cols[2] = "shared", f"shares {shared[v.node].name}'s storage"
    elif v.is_input:
        kind, cols[2] = "input", f"{size} (input)"
    else:
        kind, cols[0] = "device", size
    path = v.node.meta.get(PATH) if v.node.op == "placeholder" else None
    name = v.name if path is None else f"{v.name} = {path}"
    shape = "[" + ", ".join(v.shape_expr or map(str, v.shape)) + "]"
    dtype = "int (a symbolic size)" if v.dtype is None else str(v.dtype).replace("torch.", "")
    op = v.op.removeprefix("aten.").removesuffix(".default")
    tds = "".join(f"<td>{esc(c)}</td>" for c in (name, op, shape, dtype, *cols))
    src = f'<td class="src" title="{esc(v.source or "")}"><code>{esc(_short_source(v.source))}'
    return f'<tr class="{kind}">{tds}{src}</code></td></tr>'


def _summary(items: Sequence[tuple[str, Partition]]) -> str:
    head = ("partition", "activation", "peak (device)", "host peak", "copied", "recompute")
    rows = []
    for label, p in items:
        cells = (
            label,
            format_bytes(p.activation_bytes),
            format_bytes(p.peak_bytes),
            format_bytes(p.host_peak_bytes),
            format_bytes(p.transfer_bytes),
            f"{len(p.recomputed)} ops, {p.recompute_flops:,} FLOPs",
        )
        rows.append("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in cells) + "</tr>")
    ths = "".join(f"<th>{h}</th>" for h in head)
    return f'<table class="summary"><tr>{ths}</tr>{"".join(rows)}</table>'


def _section(label: str, p: Partition) -> str:
    rows = "".join(
        f"<tr><td>{esc(n.name)}</td><td>{esc(n.meta.get(PATH) or '?')}</td>"
        f"<td>{esc(format_value_type(n.meta.get('val')))}</td></tr>"
        for n in p.joint.primals()
    )
    inputs = (
        f'<details class="inputs"><summary>inputs: {len(p.joint.primals())} (graph name, '
        "your argument, type)</summary><table><tr><th>name</th><th>argument</th><th>type</th>"
        f"</tr>{rows}</table></details>"
    )
    return (
        f'<section class="partition" data-partition="{esc(label)}"><h2>{esc(label)}</h2>'
        f'{inputs}<div class="cut-box">{cut_svg(p)}</div><h3>saved values</h3>{saved_table(p)}'
        "</section>"
    )


_STYLE = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1em; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; white-space: nowrap; }
th { background: #eee; } tr.host td { background: #f3eafa; } tr.total td { font-weight: bold; }
tr.input td, tr.shared td { color: #666; }
.saved th, .saved td:nth-child(7) { white-space: normal; }
.saved td:first-child, td.src, .inputs td { white-space: normal; overflow-wrap: anywhere; }
td.src, .inputs td { min-width: 14em; }
code { font-size: 12px; } .cut-box { border: 1px solid #ddd; padding: 4px; }
section.partition { margin-bottom: 2em; }
.key span { margin-right: 1.5em; white-space: nowrap; }
.legend > span { display: inline-block; margin-right: 1.5em; font-size: 13px; }
.swatch { display: inline-block; width: 14px; height: 14px; border: 1px solid #333;
  vertical-align: middle; }
.caption { max-width: 720px; font-size: 13px; color: #444; } summary { cursor: pointer; }
"""


def page(items: Sequence[tuple[str, Partition]], title: str = "functrans memory report") -> str:
    """The whole HTML page for ``items`` (see the module docstring)."""
    parts = [
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>',
        f"<style>{_STYLE}</style></head><body><h1>{esc(title)}</h1>",
        _summary(items),
        f"<h2>memory over forward then backward</h2>{timeline_svg(items)}",
    ]
    if len(items) > 1:
        parts.append(f"<h2>device activation memory against recompute</h2>{pareto_svg(items)}")
    parts.append(f"<h2>the cuts</h2>{legend_html()}")
    parts += [_section(label, p) for label, p in items]
    parts.append("</body></html>\n")
    return "".join(parts)
