"""functrans used the way an ML researcher uses it, compared with eager PyTorch under one seed.

A small GPT written in plain ``torch.nn`` (tied input/output embeddings, a frozen position
embedding, ``F.scaled_dot_product_attention`` with causal masking and attention dropout, dropout
in the residual paths, LayerNorm, a GELU MLP) is trained for a few steps with AdamW, gradient
accumulation over two micro-batches and gradient clipping, with ``model.eval()`` +
``torch.no_grad()`` evaluations (the first one before any training step), some steps under CPU
bf16 autocast, an EMA copy made with ``copy.deepcopy``, ``state_dict`` round trips and attribute
access through the wrapper. ``run(compile=False)`` is the eager reference; ``run(compile=True)``
wraps the same model in ``ft.jit``. Both seed the global generator identically, and every loss,
logits tensor, gradient norm and final (EMA) parameter is compared.

The float32 run of the 2-layer model is compared under both partitions; the runs that check one
behaviour each (bf16 autocast schedules, the EMA copy, remat policies on the blocks, train/eval
switches, a jitted closure) use a 1-layer model, as a first trace costs seconds per block.

Tolerances. functrans promises that random ops draw from the caller's generator in eager's order
and are never recomputed (README: "random ops under the same seed on both sides"; ``split``
never re-runs a random op), so dropout masks are the same on both sides, and the aten backend
runs the very ATen ops eager runs. In float32 the results are therefore expected to agree to the
last bits; ``F32`` allows only float32 reassociation noise (rtol 1e-5, atol 1e-6). At this
initialisation (std 0.02, near-uniform predictions) a different dropout mask, or a dropout that
should not be there, moves a loss by only ~1e-4 relative but the logits by 50-100%, so logits
are compared as well as losses.
Steps under bf16 autocast are held to the same tolerance: the graphs hold exactly the casts
eager's autocast makes.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import functrans as ft
from functrans import policies

# ---------------------------------------------------------------------------------------------
# the model: a plain-PyTorch GPT (nanoGPT style)


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 64
    seq: int = 16
    d_model: int = 32
    heads: int = 2
    layers: int = 2
    dropout: float = 0.1
    remat: str = "none"  # "none" or a key of REMAT_POLICIES: wrap every block in ft.remat


REMAT_POLICIES: dict[str, Callable[[], object]] = {
    "dots_saveable": lambda: policies.dots_saveable,
    "nothing_saveable": lambda: policies.nothing_saveable,
    "save_only_these_names": lambda: policies.save_only_these_names("attn_out", "mlp_hidden"),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)
        self.heads = c.heads
        self.dropout = c.dropout
        self.resid_dropout = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(c.d_model, 4 * c.d_model)
        self.gelu = nn.GELU()
        self.proj = nn.Linear(4 * c.d_model, c.d_model)
        self.dropout = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = ft.checkpoint_name(self.gelu(self.fc(x)), "mlp_hidden")
        return self.dropout(self.proj(h))


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.d_model)
        self.attn = CausalSelfAttention(c)
        self.ln_2 = nn.LayerNorm(c.d_model)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + ft.checkpoint_name(self.attn(self.ln_1(x)), "attn_out")
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.config = c
        self.wte = nn.Embedding(c.vocab, c.d_model)
        self.wpe = nn.Embedding(c.seq, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        blocks: list[nn.Module] = [Block(c) for _ in range(c.layers)]
        if c.remat != "none":
            blocks = [ft.remat(b, policy=REMAT_POLICIES[c.remat]()) for b in blocks]
        self.h = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(c.d_model)
        self.lm_head = nn.Linear(c.d_model, c.vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        self.apply(self._init_weights)
        self.wpe.weight.requires_grad_(False)  # a frozen embedding: never trained

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.seq :])
            idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        return idx


CFG = GPTConfig()
SMALL = GPTConfig(layers=1)  # for the checks of one behaviour: a cheaper first trace
BATCH, MICRO, STEPS, EVAL_EVERY = 4, 2, 8, 3
LR, WEIGHT_DECAY, CLIP, EMA_DECAY = 1e-2, 0.1, 1.0, 0.9


@functools.cache
def param_names(layers: int = CFG.layers) -> list[str]:
    """The plain model's names in its parameters() order: records are keyed by them, so that
    wrappers that rename (ft.jit's, ft.remat's) do not get in the way of comparing values."""
    return [n for n, _ in GPT(GPTConfig(layers=layers)).named_parameters()]


def new_model(c: GPTConfig = CFG, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(c)


def data() -> tuple[list[list[tuple[torch.Tensor, torch.Tensor]]], tuple[torch.Tensor, ...]]:
    """A fixed sequence of (input, target) micro-batches per step, and one held-out batch."""
    g = torch.Generator().manual_seed(1234)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.randint(0, CFG.vocab, (BATCH, CFG.seq + 1), generator=g)
        return t[:, :-1], t[:, 1:]

    train = [[batch() for _ in range(MICRO)] for _ in range(STEPS)]
    return train, batch()


TRAIN, HELD_OUT = data()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tensors this small gain nothing from intra-op threads, and on a busy 2-core machine the
    threads' spinning makes every step several times slower; eager and jit share the setting."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------
# the training loop


@dataclass
class Record:
    """Everything a run produced, keyed "train/<step>/<micro>", "eval/<step>", "ema/<step>"."""

    losses: dict[str, float] = field(default_factory=dict)
    logits: dict[str, torch.Tensor] = field(default_factory=dict)  # float32 copies
    dtypes: dict[str, tuple[torch.dtype, torch.dtype]] = field(default_factory=dict)
    grad_norms: dict[str, float] = field(default_factory=dict)  # clip_grad_norm_'s, per step
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # final
    ema: dict[str, torch.Tensor] = field(default_factory=dict)  # final EMA parameters
    frozen_grads: list[torch.Tensor | None] = field(default_factory=list)  # wpe.weight.grad
    tied: bool = False


def snapshot(module: nn.Module, layers: int = CFG.layers) -> dict[str, torch.Tensor]:
    names = param_names(layers)
    return {n: p.detach().clone() for n, p in zip(names, module.parameters(), strict=True)}


def evaluate(model: nn.Module, rec: Record, key: str) -> None:
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits, loss = model(*HELD_OUT)
    model.train(was_training)
    rec.losses[key], rec.logits[key] = loss.item(), logits.float()


@functools.cache
def run(
    compile: bool,
    partition: str | None = None,
    *,
    autocast_steps: tuple[int, ...] = (),
    ema: bool = False,
    remat: str = "none",
    layers: int = CFG.layers,
) -> Record:
    """Train the GPT for STEPS steps; evaluate before the first step and every EVAL_EVERY steps
    (nanoGPT's order: the initial loss in eval mode first, then training with dropout)."""
    net = new_model(GPTConfig(remat=remat, layers=layers))
    if compile:
        model = ft.jit(net) if partition is None else ft.jit(net, partition=partition)
    else:
        model = net
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.dim() >= 2]
    no_decay = [p for p in trainable if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0}],
        lr=LR,
        betas=(0.9, 0.95),
    )
    rec = Record()
    ema_model: nn.Module | None = None
    torch.manual_seed(42)  # dropout masks: the same generator state on both sides
    for step in range(STEPS):
        if step % EVAL_EVERY == 0:
            evaluate(model, rec, f"eval/{step}")
            if ema_model is not None:
                evaluate(ema_model, rec, f"ema/{step}")
        bf16 = step in autocast_steps
        for micro, (x, y) in enumerate(TRAIN[step]):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits, loss = model(x, y)
            key = f"train/{step}/{micro}"
            rec.losses[key], rec.logits[key] = loss.item(), logits.detach().float()
            rec.dtypes[key] = (logits.dtype, loss.dtype)
            (loss / MICRO).backward()  # backward outside autocast, as recommended
        rec.frozen_grads.append(net.wpe.weight.grad)
        rec.grad_norms[f"step/{step}"] = torch.nn.utils.clip_grad_norm_(trainable, CLIP).item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ema:
            if ema_model is None:
                ema_model = copy.deepcopy(model)
                ema_model.requires_grad_(False)
            else:
                with torch.no_grad():
                    for pe, p in zip(ema_model.parameters(), model.parameters(), strict=True):
                        pe.lerp_(p, 1.0 - EMA_DECAY)
    evaluate(model, rec, f"eval/{STEPS}")
    rec.params = snapshot(model, layers)
    rec.tied = net.lm_head.weight is net.wte.weight
    if ema_model is not None:
        evaluate(ema_model, rec, f"ema/{STEPS}")
        rec.ema = snapshot(ema_model, layers)
    return rec


# ---------------------------------------------------------------------------------------------
# comparisons

F32 = {"rtol": 1e-5, "atol": 1e-6}


def mismatches(
    got: dict[str, float], want: dict[str, float], rtol: float, atol: float
) -> list[str]:
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    return [
        f"{k}: jit {got[k]:.7g} eager {want[k]:.7g} (diff {got[k] - want[k]:.3g})"
        for k in want
        if not math.isclose(got[k], want[k], rel_tol=rtol, abs_tol=atol)
    ]


def tensor_mismatches(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float, atol: float
) -> list[str]:
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    return [
        f"{k}: max abs diff {(got[k] - want[k]).abs().max().item():.3g} "
        f"(max abs {want[k].abs().max().item():.3g})"
        for k in want
        if not torch.allclose(got[k], want[k], rtol=rtol, atol=atol)
    ]


def assert_records_close(got: Record, want: Record, rtol: float, atol: float) -> None:
    """Every loss, logits tensor, gradient norm and final (EMA) parameter."""
    assert got.dtypes == want.dtypes
    bad = mismatches(got.losses, want.losses, rtol, atol)
    bad += [f"logits {m}" for m in tensor_mismatches(got.logits, want.logits, rtol, atol)]
    bad += [f"grad norm {m}" for m in mismatches(got.grad_norms, want.grad_norms, rtol, atol)]
    bad += [f"param {m}" for m in tensor_mismatches(got.params, want.params, rtol, atol)]
    bad += [f"ema param {m}" for m in tensor_mismatches(got.ema, want.ema, rtol, atol)]
    assert not bad, f"{len(bad)} mismatches:\n" + "\n".join(bad)


def check_invariants(rec: Record, layers: int = CFG.layers) -> None:
    init = snapshot(new_model(GPTConfig(layers=layers)), layers)
    assert rec.tied, "lm_head.weight is no longer the token embedding"
    assert all(g is None for g in rec.frozen_grads), "the frozen embedding got a gradient"
    assert torch.equal(rec.params["wpe.weight"], init["wpe.weight"]), "frozen embedding moved"
    moved = [k for k in init if k != "wpe.weight" and torch.equal(rec.params[k], init[k])]
    assert not moved, f"parameters that never trained: {moved}"


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


# ---------------------------------------------------------------------------------------------
# training runs compared with eager


@pytest.mark.parametrize("partition", ["default", "min_cut"])
def test_gpt_trains_like_eager(partition: str) -> None:
    """float32; eval before the first step and every 3 steps, then back to training."""
    want, got = run(False), run(True, partition)
    check_invariants(want)
    check_invariants(got)
    assert_records_close(got, want, **F32)


@pytest.mark.parametrize(
    "autocast_steps",
    [(2, 3, 4), (0, 1, 5)],
    ids=["float32_first", "bf16_first"],
)
def test_gpt_with_some_bf16_autocast_steps_trains_like_eager(
    autocast_steps: tuple[int, ...],
) -> None:
    """Forward under ``torch.autocast("cpu", bfloat16)`` on some steps, float32 on others, in
    one run and in both orders; backward outside autocast."""
    layers = SMALL.layers
    want = run(False, autocast_steps=autocast_steps, layers=layers)
    got = run(True, autocast_steps=autocast_steps, layers=layers)
    check_invariants(got, layers)
    dtypes = {k: (got.dtypes[k], w) for k, w in want.dtypes.items() if got.dtypes[k] != w}
    assert not dtypes, f"(logits, loss) dtypes, (jit, eager): {dtypes}"
    # as tight as float32: the graphs hold the casts eager's autocast makes, in the forward
    # (traced under autocast, replayed without it) and in the backward (traced without it, as
    # eager runs loss.backward() outside autocast). Looser tolerances hid both differences:
    # SDPA's math path re-cast to bf16 on replay, and backward ops autocast while tracing.
    assert_records_close(got, want, **F32)


def test_ema_copy_of_a_jitted_model() -> None:
    """``ema = copy.deepcopy(jitted)`` after the first step, lerped each step, evaluated."""
    want = run(False, ema=True, layers=SMALL.layers)
    got = run(True, ema=True, layers=SMALL.layers)
    assert [k for k in want.losses if k.startswith("ema/")] == ["ema/3", "ema/6", "ema/8"]
    assert_records_close(got, want, **F32)
    # an EMA, not an alias of the model's parameters
    assert not torch.allclose(got.ema["wte.weight"], got.params["wte.weight"])
    check_invariants(got, SMALL.layers)


@pytest.mark.parametrize("remat", list(REMAT_POLICIES))
@pytest.mark.parametrize("compile", [False, True], ids=["eager_remat", "jit_remat"])
def test_remat_blocks_train_like_plain_eager(remat: str, compile: bool) -> None:
    """``ft.remat(block, policy=...)`` on the blocks: eagerly (torch's selective checkpoint)
    and under ``ft.jit`` (tags honored by the partitioner), against the plain eager model
    (one block: the policy's effect is per block, and a trace costs seconds per block)."""
    want, got = run(False, layers=SMALL.layers), run(compile, remat=remat, layers=SMALL.layers)
    assert_records_close(got, want, **F32)


# ---------------------------------------------------------------------------------------------
# train/eval mode and grad mode


EVAL_CONTEXTS: dict[str, Callable[[], contextlib.AbstractContextManager[object]]] = {
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
    "grad_enabled": contextlib.nullcontext,  # an eval loss computed without no_grad
}


@pytest.mark.parametrize(
    ("first", "context"),
    [
        ("eval", "no_grad"),
        ("train", "inference_mode"),
        ("train", "grad_enabled"),
        ("eval", "grad_enabled"),
    ],
)
def test_train_and_eval_mode_switches(first: str, context: str) -> None:
    """Alternate ``model.train()`` / ``model.eval()`` calls on the jitted and the eager model
    (same parameters): eval mode must never drop out, train mode always must."""
    net = new_model(SMALL)
    ref = copy.deepcopy(net)
    jitted = ft.jit(net)
    x, y = TRAIN[0][0]
    order = ["train", "eval", "train", "eval"] if first == "train" else ["eval", "train", "eval"]
    bad, eval_losses = [], set()
    for i, mode in enumerate(order):
        ctx = EVAL_CONTEXTS[context] if mode == "eval" else contextlib.nullcontext
        for m in (jitted, ref):
            m.train(mode == "train")
        with ctx():
            torch.manual_seed(i)
            got_logits, got = jitted(x, y)
            torch.manual_seed(i)
            want_logits, want = ref(x, y)
        if mode == "eval":
            eval_losses.add(want.item())
        if not torch.allclose(got_logits, want_logits, **F32):
            bad.append(
                f"call {i} ({mode} mode): loss jit {got.item():.7g} eager {want.item():.7g}, "
                f"logits relative difference {relative(got_logits, want_logits):.3g}"
            )
    assert len(eval_losses) == 1  # eval mode is deterministic
    assert not bad, "\n".join(bad)


def test_jitted_loss_function_closing_over_the_model() -> None:
    """The other common style: ``ft.jit`` of a loss function that closes over the model,
    trained with AdamW, with evaluations in between (under no_grad, and once without it)."""
    net = new_model(SMALL)
    ref = copy.deepcopy(net)
    loss_fn = ft.jit(lambda x, y: net(x, y)[1])
    opts = [
        torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=LR) for m in (net, ref)
    ]
    got, want = {}, {}
    for step in range(3):
        for m in (net, ref):
            m.train()
        x, y = TRAIN[step][0]
        torch.manual_seed(step)
        loss = loss_fn(x, y)
        loss.backward()
        got[f"train/{step}"] = loss.item()
        torch.manual_seed(step)
        loss = ref(x, y)[1]
        loss.backward()
        want[f"train/{step}"] = loss.item()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for m in (net, ref):
            m.eval()
        ctx = torch.no_grad if step < 2 else contextlib.nullcontext  # the last without no_grad
        with ctx():
            got[f"eval/{step}"] = loss_fn(*HELD_OUT).item()
            want[f"eval/{step}"] = ref(*HELD_OUT)[1].item()
    bad = mismatches(got, want, **F32)
    bad += tensor_mismatches(snapshot_small(net), snapshot_small(ref), **F32)
    assert not bad, "\n".join(bad)


def snapshot_small(m: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in m.named_parameters()}


# ---------------------------------------------------------------------------------------------
# state_dict, deepcopy, attribute access


def outputs(model: nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(*HELD_OUT)[0]


def test_state_dict_keys_match_the_plain_model() -> None:
    net = new_model()
    assert list(ft.jit(net).state_dict()) == list(net.state_dict())


def test_jitted_state_dict_loads_into_a_plain_model() -> None:
    net = new_model()
    jitted = ft.jit(net)
    buf = io.BytesIO()
    torch.save(jitted.state_dict(), buf)
    buf.seek(0)
    fresh = new_model(seed=1)
    fresh.load_state_dict(torch.load(buf))
    assert fresh.lm_head.weight is fresh.wte.weight
    torch.testing.assert_close(outputs(fresh), outputs(jitted), rtol=0, atol=0)


def test_plain_state_dict_loads_into_a_jitted_model() -> None:
    net = new_model()
    buf = io.BytesIO()
    torch.save(net.state_dict(), buf)
    buf.seek(0)
    jitted = ft.jit(new_model(seed=1))
    jitted.load_state_dict(torch.load(buf))
    torch.testing.assert_close(outputs(jitted), outputs(net), rtol=0, atol=0)


def test_deepcopy_of_a_jitted_model_is_independent() -> None:
    net = new_model(SMALL)
    jitted = ft.jit(net)
    x, y = TRAIN[0][0]
    jitted.eval()
    with torch.no_grad():
        jitted(x, y)  # a compiled entry is cached before the copy (EMA copies a trained one)
    clone = copy.deepcopy(jitted)
    for a, b in zip(clone.parameters(), jitted.parameters(), strict=True):
        assert a is not b and a.data_ptr() != b.data_ptr()
    with torch.no_grad():
        for p in clone.parameters():
            p.mul_(0.5)  # the copy's own parameters drive the copy, not the original's
    ref = copy.deepcopy(net)
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(0.5)
    torch.testing.assert_close(outputs(clone), outputs(ref), **F32)
    torch.testing.assert_close(outputs(jitted), outputs(net), rtol=0, atol=0)


@pytest.mark.parametrize("attribute", ["config", "num_params", "generate"])
def test_attribute_access_through_jit(attribute: str) -> None:
    net = new_model()
    jitted = ft.jit(net)
    if attribute == "config":
        assert jitted.config is net.config
    elif attribute == "num_params":
        assert (
            jitted.num_params() == net.num_params() == net.num_params(False) - CFG.seq * CFG.d_model
        )
    else:
        net.eval()
        prompt = HELD_OUT[0][:1, :4]
        torch.testing.assert_close(jitted.generate(prompt, 3), net.generate(prompt, 3))


def test_remat_module_state_dict_keys_match_the_plain_block() -> None:
    block = Block(CFG)
    assert list(ft.remat(block, policy=policies.dots_saveable).state_dict()) == list(
        block.state_dict()
    )


def test_autocast_attention_rounds_like_eager() -> None:
    """One training-mode attention forward (dropout on, so eager takes SDPA's math path) under
    bf16 autocast, jitted vs eager. The traced ops must be eager's ops: eager's autocast casts
    ``scaled_dot_product_attention``'s inputs to bf16 once, and the math path then upcasts and
    runs its matmuls in float32 (autocast is off inside an autocast op), so the bf16 outputs
    agree exactly, as the float32 ones do (the float32 runs above are bit for bit)."""
    attn = CausalSelfAttention(CFG).train()
    x = torch.randn(BATCH, CFG.seq, CFG.d_model, generator=torch.Generator().manual_seed(3))
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        torch.manual_seed(5)
        got = ft.jit(attn)(x)
        torch.manual_seed(5)
        want = attn(x)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)
