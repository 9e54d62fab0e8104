"""The on-disk trace cache (``functrans/_disk_cache.py``): graphs round-trip through JSON, a
fresh process hits what another stored, anything that decides the trace changes the key or
fails the entry's dependencies (a miss, never a wrong hit), and the folder is private, atomic,
bounded and self-repairing."""

from __future__ import annotations

import functools
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
from hypothesis import strategies as st

import functrans as ft
from benchmarks.zoo import ZOO, has_transformers
from functrans import policies
from functrans._jit.disk import graph_json as _graph_json
from functrans._jit.disk import store as _disk_cache
from functrans.extend import REMAT, SwitchError, tensor_leaves
from functrans.testing import programs

REPO = Path(__file__).resolve().parents[2]
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


def _round_trip(g, root=None, verify=True):
    """``g`` through JSON text (``root``: the function its captured tensors are found from;
    ``verify=False``: values made from the stored metadata, as for a signed entry)."""
    doc = json.loads(json.dumps(_graph_json.dump(g, root)))
    return _graph_json.load(doc, root, verify=verify)


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
    unverified = _round_trip(jg, model.fn, verify=False)  # values from the stored metadata
    assert _vals(unverified) == _vals(jg)

    def saved(g):
        return [(str(v.node), v.nbytes, v.storage_bytes) for v in ft.partition(g, "min_cut").saved]

    assert saved(unverified) == saved(jg)
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
import m_code, m_helper, m_global, m_pure, m_pure_lib

changes = set(filter(None, os.environ.get("CHANGES", "").split(",")))
m_global.SCALE = 3.0 if "global" in changes else 2.0   # as an argparse flag would set it
m_pure_lib.FACTOR = 5.0 if "lib_global" in changes else 4.0


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


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.full((8,), 2.0))

    def forward(self, x):
        return (x * self.scale).tanh().sum()


scaled = Scaled()
if "buffer" in changes:
    scaled.scale.fill_(3.0)  # its value, not its metadata: an input of the stored graph
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
    "buffer": (lambda x: torch.func.functional_call(scaled, {}, (x,)), {}),
    "module": (whole, {}),
    "strategy": (m_code.g, {"partition": "default" if "strategy" in changes else "min_cut"}),
    "dtype": (m_code.h, {}),
    "pure": (m_pure.f, {}),
    "lib_global": (m_pure.g, {}),
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
    # helpers that run no torch code: a size and a factor, from another file
    "m_pure_lib.py": """
        FACTOR = 1.0

        def rows():
            return {rows}

        def factor():
            return FACTOR
    """,
    "m_pure.py": """
        import m_pure_lib

        def f(x):
            return x.reshape(m_pure_lib.rows(), -1).softmax(-1).sum()

        def g(x):
            return (x * m_pure_lib.factor()).tanh().sum()
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


def _run(
    folder: Path, cache: Path, changes: str = "", script: str = "prog.py", **extra: str
) -> dict:
    env = {
        **os.environ,
        "FUNCTRANS_CACHE_DIR": str(cache),
        "FUNCTRANS_CACHE": "1",
        "FUNCTRANS_NATIVE": "0",
        "CHANGES": changes,
        "PYTHONPATH": str(folder),
        **extra,
    }
    done = subprocess.run(
        [sys.executable, str(folder / script)],
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
    _write_program(program, k="2", act="sin", rows="2")
    first = _run(program, cache)
    assert all(hits == 0 and same for hits, same, _ in first.values()), first
    again = _run(program, cache)
    # a function capturing parameters traces twice: once with them baked in (stored as paths
    # to them), then with them lifted to inputs
    two = {"attribute", "training"}
    assert all(h == (2 if k in two else 1) and same for k, (h, same, _) in again.items()), again
    assert {k: v[2] for k, v in again.items()} == {k: v[2] for k, v in first.items()}

    changed = "closure,global,attribute,training,module,strategy,dtype,lib_global"
    out = _run(program, cache, changed)
    for case in changed.split(","):
        hits, same, _ = out[case]
        assert same, (case, out)
        # the strategy acts after the trace: the stored graph is partitioned its new way
        assert hits == (1 if case == "strategy" else 0), (case, out)
    assert out["strategy"][2] != first["strategy"][2]  # min_cut and default save differently
    # a module buffer is lifted before the first trace: one stored trace, hit with the new value
    out = _run(program, cache, "buffer")
    assert out["buffer"][:2] == [1, True], out

    # edit the function, a helper in another file and a helper that runs no torch code
    _write_program(program, k="3", act="cos", rows="4")
    out = _run(program, cache)
    for case in ("code", "helper", "pure", "lib_global"):  # lib_global: its file changed
        hits, same, _ = out[case]
        assert hits == 0 and same, (case, out)
    assert out["global"][0] == 1  # untouched files and values still hit


# -- the folder --------------------------------------------------------------------------------


def _square_sum(x):
    return (x * x).sum()


def _doc(entry):
    """A stored entry's JSON, behind its checksum line."""
    return json.loads(entry.read_text().partition("\n")[2])


def _sealed(text):
    from functrans._jit.disk.store import _sealed as seal

    return seal(text)


def test_a_corrupt_entry_is_ignored_and_rewritten(cache):
    x = torch.arange(4.0, requires_grad=True)
    ft.jit(_square_sum)(x).backward()
    (entry,) = _entries(cache)
    good = entry.read_text()
    assert good.startswith("hmac-sha256:")  # signed: loaded without running the graph
    doc = _doc(entry)
    node = next(n for n in doc["graph"]["nodes"] if n["op"] == "call_function")
    node["val"]["tensor"][0] = [99]  # a value the graph no longer computes
    # torn, empty, damaged behind its checksum, and sealed but wrong inside
    damaged = good.replace('"call_function"', '"call_functiom"', 1)
    for bad in (good[: len(good) // 2], "", damaged, _sealed(json.dumps(doc))):
        entry.write_text(bad)
        f = ft.jit(_square_sum)
        x.grad = None
        f(x).backward()
        assert f.cache_info().disk_hits == 0
        assert torch.equal(x.grad, 2 * x.detach())
        (entry,) = _entries(cache)  # the bad one removed, a good one written
        assert _doc(entry)["key"] == doc["key"]
    f = ft.jit(_square_sum)
    f(x)
    assert f.cache_info().disk_hits == 1


def _tanh_twice(x):
    return (torch.tanh(x) * 2).sum()


def test_no_flipped_byte_of_a_real_entry_gives_a_wrong_value(cache):
    """One changed digit that keeps the JSON valid (``mul(tanh, 2)`` -> ``3``) used to load and
    run; now every entry carries a checksum: 200 flips at random positions, never a hit with a
    wrong value (a damaged entry is a miss, rewritten)."""
    import random

    x = torch.linspace(-1.0, 1.0, 6, requires_grad=True)
    want = _tanh_twice(x.detach())
    ft.jit(_tanh_twice)(x)
    (entry,) = _entries(cache)
    good = entry.read_bytes()
    rng = random.Random(0)
    hits = 0
    for _ in range(200):
        raw = bytearray(good)
        i = rng.randrange(len(raw))
        raw[i] = rng.choice([c for c in b'0123456789abcdef"{}[]:, xz' if c != raw[i]])
        for old in _entries(cache):  # the last miss rewrote a good entry: only the damaged one
            old.unlink()
        entry.write_bytes(bytes(raw))
        f = ft.jit(_tanh_twice)
        out = f(x.detach())
        hits += f.cache_info().disk_hits
        assert torch.equal(out, want)
    assert hits == 0
    entry.write_bytes(good)
    f = ft.jit(_tanh_twice)
    assert torch.equal(f(x.detach()), want) and f.cache_info().disk_hits == 1


def test_the_cache_can_be_turned_off(cache, monkeypatch):
    monkeypatch.setenv("FUNCTRANS_CACHE", "0")
    f = ft.jit(_square_sum)
    assert f(torch.ones(3)).item() == 3.0
    assert not (cache / "traces").exists()
    monkeypatch.setenv("FUNCTRANS_CACHE", "maybe")
    with pytest.raises(SwitchError, match="FUNCTRANS_CACHE='maybe' is not accepted: 1/true"):
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


def test_symbolic_traces_are_stored_and_hit_at_other_sizes(cache):
    f = ft.jit(_square_sum, dynamic=True)
    assert f(torch.ones(3)).item() == 3.0
    assert f(torch.ones(5)).item() == 5.0
    (entry,) = _entries(cache)
    doc = _doc(entry)
    assert doc["graph"]["nodes"][0]["val"]["tensor"][0] == ["s0"]
    g = ft.jit(_square_sum, dynamic=True)  # as in a new process
    assert g(torch.ones(7)).item() == 7.0
    assert g.cache_info().disk_hits == 1
    # the loaded entry checks what the trace assumed, no more and no less
    (want,) = [s.shape for s in f._cache.slots()]
    (got,) = [s.shape for s in g._cache.slots()]
    assert got.parts == want.parts and (got.sizes, got.strides) == (want.sizes, want.strides)
    h = ft.jit(_square_sum, dynamic=True)
    assert h(torch.ones(1)).item() == 1.0  # size 1 is never symbolic: another key
    assert h.cache_info().disk_hits == 0


def _mlp(x, w1, w2):
    return (torch.tanh(x @ w1) @ w2).softmax(-1).pow(2).sum()


def _mlp_inputs(batch):
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(8, 16, generator=g, requires_grad=True)
    w2 = torch.randn(16, 8, generator=g, requires_grad=True)
    return torch.randn(batch, 8, generator=g), w1, w2


def test_a_different_dynamic_mapping_misses(cache):
    ft.jit(_mlp, dynamic={"x": {0: "batch"}})(*_mlp_inputs(6)).backward()
    assert len(_entries(cache)) == 1
    for dynamic in ({"x": {0: "rows"}}, {"x": (0,)}, {"x": {0: "b"}, "w1": {1: "h"}}, True):
        f = ft.jit(_mlp, dynamic=dynamic)
        f(*_mlp_inputs(6)).backward()
        assert f.cache_info().disk_hits == 0, dynamic
    f = ft.jit(_mlp, dynamic={"x": {0: "batch"}})
    x, w1, w2 = _mlp_inputs(11)
    f(x, w1, w2).backward()
    assert f.cache_info().disk_hits == 1
    want = torch.autograd.grad(_mlp(x, w1, w2), [w1, w2])
    torch.testing.assert_close([w1.grad, w2.grad], list(want))


def test_a_loaded_symbolic_graph_plans_at_named_sizes(cache):
    """``memory_budget(at=...)`` reads the named dimensions: a loaded graph has them."""
    options = {"max_bytes": 2000, "at": {"batch": 4096}}
    kw = {"dynamic": {"x": {0: "batch"}}, "partition": "memory_budget"}
    f = ft.jit(_mlp, **kw, **options)
    f(*_mlp_inputs(6)).backward()
    g = ft.jit(_mlp, **kw, **options)
    g(*_mlp_inputs(6)).backward()
    assert g.cache_info().disk_hits == 1
    (want,), (got,) = f.partitions(), g.partitions()
    assert sorted(s.name for s in got.saved) == sorted(s.name for s in want.saved)
    assert not [s for s in got.saved if s.bytes_expr is not None and not s.is_input]


def _branchy(x):
    return (x * 2).sum() if x.shape[0] > 8 else (x * 3).sum()


@pytest.mark.parametrize(
    "guards",
    [
        ["__import__('os').system('touch pwned')"],  # not size arithmetic: never compiled
        ["L['t7'].size()[0] == 4"],  # an input the graph does not have
        ["L['t0'].size()[0] == 999"],  # a condition these sizes fail: a miss, not a stale hit
        "not a list",
    ],
)
def test_a_corrupt_stored_guard_is_ignored(cache, guards, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ft.jit(_branchy, dynamic=True)(torch.ones(4))
    (entry,) = _entries(cache)
    doc = _doc(entry)
    assert any("<= 8" in g for g in doc["shape"]["guards"])  # the user's `if`, stored
    doc["shape"]["guards"] = guards
    entry.write_text(_sealed(json.dumps(doc)))  # sealed: the guard check must catch it
    f = ft.jit(_branchy, dynamic=True)
    assert f(torch.ones(5)).item() == 15.0
    assert f.cache_info().disk_hits == 0
    assert not (tmp_path / "pwned").exists()
    g = ft.jit(_branchy, dynamic=True)  # the rewritten entry
    assert g(torch.ones(6)).item() == 18.0 and g.cache_info().disk_hits == 1


# Training steps with dynamic shapes in fresh processes: prints per case the disk hits, the
# in-memory misses, whether outputs and gradients equal eager's, and the outputs.
DYNAMIC_PROGRAM = """
import json, os
import torch
import functrans as ft
import m_dyn

sizes = [int(s) for s in os.environ["SIZES"].split(",")]
cases = {
    "true": (m_dyn.step, {"dynamic": True}),
    "auto": (m_dyn.step, {}),
    "branch": (m_dyn.branch, {"dynamic": True}),
    "branch_auto": (m_dyn.branch, {}),
}
out = {}
for name, (fn, options) in cases.items():
    jitted = ft.jit(fn, **options)
    same, values = True, []
    for b in sizes:
        params = m_dyn.params()
        x = torch.randn(b, 8, generator=torch.Generator().manual_seed(b))
        y = jitted(params, x)
        grads = torch.autograd.grad(y, list(params.values()))
        want = fn(params, x)
        wgrads = torch.autograd.grad(want, list(params.values()))
        same = same and bool(torch.allclose(y, want))
        same = same and all(bool(torch.allclose(a, b)) for a, b in zip(grads, wgrads))
        values.append(round(y.item(), 4))
    info = jitted.cache_info()
    out[name] = [info.disk_hits, info.misses, same, values]
print("RESULT " + json.dumps(out))
"""

DYNAMIC_MODULE = """
import torch

def params():
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(8, 16, generator=g).requires_grad_()
    w2 = torch.randn(16, 8, generator=g).requires_grad_()
    return {"w1": w1, "w2": w2}

def step(params, x):
    h = torch.tanh(x @ params["w1"])
    h = h.view(x.shape[0] * 2, 8).softmax(-1).reshape(x.shape[0], -1)  # size arithmetic
    return ((h @ params["w2"]) ** 2).mean()

def branch(params, x):
    h = x @ params["w1"]
    if x.shape[0] > 8:
        h = h.relu() * 2
    else:
        h = h.sin()
    return (h @ params["w2"]).sum()
"""


def test_symbolic_traces_hit_in_a_fresh_process_at_other_sizes(tmp_path):
    cache, folder = tmp_path / "cache", tmp_path / "program"
    folder.mkdir()
    (folder / "dyn.py").write_text(DYNAMIC_PROGRAM)
    (folder / "m_dyn.py").write_text(DYNAMIC_MODULE)
    past = time.time() - 60
    for p in folder.iterdir():
        os.utime(p, (past, past))
    run = functools.partial(_run, folder, cache, script="dyn.py")
    first = run(SIZES="4,6")
    assert all(hits == 0 and same for hits, _, same, _ in first.values()), first
    # true: one symbolic entry; auto: static at 4, symbolic from 6; both stored
    again = run(SIZES="5,7")  # other batch sizes
    assert again["true"][:3] == [1, 1, True], again  # one load, then an in-memory hit
    assert again["auto"][:3] == [1, 2, True], again  # 5: static (a miss), 7: the symbolic one
    assert again["branch"][:3] == [1, 1, True], again  # 5 and 7 <= 8: the branch it stored
    # the stored branch entries were traced under x.shape[0] <= 8: 12 and 16 fail it and are
    # traced again (the other branch), never run through the stale graph
    other = run(SIZES="4,12,16")
    assert other["true"][:3] == [1, 1, True], other
    assert other["branch"][:3] == [1, 2, True], other  # 4: loaded; 12: traced, 16: its hit
    assert other["branch_auto"][:3] == [1, 2, True], other  # 4: static hit; 12: traced
    both = run(SIZES="6,12")  # each branch now has its entry
    assert both["branch"][:3] == [2, 2, True], both
    assert both["branch_auto"][:3] == [1, 2, True], both


def test_a_function_stores_its_first_traces_only(cache):
    """Recording what a trace ran doubles its time on CPython 3.11: a jitted function stores
    the traces of its first DISK_STORES misses (what every restart pays again), later misses
    only look up."""
    from functrans._jit.jitted import DISK_STORES

    f = ft.jit(_square_sum, dynamic=False)  # an entry per shape: a miss per shape
    for n in range(1, DISK_STORES + 3):
        f(torch.ones(n + 1))
    assert len(_entries(cache)) == DISK_STORES
    g = ft.jit(_square_sum, dynamic=False)
    for n in range(1, DISK_STORES + 3):
        assert g(torch.ones(n + 1)).item() == n + 1
    assert g.cache_info().disk_hits == DISK_STORES


def test_code_that_looks_values_up_by_name_is_not_stored(cache):
    """Found by a user-style review: globals()["V"], importlib.import_module(name).X and
    sys.argv read inside the function are not in the key, and a second process got the first
    one's value. Code that ran and names such a lookup is not stored."""
    import sys as _sys

    def by_name(x):
        return x * globals()["_LOOKED_UP"]

    def from_argv(x):
        return x * len(_sys.argv)

    globals()["_LOOKED_UP"] = 2.0
    for fn in (by_name, from_argv):
        f = ft.jit(fn)
        f(torch.ones(2))
    assert not _entries(cache)


class _Sizes:
    def rows(self):  # runs no torch code: only reached through the class of `self`
        return 2

    def forward(self, x):
        return x.reshape(self.rows(), -1).sum()


def _pure_rows():
    return _sizes_helper()


def _sizes_helper():
    return 2


def test_the_recorder_sees_code_that_runs_no_torch():
    """Code that ran while tracing but called no torch function is on no torch call's stack:
    it is found by name (a helper calling a helper) and by the class of a method's ``self``."""
    from functrans._jit.disk.code_deps import Recorder, dependencies

    sizes = _Sizes()

    def f(x):
        return sizes.forward(x) + x.reshape(_pure_rows(), -1).sum()

    with Recorder() as r:
        ft.trace(f)(torch.ones(4))
    assert r.ok
    observed = {c.co_name for c in r.codes if c not in r.static}
    assert {"f", "forward"} <= observed
    assert {_Sizes.rows.__code__, _pure_rows.__code__, _sizes_helper.__code__} <= r.static
    deps = dependencies(r, {f.__code__}, time.time() + 60)  # f: hashed by the key
    assert deps.files[__file__]
    assert (__name__, "_sizes_helper") in deps.globals  # what _pure_rows names


_PICK_INDEX = 0
_SCALE = 2.0


class _Pick(torch.nn.Module):
    def forward(self, xs):  # called by Module.__call__, never by name; runs no torch
        return xs[_PICK_INDEX]


class _PickNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.pick, self.lin = _Pick(), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(self.pick((x, x + 1))) * getattr(self, "_scale_" + "fixed")()

    def _scale_fixed(self):  # picked by a computed name; runs no torch
        return _SCALE


def test_the_recorder_follows_every_function_of_a_user_class(cache):
    # a user class's functions may run without their name in any code (a submodule's
    # forward, a getattr by a computed name): all of them are followed, and the globals they
    # read are dependencies (a review found these missed once classes were followed by name)
    from functrans._jit.disk.code_deps import Recorder, dependencies

    torch.manual_seed(0)
    net = _PickNet()

    def f(x):
        return net(x)

    with Recorder() as r:
        ft.trace(f)(torch.ones(2, 4))
    assert {_Pick.forward.__code__, _PickNet._scale_fixed.__code__} <= r.static
    deps = dependencies(r, {f.__code__}, time.time() + 60)  # f: hashed by the key
    assert {(__name__, "_PICK_INDEX"), (__name__, "_SCALE")} <= set(deps.globals)

    global _PICK_INDEX
    x = torch.randn(2, 4)
    first = ft.jit(net)
    assert torch.equal(first(x), net(x)) and first.cache_info().disk_hits == 0
    _PICK_INDEX = 1
    try:
        again = ft.jit(net)  # a new process would see the stored entry: its global changed
        assert torch.equal(again(x), net(x)) and again.cache_info().disk_hits == 0
    finally:
        _PICK_INDEX = 0


_SITE_PACKAGE = """
class Shapes:
    def forward(self, x):
        return x.reshape(self.rows(), -1).sum()

    def rows(self):  # named by forward
        return self.half() * 2

    def half(self):  # named by rows, itself reached by name
        return 1

    def __len__(self):  # called without its name (len(x)): followed always
        return 2

    def unused(self):  # named by nothing that ran
        return 5
"""


def test_the_recorder_follows_an_installed_packages_class_by_name(tmp_path, monkeypatch):
    # following every function of an installed package's classes reached ~3,900 code objects
    # of a Hugging Face model (PreTrainedModel's mixins), 30 ms of each cold start: such a
    # class's function is followed once some code that ran or was reached uses its name
    import importlib

    from functrans._jit.disk.code_deps import Recorder

    site = tmp_path / "site-packages"
    (site / "ft_site_pkg").mkdir(parents=True)
    (site / "ft_site_pkg" / "__init__.py").write_text(_SITE_PACKAGE)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "ft_site_pkg", raising=False)
    pkg = importlib.import_module("ft_site_pkg")
    shapes = pkg.Shapes()
    with Recorder() as r:
        ft.trace(lambda x: shapes.forward(x))(torch.ones(4))
    assert r.ok
    reached = {pkg.Shapes.rows, pkg.Shapes.half, pkg.Shapes.__len__}
    assert {f.__code__ for f in reached} <= r.static
    assert pkg.Shapes.unused.__code__ not in r.codes
    monkeypatch.delitem(sys.modules, "ft_site_pkg")


def test_a_trace_without_a_recorder_calls_no_watcher():
    from functrans._trace.trace_run import WATCHERS

    ft.trace(lambda x: x * 2)(torch.ones(2))
    assert WATCHERS.get() == ()


def test_functrans_digest_follows_its_files_stats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from functrans._jit.disk import code_deps

    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "__pycache__").mkdir()
    (src / "a.py").write_text("x = 1\n")
    (src / "sub" / "b.cpp").write_text("int x;\n")
    (src / "__pycache__" / "a.py").write_text("")
    (src / "notes.txt").write_text("")
    monkeypatch.setattr(code_deps, "library_dirs", lambda: (("/torch/", f"{src}/"), ()))

    def digest() -> str:
        return code_deps.functrans_digest.__wrapped__()  # uncached

    first = digest()
    assert digest() == first
    # files it does not read: the same digest
    (src / "notes.txt").write_text("changed")
    (src / "__pycache__" / "a.py").write_text("changed")
    assert digest() == first
    # an edit of the same size: the modification time tells
    st = os.stat(src / "a.py")
    (src / "a.py").write_text("x = 2\n")
    os.utime(src / "a.py", ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert digest() != first
    os.utime(src / "a.py", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert digest() == first  # stats alike: the digest alike (as Python's bytecode check)
    (src / "sub" / "b.cpp").write_text("int xy;\n")  # a C++ file counts too
    assert digest() != first


def test_an_installed_packages_file_is_known_by_its_stat(tmp_path):
    # hashing the ~150 files a Hugging Face model runs cost every cold and warm start 6-9 ms;
    # an installed package's file is known by size, mtime and ctime (ns), inode and device;
    # the user's own files stay hashed by content
    from functrans._jit.disk import code_deps

    site = tmp_path / "site-packages" / "pkg"
    site.mkdir(parents=True)
    lib, mine = site / "m.py", tmp_path / "train.py"
    for f in (lib, mine):
        f.write_text("x = 1\n")
    first, own = code_deps.file_digest(str(lib)), code_deps.file_digest(str(mine))
    assert first is not None and first.startswith("stat:")
    assert own is not None and len(own) == 64  # sha256 of the content
    st = os.stat(lib)
    lib.write_text("x = 2\n")  # an edit of the same size
    os.utime(lib, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert code_deps.file_digest(str(lib)) != first
    os.utime(lib, ns=(st.st_atime_ns, st.st_mtime_ns))
    # its modification time set back (cp -p onto it, a build that fixes mtimes): the change
    # time, which no tool sets back, still tells (stricter than Python's bytecode check)
    assert code_deps.file_digest(str(lib)) != first
    assert code_deps.file_digest(str(lib)) == code_deps.file_digest(str(lib))
    mine.write_text("x = 2\n")
    os.utime(mine, ns=(os.stat(mine).st_atime_ns, os.stat(mine).st_mtime_ns))
    assert code_deps.file_digest(str(mine)) != own


def test_fingerprints_tell_dict_kinds_and_module_state_apart():
    # plain dicts take a shortcut in the fingerprint (a module holds a dozen): their kind,
    # keys and values still count, and a module's hooks and attributes still do
    from collections import OrderedDict

    from functrans._jit.disk.fingerprint import Fingerprint

    class Sub(dict):  # type: ignore[type-arg]
        pass

    digest = lambda v: Fingerprint().digest(v)  # noqa: E731
    kinds = [digest(d) for d in ({"a": 1}, OrderedDict(a=1), Sub(a=1), {"a": 2}, {"b": 1}, {})]
    assert len(set(kinds)) == len(kinds)
    assert digest({"a": 1}) == digest({"a": 1})

    def block(p: float = 0.1) -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(p))

    hooked = block()
    hooked.register_forward_hook(lambda *a: None)
    assert len({digest(block()), digest(block(0.2)), digest(hooked)}) == 3
    assert digest(block()) == digest(block())


def test_the_keys_tensor_metadata_is_hashed_as_text_that_tells_every_field_apart():
    # the inputs' metadata enters the key as one repr string (a model has hundreds of
    # tensors): it must be atoms whose repr reads back as the same value, and each field that
    # decides a trace (sizes, strides, offset, dtype, grad, aliasing) must change the text
    import ast

    from functrans._jit.disk.key import _tensors

    base = torch.zeros(4, 6)
    variants = [
        (base, base.clone()),
        (base, base),  # the same tensor twice: aliasing
        (base.t(), base.clone()),  # strides
        (base[1:], base.clone()),  # sizes and offset
        (base.double(), base.clone()),
        (base.clone().requires_grad_(), base.clone()),
    ]
    texts = []
    for tensors in variants:
        meta = _tensors(tensors)
        assert ast.literal_eval(repr(meta)) == meta
        texts.append(repr(meta))
    assert len(set(texts)) == len(texts)
    assert repr(_tensors((torch.ones(4, 6), torch.ones(4, 6)))) == texts[0]


def test_fingerprints_hash_a_modules_plain_attributes_as_the_general_walk_does(monkeypatch):
    # a module's atoms and empty dicts are hashed inline (a block has a hundred); the digest
    # is the one the general walk gives, shared empty dicts (aliasing) included
    from functrans._jit.disk.fingerprint import Fingerprint

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2), torch.nn.Dropout(0.1))
    net.scale, net.name, net.flag, net.nothing = 0.5, "net", True, None
    net[0].shared = net[1].shared = {}  # one empty dict reached twice
    net[2].table = {}
    fast = Fingerprint().digest(net)
    monkeypatch.setattr(Fingerprint, "_simple", lambda self, obj: False)
    assert fast == Fingerprint().digest(net)
    net[2].table = net[0].shared  # now aliased: a different digest either way
    slow = Fingerprint().digest(net)
    monkeypatch.undo()
    assert Fingerprint().digest(net) == slow != fast


def test_fingerprints_hash_each_kind_of_value_by_what_it_holds():
    # the fingerprint picks how to hash a value by its type, once per type: every kind still
    # hashes what it holds, and a value whose state lives in C is still refused
    import enum
    import functools

    import numpy as np

    from functrans._jit.disk.fingerprint import Fingerprint, Unhashable

    class Color(enum.Enum):
        RED = 1
        BLUE = 2

    class Version(str):
        pass

    class Holder:
        scale = staticmethod(lambda x: x * 2)

    digest = lambda v: Fingerprint().digest(v)  # noqa: E731
    values = [
        np.arange(3),
        np.arange(4),
        np.float32(1.0),
        np.float64(1.0),
        Color.RED,
        Color.BLUE,
        {1, 2},
        {1, 3},
        Version("2.1"),
        Version("2.2"),
        functools.partial(max, 1),
        functools.partial(max, 2),
        torch.ops.aten.add.Tensor,
        torch.ops.aten.mul.Tensor,
        Holder,
        torch.ones(2),
        torch.ones(3),
    ]
    digests = [digest(v) for v in values]
    assert len(set(digests)) == len(values)
    assert digest({2, 1}) == digest({1, 2})
    assert digest(np.arange(3)) == digest(np.arange(3))
    with pytest.raises(Unhashable, match="state lives in C"):
        digest(iter([1, 2]))

    # by the type itself, not the type's ==: a metaclass may call two classes equal
    class ByName(type):
        def __eq__(cls, other: object) -> bool:
            return isinstance(other, type) and cls.__name__ == other.__name__

        def __hash__(cls) -> int:
            return hash(cls.__name__)

    plain_x = ByName("X", (object,), {})
    c_state_x = ByName("X", (BaseException,), {})
    digest(plain_x())
    with pytest.raises(Unhashable, match="state lives in C"):
        digest(c_state_x())


WRITES_PROGRAM = """
import json, torch, functrans as ft
from functrans._jit.disk import store
from torch.func import functional_call

traces = []  # the traces made: misses of the disk, and traces that failed

def counting(key, make, real=store.traced):
    try:
        g, hit = real(key, make)
    except Exception:
        traces.append(1)
        raise
    traces.extend([] if hit else [1])
    return g, hit

store.traced = counting

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6)).train()
eager = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6)).train()
eager.load_state_dict(model.state_dict())
params = {k: v.detach().requires_grad_() for k, v in model.named_parameters()}
x = torch.randn(8, 4)

def loss(p, x):
    return functional_call(model, p, (x,)).square().mean()

f = ft.jit(loss)
got = f(params, x)
want = functional_call(eager, dict(eager.named_parameters()), (x,)).square().mean()
same = (
    isinstance(got, torch.Tensor)
    and torch.equal(got, want)
    and all(torch.equal(a, b) for a, b in zip(model.buffers(), eager.buffers()))
)
hits = f.cache_info().disk_hits
print("RESULT " + json.dumps({"hits": hits, "same": bool(same), "traces": len(traces)}))
"""


def test_a_stored_step_that_writes_a_buffer_writes_it_in_a_fresh_process(tmp_path):
    """A function writing a buffer it reaches (batch norm under ``functional_call``) is traced
    with copies whose final values are more outputs; read back from the disk in a fresh
    process, that graph returned the written values to the caller and wrote no buffer (the
    disk key did not say which inputs the trace wrote). The first process traces three
    times: to find the batch counter it writes (a captured one-element tensor, lifted then),
    to find the inputs it writes, and with them copied. The second traces nothing: the first
    left hints of what the call writes (the counter's path, the inputs' positions), so it
    lifts the counter and looks up the graph that copies them without tracing to learn."""
    program = tmp_path / "program"
    program.mkdir()
    (program / "writes.py").write_text(WRITES_PROGRAM)
    past = time.time() - 60  # written before the processes start, as source files are
    os.utime(program / "writes.py", (past, past))
    cache = tmp_path / "cache"
    first = _run(program, cache, script="writes.py")
    again = _run(program, cache, script="writes.py")
    assert first == {"hits": 0, "same": True, "traces": 3}, first
    assert again == {"hits": 1, "same": True, "traces": 0}, again
    third = _run(program, cache, script="writes.py")  # the hints hold as they are read
    assert third == again, third


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_a_wrong_writes_hint_changes_no_result(data: st.DataObject) -> None:
    """The rule behind the hints: whatever a hint says (inputs the call does not write,
    captured tensors it does not write, or too little), the step computes eager's loss,
    gradients and buffers, and leaves the inputs it does not write untouched (their version
    too: a hinted write-back into an unwritten leaf that requires grad raised, found by this
    property). A hint only decides what the first trace tries."""
    from torch.func import functional_call

    from functrans._trace.capture import reach

    torch.manual_seed(0)
    mine = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6)).train()
    eager = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6)).train()
    eager.load_state_dict(mine.state_dict())

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(mine, p, (x,)).square().mean()

    steps = sorted(
        {json.dumps([list(s) for s in p.steps]) for ps in reach(loss).tensors.values() for p in ps}
    )
    hint = _disk_cache.WritesHint(
        tuple(data.draw(st.lists(st.integers(0, 12), unique=True, max_size=6))),
        tuple(json.loads(s) for s in data.draw(st.lists(st.sampled_from(steps), unique=True))),
    )
    params = {k: v.detach().requires_grad_() for k, v in mine.named_parameters()}
    ref = {k: v.detach().requires_grad_() for k, v in eager.named_parameters()}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_disk_cache, "writes_hint", lambda key: hint)
        f = ft.jit(loss)
        for _ in range(2):
            x = torch.randn(8, 4)
            versions = [t._version for t in (x, *params.values())]
            got = f(params, x)
            # inputs it does not write keep their version (no copy into them): eager's
            assert [t._version for t in (x, *params.values())] == versions
            want = functional_call(eager, ref, (x,)).square().mean()
            assert isinstance(got, torch.Tensor) and torch.equal(got, want)
            got.backward()
            want.backward()
    for k in params:
        torch.testing.assert_close(params[k].grad, ref[k].grad)
    for (name, a), (_, b) in zip(mine.named_buffers(), eager.named_buffers(), strict=True):
        assert torch.equal(a, b), name
