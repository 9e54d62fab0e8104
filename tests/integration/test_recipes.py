"""torchtitan and torchtune, as their users train: their models built from configs (no
download), their activation-checkpoint wrappers, a few SGD steps under one seed; ``ft.jit``
and functrans' checkpoint and policies against eager, loss for loss.

Both packages are installed by the project's set-up (the Makefile, ``recipes`` extra;
torchtune with the torchao it needs in a folder of its own, as peft refuses that torchao);
where one cannot import, its tests skip naming why.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import functrans as ft


def _importable(name: str) -> str | None:
    """None where ``name`` imports, else why not."""
    try:
        __import__(name)
    except Exception as e:  # an ImportError, or a package failing with this torch
        return f"{name} does not import with torch {torch.__version__}: {e!r}"[:300]
    return None


_TITAN = _importable("torchtitan.models.llama3")


def _train(
    model: torch.nn.Module, run: Callable[[torch.Tensor], Any], steps: int = 3
) -> list[float]:
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1], ids[:, 1:]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        logits = run(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _titan() -> torch.nn.Module:
    from torchtitan.models.llama3 import Transformer, llama3_args

    args = copy.deepcopy(llama3_args["debugmodel"])  # torchtitan's debug Llama, 6 layers
    args.vocab_size = 128
    torch.manual_seed(0)
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    return model


@pytest.mark.skipif(_TITAN is not None, reason=str(_TITAN))
@pytest.mark.parametrize("ac", ["none", "full", "op", "2"])
def test_torchtitan_debug_llama_trains_under_jit_as_eager(ac: str) -> None:
    """torchtitan's debug Llama (its layers an ``nn.ModuleDict``), with each of its
    activation-checkpointing modes applied as its trainer does: ``ft.jit`` gives eager's
    losses, compiled once, its layers one region."""
    from torchtitan.config.job_config import ActivationCheckpoint
    from torchtitan.distributed.activation_checkpoint import apply_ac

    model = _titan()
    if ac != "none":
        mode = "full" if ac == "full" else "selective"
        apply_ac(model, ActivationCheckpoint(mode=mode, selective_ac_option=ac))
    eager = copy.deepcopy(model)
    want = _train(eager, eager)
    jitted = ft.jit(model)
    got = _train(model, jitted)
    assert got == pytest.approx(want, rel=1e-5)
    info = jitted.cache_info()
    assert (info.misses, info.hits) == (1, 2)
    assert info.regions_reused >= 4


@pytest.mark.skipif(_TITAN is not None, reason=str(_TITAN))
def test_torchtitan_checkpoint_wrapper_with_a_functrans_policy() -> None:
    """torchtitan's wrapper (``ptd_checkpoint_wrapper``) with ``ft.checkpoint`` and a
    functrans policy: eager training equals training without checkpointing, and so does
    ``ft.jit`` of the wrapped model."""
    from torchtitan.distributed.activation_checkpoint import ptd_checkpoint_wrapper

    model = _titan()
    plain = copy.deepcopy(model)
    want = _train(plain, plain)
    for name, block in list(model.layers.named_children()):
        wrapped = ptd_checkpoint_wrapper(
            block, checkpoint_fn=ft.checkpoint, policy=ft.policies.dots_saveable
        )
        model.layers.register_module(name, wrapped)
    eager = copy.deepcopy(model)
    assert _train(eager, eager) == pytest.approx(want, rel=1e-5)
    assert _train(model, ft.jit(model)) == pytest.approx(want, rel=1e-5)


#: where the Makefile installs torchtune and the torchao it needs (peft refuses to import
#: beside that torchao, so only the torchtune test's subprocess puts it on its path)
_TUNE_DIR = Path(sys.prefix) / "torchtune"

_TUNE_SCRIPT = """
import copy, functools, json, sys
import torch
import functrans as ft
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torchtune.models.llama3_2 import llama3_2
from torchtune.modules import TransformerSelfAttentionLayer
from torchtune.training import set_activation_checkpointing
from tests.integration.test_recipes import _train

def build():
    torch.manual_seed(0)
    return llama3_2(vocab_size=128, num_layers=3, num_heads=4, num_kv_heads=2,
                    embed_dim=64, max_seq_len=64, intermediate_dim=128)

plain = build()
want = _train(plain, plain)
model = build()
wrapper = functools.partial(
    checkpoint_wrapper, checkpoint_fn=ft.checkpoint, policy=ft.policies.dots_saveable
)
set_activation_checkpointing(model, {TransformerSelfAttentionLayer}, checkpoint_wrapper_fn=wrapper)
wrapped = type(model.layers[0]).__name__
eager = copy.deepcopy(model)
checkpointed = _train(eager, eager)
jitted = ft.jit(model)
compiled = _train(model, jitted)
info = jitted.cache_info()
print("RESULT " + json.dumps({"want": want, "eager": checkpointed, "jit": compiled,
      "wrapped": wrapped, "misses": info.misses, "reused": info.regions_reused}))
"""


def test_torchtune_checkpoint_wrapper_with_ft_checkpoint() -> None:
    """torchtune's ``set_activation_checkpointing`` with ``ft.checkpoint`` as the wrapper's
    checkpoint function and a functrans policy, on its Llama 3.2 builder: eager and
    ``ft.jit`` equal eager without checkpointing; the layers share one region. Run in a
    subprocess with torchtune's folder on its path."""
    if not (_TUNE_DIR / "torchtune").is_dir():
        pytest.skip(f"torchtune is not installed in {_TUNE_DIR} (make installs it there)")
    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(_TUNE_DIR), str(root)]),
        "FUNCTRANS_CACHE": "0",
    }
    done = subprocess.run(
        [sys.executable, "-c", _TUNE_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=root,
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    got = json.loads(lines[-1].removeprefix("RESULT "))
    assert got["wrapped"] == "CheckpointWrapper"
    assert got["eager"] == pytest.approx(got["want"], rel=1e-5)
    assert got["jit"] == pytest.approx(got["want"], rel=1e-5)
    assert (got["misses"], got["reused"]) == (1, 2)  # layers 2 and 3 reuse layer 1
