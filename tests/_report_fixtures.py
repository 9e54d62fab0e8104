"""Fixtures shared by the report tests: small partitions and a GPT block cut three ways."""

import math

import pytest
import torch

import functrans as ft
from functrans.extend import Cut


def block(params, x):
    h = torch.tanh(x @ params["w"])
    h = torch.nn.functional.layer_norm(h, (8,), params["g"], params["b"])
    return (h.exp() * params["g"]).sum()


@pytest.fixture(scope="module")
def parts():
    args = ({"w": torch.randn(8, 8), "g": torch.ones(8), "b": torch.zeros(8)}, torch.randn(4, 8))
    jg = ft.joint(block)(*args)
    return {
        "default": ft.partition(jg, "default"),
        "min_cut": ft.partition(jg, "min_cut"),
        "full_remat": ft.partition(jg, "full_remat"),
        "offload": ft.partition(jg, lambda jg: Cut(saved=("tanh",), offloaded=("exp",))),
    }


def mb0_offload(jg):
    """What the review hit: no device activations, everything offloaded, little recompute."""
    return ft.partition(jg, "memory_budget", max_bytes=0, offload=ft.Offload(bandwidth=math.inf))


@pytest.fixture(scope="module")
def offload_parts(parts):
    return {"full_remat": parts["full_remat"], "mb0+offload": mb0_offload(parts["min_cut"].joint)}


@pytest.fixture(scope="module")
def gpt():
    """A GPT block (pre-LayerNorm attention and MLP, 108 forward nodes) cut three ways."""
    from benchmarks import zoo

    model = zoo.ZOO["gpt_block"]()
    jg = ft.joint(model.fn, argnums=0)(*model.make("small"))
    return {
        "default": ft.partition(jg, "default"),
        "min_cut": ft.partition(jg, "min_cut"),
        "mb0+offload": mb0_offload(jg),
    }
