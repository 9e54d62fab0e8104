"""The benchmark model zoo: every model builds, its loss matches eager, and the joint graph
partitioned with ``default`` gives the gradients of ``torch.func.grad``; torch's min-cut
partitioner run on our joint graph (the benchmarks' reference) gives them too.

Models run at their "small" size, in float64 where the model supports it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import optree
import pytest
import torch

import functrans as ft
from functrans.testing import assert_close

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:  # the benchmarks package lives at the repository root
    sys.path.insert(0, _ROOT)

from benchmarks import zoo  # noqa: E402

CORE = ["mlp_stack", "gpt_block", "llama_block", "conv_block"]
ALL = CORE + list(zoo.HF_MODELS)


def _model(name: str) -> zoo.Model:
    if name in zoo.HF_MODELS:
        pytest.importorskip("transformers")
        return getattr(zoo, name)()  # type: ignore[no-any-return]
    return zoo.ZOO[name]()


def _setup(name: str) -> tuple[zoo.Model, Any, Any]:
    model = _model(name)
    dtype = torch.float64 if model.supports_float64 else torch.float32
    params, x = model.make("small", dtype=dtype)
    return model, params, x


def test_zoo_lists_core_models() -> None:
    assert set(CORE) <= set(zoo.ZOO)
    has_hf = zoo.has_transformers()
    assert all((n in zoo.ZOO) == has_hf for n in zoo.HF_MODELS)


@pytest.mark.parametrize("name", ALL)
def test_loss_and_grads_match_eager(name: str) -> None:
    model, params, x = _setup(name)
    loss = model.fn(params, x)
    assert loss.shape == () and torch.isfinite(loss)

    jg = ft.joint(model.fn, argnums=0)(params, x)
    p = ft.partition(jg, "default")
    out, saved = p.forward(params, x)
    assert_close(out, loss, "loss")
    grads = p.backward(saved, (torch.ones((), dtype=loss.dtype),))
    assert_close(grads, torch.func.grad(model.fn)(params, x), "grad")


@pytest.mark.parametrize("name", ["gpt_block", "conv_block", "hf_gpt2"])
def test_torch_min_cut_adapter_grads(name: str) -> None:
    """``benchmarks._torch_ref`` feeds our joint graph to torch's partitioner correctly."""
    from benchmarks._torch_ref import run_torch_partition, torch_min_cut

    model, params, x = _setup(name)
    jg = ft.joint(model.fn, argnums=0)(params, x)
    r = torch_min_cut(jg)
    assert r["unmatched_names"] == []
    ones = torch.ones((), dtype=jg.forward_outputs()[0].meta["val"].dtype)
    (out,), grads = run_torch_partition(jg, r["fw"], r["bw"], (params, x), [ones])
    assert_close(out, model.fn(params, x), "loss")
    expected = optree.tree_leaves(torch.func.grad(model.fn)(params, x), namespace="functrans")
    assert_close(tuple(grads), tuple(expected), "grad")


def test_forward_flops_positive() -> None:
    assert zoo.forward_flops(zoo.ZOO["gpt_block"](), "small") > 0
