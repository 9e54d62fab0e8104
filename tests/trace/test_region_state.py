"""Blocks that update a key/value cache they are passed (HF decoder layers with
``use_cache=True``, the default) are regions: the trace's stand-in answers ``update`` as the
empty slot would, and each call fills the real cache's slot. The rule: compiled so, a step's
values, gradients and cache contents are eager's, whatever the block does with its layer
index; a block whose index takes part in its computation is a region per layer."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import functrans as ft
from functrans._core.switches import overridden
from functrans._trace import regions

transformers = pytest.importorskip("transformers")

SCALES = [1.0, -0.5, 2.0, 0.25, 1.5, -1.0]

#: what a layer does with its index beside naming its cache slot
USES = ["none", "scale", "parity", "table", "length", "twice"]


class Layer(torch.nn.Module):
    def __init__(self, d: int, layer_idx: int, use: str) -> None:
        super().__init__()
        self.layer_idx, self.use = layer_idx, use
        self.k, self.v = torch.nn.Linear(d, d), torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor, cache: Any) -> torch.Tensor:
        k, v = cache.update(self.k(x), self.v(x), self.layer_idx)
        y = x + torch.tanh(k) * v
        if self.use == "scale":
            y = y * (self.layer_idx + 1)
        elif self.use == "parity" and self.layer_idx % 2:
            y = -y
        elif self.use == "table":
            y = y * SCALES[self.layer_idx]
        elif self.use == "length":  # a query the stand-in does not answer: traced inline
            y = y + cache.get_seq_length(self.layer_idx)
        elif self.use == "twice":  # a second update of its slot: traced inline
            k, _ = cache.update(k, v, self.layer_idx)
            y = y + k[..., :1, :].sum()
        return y


class Net(torch.nn.Module):
    def __init__(self, d: int, n: int, use: str) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(d, i, use) for i in range(n))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        cache = transformers.DynamicCache()
        for layer in self.layers:
            x = layer(x, cache)
        return x.square().mean(), [t for layer in cache.layers for t in (layer.keys, layer.values)]


def _step(model: torch.nn.Module, run: Any, x: torch.Tensor) -> list[torch.Tensor]:
    loss, cached = run(x)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    model.zero_grad()
    return [loss.detach(), *[c.detach() for c in cached], *grads]


def _traced_and_reused(run: Any, x: torch.Tensor) -> tuple[int, int]:
    traced, reused = regions.stats.traced, regions.stats.reused
    run(x)[0].backward()
    return regions.stats.traced - traced, regions.stats.reused - reused


def test_a_layer_that_names_its_slot_only_is_one_region() -> None:
    torch.manual_seed(0)
    model = Net(8, 4, "none")
    x = torch.randn(2, 3, 8)
    with overridden(FUNCTRANS_CACHE="0"):
        traced, reused = _traced_and_reused(ft.jit(copy.deepcopy(model)), x)
    # the first layer's input needs no gradient, the others' do: two keys
    assert (traced, reused) == (2, 2)


@pytest.mark.parametrize("use", ["scale", "parity", "table"])
def test_a_layer_whose_index_is_computation_is_a_region_per_layer(use: str) -> None:
    torch.manual_seed(0)
    model = Net(8, 4, use)
    x = torch.randn(2, 3, 8)
    with overridden(FUNCTRANS_CACHE="0"):
        traced, reused = _traced_and_reused(ft.jit(copy.deepcopy(model)), x)
    assert (traced, reused) == (4, 0)


@pytest.mark.parametrize("use", ["length", "twice"])
def test_a_layer_using_the_cache_otherwise_is_traced_inline(use: str) -> None:
    torch.manual_seed(0)
    model = Net(8, 3, use)
    x = torch.randn(2, 3, 8)
    with overridden(FUNCTRANS_CACHE="0"):
        _, reused = _traced_and_reused(ft.jit(copy.deepcopy(model)), x)
    assert reused == 0


@settings(max_examples=8, deadline=None)
@given(
    uses=st.lists(st.sampled_from(USES), min_size=2, max_size=4),
    mode=st.sampled_from(["compiled", "unrolled"]),
    seed=st.integers(0, 2**16),
)
@example(uses=["none", "scale", "none", "none"], mode="compiled", seed=0)
@example(uses=["parity", "parity", "parity"], mode="compiled", seed=0)
@example(uses=["none", "none"], mode="unrolled", seed=0)  # an empty constant made by an op
@example(uses=["none", "none", "twice", "twice"], mode="compiled", seed=1)
def test_property_cache_updating_stacks_equal_eager(uses: list[str], mode: str, seed: int) -> None:
    """Layers doing anything with their index (a generated mix), compiled under each region
    mode: loss, every cache slot and every gradient equal eager's."""
    torch.manual_seed(seed)
    model = Net(8, len(uses), "none")
    for layer, use in zip(model.layers, uses, strict=True):
        layer.use = use
    x = torch.randn(2, 3, 8)
    want = _step(model, model, x)
    with overridden(FUNCTRANS_REGIONS=mode, FUNCTRANS_CACHE="0"):
        got = _step(model, ft.jit(model), x)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):  # float32 sums of any order: scaled tolerance
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * max(1.0, b.abs().max().item()))


def _qwen(layers: int) -> Any:
    from benchmarks._hf_zoo import hf_qwen2_default  # the benchmarks' HF-defaults family

    torch.manual_seed(0)
    return hf_qwen2_default(layers, hidden=32).module


def test_hf_default_config_layers_are_one_region_and_train_as_eager() -> None:
    """A Qwen2 from its config, ``use_cache`` left at its default (True): its layers reuse
    one region; loss, gradients and the returned cache equal eager's."""
    model = _qwen(4)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))

    def run(m: Any) -> Any:
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        return out, grads

    want, want_grads = run(model)
    before = regions.stats.reused
    with overridden(FUNCTRANS_CACHE="0"):
        got, got_grads = run(ft.jit(model))
    assert regions.stats.reused - before == 3  # layers 2 to 4 reuse layer 1's region
    torch.testing.assert_close(got.loss, want.loss)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert got.cache.get_seq_length() == want.cache.get_seq_length() == 7
    for a, b in zip(got.cache.layers, want.cache.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys)
        torch.testing.assert_close(a.values, b.values)


def test_layer_indices_changed_after_compiling_fill_the_slots_eager_fills() -> None:
    """The index attribute left out of the region's key is still state the step read: a
    caller swapping two layers' ``layer_idx`` after the first call gets eager's cache (the
    step recompiles), not the slots the first trace filled."""
    torch.manual_seed(0)
    model = Net(8, 3, "none")
    x = torch.randn(2, 3, 8)
    with overridden(FUNCTRANS_CACHE="0"):
        jitted = ft.jit(model)
        _step(model, jitted, x)
        model.layers[0].layer_idx, model.layers[2].layer_idx = 2, 0
        want = _step(model, model, x)
        got = _step(model, jitted, x)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    assert jitted.cache_info().misses == 2
