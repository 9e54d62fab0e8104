"""jit's cache under real use: bounded, explains every recompile, warns on recompile storms."""

import warnings

import pytest
import torch
from torch import nn

import functrans as ft
from functrans._jit.cache import RECOMPILE_WARNING, RecompileWarning


@pytest.fixture
def recompiles(capsys):
    ft.set_logs("recompiles")
    yield lambda: capsys.readouterr().err
    ft.set_logs()


def test_least_recently_used_entry_is_evicted():
    f = ft.jit(lambda x: x * 2, cache_size=2, dynamic=False)  # an entry per shape
    a, b, c = torch.ones(1), torch.ones(2), torch.ones(3)
    f(a), f(b), f(a), f(c)  # b is the least recently used when c arrives
    info = f.cache_info()
    assert (info.entries, info.evictions, info.misses) == (2, 1, 3)
    f(a)
    assert f.cache_info().misses == 3  # a stayed
    f(b)
    assert f.cache_info().misses == 4 and f.cache_info().evictions == 2


def test_evicted_entries_are_not_found_through_guards():
    f = ft.jit(lambda x: x + 1, cache_size=1, dynamic=False)
    f(torch.zeros(2))
    f(torch.zeros(3))
    torch.testing.assert_close(f(torch.zeros(2)), torch.ones(2))
    assert f.cache_info().misses == 3


@pytest.mark.parametrize("size", [0, -1, 1.5, True, "8"])
def test_cache_size_must_be_a_positive_int(size):
    with pytest.raises(ft.FunctransError, match="cache_size"):
        ft.jit(lambda x: x, cache_size=size)


def test_recompile_log_names_the_shape_that_changed(recompiles):
    def f(x):
        return x.sum()

    jf = ft.jit(f)
    jf(torch.ones(4, 32))
    assert recompiles() == ""  # the first compile is not a recompile
    jf(torch.ones(4, 48))
    log = recompiles()
    assert "recompiling jit(" in log and "x: shape[1] 32 -> 48" in log


def test_recompile_log_names_module_flags_grad_mode_autocast_and_statics(recompiles):
    net = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1))
    model = ft.jit(net)
    x = torch.ones(1, 2)
    model(x)
    net[1].eval()
    model(x)
    assert "model.1.training True -> False" in recompiles()
    with torch.no_grad():
        model(x)
    assert "grad mode True -> False" in recompiles()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
    assert "autocast('cpu') off -> bfloat16" in recompiles()

    jf = ft.jit(lambda x, scale: x * scale)
    jf(x, 2)
    jf(x, 3)
    assert "scale: 2 -> 3" in recompiles()


def test_a_float_that_keeps_changing_warns_on_its_second_change():
    jf = ft.jit(lambda x, lr: x * lr)
    x = torch.ones(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jf(x, 0.1)
        jf(x, 0.2)  # one change: maybe a schedule with two values
    with pytest.warns(RecompileWarning, match=r"lr: 0\.2 -> 0\.3.*torch\.tensor"):
        jf(x, 0.3)
    torch.testing.assert_close(jf(torch.ones(2), torch.tensor(0.5)), torch.full((2,), 0.5))


def test_a_recompile_storm_warns_once():
    jf = ft.jit(lambda x: x.sum(), dynamic=False)  # every new shape compiles
    with pytest.warns(RecompileWarning, match=f"compiled {RECOMPILE_WARNING} times") as caught:
        for n in range(1, RECOMPILE_WARNING + 3):
            jf(torch.ones(n))
    assert sum(issubclass(w.category, RecompileWarning) for w in caught) == 1
