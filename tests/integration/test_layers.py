"""Common torch layers under ``ft.jit``, checked against eager under one seed: recurrent
layers (oneDNN's fused LSTM and the plain path), weight reparametrizations that update buffers
in forward (spectral norm's power iteration), and copies of jitted and remat'd modules
(``torch.save``, ``pickle``).
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.utils.parametrize as parametrize
from torch.nn.utils import parametrizations
from torch.utils.checkpoint import checkpoint

import functrans as ft

ATOL = 1e-5


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        # the deprecated weight_norm, hooks that make jit run as written, oneDNN's TF32 note
        warnings.simplefilter("ignore")
        yield


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4)


# --- recurrent layers ------------------------------------------------------------------------

_RNNS = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn": torch.nn.RNN}


def _rnn_loss(out: tuple[torch.Tensor, object]) -> torch.Tensor:
    y, hidden = out
    hs = hidden if isinstance(hidden, tuple) else (hidden,)
    return y.square().sum() + sum(h.sin().sum() for h in hs)


@pytest.mark.parametrize("mkldnn", [True, False], ids=["mkldnn", "plain"])
@pytest.mark.parametrize("kind", sorted(_RNNS))
def test_rnn_training_matches_eager(kind: str, mkldnn: bool) -> None:
    """A 2-layer, bidirectional, batch-first recurrent layer trained two steps under jit: loss,
    gradients and parameters as eager's. LSTM's oneDNN kernel (used in eager training on CPU)
    returns a workspace only a grad-mode forward fills: the compiled forward used to hand its
    backward None (``mkldnn_rnn_layer_backward ... argument #22 'workspace'``)."""
    cls = _RNNS[kind]
    with torch.backends.mkldnn.flags(enabled=mkldnn):
        torch.manual_seed(0)
        eager = cls(3, 4, num_layers=2, batch_first=True, bidirectional=True)
        model = copy.deepcopy(eager)
        jitted = ft.jit(model)
        x = torch.randn(2, 5, 3)
        h0 = torch.randn(4, 2, 4)
        hx = (h0, torch.randn(4, 2, 4)) if kind == "lstm" else h0
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, model)]
        for _ in range(2):
            losses = []
            for m in (eager, jitted):
                loss = _rnn_loss(m(x, hx))
                loss.backward()
                losses.append(loss.detach())
            _close(losses[1], losses[0])
            for (name, a), b in zip(eager.named_parameters(), model.parameters(), strict=True):
                assert a.grad is not None and b.grad is not None, name
                _close(b.grad, a.grad)
            for opt in opts:
                opt.step()
                opt.zero_grad()
        for a, b in zip(eager.parameters(), model.parameters(), strict=True):
            _close(b, a)


def test_lstm_inference_keeps_the_fused_kernel() -> None:
    """Without gradients the trace is left as dispatched (oneDNN's kernel where enabled) and
    still computes eager's values."""
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(3, 4, num_layers=2, batch_first=True, bidirectional=True)
    x = torch.randn(2, 5, 3)
    with torch.no_grad():
        want = lstm(x)
        got = ft.jit(lstm)(x)
    _close(got[0], want[0])
    _close(got[1][0], want[1][0])
    _close(got[1][1], want[1][1])


def test_lstm_under_grad_and_remat() -> None:
    """The functional forms take the same path: ``ft.grad`` of an LSTM loss, and an LSTM inside
    a traced ``remat`` region, give eager's gradients."""
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(3, 4, batch_first=True)
    x = torch.randn(2, 5, 3)
    params = {k: v.detach() for k, v in lstm.named_parameters()}

    def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return _rnn_loss(torch.func.functional_call(lstm, p, (x,)))

    want = torch.func.grad(loss)(params)
    for got in (ft.grad(loss)(params), ft.jit(ft.grad(ft.remat(loss)))(params)):
        for k in want:
            _close(got[k], want[k])


# --- weight reparametrizations ---------------------------------------------------------------


class _Symmetric(torch.nn.Module):
    """A custom parametrization (torch's tutorial example): the weight as a symmetric matrix."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.triu() + w.triu(1).transpose(-1, -2)


def _symmetric(layer: torch.nn.Linear) -> torch.nn.Linear:
    parametrize.register_parametrization(layer, "weight", _Symmetric())
    return layer


_REPARAM: dict[str, Callable[[torch.nn.Linear], torch.nn.Module]] = {
    "spectral_norm": torch.nn.utils.spectral_norm,
    "parametrizations.spectral_norm": parametrizations.spectral_norm,
    "weight_norm": torch.nn.utils.weight_norm,
    "parametrizations.weight_norm": parametrizations.weight_norm,
    "register_parametrization": _symmetric,
}


def _net(kind: str) -> torch.nn.Module:
    return torch.nn.Sequential(
        _REPARAM[kind](torch.nn.Linear(6, 6)), torch.nn.Tanh(), torch.nn.Linear(6, 3)
    )


def _train(
    model: torch.nn.Module, run: Callable[[torch.Tensor], torch.Tensor], steps: int = 3
) -> list[torch.Tensor]:
    torch.manual_seed(1)
    x = torch.randn(4, 6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = run(x).square().sum()
        loss.backward()
        losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    return losses


def _same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        _close(sb[name], sa[name])


@pytest.mark.parametrize("kind", sorted(_REPARAM))
def test_reparametrized_training_matches_eager(kind: str) -> None:
    """Three optimizer steps under jit: losses, parameters and the buffers forward updates
    (spectral norm's power-iteration vectors ``u``/``v``) as in eager. The power iteration used
    to leave the backward reading the buffer the write-back then overwrote (a version counter
    error); a saved buffer the call updates is now saved as a copy."""
    torch.manual_seed(0)
    eager = _net(kind)
    torch.manual_seed(0)
    model = _net(kind)
    jitted = ft.jit(model)
    want = _train(eager, eager)
    got = _train(model, jitted)
    for g, w in zip(got, want, strict=True):
        _close(g, w)
    _same_state(eager, model)


def test_spectral_norm_buffers_update_and_backward_reads_the_old_ones() -> None:
    """The compiled step updates u/v in place (the module's own tensors, as eager does) and its
    backward still reads the values the forward read."""
    torch.manual_seed(0)
    layer = parametrizations.spectral_norm(torch.nn.Linear(6, 5))
    u = layer.parametrizations.weight[0]._u
    before = u.clone()
    torch.manual_seed(0)
    reference = parametrizations.spectral_norm(torch.nn.Linear(6, 5))
    x = torch.randn(3, 6)
    ft.jit(layer)(x).sum().backward()
    reference(x).sum().backward()
    assert layer.parametrizations.weight[0]._u is u and not torch.equal(u, before)
    _close(u, reference.parametrizations.weight[0]._u)
    _close(
        layer.parametrizations.weight.original.grad, reference.parametrizations.weight.original.grad
    )


@pytest.mark.parametrize("kind", ["spectral_norm", "parametrizations.spectral_norm"])
def test_spectral_norm_remat_matches_checkpoint(kind: str) -> None:
    """Eager ``ft.remat`` of a spectral-normed layer is torch's checkpoint: the recomputation in
    backward runs the power iteration again, as checkpoint's does."""
    torch.manual_seed(0)
    ours = _net(kind)
    torch.manual_seed(0)
    theirs = _net(kind)
    block = ft.remat(ours)
    got = _train(ours, block)
    want = _train(theirs, lambda x: checkpoint(theirs, x, use_reentrant=False))
    for g, w in zip(got, want, strict=True):
        _close(g, w)
    _same_state(theirs, ours)


def test_traced_remat_updates_buffers_once() -> None:
    """Under jit, a remat region's recomputation is part of the compiled backward and does not
    run the power iteration again: ``jit`` of a model with a remat'd spectral-normed block
    trains as the model without remat does in eager (eager remat, as checkpoint, updates the
    buffers a second time in backward)."""

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net("parametrizations.spectral_norm")
            self.remat_net = ft.remat(self.net)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.remat_net(x)

    torch.manual_seed(0)
    model = Block()
    torch.manual_seed(0)
    plain = _net("parametrizations.spectral_norm")
    got = _train(model, ft.jit(model))
    want = _train(plain, plain)
    for g, w in zip(got, want, strict=True):
        _close(g, w)
    _same_state(plain, model.net)


# --- copies of jitted and remat'd modules ----------------------------------------------------


class _Shared(torch.nn.Module):
    """Holds a block and a remat view of the same block (both share its parameter tables)."""

    def __init__(self) -> None:
        super().__init__()
        self.blk = torch.nn.Linear(4, 4)
        self.remat_blk = ft.remat(self.blk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.remat_blk(x).tanh() + self.blk(x)


def _sine(x: torch.Tensor) -> torch.Tensor:
    return x.sin() * 2


def test_jit_leaves_no_fake_tensors_in_a_shared_module() -> None:
    """torch's ``functional_call`` swaps by name and restored the table a remat view shares
    with its block to the trace's fake tensors: the module kept FakeTensors after one call."""
    model = _Shared()
    ft.jit(model)(torch.randn(2, 4))
    for name, p in model.named_parameters():
        assert type(p) is torch.nn.Parameter, name
    assert model.blk.weight is model.remat_blk.weight


def _roundtrips(obj: object) -> Iterator[object]:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    yield torch.load(buf, weights_only=False)
    yield pickle.loads(pickle.dumps(obj))
    yield copy.deepcopy(obj)


_COPIED: dict[str, Callable[[], Callable[[torch.Tensor], torch.Tensor]]] = {
    "jit(shared)": lambda: ft.jit(_Shared()),
    "jit(linear)": lambda: ft.jit(torch.nn.Linear(4, 4)),
    "remat(linear)": lambda: ft.remat(torch.nn.Linear(4, 4)),
    "shared": _Shared,
    "jit(function)": lambda: ft.jit(_sine),
}


@pytest.mark.parametrize("called", [False, True], ids=["before_call", "after_call"])
@pytest.mark.parametrize("kind", sorted(_COPIED))
def test_copies_compute_the_same_and_compile_again(kind: str, called: bool) -> None:
    """``torch.save``/``pickle``/``deepcopy`` of jitted and remat'd modules (and of a jitted
    module-level function), before and after a call: the copy computes the same values and
    gradients, and a jitted copy compiles on its own first call."""
    torch.manual_seed(0)
    obj = _COPIED[kind]()
    torch.manual_seed(0)
    reference = _COPIED[kind]()  # the same weights; called here, so obj stays uncalled
    x = torch.randn(2, 4, requires_grad=True)
    want = (obj if called else reference)(x)
    (want_dx,) = torch.autograd.grad(want.sum(), x)
    for copied in _roundtrips(obj):
        assert callable(copied)
        info = getattr(copied, "cache_info", None)
        if info is not None:
            assert info().entries == 0
        got = copied(x)
        _close(got, want)
        (dx,) = torch.autograd.grad(got.sum(), x)
        _close(dx, want_dx)
        if info is not None:
            assert info().entries == 1


def test_loaded_jitted_model_trains_like_the_original() -> None:
    """A loaded copy of a jitted model with a remat view is its own model: it trains to the
    same parameters as the original does."""
    torch.manual_seed(0)
    model = ft.jit(_Shared())
    model(torch.randn(2, 4))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for m in (model, loaded):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(2):
            m(torch.ones(2, 4)).square().sum().backward()
            opt.step()
            opt.zero_grad()
    _same_state(model, loaded)
    assert loaded.blk.weight is loaded.remat_blk.weight
    assert loaded.blk.weight is not model.blk.weight
