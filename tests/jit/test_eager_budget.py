"""``ft.remat(model, peak_bytes=N)``: a peak budget for a model that runs eagerly.

The rules: a training step's measured peak is at most ``N`` wherever a plan is given; the
gradients (and buffers) are eager's, dropout included; a larger ``N`` checkpoints no more
blocks; a limit below every plan is refused by name at the first training call; no_grad
calls run as written; a checkpointed block recomputes with the weights its forward used.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import functrans as ft
from functrans.testing import measure_peak


class Block(nn.Module):
    def __init__(self, d: int, p: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, -1)
        a = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1)
        x = x + self.drop(self.o(a @ v))
        return x + self.drop(self.down(F.gelu(self.up(self.ln2(x)))))


class Stack(nn.Module):
    def __init__(self, n: int = 6, d: int = 32, p: float = 0.0) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, p) for _ in range(n))
        self.head = nn.Linear(d, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x).square().mean()


def _step(model: nn.Module, params: list[nn.Parameter], x: torch.Tensor) -> list[torch.Tensor]:
    for p in params:
        p.grad = None
    torch.manual_seed(7)
    model(x).backward()
    return [p.grad.clone() for p in params if p.grad is not None]


def _peak(model: nn.Module, params: list[nn.Parameter], x: torch.Tensor) -> int:
    for p in params:
        p.grad = None
    torch.manual_seed(7)
    return measure_peak(lambda: model(x).backward()).peak_bytes


@pytest.fixture(scope="module")
def stack() -> tuple[Stack, torch.Tensor, int]:
    torch.manual_seed(0)
    m = Stack()
    x = torch.randn(4, 32, 32)
    return m, x, _peak(m, list(m.parameters()), x)


@pytest.mark.parametrize("frac", [0.9, 0.6, 0.45])
def test_the_measured_peak_is_within_the_limit(
    stack: tuple[Stack, torch.Tensor, int], frac: float
) -> None:
    m, x, eager = stack
    params = list(m.parameters())
    limit = int(frac * eager)
    budgeted = ft.remat(m, peak_bytes=limit)
    for a, b in zip(_step(budgeted, params, x), _step(m, params, x), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert _peak(budgeted, params, x) <= limit
    (plan,) = budgeted.plans()
    assert plan.calls == 6 and 0 < plan.checkpointed <= 6


def test_a_larger_budget_checkpoints_no_more_blocks(stack: tuple[Stack, torch.Tensor, int]) -> None:
    m, x, eager = stack
    counts = []
    for frac in (0.45, 0.6, 0.9, 2.0):
        budgeted = ft.remat(m, peak_bytes=int(frac * eager))
        _step(budgeted, list(m.parameters()), x)
        counts.append(budgeted.plans()[0].checkpointed)
    assert counts == sorted(counts, reverse=True)
    assert counts[-1] == 0  # twice eager's peak: nothing to checkpoint


def test_dropout_blocks_train_as_eager() -> None:
    torch.manual_seed(1)
    m = Stack(n=4, p=0.2)
    x = torch.randn(4, 16, 32)
    params = list(m.parameters())
    budgeted = ft.remat(m, peak_bytes=int(0.8 * _peak(m, params, x)))
    for a, b in zip(_step(budgeted, params, x), _step(m, params, x), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_limit_below_every_plan_is_refused_by_name(
    stack: tuple[Stack, torch.Tensor, int],
) -> None:
    m, x, _ = stack
    budgeted = ft.remat(m, peak_bytes=1024)
    with pytest.raises(ft.InvalidPartitionError, match=r"remat\(Stack, peak_bytes=1024\).*6 rep"):
        budgeted(x)


def test_no_grad_runs_as_written_and_new_shapes_plan_again(
    stack: tuple[Stack, torch.Tensor, int],
) -> None:
    m, x, eager = stack
    budgeted = ft.remat(m, peak_bytes=int(0.6 * eager))
    with torch.no_grad():
        torch.testing.assert_close(budgeted(x), m(x))
    assert budgeted.plans() == []
    budgeted(x).backward()
    budgeted(x[:2]).backward()
    assert len(budgeted.plans()) == 2
    m.eval()  # no signal: HF models are built in eval mode and trained so
    try:
        budgeted(x[:1]).backward()
    finally:
        m.train()
    assert len(budgeted.plans()) == 3
    assert list(budgeted.state_dict()) == list(m.state_dict())


@pytest.mark.parametrize(
    ("f", "kw", "match"),
    [
        (lambda x: x, {}, "takes a module"),
        (nn.Linear(2, 2), {"policy": "dots_saveable"}, "takes no policy"),
        (nn.Linear(2, 2), {"peak_bytes_bad": True}, None),
    ],
)
def test_bad_arguments_are_refused_when_made(f: Any, kw: dict[str, Any], match: str | None) -> None:
    if match is None:
        with pytest.raises(ft.InvalidArgumentError, match="peak_bytes=-1"):
            ft.remat(f, peak_bytes=-1)
        return
    with pytest.raises(ft.InvalidArgumentError, match=match):
        ft.remat(f, peak_bytes=1 << 20, **kw)


def test_a_hugging_face_model_from_a_config() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 64, (4, 48))
    params = [p for p in model.parameters() if p.requires_grad]

    def step(m: nn.Module) -> list[torch.Tensor]:
        for p in params:
            p.grad = None
        m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        return [p.grad.clone() for p in params if p.grad is not None]

    def peak(m: nn.Module) -> int:
        for p in params:
            p.grad = None
        return measure_peak(
            lambda: m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        ).peak_bytes

    limit = int(0.7 * peak(model))
    budgeted = ft.remat(model, peak_bytes=limit)
    for a, b in zip(step(budgeted), step(model), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert peak(budgeted) <= limit
    assert budgeted.plans()[0].calls == 4


def test_functional_call_with_other_weights_recomputes_with_them() -> None:
    """Shrunk from the benchmark's tied LM: under ``functional_call`` with weights other than
    the module's own, a checkpointed block's recomputation (after functional_call swapped
    the module's own back) must use the weights its forward used."""
    torch.manual_seed(0)
    m = Stack(n=3)
    other = {k: torch.randn_like(v).requires_grad_() for k, v in m.named_parameters()}
    x = torch.randn(2, 8, 32)

    def grads(module: nn.Module) -> dict[str, torch.Tensor]:
        for v in other.values():
            v.grad = None
        torch.func.functional_call(module, other, (x,)).backward()
        return {k: v.grad.clone() for k, v in other.items() if v.grad is not None}

    from functrans._jit.eager_budget import _checkpointing

    with _checkpointing(list(m.blocks)):  # every block checkpointed, as a tight plan would
        got = grads(m)
    want = grads(m)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)


class ConvBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn(self.conv(x)))


class ConvStack(nn.Module):
    def __init__(self, n: int = 4, c: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ConvBlock(c) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x.square().mean()


def test_batch_norm_blocks_update_their_statistics_once_as_eager() -> None:
    """Shrunk from the benchmark's BN ResNet: the planning trace must not write the running
    statistics (and finds the blocks although they update buffers); a checkpointed block's
    recomputation must not write them a second time."""
    torch.manual_seed(0)
    m, x = ConvStack(n=6, c=16), torch.randn(8, 16, 24, 24)
    params = list(m.parameters())
    start = {k: v.clone() for k, v in m.state_dict().items()}

    def step(module: nn.Module) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        m.load_state_dict(start)
        grads = _step(module, params, x)
        return grads, {k: v.clone() for k, v in m.state_dict().items()}

    want_grads, want_state = step(m)
    limit = int(0.75 * _peak(m, params, x))
    m.load_state_dict(start)
    budgeted = ft.remat(m, peak_bytes=limit)
    got_grads, got_state = step(budgeted)
    assert budgeted.plans()[0].checkpointed > 0
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for k in want_state:
        torch.testing.assert_close(got_state[k], want_state[k], rtol=0, atol=0)
    m.load_state_dict(start)
    assert _peak(budgeted, params, x) <= limit


@pytest.mark.parametrize("kw", [{}, {"use_reentrant": False}])
def test_torchs_call_form_is_refused_naming_checkpoint(kw: dict[str, Any]) -> None:
    """``ft.remat(fn, x)`` (``torch.utils.checkpoint``'s form; HF calls
    ``gradient_checkpointing_func`` so) raised a raw TypeError (issue 52)."""
    with pytest.raises(ft.InvalidArgumentError, match=r"ft\.checkpoint\(f, \*args"):
        ft.remat(torch.sin, torch.ones(2), **kw)  # type: ignore[call-overload]


def test_a_forward_set_on_a_block_instance_comes_back_after_a_call() -> None:
    """A block whose ``forward`` is set on the instance (``jit_blocks`` does it; so may a user)
    keeps it: the budget's checkpointing restores it rather than deleting it."""
    from functrans._jit.eager_budget import _checkpointing

    torch.manual_seed(0)
    m = Stack(n=2)
    own = m.blocks[0].forward
    m.blocks[0].forward = own  # an instance attribute now
    with _checkpointing(list(m.blocks)):
        assert m.blocks[0].forward is not own
    assert m.blocks[0].__dict__["forward"] is own
    assert "forward" not in m.blocks[1].__dict__
