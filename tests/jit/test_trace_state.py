"""Everything a jitted trace reads from outside its arguments is lifted or guarded: globals of
the modules its code reaches (not only its own), generator arguments (inputs keyed by device,
drawn from at run time) and grad mode turned on inside a body called under ``no_grad``. Each
case is compared with eager."""

import importlib
import sys
import textwrap
import warnings

import pytest
import torch

import functrans as ft


@pytest.fixture
def make_module(tmp_path, monkeypatch):
    """Write ``source`` to ``tmp_path/<name>.py`` (``name`` may be dotted: packages get an
    ``__init__.py``) and import it: a real, separate module, removed from sys.modules after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    made: list[str] = []

    def make(name: str, source: str) -> object:
        parts = name.split(".")
        folder = tmp_path.joinpath(*parts[:-1])
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(1, len(parts)):
            init = tmp_path.joinpath(*parts[:i], "__init__.py")
            if not init.exists():
                init.write_text("")
        (folder / f"{parts[-1]}.py").write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        made.extend(".".join(parts[: i + 1]) for i in range(len(parts)))
        return importlib.import_module(name)

    yield make
    for name in made:
        sys.modules.pop(name, None)


@pytest.fixture
def recompiles(capsys):
    ft.set_logs("recompiles")
    yield lambda: capsys.readouterr().err
    ft.set_logs()


HELPERS = """
    import torch
    SCALE = torch.tensor(2.0)
    K = 3.0
    def apply(x):
        return x * SCALE * K
"""


# -- 1. globals of every module the code reaches ---------------------------------------------


def test_tensor_global_of_an_imported_helper_module_is_read_anew(make_module):
    helpers = make_module("st_helpers_a", HELPERS)
    user = make_module(
        "st_user_a",
        """
        import functrans as ft
        import st_helpers_a as helpers
        f = ft.jit(lambda x: helpers.apply(x))
        """,
    )
    x = torch.randn(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # lifted, not compiled in as a constant with a warning
        torch.testing.assert_close(user.f(x), helpers.apply(x))
        helpers.SCALE = torch.tensor(10.0)
        torch.testing.assert_close(user.f(x), helpers.apply(x))
    assert user.f.cache_info().misses == 1  # a lifted input: a new value needs no compile


def test_helper_attribute_read_by_the_function_itself(make_module):
    helpers = make_module("st_helpers_b", HELPERS)
    f = ft.jit(lambda x: x * helpers.SCALE + helpers.K)  # the module is a closure cell here
    x = torch.randn(3)
    torch.testing.assert_close(f(x), x * helpers.SCALE + helpers.K)
    helpers.SCALE, helpers.K = torch.tensor(-1.0), 7.0
    torch.testing.assert_close(f(x), x * -1.0 + 7.0)


def test_scalar_global_of_a_helper_recompiles_and_the_log_names_it(make_module, recompiles):
    helpers = make_module("st_helpers_c", HELPERS)
    f = ft.jit(lambda x: helpers.apply(x))
    x = torch.randn(3)
    torch.testing.assert_close(f(x), helpers.apply(x))
    assert recompiles() == ""
    helpers.K = 5.0
    torch.testing.assert_close(f(x), helpers.apply(x))
    assert "st_helpers_c.K 3.0 -> 5.0" in recompiles()
    assert f.cache_info().misses == 2


def test_globals_reached_transitively_through_helpers(make_module):
    inner = make_module(
        "st_inner_d",
        """
        import torch
        OFFSET = torch.tensor(1.0)
        POWER = 2
        def shift(x):
            return x ** POWER + OFFSET
        """,
    )
    make_module(
        "st_outer_d",
        """
        import st_inner_d
        def apply(x):
            return st_inner_d.shift(x) * 2
        """,
    )
    outer = sys.modules["st_outer_d"]
    f = ft.jit(lambda x: outer.apply(x))
    x = torch.randn(4)
    torch.testing.assert_close(f(x), outer.apply(x))
    inner.OFFSET = torch.tensor(-3.0)
    torch.testing.assert_close(f(x), outer.apply(x))
    inner.POWER = 3
    torch.testing.assert_close(f(x), outer.apply(x))


def test_global_of_a_submodule_of_a_package(make_module):
    sub = make_module(
        "st_pkg_e.ops",
        """
        import torch
        BIAS = torch.zeros(3)
        def add(x):
            return x + BIAS
        """,
    )
    pkg = sys.modules["st_pkg_e"]
    f = ft.jit(lambda x: pkg.ops.add(x))
    x = torch.randn(3)
    torch.testing.assert_close(f(x), sub.add(x))
    sub.BIAS = torch.arange(3.0)
    torch.testing.assert_close(f(x), sub.add(x))


def test_helper_tensor_that_requires_grad_gets_its_gradient(make_module):
    helpers = make_module(
        "st_helpers_f",
        """
        import torch
        W = torch.randn(3, requires_grad=True)
        def apply(x):
            return (x * W).sum()
        """,
    )
    f = ft.jit(lambda x: helpers.apply(x))
    x = torch.randn(3)
    f(x).backward()
    got = helpers.W.grad.clone()
    helpers.W.grad = None
    helpers.apply(x).backward()
    torch.testing.assert_close(got, helpers.W.grad)


def test_module_forward_reading_a_helper_global(make_module):
    helpers = make_module("st_helpers_g", HELPERS)
    model = make_module(
        "st_model_g",
        """
        import torch
        import st_helpers_g as helpers
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(3, 3)
            def forward(self, x):
                return helpers.apply(self.lin(x))
        """,
    )
    net = model.Net()
    f = ft.jit(lambda x: net(x))
    x = torch.randn(2, 3)
    torch.testing.assert_close(f(x), net(x))
    helpers.SCALE, helpers.K = torch.tensor(0.5), 4.0
    torch.testing.assert_close(f(x), net(x))


# -- 2. generators are inputs: keyed by device, drawn from at run time -----------------------


def _draws(x, g):
    noise = torch.randn(x.shape, generator=g)
    return x * noise + torch.rand_like(x, generator=g)


def test_fresh_generators_compile_once_and_draw_as_eager():
    f = ft.jit(_draws)
    x = torch.randn(5)
    for i in range(200):
        g, ref = torch.Generator().manual_seed(i), torch.Generator().manual_seed(i)
        assert torch.equal(f(x, g), _draws(x, ref))
        assert torch.equal(g.get_state(), ref.get_state())  # advanced as eager advances it
    info = f.cache_info()
    assert (info.misses, info.hits) == (1, 199)


def test_generator_feeding_a_dropout_mask_gives_eager_gradients():
    def loss(x, w, g):
        mask = (torch.rand(x.shape, generator=g) > 0.5).to(x.dtype)
        return (torch.tanh(x @ w) * mask).sum()

    f = ft.jit(loss)
    for i in range(20):
        x = torch.randn(4, 3)
        w = torch.randn(3, 3, requires_grad=True)
        w_ref = w.detach().clone().requires_grad_()
        g, ref = torch.Generator().manual_seed(100 + i), torch.Generator().manual_seed(100 + i)
        out, want = f(x, w, g), loss(x, w_ref, ref)
        out.backward()
        want.backward()
        assert torch.equal(out, want)
        torch.testing.assert_close(w.grad, w_ref.grad)
        assert torch.equal(g.get_state(), ref.get_state())
    assert f.cache_info().misses == 1


def test_one_generator_used_across_calls_continues_its_stream():
    f = ft.jit(_draws)
    x = torch.randn(3)
    g, ref = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    for _ in range(5):
        assert torch.equal(f(x, g), _draws(x, ref))
    assert torch.equal(g.get_state(), ref.get_state())


def test_one_generator_passed_twice_stays_one_stream():
    def two(x, a, b):
        return _draws(x, a) - _draws(x, b)

    f = ft.jit(two)
    x = torch.randn(3)
    g, ref = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    assert torch.equal(f(x, g, g), two(x, ref, ref))
    assert torch.equal(g.get_state(), ref.get_state())
    g1, g2 = torch.Generator().manual_seed(2), torch.Generator().manual_seed(3)
    r1, r2 = torch.Generator().manual_seed(2), torch.Generator().manual_seed(3)
    assert torch.equal(f(x, g1, g2), two(x, r1, r2))  # two streams: another entry
    assert torch.equal(g1.get_state(), r1.get_state())
    assert torch.equal(g2.get_state(), r2.get_state())
    for seed in range(5):  # both shapes of the call compiled once each
        h = torch.Generator().manual_seed(seed)
        f(x, h, h)
        f(x, torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed))
    assert f.cache_info().misses == 2


def test_generator_passed_by_keyword():
    f = ft.jit(lambda x, *, gen: _draws(x, gen))
    x = torch.randn(3)
    for i in range(10):
        g, ref = torch.Generator().manual_seed(i), torch.Generator().manual_seed(i)
        assert torch.equal(f(x, gen=g), _draws(x, ref))
    assert f.cache_info().misses == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_generators_are_keyed_by_device():
    f = ft.jit(lambda x, g: x + torch.rand(x.shape, generator=g, device=x.device))
    for device in ("cpu", "cuda", "cpu", "cuda"):
        x = torch.zeros(8, device=device)
        g = torch.Generator(device=device).manual_seed(3)
        ref = torch.Generator(device=device).manual_seed(3)
        assert torch.equal(f(x, g), x + torch.rand(x.shape, generator=ref, device=device))
        assert torch.equal(g.get_state(), ref.get_state())
    assert f.cache_info().misses == 2


# -- 3. grad mode turned on inside a body called under no_grad -------------------------------


def _inside(x, w):
    y = x * 2
    with torch.enable_grad():
        z = (y * w).sum()
    return z, y * w  # the second output is made under the caller's no_grad


def test_enable_grad_inside_a_no_grad_call_records_as_eager():
    f = ft.jit(_inside)
    x = torch.randn(3)
    w = torch.randn(3, requires_grad=True)
    w_ref = w.detach().clone().requires_grad_()
    for _ in range(2):  # the compile, then the cached entry
        with torch.no_grad():
            out, want = f(x, w), _inside(x, w_ref)
            assert not torch.is_grad_enabled()  # the caller's mode is left as it was
        assert [o.requires_grad for o in out] == [o.requires_grad for o in want] == [True, False]
        torch.testing.assert_close(out, want)
        w.grad = w_ref.grad = None
        out[0].backward()
        want[0].backward()
        torch.testing.assert_close(w.grad, w_ref.grad)
    assert f.cache_info().misses == 1


def test_grad_mode_is_part_of_the_key():
    f = ft.jit(_inside)
    x, w = torch.randn(3), torch.randn(3, requires_grad=True)
    with torch.no_grad():
        f(x, w)
    z, y = f(x, w)  # grad on: eager records both outputs
    assert z.requires_grad and y.requires_grad
    assert f.cache_info().misses == 2


def test_no_grad_call_without_enable_grad_stays_forward_only():
    f = ft.jit(lambda x, w: (x * w).sum())
    x, w = torch.randn(3), torch.randn(3, requires_grad=True)
    with torch.no_grad():
        out = f(x, w)
    assert not out.requires_grad and out.grad_fn is None
    assert f.cache_info().partition_s == 0.0  # no joint graph was made


def test_enable_grad_inside_on_inputs_that_need_no_grad():
    f = ft.jit(_inside)
    x, w = torch.randn(3), torch.randn(3)
    with torch.no_grad():
        out, want = f(x, w), _inside(x, w)
    assert [o.requires_grad for o in out] == [o.requires_grad for o in want] == [False, False]
    torch.testing.assert_close(out, want)
