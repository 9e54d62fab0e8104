"""Logs, torch.compile backend, drawings and the explain command."""

import shutil
import subprocess
import sys

import pytest
import torch

import functrans as ft


def test_set_logs_prints_each_requested_stage(capsys):
    ft.set_logs("joint,partition,codegen")
    try:
        ft.jit(lambda x: x.sin().sum())(torch.ones(2, requires_grad=True)).backward()
    finally:
        ft.set_logs()
    err = capsys.readouterr().err
    assert "[functrans:joint]" in err and "[functrans:partition]" in err
    assert "[functrans:codegen]" in err and "[functrans:trace]" not in err
    with pytest.raises(ValueError, match="unknown log stage"):
        ft.set_logs("jiont")


def test_dynamo_backend_with_graph_breaks_matches_eager():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    ref.load_state_dict(model.state_dict())

    def step(m, x):
        h = m[0](x)
        torch._dynamo.graph_break()
        return m[2](m[1](h)).pow(2).mean()

    compiled = torch.compile(step, backend=ft.dynamo_backend(partition="min_cut"), dynamic=False)
    x = torch.randn(3, 4)
    compiled(model, x).backward()
    step(ref, x).backward()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_draw_dot_and_html(tmp_path):
    p = ft.partition(
        ft.joint(lambda x, w: torch.tanh(x @ w).sum())(torch.ones(4, 4), torch.ones(4, 4)),
        "min_cut",
    )
    dot = ft.viz.draw(p, tmp_path / "p.dot").read_text()
    assert 'label="saved 64 B"' in dot  # mm crosses the cut with its bytes
    assert "dashed" in dot  # tanh is recomputed
    page = ft.viz.draw(p, tmp_path / "p.html").read_text()
    assert page.startswith("<!doctype html>") and "activation bytes" in page
    with pytest.raises(ft.FunctransError, match=r"\.dot, \.svg or \.html"):
        ft.viz.draw(p, tmp_path / "p.png")


@pytest.mark.skipif(shutil.which("dot") is not None, reason="graphviz is installed")
def test_draw_svg_without_graphviz_says_how_to_install(tmp_path):
    p = ft.partition(ft.joint(lambda x: x.sin().sum())(torch.ones(2)), "default")
    with pytest.raises(ft.FunctransError, match="apt-get install graphviz"):
        ft.viz.draw(p, tmp_path / "p.svg")


def test_explain_command(tmp_path):
    src = tmp_path / "ex.py"
    src.write_text(
        "import torch\n"
        "def example():\n"
        "    return (lambda x, w: torch.relu(x @ w).sum()), (torch.ones(8, 8), torch.ones(8, 8))\n"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "functrans",
            "explain",
            f"{src}:example",
            "--budget",
            "0.5",
            "--draw",
            str(tmp_path / "p.dot"),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "===== joint graph =====" in out and "partition 'memory_budget'" in out
    assert "peak" in out and (tmp_path / "p.dot").exists()


def test_explain_offload_and_bad_targets_in_one_line(tmp_path, capsys):
    # found by review: a missing function or strategy printed a traceback; no way to offload
    from functrans.__main__ import main

    src = tmp_path / "ex.py"
    src.write_text(
        "import torch\n"
        "def example():\n"
        "    f = lambda x, w: torch.tanh(x @ w).exp().sum()\n"
        "    return f, (torch.ones(8, 16), torch.ones(16, 16, requires_grad=True))\n"
    )
    assert main(["explain", f"{src}:example", "--offload", "inf"]) == 0
    assert "offloaded to host:" in capsys.readouterr().out
    for argv, message in [
        ([f"{src}:nosuch"], "has no 'nosuch'; its functions: example"),
        ([f"{tmp_path}/missing.py:f"], "missing.py is not a file"),
        ([f"{src}:example", "--html", str(tmp_path / "r.html"), "--compare", "nosuch"], "unknown"),
        ([f"{src}:example", "--budget", "-1"], "budget=-1.0 (float) is not accepted"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main(["explain", *argv])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
