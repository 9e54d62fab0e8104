"""jit(module) behaves as the module does: state dicts, names, copies, pickling, attributes."""

import copy
import io
import pickle

import torch
from torch import nn

import functrans as ft


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = {"width": 4}
        self.body = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.GELU())
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.body(x))

    def num_params(self):
        return sum(p.numel() for p in self.parameters())


def make(seed=0):
    torch.manual_seed(seed)
    return Net()


def test_state_dict_and_parameter_names_are_the_modules():
    net = make()
    model = ft.jit(net)
    model(torch.randn(5, 3))
    assert list(model.state_dict()) == list(net.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in net.named_parameters()]
    assert [n for n, _ in model.named_buffers()] == [n for n, _ in net.named_buffers()]
    assert list(model.modules()) == list(net.modules())


def test_state_dict_round_trips_between_plain_and_jitted_modules():
    net = make(0)
    model = ft.jit(net)
    x = torch.randn(5, 3)
    model(x).sum().backward()  # updates batch norm statistics
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer)
    plain, jitted = make(1), ft.jit(make(2))
    plain.load_state_dict(state)
    jitted.load_state_dict(state)
    for m in (net, plain, jitted):
        m.eval()
    with torch.no_grad():
        expected = net(x)
        torch.testing.assert_close(plain(x), expected, rtol=0, atol=0)
        torch.testing.assert_close(jitted(x), expected)


def test_a_jitted_child_keeps_its_parents_state_dict_keys():
    class Parent(nn.Module):
        def __init__(self, child):
            super().__init__()
            self.enc = child
            self.out = nn.Linear(2, 1)

    plain, jitted = Parent(make(0)), Parent(ft.jit(make(0)))
    assert list(plain.state_dict()) == list(jitted.state_dict())
    jitted.load_state_dict(plain.state_dict())  # strict: no missing or unexpected keys


def test_attributes_and_methods_are_the_modules():
    net = make()
    model = ft.jit(net)
    assert model.config is net.config and model.num_params() == net.num_params()
    assert model.body is net.body and model.head.weight is net.head.weight


def test_deepcopy_after_a_call_gives_an_independent_model_that_compiles_again():
    net = make()
    model = ft.jit(net)
    x = torch.randn(5, 3)
    model(x).sum().backward()
    ema = copy.deepcopy(model)
    assert ema.cache_info().entries == 0  # compiled entries are not copied
    with torch.no_grad():
        for p in ema.parameters():
            p.mul_(0.5)
    ema.eval(), net.eval()
    assert net.body[1].training is False and model.training is False
    with torch.no_grad():
        y = ema(x)
        reference = copy.deepcopy(net)
        for p in reference.parameters():
            p.mul_(0.5)
        torch.testing.assert_close(y, reference(x))
        assert not torch.allclose(y, net(x))  # the original model was not touched
    assert ema.module is not net and ema.head.weight is ema.module.head.weight


def test_pickling_a_jitted_module_drops_compiled_entries():
    model = ft.jit(make())
    x = torch.randn(5, 3)
    out = model(x)
    again = pickle.loads(pickle.dumps(model))
    torch.testing.assert_close(again(x), out)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(loaded(x), out)


def test_to_dtype_recompiles_for_the_new_parameters():
    model = ft.jit(make())
    model(torch.randn(5, 3))
    model.to(torch.float64)
    assert model(torch.randn(5, 3, dtype=torch.float64)).dtype == torch.float64
    assert model.cache_info().misses == 2


def test_remat_module_is_the_module_too():
    # found by tests/integration/test_real_use.py: remat(module) prefixed every key with "module."
    net = make()
    block = ft.remat(net)
    assert list(block.state_dict()) == list(net.state_dict())
    block.load_state_dict(make(1).state_dict())
    assert block.num_params() == net.num_params()
    x = torch.randn(5, 3)
    copy.deepcopy(block)(x).sum().backward()  # the copy's forward runs the copy's parameters
    assert net.head.weight.grad is None


class _TanhLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        return (h * h).sum()


def test_saved_values_name_the_users_line_under_jit_module() -> None:
    import inspect
    import os

    jm = ft.jit(_TanhLinear())
    jm(torch.randn(2, 4)).backward()
    sources = [v.source for v in jm.partitions()[0].saved if v.source]
    assert sources, "no saved value carries a source line"
    _, start = inspect.getsourcelines(_TanhLinear.forward)
    want = f"{__file__}:{start + 1}: h = torch.tanh(self.lin(x))"
    # not torch's nn/modules/linear.py, not functrans' own _jit_module.py
    assert want in sources, sources
    library = (os.path.dirname(ft.__file__), os.path.dirname(torch.__file__))
    assert not [s for s in sources if s.startswith(library)], sources
