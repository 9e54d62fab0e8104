"""Hugging Face KV caches under ``jit(model)``: ``DynamicCache`` and ``StaticCache`` are pytrees
to functrans, so a jitted causal LM runs with ``use_cache=True``, its decode steps share one
entry with a symbolic sequence length, ``generate`` on the jitted model runs its forward
through the compiled entry and gives eager's tokens, and a cache passed in is updated in place
as eager updates it. Tiny GPT-2 and Llama from configs, random weights under one seed."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch

import functrans as ft

transformers = pytest.importorskip("transformers")

VOCAB = 64


def _model(kind: str) -> Any:
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        return transformers.LlamaForCausalLM(config).eval()
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config).eval()


def _prompt(n: int = 5) -> torch.Tensor:
    return torch.randint(1, VOCAB, (1, n), generator=torch.Generator().manual_seed(1))


class _Counted:
    """Counts the calls of a jitted module's compiled entry that ran compiled."""

    def __init__(self, jm: Any) -> None:
        self.compiled = self.calls = 0
        jitted = jm._compiled
        run = jitted.run_or_none

        def counting(*args: Any, **kwargs: Any) -> Any:
            found = run(*args, **kwargs)
            self.calls += 1
            self.compiled += found is not None
            return found

        jitted.__dict__["run_or_none"] = counting


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_generate_runs_compiled_and_matches_eager(kind: str) -> None:
    model = _model(kind)
    new = 12
    want = model.generate(_prompt(), max_new_tokens=new, do_sample=False, pad_token_id=0)
    jm = ft.jit(model)
    counted = _Counted(jm)
    got = jm.generate(_prompt(), max_new_tokens=new, do_sample=False, pad_token_id=0)
    assert got.tolist() == want.tolist()
    # every forward generate made (prefill + one per new token but the last) ran compiled
    assert counted.calls == counted.compiled == new
    # prefill (empty cache), the first decode step, then one entry with a symbolic length
    info = jm.cache_info()
    assert info.misses == 3, info
    assert info.hits == new - 3


def test_use_cache_default_returns_live_cache() -> None:
    model = _model("llama")
    ids = _prompt()
    with torch.no_grad():
        want = model(input_ids=ids)
        got = ft.jit(model)(input_ids=ids)
    assert type(got.cache) is type(want.cache)
    assert got.cache.get_seq_length() == 5
    for a, b in zip(want.cache.layers, got.cache.layers, strict=True):
        torch.testing.assert_close(b.keys, a.keys)
        torch.testing.assert_close(b.values, a.values)
    torch.testing.assert_close(got.logits, want.logits)


def test_cache_passed_in_is_updated_in_place_with_grad() -> None:
    """Eager's ``cache.update`` mutates the cache the caller passed; so does the jitted call
    (and the returned cache is that same object). Grad mode on: the joint trace runs the
    forward twice, which must not leak state between runs through the cache's metadata."""
    model = _model("llama")
    jm = ft.jit(model)
    mine, theirs = transformers.DynamicCache(), transformers.DynamicCache()
    ids = _prompt(7)
    for chunk in (ids[:, :5], ids[:, 5:]):
        want = model(input_ids=chunk, cache=theirs)
        got = jm(input_ids=chunk, cache=mine)
        assert got.cache is mine
        assert mine.get_seq_length() == theirs.get_seq_length()
        torch.testing.assert_close(got.logits, want.logits)
        torch.testing.assert_close(mine.layers[1].values, theirs.layers[1].values)
    want.logits.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    got.logits.sum().backward()
    for n, p in model.named_parameters():
        if n in grads:
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-5)


def test_static_cache_decode() -> None:
    """A ``StaticCache`` (fixed-size buffers written by index) through the jitted forward."""
    model = _model("llama")
    jm = ft.jit(model)
    ids = _prompt(6)
    caches = [transformers.StaticCache(config=model.config, max_cache_len=16) for _ in "ab"]
    with torch.no_grad():
        for step in range(3, 7):
            chunk = ids[:, :3] if step == 3 else ids[:, step - 1 : step]
            want = model(input_ids=chunk, cache=caches[0])
            got = jm(input_ids=chunk, cache=caches[1])
            torch.testing.assert_close(got.logits, want.logits)
    for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
        torch.testing.assert_close(b.keys, a.keys)


def test_functrans_does_not_import_transformers() -> None:
    code = "import sys, torch, functrans as ft; ft.jit(lambda x: x * 2)(torch.ones(2)); "
    code += "print('transformers' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "False"
