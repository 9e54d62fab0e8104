"""The on-disk trace cache (``functrans/_disk_cache.py``): graphs round-trip through JSON, a
fresh process hits what another stored, anything that decides the trace changes the key or
fails the entry's dependencies (a miss, never a wrong hit), and the folder is private, atomic,
bounded and self-repairing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings

import functrans as ft
from benchmarks.zoo import ZOO, has_transformers
from functrans import _disk_cache, _graph_json, policies
from functrans.extend import REMAT, tensor_leaves
from functrans.testing import programs

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300
MODELS = [name for name in ZOO if not name.startswith("hf_")] + (
    ["hf_llama"] if has_transformers() else []
)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private cache root of this test, with the disk cache on."""
    root = tmp_path / "cache"
    monkeypatch.setenv("FUNCTRANS_CACHE_DIR", str(root))
    monkeypatch.setenv("FUNCTRANS_CACHE", "1")
    monkeypatch.setenv("FUNCTRANS_NATIVE", "0")  # no native build in a fresh cache root
    return root


def _entries(root: Path) -> list[Path]:
    folder = root / "traces"
    return sorted(folder.glob("*.json")) if folder.exists() else []


def _round_trip(g, root=None):
    """``g`` through JSON text (``root``: the function its captured tensors are found from)."""
    return _graph_json.load(json.loads(json.dumps(_graph_json.dump(g, root))), root)


def _vals(g):
    return [
        (n.name, _graph_json._val(n.meta.get("val"))) for n in g.fx_graph.nodes if n.op != "output"
    ]


def _model(name, requires_grad=True):
    model = ZOO[name]()
    params, x = model.make("small")
    for t in tensor_leaves(((params,), {})):
        t.requires_grad_(requires_grad)
    return model, params, x


# -- graphs through JSON -----------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_forward_graphs_of_the_zoo_round_trip(name):
    model, params, x = _model(name, requires_grad=False)
    g = ft.trace(model.fn)(params, x)
    back = _round_trip(g, model.fn)
    assert str(back) == str(g)
    assert _vals(back) == _vals(g)
    torch.testing.assert_close(back(params, x), g(params, x), rtol=0, atol=0)


@pytest.mark.parametrize("name", MODELS)
def test_joint_graphs_of_the_zoo_round_trip(name):
    model, params, x = _model(name, requires_grad=False)
    jg = ft.joint(model.fn, argnums=0)(params, x)
    back = _round_trip(jg, model.fn)
    assert str(back) == str(jg)
    assert _vals(back) == _vals(jg)
    assert (back.num_outputs, back.argnums, back.differentiable) == (
        jg.num_outputs,
        jg.argnums,
        jg.differentiable,
    )
    tangents = (torch.ones(()),)
    want, got = jg((params, x), tangents), back((params, x), tangents)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    back.verify()


def test_remat_tags_round_trip_and_partition_alike():
    def f(x, w):
        return torch.tanh(x @ w).exp().sum()

    x, w = torch.randn(4, 4), torch.randn(4, 4, requires_grad=True)
    jg = ft.joint(ft.remat(f, policy=policies.dots_saveable))(x, w)
    back = _round_trip(jg)
    tags = {n.name: n.meta.get(REMAT) for n in jg.fx_graph.nodes}
    assert any(tags.values())
    assert {n.name: n.meta.get(REMAT) for n in back.fx_graph.nodes} == tags
    for strategy in ("default", "min_cut"):
        want, got = ft.partition(jg, strategy), ft.partition(back, strategy)
        assert sorted(s.name for s in got.saved) == sorted(s.name for s in want.saved)
        assert str(got.backward) == str(want.backward)


@settings(max_examples=25, deadline=None)
@given(programs(max_steps=6))
def test_random_programs_round_trip(prog):
    xs = [t.requires_grad_(True) for t in prog.example_inputs()]
    with ft.testing.seeded(0) if prog.is_random else _nothing():
        jg = ft.joint(prog)(*xs)
    back = _round_trip(jg)
    assert str(back) == str(jg)
    assert _vals(back) == _vals(jg)
    g = ft.trace(prog)(*[x.detach() for x in xs])
    assert str(_round_trip(g)) == str(g)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_function_that_cannot_be_hashed_is_not_stored(cache):
    gen = (i for i in range(3))  # a generator: its state is invisible

    def f(x):
        return x * 2 if gen is not None else x

    assert torch.equal(ft.jit(f)(torch.ones(2)), torch.full((2,), 2.0))
    assert _entries(cache) == []


# -- across processes --------------------------------------------------------------------------

# Each case is a function of a tensor, jitted and differentiated; CHANGES (a comma-separated
# list) says which cases change what decides their trace. Prints, per case, the disk hits and
# whether the output and gradient equal eager's.
PROGRAM = """
import json, os, sys
import torch
import functrans as ft
import m_code, m_helper, m_global

changes = set(filter(None, os.environ.get("CHANGES", "").split(",")))
m_global.SCALE = 3.0 if "global" in changes else 2.0   # as an argparse flag would set it


def closure(k):
    return lambda x: (x * k).sin().sum()


class Block(torch.nn.Module):
    def __init__(self, heads):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.heads = heads

    def forward(self, x):
        h = (x * self.w).reshape(self.heads, -1)
        return h.softmax(-1).sum() if self.training else h.tanh().sum()


block = Block(4 if "attribute" in changes else 2)
whole = Block(4 if "module" in changes else 2)  # jit(module): parameters are inputs
if "training" in changes:
    block.eval()
cases = {
    "code": (m_code.f, {}),
    "helper": (m_helper.f, {}),
    "global": (m_global.f, {}),
    "closure": (closure(3.0 if "closure" in changes else 2.0), {}),
    "attribute": (lambda x: block(x), {}),
    "training": (lambda x: block(x), {}),
    "module": (whole, {}),
    "strategy": (m_code.g, {"partition": "default" if "strategy" in changes else "min_cut"}),
    "dtype": (m_code.h, {}),
}
out = {}
for name, (fn, options) in cases.items():
    dtype = torch.float64 if name == "dtype" and "dtype" in changes else torch.float32
    x = torch.linspace(-1, 1, 8, dtype=dtype, requires_grad=True)
    jitted = ft.jit(fn, **options)
    y = jitted(x)
    (gx,) = torch.autograd.grad(y, x)
    want = fn(x)
    (wx,) = torch.autograd.grad(want, x)
    same = bool(torch.allclose(y, want) and torch.allclose(gx, wx))
    saved = sorted(s.name for p in jitted.partitions() for s in p.saved)
    out[name] = [jitted.cache_info().disk_hits, same, saved]
print("RESULT " + json.dumps(out))
"""

MODULES = {
    "m_code.py": """
        import torch

        def f(x):
            return (x.sin() * {k}).sum()

        def g(x):
            return (x.exp() * x.cos()).sum()

        def h(x):
            return x.sigmoid().sum()
    """,
    "m_helper_lib.py": """
        def act(x):
            return x.{act}()
    """,
    "m_helper.py": """
        import m_helper_lib

        def f(x):
            return m_helper_lib.act(x * 2).sum()
    """,
    "m_global.py": """
        SCALE = 1.0

        def f(x):
            return (x * SCALE).tanh().sum()
    """,
}


def _write_program(folder: Path, **fills: str) -> None:
    folder.mkdir(exist_ok=True)
    (folder / "prog.py").write_text(PROGRAM)
    for name, text in MODULES.items():
        (folder / name).write_text(textwrap.dedent(text).format(**fills))
    past = time.time() - 60  # written before the processes start, as source files are
    for p in folder.iterdir():
        os.utime(p, (past, past))


def _run(folder: Path, cache: Path, changes: str = "") -> dict:
    env = {
        **os.environ,
        "FUNCTRANS_CACHE_DIR": str(cache),
        "FUNCTRANS_CACHE": "1",
        "FUNCTRANS_NATIVE": "0",
        "CHANGES": changes,
        "PYTHONPATH": str(folder),
    }
    done = subprocess.run(
        [sys.executable, str(folder / "prog.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=folder,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def test_a_fresh_process_hits_and_every_change_misses(tmp_path):
    cache = tmp_path / "cache"
    program = tmp_path / "program"
    _write_program(program, k="2", act="sin")
    first = _run(program, cache)
    assert all(hits == 0 and same for hits, same, _ in first.values()), first
    again = _run(program, cache)
    # a function capturing parameters traces twice: once with them baked in (stored as paths
    # to them), then with them lifted to inputs
    two = {"attribute", "training"}
    assert all(h == (2 if k in two else 1) and same for k, (h, same, _) in again.items()), again
    assert {k: v[2] for k, v in again.items()} == {k: v[2] for k, v in first.items()}

    changed = "closure,global,attribute,training,module,strategy,dtype"
    out = _run(program, cache, changed)
    for case in changed.split(","):
        hits, same, _ = out[case]
        assert same, (case, out)
        # the strategy acts after the trace: the stored graph is partitioned its new way
        assert hits == (1 if case == "strategy" else 0), (case, out)
    assert out["strategy"][2] != first["strategy"][2]  # min_cut and default save differently

    _write_program(program, k="3", act="cos")  # edit the function and a helper in another file
    out = _run(program, cache)
    for case in ("code", "helper"):
        hits, same, _ = out[case]
        assert hits == 0 and same, (case, out)
    assert out["global"][0] == 1  # untouched files and values still hit


# -- the folder --------------------------------------------------------------------------------


def _square_sum(x):
    return (x * x).sum()


def test_a_corrupt_entry_is_ignored_and_rewritten(cache):
    x = torch.arange(4.0, requires_grad=True)
    ft.jit(_square_sum)(x).backward()
    (entry,) = _entries(cache)
    good = entry.read_text()
    doc = json.loads(good)
    node = next(n for n in doc["graph"]["nodes"] if n["op"] == "call_function")
    node["val"]["tensor"][0] = [99]  # a value the graph no longer computes
    for bad in (good[: len(good) // 2], "", json.dumps(doc)):
        entry.write_text(bad)
        f = ft.jit(_square_sum)
        x.grad = None
        f(x).backward()
        assert f.cache_info().disk_hits == 0
        assert torch.equal(x.grad, 2 * x.detach())
        assert json.loads(entry.read_text())["key"] == doc["key"]  # rewritten whole
    f = ft.jit(_square_sum)
    f(x)
    assert f.cache_info().disk_hits == 1


def test_the_cache_can_be_turned_off(cache, monkeypatch):
    monkeypatch.setenv("FUNCTRANS_CACHE", "0")
    f = ft.jit(_square_sum)
    assert f(torch.ones(3)).item() == 3.0
    assert not (cache / "traces").exists()
    monkeypatch.setenv("FUNCTRANS_CACHE", "maybe")
    with pytest.raises(_disk_cache.DiskCacheError, match="FUNCTRANS_CACHE must be 1 or 0"):
        ft.jit(_square_sum)(torch.ones(3))


def test_folders_are_private_and_writes_leave_no_temporary_files(cache):
    ft.jit(_square_sum)(torch.ones(3))
    for d in (cache, cache / "traces"):
        assert d.stat().st_mode & 0o777 == 0o700, d
    (entry,) = _entries(cache)
    assert entry.stat().st_mode & 0o077 == 0
    assert [p.name for p in (cache / "traces").iterdir()] == [entry.name]


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX owners")
@pytest.mark.parametrize("what", ["root", "entry"])
def test_a_folder_or_entry_others_can_write_is_refused(cache, what, monkeypatch):
    ft.jit(_square_sum)(torch.ones(3))
    (entry,) = _entries(cache)
    (cache if what == "root" else entry).chmod(0o777 if what == "root" else 0o666)
    monkeypatch.setattr(_disk_cache, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f = ft.jit(_square_sum)
        assert f(torch.ones(3)).item() == 3.0
        g = ft.jit(_square_sum)
        g(torch.ones(3))
    assert f.cache_info().disk_hits == 0
    if what == "root":  # nothing read or written there
        assert g.cache_info().disk_hits == 0 and entry.stat().st_mode & 0o777 == 0o600
    else:  # the refused entry was replaced by a private one, which the next call reads
        assert g.cache_info().disk_hits == 1 and entry.stat().st_mode & 0o077 == 0
    refusals = [w for w in caught if issubclass(w.category, _disk_cache.DiskCacheWarning)]
    assert len(refusals) == 1, [str(w.message) for w in caught]  # once
    assert "is writable by other users" in str(refusals[0].message)


def test_the_size_bound_evicts_the_least_recently_used(cache, monkeypatch):
    fns = [lambda x, k=k: (x * k).sum() for k in range(4)]
    ft.jit(fns[0])(torch.ones(3))
    (first,) = _entries(cache)
    size = first.stat().st_size
    monkeypatch.setenv("FUNCTRANS_CACHE_SIZE_MB", str(2.5 * size / 2**20))
    for i, f in enumerate(fns[1:], start=1):
        os.utime(first, (time.time() - 100 + i,) * 2) if i == 1 else None
        ft.jit(f)(torch.ones(3))
    left = _entries(cache)
    assert len(left) == 2
    assert first not in left
    assert sum(p.stat().st_size for p in left) <= 2.5 * size


def test_symbolic_traces_are_not_stored(cache):
    f = ft.jit(_square_sum, dynamic=True)
    assert f(torch.ones(3)).item() == 3.0
    assert f(torch.ones(5)).item() == 5.0
    assert all("s0" not in p.read_text() for p in _entries(cache))
