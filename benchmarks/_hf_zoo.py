"""Tiny Hugging Face models for the zoo: randomly initialized from configs, no weight download.

Re-exported by :mod:`benchmarks.zoo`, which lists them in ``ZOO`` when ``transformers`` can be
imported; ``transformers`` itself is imported only when one of them is built.

Each is a :class:`benchmarks.zoo.Model` (defined in :mod:`benchmarks._model`) whose
``fn(params, x)`` is ``functional_call(model.module, params, (), hf_kwargs(x)).loss``: ``x`` is the
``input_ids`` tensor of a causal LM (the labels are the inputs) or a dict of the model's keyword
arguments (``hf_bert``: ids, a padding mask and masked-LM labels). Attention is ``"eager"`` by
default (see :data:`SDPA_NOTE`); the four cover four attention patterns: causal (``hf_gpt2``),
causal with rotary positions (``hf_llama``), causal with a sliding window and grouped key/value
heads (``hf_mistral``), bidirectional with key padding (``hf_bert``).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from ._model import Model, Params, pick

__all__ = [
    "HF_MODELS",
    "MISTRAL_WINDOW",
    "SDPA_NOTE",
    "has_transformers",
    "hf_bert",
    "hf_gpt2",
    "hf_kwargs",
    "hf_llama",
    "hf_mistral",
    "hf_qwen2_default",
]

#: Names of the models that need ``transformers``.
HF_MODELS = ("hf_llama", "hf_gpt2", "hf_bert", "hf_mistral")

#: Why the HF models default to ``attn_implementation="eager"``.
SDPA_NOTE = (
    "attn_implementation='sdpa' used to give wrong gradients: torch's core ATen decomposition "
    "of aten._scaled_dot_product_flash_attention_for_cpu returns the attention matrix where its "
    "backward op expects the logsumexp. functrans now keeps that op whole (regression test in "
    "tests/transforms/test_api.py); the zoo keeps 'eager' attention so both sides see matmul + "
    "softmax"
)

#: Mistral's attention window at every size: below the "small" sequence length (8), so the
#: sliding-window mask really differs from a causal one
#: (tests/integration/test_hf_models.py checks it).
MISTRAL_WINDOW = 4

VOCAB = 128


def has_transformers() -> bool:
    """Whether ``transformers`` can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec("transformers") is not None
    except (ImportError, ValueError):  # ValueError: sys.modules["transformers"] is None
        return False


def hf_kwargs(x: Any) -> dict[str, Any]:
    """The model's keyword arguments for a zoo input: a causal LM's ids are its labels too."""
    return dict(x) if isinstance(x, dict) else {"input_ids": x, "labels": x}


def _causal_batch(gen: torch.Generator, b: int, t: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=gen)


def _hf_model(
    name: str,
    build: Callable[[Any], torch.nn.Module],
    batch: Callable[[torch.Generator, int, int], Any] = _causal_batch,
    sizes: tuple[tuple[int, int], tuple[int, int]] = ((1, 8), (2, 32)),
) -> Model:
    """Wrap a randomly initialized transformers model with a loss as ``fn(params, x) -> loss``;
    ``sizes`` holds ``batch``'s (batch, seq) at "small" and at "bench"."""
    transformers = importlib.import_module("transformers")
    transformers.logging.set_verbosity_error()  # config notes about unused defaults
    module = build(transformers).eval()

    def fn(params: Params, x: Any) -> torch.Tensor:
        out = torch.func.functional_call(module, params, (), hf_kwargs(x))
        return out.loss  # type: ignore[no-any-return]  # transformers' outputs are untyped

    def make(
        size: str = "small", dtype: torch.dtype = torch.float32, seed: int = 0
    ) -> tuple[Params, Any]:
        b, t = pick(size, *sizes)
        with torch.random.fork_rng():  # the model's own initialization, seeded
            torch.manual_seed(seed)
            fresh = build(transformers)
        params = {k: v.detach().to(dtype) for k, v in fresh.named_parameters()}
        return params, batch(torch.Generator().manual_seed(seed), b, t)

    # RMSNorm/rotary in transformers compute in float32 whatever the parameters' dtype
    return Model(name, fn, make, supports_float64=False, module=module)


def _suffix(name: str, attn: str, layers: int) -> str:
    name = name if attn == "eager" else f"{name}_{attn}"
    return name if layers == 2 else f"{name}_{layers}l"


def hf_llama(attn: str = "eager", layers: int = 2) -> Model:
    """A Llama of ``layers`` layers (hidden 64, 4 heads, vocab 128) from ``LlamaConfig``, random
    weights.

    ``attn`` is the config's ``attn_implementation``. ``"eager"`` (matmul + softmax) is the
    default, so the partitioners see matmul + softmax (see :data:`SDPA_NOTE`).
    """

    def build(tf: Any) -> torch.nn.Module:
        cfg = tf.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=64,
            use_cache=False,
            attn_implementation=attn,
        )
        return tf.LlamaForCausalLM(cfg)  # type: ignore[no-any-return]  # transformers is untyped

    return _hf_model(_suffix("hf_llama", attn, layers), build)


def hf_qwen2_default(layers: int = 12, hidden: int = 64) -> Model:
    """A Qwen2 of ``layers`` layers (``hidden`` wide, MLP twice that, 4 query heads over 2
    key/value heads, vocab 128) from ``Qwen2Config`` with every other setting at its default:
    ``use_cache=True`` (each layer fills a KV cache in the training step) and the default
    attention."""

    def build(tf: Any) -> torch.nn.Module:
        cfg = tf.Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        return tf.Qwen2ForCausalLM(cfg)  # type: ignore[no-any-return]  # transformers is untyped

    return _hf_model(f"hf_qwen2_default_{layers}l", build)


def hf_gpt2(attn: str = "eager", layers: int = 2) -> Model:
    """A GPT-2 of ``layers`` layers (hidden 64, 4 heads, vocab 128) from ``GPT2Config``, random
    weights.

    ``attn`` is the config's ``attn_implementation``. ``"eager"`` (matmul + softmax) is the
    default, so the partitioners see matmul + softmax (see :data:`SDPA_NOTE`).
    """

    def build(tf: Any) -> torch.nn.Module:
        cfg = tf.GPT2Config(
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=layers,
            n_head=4,
            n_positions=64,
            bos_token_id=0,
            eos_token_id=0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            use_cache=False,
            attn_implementation=attn,
        )
        return tf.GPT2LMHeadModel(cfg)  # type: ignore[no-any-return]  # transformers is untyped

    return _hf_model(_suffix("hf_gpt2", attn, layers), build)


def hf_mistral(
    attn: str = "eager", layers: int = 2, sliding_window: int | None = MISTRAL_WINDOW
) -> Model:
    """A Mistral of ``layers`` layers (hidden 64, 4 query heads over 2 key/value heads, vocab
    128) from ``MistralConfig``, random weights, attending over a sliding window of
    ``sliding_window`` positions (``None``: plain causal attention, to check the window matters).
    """

    def build(tf: Any) -> torch.nn.Module:
        cfg = tf.MistralConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            sliding_window=sliding_window,
            use_cache=False,
            attn_implementation=attn,
        )
        return tf.MistralForCausalLM(cfg)  # type: ignore[no-any-return]  # transformers is untyped

    return _hf_model(_suffix("hf_mistral", attn, layers), build)


def _masked_lm_batch(gen: torch.Generator, b: int, t: int) -> dict[str, torch.Tensor]:
    """Ids, a padding mask (the last sequence's final quarter is padding) and masked-LM labels
    (every third position; -100 elsewhere and on padding)."""
    ids = torch.randint(0, VOCAB, (b, t), generator=gen)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[-1, t - t // 4 :] = 0
    labels = torch.full_like(ids, -100)
    labels[:, ::3] = ids[:, ::3]
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def hf_bert(attn: str = "eager", layers: int = 2) -> Model:
    """A BERT masked LM of ``layers`` layers (hidden 64, 4 heads, vocab 128) from ``BertConfig``,
    random weights: bidirectional attention with a key padding mask; ``x`` is a dict of kwargs.
    """

    def build(tf: Any) -> torch.nn.Module:
        cfg = tf.BertConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=layers,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            attn_implementation=attn,
        )
        return tf.BertForMaskedLM(cfg)  # type: ignore[no-any-return]  # transformers is untyped

    return _hf_model(_suffix("hf_bert", attn, layers), build, _masked_lm_batch)
