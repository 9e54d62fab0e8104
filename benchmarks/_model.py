"""What every zoo model is: :class:`Model`, and the size switch its builders share.

Both :mod:`benchmarks.zoo` (hand-written models) and :mod:`benchmarks._hf_zoo` (Hugging Face
models) build on this module, so neither imports the other's internals (zoo re-exports the HF
models; they import only this).

>>> pick("small", small=(1, 8), bench=(2, 32))
(1, 8)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Builder", "LossFn", "Model", "Params", "Wrap", "pick"]

Params = dict[str, Any]
LossFn = Callable[[Params, Any], torch.Tensor]
#: how a stack calls each block: ``wrap(block, block_params, x) -> x``
Wrap = Callable[..., torch.Tensor]
Builder = Callable[..., tuple[Params, Any]]


@dataclass(frozen=True)
class Model:
    """One zoo entry: ``make(size, dtype, seed) -> (params, x)`` and ``fn(params, x) -> loss``."""

    name: str
    fn: LossFn
    make: Builder
    supports_float64: bool = True  # False where the model computes in float32 internally
    module: torch.nn.Module | None = None  # HF models: fn calls it with params swapped in
    #: stacks of blocks: ``blockwise(wrap)`` is ``fn`` with each block called as
    #: ``wrap(block, block_params, x)`` (``wrap=torch.utils.checkpoint.checkpoint`` checkpoints
    #: every block, as users do by hand)
    blockwise: Callable[[Wrap], LossFn] | None = None


def pick(size: str, small: Any, bench: Any) -> Any:
    """``small`` or ``bench`` by ``size`` (``"small"``: fast tests, ``"bench"``: benchmarks)."""
    if size not in ("small", "bench"):
        raise ValueError(f"size must be 'small' or 'bench', got {size!r}")
    return small if size == "small" else bench
