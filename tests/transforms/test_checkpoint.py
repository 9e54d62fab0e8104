"""``ft.checkpoint`` (a drop-in for ``torch.utils.checkpoint.checkpoint`` taking remat policies),
``torch.utils.checkpoint`` regions inside traces (Hugging Face gradient checkpointing,
``checkpoint_wrapper``) and ``jit(module)``'s forward signature (Hugging Face's Trainer)."""

from __future__ import annotations

import copy
import functools
import inspect
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.testing import assert_close
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import functrans as ft
from functrans import policies
from functrans._core.tags import REMAT
from functrans._transforms.checkpoint import _torch_entry

aten = torch.ops.aten


def _block(x: torch.Tensor, w: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
    return torch.tanh(x @ w).sin() * scale


def _weights() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(4, 5), torch.randn(5, 5, requires_grad=True)


def _grads(loss_fn: Any, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w.grad = None
    loss = loss_fn()
    loss.backward()
    assert w.grad is not None
    return loss.detach(), w.grad.clone()


# ---------------------------------------------------------------------------------------------
# ft.checkpoint: eager and under transforms, against torch.utils.checkpoint and plain eager


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_eager_matches_torch_checkpoint(use_reentrant: bool) -> None:
    x, w = _weights()
    x = x.requires_grad_(use_reentrant)  # reentrant: a tensor argument must require grad
    plain = _grads(lambda: _block(x, w).sum(), w)
    theirs = _grads(
        lambda: torch_checkpoint.checkpoint(_block, x, w, use_reentrant=use_reentrant).sum(), w
    )
    ours = _grads(lambda: ft.checkpoint(_block, x, w, use_reentrant=use_reentrant).sum(), w)
    assert_close(ours, theirs)
    assert_close(ours, plain)


def test_kwargs_reach_the_function_and_torch_options_are_accepted() -> None:
    x, w = _weights()
    plain = _grads(lambda: _block(x, w, scale=3.0).sum(), w)
    ours = _grads(
        lambda: ft.checkpoint(
            _block,
            x,
            w,
            scale=3.0,
            preserve_rng_state=False,
            determinism_check="none",
            debug=True,
            early_stop=False,
        ).sum(),
        w,
    )
    assert_close(ours, plain)


def test_dropout_recomputes_the_forward_mask() -> None:
    # the RNG state is restored for the recomputation, as in torch's checkpoint
    x, w = _weights()

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x @ w, 0.5).tanh()

    torch.manual_seed(1)
    plain = _grads(lambda: f(x, w).sum(), w)
    torch.manual_seed(1)
    ours = _grads(lambda: ft.checkpoint(f, x, w, policy=policies.dots_saveable).sum(), w)
    assert_close(ours, plain)


def test_reentrant_without_grad_inputs_gives_no_gradient_like_torch() -> None:
    x, w = _weights()  # x needs no grad: torch's reentrant checkpoint cuts w off
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad"):
        theirs = torch_checkpoint.checkpoint(lambda x: _block(x, w), x, use_reentrant=True)
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad"):
        ours = ft.checkpoint(lambda x: _block(x, w), x, use_reentrant=True)
    assert ours.requires_grad is theirs.requires_grad is False
    assert_close(ours, theirs)


def test_policy_decides_in_a_trace_as_remat_does() -> None:
    x, w = _weights()
    f = lambda x, w: ft.checkpoint(_block, x, w, policy=policies.dots_saveable).sum()  # noqa: E731
    g = lambda x, w: ft.remat(_block, policy=policies.dots_saveable)(x, w).sum()  # noqa: E731
    ours = ft.partition(ft.joint(f)(x, w), "default")
    theirs = ft.partition(ft.joint(g)(x, w), "default")
    assert sorted(s.name for s in ours.saved) == sorted(s.name for s in theirs.saved)
    assert "mm" in {s.name for s in ours.saved}
    nothing = ft.partition(
        ft.joint(lambda x, w: ft.checkpoint(_block, x, w).sum())(x, w), "default"
    )
    assert "mm" not in {s.name for s in nothing.saved}  # default: save nothing, as torch's


def test_selective_checkpoint_context_fn_is_translated() -> None:
    x, w = _weights()
    # torch's selective checkpointing: a list of ops, and a policy_fn(ctx, op, ...)
    by_list = functools.partial(create_selective_checkpoint_contexts, [aten.mm.default])

    def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        save = op is aten.mm.default
        return torch_checkpoint.CheckpointPolicy.MUST_SAVE if save else False

    by_fn = functools.partial(create_selective_checkpoint_contexts, policy_fn)
    plain = _grads(lambda: _block(x, w).sum(), w)
    for context_fn in (by_list, by_fn):
        theirs = functools.partial(torch_checkpoint.checkpoint, use_reentrant=False)
        ours = functools.partial(ft.checkpoint, context_fn=context_fn)
        expect = _grads(lambda: theirs(_block, x, w, context_fn=context_fn).sum(), w)  # noqa: B023
        assert_close(_grads(lambda: ours(_block, x, w).sum(), w), expect)  # noqa: B023
        assert_close(expect, plain)
        joint = ft.joint(lambda x, w: ours(_block, x, w).sum())(x, w)  # noqa: B023
        assert "mm" in {s.name for s in ft.partition(joint, "default").saved}


def test_under_grad_jit_and_vmap() -> None:
    x, w = _weights()
    loss = lambda w: ft.checkpoint(_block, x, w, policy=policies.dots_saveable).sum()  # noqa: E731
    plain = torch.func.grad(lambda w: _block(x, w).sum())(w.detach())
    assert_close(ft.grad(loss)(w.detach()), plain)
    assert_close(ft.jit(ft.grad(loss))(w.detach()), plain)
    jitted = _grads(lambda: ft.jit(lambda x, w: ft.checkpoint(_block, x, w).sum())(x, w), w)
    assert_close(jitted, _grads(lambda: _block(x, w).sum(), w))
    batched = ft.vmap(lambda x: ft.checkpoint(_block, x, w.detach()))(x)
    assert_close(batched, _block(x, w.detach()))
    per_example = ft.vmap(ft.grad(lambda x: ft.checkpoint(_block, x, w.detach()).sum()))(x)
    assert_close(per_example, torch.func.vmap(torch.func.grad(lambda x: _block(x, w).sum()))(x))


def test_a_module_runs_with_its_hooks() -> None:
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 3)
    seen: list[int] = []
    net.register_forward_hook(lambda m, a, out: seen.append(1))
    x = torch.randn(2, 3, requires_grad=True)
    out = ft.checkpoint(net, x)
    assert_close(out, net(x))
    out.sum().backward()  # the recomputation reruns the hook, as torch's checkpoint does
    assert len(seen) >= 2


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"use_reentrant": "yes"}, "use_reentrant='yes'"),
        ({"determinism_check": "strict"}, "determinism_check='strict'"),
        ({"debug": 1}, "debug=1"),
        ({"policy": "dots_saveable"}, "is a name, not a policy"),
        (
            {
                "policy": policies.dots_saveable,
                "context_fn": functools.partial(
                    create_selective_checkpoint_contexts, [aten.mm.default]
                ),
            },
            "both policy=",
        ),
    ],
)
def test_bad_options_are_refused_by_name(options: dict[str, Any], match: str) -> None:
    x, w = _weights()
    with pytest.raises(ft.FunctransError, match=match):
        ft.checkpoint(_block, x, w, **options)


def test_other_context_fn_is_refused() -> None:
    x, w = _weights()
    from contextlib import nullcontext

    with pytest.raises(ft.UnsupportedOpError, match="not torch's selective-checkpoint"):
        ft.checkpoint(_block, x, w, context_fn=lambda: (nullcontext(), nullcontext()))
    with pytest.raises(ft.InvalidArgumentError, match="function=3"):
        ft.checkpoint(3, x)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# torch.utils.checkpoint inside a trace: a remat region


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_torch_checkpoint_in_jit_is_a_remat_region(use_reentrant: bool) -> None:
    x, w = _weights()
    x = x.requires_grad_()

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch_checkpoint.checkpoint(_block, x, w, use_reentrant=use_reentrant).sum()

    ours = _grads(lambda: ft.jit(f)(x, w), w)
    assert_close(ours, _grads(lambda: f(x, w), w))
    jg = ft.joint(f)(x, w)
    assert any(
        REMAT in n.meta for n in jg.graph_module.graph.nodes
    )  # tagged: not re-run in backward
    before = _torch_entry().__dict__.get("__dynamo_disable")  # type: ignore[union-attr]
    ft.trace(f)(x, w)
    assert _torch_entry().__dict__.get("__dynamo_disable") is before  # type: ignore[union-attr]


def test_torch_checkpoint_selective_policy_in_a_trace() -> None:
    x, w = _weights()
    context_fn = functools.partial(create_selective_checkpoint_contexts, [aten.mm.default])

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch_checkpoint.checkpoint(
            _block, x, w, use_reentrant=False, context_fn=context_fn
        ).sum()

    assert "mm" in {s.name for s in ft.partition(ft.joint(f)(x, w), "default").saved}
    assert_close(_grads(lambda: ft.jit(f)(x, w), w), _grads(lambda: f(x, w), w))


def test_torch_checkpoint_refusals_hold_in_a_trace() -> None:
    # what torch's reentrant checkpoint refuses in eager mode is refused in a trace
    x, w = _weights()

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch_checkpoint.checkpoint(_block, x, w, use_reentrant=True, scale=2.0).sum()

    with pytest.raises(ValueError, match="Unexpected keyword"):
        f(x, w)
    with pytest.raises(ft.InvalidArgumentError, match="unexpected keyword arguments scale"):
        ft.jit(f)(x, w)


def test_checkpoint_sequential_in_jit() -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(4)))
    x = torch.randn(3, 4, requires_grad=True)

    def loss(x: torch.Tensor) -> torch.Tensor:
        return torch_checkpoint.checkpoint_sequential(net, 2, x, use_reentrant=False).sum()

    eager = torch.autograd.grad(loss(x), list(net.parameters()))
    jitted = torch.autograd.grad(ft.jit(loss)(x), list(net.parameters()))
    assert_close(jitted, eager)


# ---------------------------------------------------------------------------------------------
# checkpoint_wrapper (torchtitan / torchtune style)


@pytest.mark.parametrize("checkpoint_fn", [None, ft.checkpoint], ids=["torch", "functrans"])
def test_checkpoint_wrapper(checkpoint_fn: Any) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))

    plain = model()
    wrapped = torch.nn.Sequential(
        *(checkpoint_wrapper(m, checkpoint_fn=checkpoint_fn) for m in model())
    )
    x = torch.randn(3, 4)
    expect = torch.autograd.grad(plain(x).pow(2).sum(), list(plain.parameters()))
    for run in (wrapped, ft.jit(wrapped)):
        got = torch.autograd.grad(run(x).pow(2).sum(), list(wrapped.parameters()))
        assert_close(got, expect)


# ---------------------------------------------------------------------------------------------
# Hugging Face gradient checkpointing

transformers = pytest.importorskip("transformers")


def _gpt2() -> torch.nn.Module:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config)
    model.train()
    return model


def _llama() -> torch.nn.Module:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    model = transformers.LlamaForCausalLM(config)
    model.train()
    return model


def _hf_grads(model: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (2, 8))
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), [p.grad.clone() for p in model.parameters()]


def _disable_dropout(model: torch.nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize(
    "func",
    [
        functools.partial(torch_checkpoint.checkpoint, use_reentrant=False),
        functools.partial(torch_checkpoint.checkpoint, use_reentrant=True),
        ft.checkpoint,
        functools.partial(ft.checkpoint, policy=policies.dots_saveable),
    ],
    ids=["torch", "torch-reentrant", "functrans", "functrans-dots"],
)
def test_hf_gradient_checkpointing_under_jit(make: Any, func: Any) -> None:
    # torch's checkpoint re-ran the layer in the trace's backward, after
    # functional_call restored the real parameters: "reads captured tensor
    # module.transformer.h.1.ln_1.bias through a path functrans cannot find"
    model = make()
    _disable_dropout(model)
    expect = _hf_grads(model)
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=func)
    assert_close(_hf_grads(model), expect)  # eager
    jitted = ft.jit(model)
    assert_close(_hf_grads(jitted), expect)
    assert jitted.cache_info().entries == 1  # compiled, not run eagerly


def test_hf_gradient_checkpointing_enable_under_jit() -> None:
    # the public entry point, with dropout on: one seed, the same masks in eager and jit
    model = _gpt2()
    expect = _hf_grads(model)
    context_fn = functools.partial(create_selective_checkpoint_contexts, [aten.mm.default])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # renamed in transformers 5
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": context_fn}
        )
    assert_close(_hf_grads(model), expect)
    jitted = ft.jit(model)
    # transformers' forward hook for PEFT (enable_input_require_grads) only marks the
    # embeddings' output as requiring grad: traced, the step compiles with it registered
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "runs as written" fallback
        assert_close(_hf_grads(jitted), expect)
    assert jitted.cache_info().entries == 1


# ---------------------------------------------------------------------------------------------
# jit(module) shows the forward's signature


def test_jit_module_shows_the_forward_signature() -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        def forward(self, x: torch.Tensor, scale: float = 1.0, *, mask: Any = None) -> Any:
            return self.lin(x) * scale

    net = Net()
    jitted = ft.jit(net)
    expected = inspect.signature(net.forward)
    assert inspect.signature(jitted) == expected
    assert inspect.signature(jitted.forward) == expected
    assert jitted.__wrapped__ is net
    x = torch.ones(1, 2)
    assert_close(jitted.forward(x, 2.0), net(x, 2.0))
    copied = copy.deepcopy(jitted)
    assert inspect.signature(copied.forward) == expected
    assert copied.__wrapped__ is copied.module is not net
    assert_close(copied.forward(x), copied.module(x))
    assert jitted.cache_info().entries == 1 and copied.cache_info().entries == 1


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "hf-checkpointing"])
def test_hf_trainer_runs_a_jitted_model(tmp_path: Path, checkpointing: bool) -> None:
    """HF's Trainer with a jitted model trains like eager; with
    ``TrainingArguments(gradient_checkpointing=True)`` too, compiled (issue 52: HF's
    input-require-grads hook made every call run as written)."""
    pytest.importorskip("accelerate")  # Trainer needs it

    # Trainer drops the dataset columns inspect.signature(model.forward) does not name
    # (remove_unused_columns=True); with (*args, **kwargs) it dropped them all
    class Rows(torch.utils.data.Dataset[dict[str, Any]]):
        def __init__(self) -> None:
            torch.manual_seed(2)
            self.rows = [
                {"input_ids": ids, "labels": ids.clone(), "unused": "text"}
                for ids in torch.randint(0, 64, (4, 8))
            ]

        def __len__(self) -> int:
            return len(self.rows)

        def __getitem__(self, i: int) -> dict[str, Any]:
            return self.rows[i]

    def train(jit: bool) -> list[float]:
        model = _gpt2()
        _disable_dropout(model)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(jit)),
            max_steps=2,
            per_device_train_batch_size=2,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            logging_steps=1,
            seed=0,
            data_seed=0,
            gradient_checkpointing=checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False} if checkpointing else None,
        )
        run = ft.jit(model) if jit else model
        trainer = transformers.Trainer(model=run, args=args, train_dataset=Rows())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # names renamed in transformers 5
            trainer.train()
        if jit:
            info = run.cache_info()
            assert info.entries >= 1 and info.misses >= 1 and info.hits >= 1  # compiled
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    eager, jitted = train(False), train(True)
    assert len(jitted) == 2
    assert jitted == pytest.approx(eager, rel=1e-4)


def test_debug_with_a_selective_policy_is_refused_by_name() -> None:
    # torch allows its debug trace only without selective contexts; say so, not a raw ValueError
    x, w = _weights()
    with pytest.raises(ft.InvalidArgumentError, match="debug=True"):
        ft.checkpoint(_block, x, w, policy=policies.dots_saveable, debug=True).sum().backward()
