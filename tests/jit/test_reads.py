"""A compiled entry depends on what its trace read: state changed after the first call is seen.

Each case is one the issue found silently wrong on 5d11780 (the compiled entry kept the old
value while eager saw the new one); the rule behind them is in ``functrans/_trace/reads.py``
and its properties in ``test_reads_properties.py``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import types

import pytest
import torch

import functrans as ft
from functrans._jit.read_guards import ReadGuard
from functrans._trace.reads import Recorder


def _same(a: object, b: object) -> None:
    torch.testing.assert_close(a, b)


@pytest.fixture
def recompiles(capsys):
    ft.set_logs("recompiles")
    yield lambda: capsys.readouterr().err
    ft.set_logs()


def _after_change(f, change, *args):
    """``jit(f)`` called, ``change()`` made, called again: (jitted result, eager result)."""
    jitted = ft.jit(f)
    _same(jitted(*args), f(*args))
    change()
    return jitted(*args), f(*args), jitted


def test_a_dict_read_from_a_closure_is_guarded_item_by_item():
    cfg = {"mult": 2.0, "logging_step": 0}
    x = torch.randn(4, requires_grad=True)
    f = lambda x: (x * cfg["mult"]).sum()  # noqa: E731
    got, want, jitted = _after_change(f, lambda: cfg.__setitem__("mult", 3.0), x)
    _same(got, want)
    cfg["logging_step"] = 100  # an item it does not read: no new compile
    _same(jitted(x), f(x))
    assert jitted.cache_info().misses == 2


def test_a_dict_global_of_another_module_is_guarded(tmp_path, monkeypatch):
    (tmp_path / "rd_cfg_mod.py").write_text("CFG = {'mult': 2.0}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import rd_cfg_mod

    try:
        f = lambda x: (x * rd_cfg_mod.CFG["mult"]).sum()  # noqa: E731
        change = lambda: rd_cfg_mod.CFG.__setitem__("mult", 3.0)  # noqa: E731
        got, want, _ = _after_change(f, change, torch.ones(3))
        _same(got, want)
    finally:
        sys.modules.pop("rd_cfg_mod", None)


def test_an_argparse_namespace_attribute_is_guarded():
    args = argparse.Namespace(k=3.0, seed=0)
    f = lambda x: (x * args.k).sum()  # noqa: E731
    got, want, jitted = _after_change(f, lambda: setattr(args, "k", 12.0), torch.ones(3))
    assert (float(got), float(want)) == (36.0, 36.0)
    args.seed = 1  # not read
    jitted(torch.ones(3))
    assert jitted.cache_info().misses == 2


class _WithConfig(torch.nn.Module):
    K = 2.0

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.cfg = types.SimpleNamespace(scale=1.0)
        self.dims = [2, 2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) * self.cfg.scale * type(self).K).reshape(self.dims)


def test_a_simple_namespace_held_by_a_module_is_guarded():
    m = _WithConfig()
    x = torch.randn(4, requires_grad=True)
    got, want, _ = _after_change(lambda x: m(x), lambda: setattr(m.cfg, "scale", 5.0), x)
    _same(got, want)


def test_a_class_attribute_read_through_the_type_is_guarded():
    cls = type("WithK", (_WithConfig,), {"K": 2.0})
    m = cls()
    got, want, _ = _after_change(m, lambda: setattr(cls, "K", 7.0), torch.randn(4))
    _same(got, want)


def test_a_list_attribute_changed_in_place_changes_the_shape():
    m = _WithConfig()
    got, want, _ = _after_change(m, lambda: m.dims.__setitem__(slice(None), [4, 1]), torch.ones(4))
    assert got.shape == want.shape == (4, 1)


def test_a_forward_patched_on_a_submodule_runs():
    seq = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    x = torch.randn(2, 4, requires_grad=True)

    def ablate() -> None:
        seq[1].forward = torch.sigmoid

    got, want, _ = _after_change(seq, ablate, x)
    _same(got, want)


def test_a_patched_torch_function_runs(monkeypatch):
    seq = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Linear(4, 1))
    x = torch.randn(2, 4, requires_grad=True)
    jitted = ft.jit(seq)
    _same(jitted(x), seq(x))
    monkeypatch.setattr(torch.nn.functional, "gelu", lambda t, approximate="none": torch.relu(t))
    _same(jitted(x), seq(x))


def test_a_block_of_a_repeated_stack_changed_alone_is_seen():
    """Blocks 1.. reuse block 0's traced region: what that trace read of block 0 is read off
    each of them too."""

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.gain = 1.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.lin(x)) * self.gain

    stack = torch.nn.Sequential(*(Block() for _ in range(4)))
    x = torch.randn(2, 4, requires_grad=True)
    got, want, jitted = _after_change(stack, lambda: setattr(stack[2], "gain", -3.0), x)
    _same(got, want)
    got.sum().backward()
    assert jitted.cache_info().regions_reused > 0


def test_a_hugging_face_config_flag_is_seen_and_the_log_names_it(recompiles):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 64, (2, 8))
    jitted = ft.jit(model)
    assert jitted(ids).hidden_states is None
    recompiles()
    model.config.output_hidden_states = True
    out = jitted(ids)
    assert out.hidden_states is not None and len(out.hidden_states) == 3
    for a, b in zip(out.hidden_states, model(ids).hidden_states, strict=True):
        _same(a, b)
    assert "model.config.output_hidden_states False -> True" in recompiles()


def test_the_recompile_log_names_a_dict_item(recompiles):
    cfg = {"mult": 2.0}
    f = ft.jit(lambda x: x * cfg["mult"])
    f(torch.ones(2))
    recompiles()
    cfg["mult"] = 3.0
    f(torch.ones(2))
    assert "cfg['mult'] 2.0 -> 3.0" in recompiles()


def test_state_the_function_does_not_read_compiles_nothing():
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)
            self.steps_seen = 0  # bookkeeping a training loop updates

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).sum()

    m = Model()
    jitted = ft.jit(m)
    for step in range(3):
        m.steps_seen = step
        jitted(torch.ones(3)).backward()
    assert jitted.cache_info().misses == 1


def _old_module(tmp_path, monkeypatch, name: str, source: str):
    """``source`` as module ``name``, its file older than this process (the disk cache stores
    no trace of code edited after the process started, and a test worker may have started
    minutes ago)."""
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    past = 1e9  # 2001
    os.utime(path, (past, past))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return importlib.import_module(name)


def _cached_module(tmp_path, monkeypatch, name: str, source: str):
    """:func:`_old_module`, with the on-disk trace cache on in a folder of its own."""
    monkeypatch.setenv("FUNCTRANS_CACHE", "1")
    monkeypatch.setenv("FUNCTRANS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FUNCTRANS_NATIVE", "0")
    return _old_module(tmp_path, monkeypatch, name, source)


def test_an_entry_from_disk_is_guarded_by_its_stored_reads(tmp_path, monkeypatch):
    mod = _cached_module(
        tmp_path,
        monkeypatch,
        "rd_disk_mod",
        "CFG = {'mult': 2.0}\n\ndef f(x):\n    return (x * CFG['mult']).sum()\n",
    )
    x = torch.ones(3, requires_grad=True)
    ft.jit(mod.f)(x)  # traced and stored
    g = ft.jit(mod.f)  # as in a new process
    _same(g(x), mod.f(x))
    assert g.cache_info().disk_hits == 1
    mod.CFG["mult"] = 5.0
    _same(g(x), mod.f(x))  # the entry read from disk is guarded like a traced one
    g2 = ft.jit(mod.f)  # a later process: the stored entry read another value
    _same(g2(x), mod.f(x))
    sys.modules.pop("rd_disk_mod", None)


def test_an_entry_from_disk_is_stale_when_a_library_function_was_patched(tmp_path, monkeypatch):
    """torch's own code is not in the disk key (its version is): what the trace read of it
    (``F.gelu``, read by ``nn.GELU.forward``) is checked when the entry is loaded."""
    mod = _cached_module(
        tmp_path,
        monkeypatch,
        "rd_gelu_mod",
        "import torch\n\nSEQ = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.GELU())\n",
    )
    x = torch.randn(2, 3)
    ft.jit(mod.SEQ)(x)  # stored
    assert ft.jit(mod.SEQ)(x) is not None
    hit = ft.jit(mod.SEQ)
    hit(x)
    assert hit.cache_info().disk_hits == 1
    monkeypatch.setattr(torch.nn.functional, "gelu", lambda t, approximate="none": t * 0)
    g = ft.jit(mod.SEQ)
    _same(g(x), mod.SEQ(x))
    assert g.cache_info().disk_hits == 0
    sys.modules.pop("rd_gelu_mod", None)


def test_reads_of_functrans_own_bookkeeping_are_not_recorded():
    """A stack's blocks are keyed by functrans (``m.named_modules()``, hooks...): those reads
    are its own, not the step's."""
    seq = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    jitted = ft.jit(seq)
    jitted(torch.ones(2, requires_grad=True))
    (slot,) = jitted._compiled._cache.slots()
    names = {r.name for r in slot.reads.reads}
    assert {"model.0.forward", "model.1.forward"} <= names
    assert not any(n.endswith(("named_modules", ".modules", "_modules")) for n in names)


def test_a_guard_names_every_change():
    ns = argparse.Namespace(a=1, b="x")
    with Recorder(lambda: ns.a + len(ns.b)) as rec:
        _ = ns.a + len(ns.b)
    guard = ReadGuard(rec.reads)
    ns.a, ns.b = 2, "yy"
    assert guard.changes() == ["ns.a 1 -> 2", "ns.b 'x' -> 'yy'"]


def test_a_value_of_another_type_is_a_change():
    ns = argparse.Namespace(k=1)
    with Recorder(lambda: ns.k) as rec:
        _ = ns.k
    guard = ReadGuard(rec.reads)
    ns.k = True  # equal to 1, yet it may select another branch
    assert not guard.holds()


def test_an_object_passed_as_a_static_argument_is_read_through():
    conf = argparse.Namespace(scale=2.0)

    def f(x: torch.Tensor, c: argparse.Namespace) -> torch.Tensor:
        return (x * c.scale).sum()

    jitted = ft.jit(f, static_argnums=1)
    x = torch.ones(3)
    assert float(jitted(x, conf)) == 6.0
    conf.scale = 5.0
    assert float(jitted(x, conf)) == 15.0


def test_a_dict_default_argument_is_read_item_by_item():
    defaults = {"mult": 2.0}

    def f(x: torch.Tensor, cfg: dict[str, float] = defaults) -> torch.Tensor:
        return (x * cfg["mult"]).sum()

    jitted = ft.jit(f)
    x = torch.ones(3)
    assert float(jitted(x)) == 6.0
    defaults["mult"] = 4.0
    assert float(jitted(x)) == 12.0
    assert f.__defaults__[0] is defaults  # the recording copy was put back


def test_a_property_of_an_installed_packages_class_reads_through(tmp_path, monkeypatch):
    """A property defined in a package's code (its getter runs inside the recording hook):
    what the getter reads is read by the traced code (``config.use_return_dict`` in HF)."""
    site = tmp_path / "site-packages"
    site.mkdir()
    (site / "rd_lib_conf.py").write_text(
        "class Conf:\n"
        "    def __init__(self):\n"
        "        self._scale = 2.0\n"
        "    @property\n"
        "    def scale(self):\n"
        "        return self._scale\n"
    )
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "rd_lib_conf", raising=False)
    conf = importlib.import_module("rd_lib_conf").Conf()
    got, want, _ = _after_change(
        lambda x: (x * conf.scale).sum(), lambda: setattr(conf, "_scale", 5.0), torch.ones(2)
    )
    assert float(got) == float(want) == 10.0


def test_an_attribute_of_an_object_with_slots_is_read_per_object():
    class Conf:
        __slots__ = ("scale",)

        def __init__(self, scale: float) -> None:
            self.scale = scale

    conf = Conf(2.0)
    got, want, _ = _after_change(
        lambda x: (x * conf.scale).sum(), lambda: setattr(conf, "scale", 3.0), torch.ones(2)
    )
    assert float(got) == float(want) == 6.0


def test_a_numpy_array_changed_in_place_is_seen():
    import numpy as np

    holder = types.SimpleNamespace(mask=np.array([1.0, 0.0, 1.0], dtype=np.float32))

    def f(x: torch.Tensor) -> torch.Tensor:
        return (x * torch.from_numpy(holder.mask)).sum()

    def change() -> None:
        holder.mask[1] = 5.0

    got, want, _ = _after_change(f, change, torch.ones(3))
    assert float(got) == float(want) == 7.0


def test_a_helper_whose_code_was_replaced_runs_the_new_code():
    def helper(x: torch.Tensor) -> torch.Tensor:
        return x.sin()

    def other(x: torch.Tensor) -> torch.Tensor:
        return x.cos()

    got, want, _ = _after_change(
        lambda x: helper(x).sum(),
        lambda: setattr(helper, "__code__", other.__code__),
        torch.ones(2),
    )
    _same(got, want)


def test_a_global_read_by_a_cached_helper_is_guarded(tmp_path, monkeypatch):
    mod = _old_module(
        tmp_path,
        monkeypatch,
        "rd_lru_mod",
        "import functools\n\nK = 2.0\n\n@functools.lru_cache\ndef k():\n    return K\n",
    )

    def f(x: torch.Tensor) -> torch.Tensor:
        return (x * mod.k()).sum()

    def change() -> None:
        mod.K = 3.0
        mod.k.cache_clear()

    got, want, _ = _after_change(f, change, torch.ones(2))
    assert float(got) == float(want) == 6.0
