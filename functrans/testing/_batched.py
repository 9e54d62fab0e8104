"""Dynamic-batch mode of random programs: every value gains a leading batch dimension.

A program's steps are written per example. In batch mode each step runs on values with a
leading batch dimension: its dimension parameters shift by one (negative ones already count
from the end), operands of different ranks are aligned after the batch dimension before they
broadcast, and ops with fixed-rank semantics get their batched form (``mm`` -> ``bmm``,
``sum()`` -> a sum per example). This is ``torch.func.vmap`` of the program written out by
hand: vmap itself reads its batch size as a Python int while tracing, which would specialise a
symbolic batch away.

>>> import torch
>>> from functrans.testing._program import Step
>>> step = Step("sum", (0,), (0, 0), (3,))  # per example: x.sum(0) of a [2, 3] value
>>> batched_step(step, [torch.ones(5, 2, 3)]).shape
torch.Size([5, 3])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["batched_step"]

_Rule = Callable[[list[Any], tuple[int, ...], tuple[int, ...]], torch.Tensor]


def _d(dim: int) -> int:
    """A per-example dimension as a dimension of the batched value."""
    return dim + 1 if dim >= 0 else dim


def _rank(x: Any) -> int:
    return x.dim() - 1 if isinstance(x, torch.Tensor) else -1


def _aligned(operands: list[Any]) -> list[Any]:
    """Tensor operands unsqueezed after the batch dimension to one per-example rank, so that
    they broadcast per example as the per-example values do."""
    rank = max(_rank(x) for x in operands)
    out = []
    for x in operands:
        if isinstance(x, torch.Tensor):
            for _ in range(rank - _rank(x)):
                x = x.unsqueeze(1)
        out.append(x)
    return out


def _index(x: torch.Tensor, entries: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    idx = torch.tensor(list(entries), dtype=torch.long, device=x.device).reshape(tuple(shape))
    return idx.expand(x.shape[0], *idx.shape)


def _matmul(x: torch.Tensor, y: torch.Tensor, t: int) -> torch.Tensor:
    return torch.matmul(x, y.mT if t else y)


def _addmm(bias: torch.Tensor, product: torch.Tensor) -> torch.Tensor:
    aligned: torch.Tensor = _aligned([bias, product])[0]
    return aligned + product


def _per_example_sum(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1).sum(1)


def _strided(x: torch.Tensor, d: int, start: int) -> torch.Tensor:
    return x[(slice(None),) * _d(d) + (slice(start, None, 2),)]


# ops whose per-example form does not run batched as it is (the others are elementwise, or
# work on trailing dimensions only: they broadcast once their operands are aligned)
_RULES: dict[str, _Rule] = {
    "unsqueeze": lambda o, p, s: o[0].unsqueeze(_d(p[0])),
    "squeeze": lambda o, p, s: o[0].squeeze(_d(p[0])),
    "transpose": lambda o, p, s: o[0].transpose(_d(p[0]), _d(p[1])),
    "permute": lambda o, p, s: o[0].permute(0, *[_d(d) for d in p]),
    "reshape": lambda o, p, s: o[0].reshape(o[0].shape[0], *s),
    "flatten": lambda o, p, s: o[0].flatten(1),
    "expand": lambda o, p, s: o[0].expand(o[0].shape[0], *s),
    "narrow": lambda o, p, s: o[0].narrow(_d(p[0]), p[1], p[2]),
    "select": lambda o, p, s: o[0].select(_d(p[0]), p[1]),
    "slice_step": lambda o, p, s: _strided(o[0], p[0], p[1]),
    "flip": lambda o, p, s: o[0].flip(_d(p[0])),
    "sum": lambda o, p, s: o[0].sum(_d(p[0]), keepdim=bool(p[1])),
    "mean": lambda o, p, s: o[0].mean(_d(p[0]), keepdim=bool(p[1])),
    "amax": lambda o, p, s: o[0].amax(_d(p[0]), keepdim=bool(p[1])),
    "var": lambda o, p, s: o[0].var(_d(p[0]), keepdim=bool(p[1]), correction=0),
    "logsumexp": lambda o, p, s: torch.logsumexp(o[0], _d(p[0]), keepdim=bool(p[1])),
    "argmax": lambda o, p, s: o[0].argmax(_d(p[0]), keepdim=bool(p[1])),
    "sum_all": lambda o, p, s: _per_example_sum(o[0]),
    "cumsum": lambda o, p, s: o[0].cumsum(_d(p[0])),
    "softmax": lambda o, p, s: torch.softmax(o[0], _d(p[0])),
    "log_softmax": lambda o, p, s: torch.log_softmax(o[0], _d(p[0])),
    "gather": lambda o, p, s: o[0].gather(_d(p[0]), _index(o[0], p[1:], s)),
    "index_select": lambda o, p, s: o[0].index_select(
        _d(p[0]), torch.tensor(list(p[1:]), dtype=torch.long, device=o[0].device)
    ),
    "cat": lambda o, p, s: torch.cat([o[0], o[1]], _d(p[0])),
    "stack": lambda o, p, s: torch.stack([o[0], o[1]], _d(p[0])),
    "mm": lambda o, p, s: _matmul(o[0], o[1], p[0]),
    "bmm": lambda o, p, s: _matmul(o[0], o[1], p[0]),
    "addmm": lambda o, p, s: _addmm(o[2], _matmul(o[0], o[1], p[0])),
    "layer_norm": lambda o, p, s: F.layer_norm(o[0], o[0].shape[-1:]),
    "pad": lambda o, p, s: F.pad(o[0], (p[0], p[1])),
}


def batched_step(step: Any, operands: list[Any], run: _Rule | None = None) -> torch.Tensor:
    """``step`` (a :class:`~functrans.testing._program.Step`) on operands with a leading batch
    dimension; ``run`` is its per-example implementation (used for elementwise ops)."""
    rule = _RULES.get(step.op)
    if rule is not None:
        return rule(operands, step.params, step.shape)
    assert run is not None, step.op
    return run(_aligned(operands), step.params, step.shape)
