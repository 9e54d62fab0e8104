"""Random straight-line programs as data: :class:`Program` (inputs, steps, outputs), the op
table (:data:`STEP_KINDS`), running them and printing them as Python source. The hypothesis
strategy that draws them is :func:`functrans.testing.programs`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["INPUT_BOUND", "STEP_KINDS", "InputSpec", "Program", "Step"]

INPUT_BOUND = 2.0  # example inputs are uniform in [-INPUT_BOUND, INPUT_BOUND)


@dataclass(frozen=True)
class InputSpec:
    """Shape and dtype of one program input."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Step:
    """One op: ``op`` (a :data:`STEP_KINDS` name) applied to ``args``.

    ``args`` are value indices (``int``) or Python ``float`` constants; ``params`` are the op's
    integer parameters (dims, narrow start/length, keepdim and transpose flags); ``shape`` is
    the shape of the result.
    """

    op: str
    args: tuple[int | float, ...]
    params: tuple[int, ...]
    shape: tuple[int, ...]


# op -> (eager implementation taking (operands, params, result shape), source template)
_Impl = Callable[[list[Any], tuple[int, ...], tuple[int, ...]], torch.Tensor]
_OPS: dict[str, tuple[_Impl, str]] = {
    "neg": (lambda o, p, s: -o[0], "-{x}"),
    "tanh": (lambda o, p, s: torch.tanh(o[0]), "torch.tanh({x})"),
    "sin": (lambda o, p, s: torch.sin(o[0]), "torch.sin({x})"),
    "cos": (lambda o, p, s: torch.cos(o[0]), "torch.cos({x})"),
    "exp_tanh": (lambda o, p, s: torch.exp(torch.tanh(o[0])), "torch.exp(torch.tanh({x}))"),
    "sigmoid": (lambda o, p, s: torch.sigmoid(o[0]), "torch.sigmoid({x})"),
    "square": (lambda o, p, s: o[0] * o[0], "{x} * {x}"),
    "relu": (lambda o, p, s: torch.relu(o[0]), "torch.relu({x})"),
    "abs": (lambda o, p, s: torch.abs(o[0]), "torch.abs({x})"),
    "gelu": (lambda o, p, s: F.gelu(o[0]), "F.gelu({x})"),
    "silu": (lambda o, p, s: F.silu(o[0]), "F.silu({x})"),
    "log1p_square": (lambda o, p, s: torch.log1p(o[0] * o[0]), "torch.log1p({x} * {x})"),
    "add": (lambda o, p, s: o[0] + o[1], "{x} + {y}"),
    "sub": (lambda o, p, s: o[0] - o[1], "{x} - {y}"),
    "mul": (lambda o, p, s: o[0] * o[1], "{x} * {y}"),
    "div": (lambda o, p, s: o[0] / (1 + o[1] * o[1]), "{x} / (1 + {y} * {y})"),
    "maximum": (lambda o, p, s: torch.maximum(o[0], o[1]), "torch.maximum({x}, {y})"),
    "minimum": (lambda o, p, s: torch.minimum(o[0], o[1]), "torch.minimum({x}, {y})"),
    "where": (lambda o, p, s: torch.where(o[0] > o[1], o[0], o[2]),
              "torch.where({x} > {y}, {x}, {z})"),
    "unsqueeze": (lambda o, p, s: o[0].unsqueeze(p[0]), "{x}.unsqueeze({p})"),
    "squeeze": (lambda o, p, s: o[0].squeeze(p[0]), "{x}.squeeze({p})"),
    "transpose": (lambda o, p, s: o[0].transpose(p[0], p[1]), "{x}.transpose({p})"),
    "permute": (lambda o, p, s: o[0].permute(p), "{x}.permute({p})"),
    "reshape": (lambda o, p, s: o[0].reshape(s), "{x}.reshape({s})"),
    "flatten": (lambda o, p, s: o[0].flatten(), "{x}.flatten()"),
    "expand": (lambda o, p, s: o[0].expand(s), "{x}.expand({s})"),
    "narrow": (lambda o, p, s: o[0].narrow(p[0], p[1], p[2]), "{x}.narrow({p})"),
    "sum": (lambda o, p, s: o[0].sum(p[0], keepdim=bool(p[1])), "{x}.sum({p0}, keepdim={keep})"),
    "mean": (lambda o, p, s: o[0].mean(p[0], keepdim=bool(p[1])), "{x}.mean({p0}, keepdim={keep})"),
    "amax": (lambda o, p, s: o[0].amax(p[0], keepdim=bool(p[1])), "{x}.amax({p0}, keepdim={keep})"),
    "sum_all": (lambda o, p, s: o[0].sum(), "{x}.sum()"),
    "softmax": (lambda o, p, s: torch.softmax(o[0], p[0]), "torch.softmax({x}, {p})"),
    "log_softmax": (lambda o, p, s: torch.log_softmax(o[0], p[0]), "torch.log_softmax({x}, {p})"),
    "layer_norm": (lambda o, p, s: F.layer_norm(o[0], o[0].shape[-1:]),
                   "F.layer_norm({x}, {x}.shape[-1:])"),
    "cat": (lambda o, p, s: torch.cat([o[0], o[1]], p[0]), "torch.cat([{x}, {y}], {p})"),
    "mm": (lambda o, p, s: torch.mm(o[0], o[1].mT if p[0] else o[1]), "torch.mm({x}, {y}{t})"),
    "bmm": (lambda o, p, s: torch.bmm(o[0], o[1].mT if p[0] else o[1]), "torch.bmm({x}, {y}{t})"),
}  # fmt: skip
STEP_KINDS: tuple[str, ...] = tuple(_OPS)
"""Every ``Step.op``, simplest first: the order hypothesis shrinks towards."""


@dataclass(frozen=True, repr=False)
class Program:
    """A straight-line program: ``inputs``, then ``steps``, returning the values ``outputs``.

    Values are numbered inputs first, then one per step; ``repr`` is :meth:`source`.
    """

    inputs: tuple[InputSpec, ...]
    steps: tuple[Step, ...]
    outputs: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype shared by every value of the program."""
        return self.inputs[0].dtype

    def value_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Shapes of all values: the inputs, then each step's result."""
        return tuple(i.shape for i in self.inputs) + tuple(s.shape for s in self.steps)

    def output_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Shapes of the tensors the program returns."""
        shapes = self.value_shapes()
        return tuple(shapes[i] for i in self.outputs)

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(tensors) != len(self.inputs):
            raise TypeError(f"program takes {len(self.inputs)} inputs, got {len(tensors)}")
        values = list(tensors)
        for step in self.steps:
            operands = [values[a] if isinstance(a, int) else a for a in step.args]
            values.append(_OPS[step.op][0](operands, step.params, step.shape))
        return tuple(values[i] for i in self.outputs)

    def example_inputs(self, seed: int = 0) -> tuple[torch.Tensor, ...]:
        """Deterministic inputs for ``seed``, uniform in ``[-INPUT_BOUND, INPUT_BOUND)``."""
        gen = torch.Generator().manual_seed(seed)
        return tuple(
            (torch.rand(i.shape, generator=gen, dtype=i.dtype) * 2 - 1) * INPUT_BOUND
            for i in self.inputs
        )

    def source(self) -> str:
        """Self-contained Python source of an equivalent function named ``program``."""
        names = [f"a{i}" for i in range(len(self.inputs))]
        lines = ["import torch", "import torch.nn.functional as F", "", ""]
        lines.append(f"def program({', '.join(names)}):")
        for name, spec in zip(names, self.inputs, strict=True):
            lines.append(f"    # {name}: {str(spec.dtype)[6:]}{list(spec.shape)}")
        for step in self.steps:
            names.append(f"v{len(names)}")
            lines.append(f"    {names[-1]} = {_expr(step, names)}  # {list(step.shape)}")
        outs = ", ".join(names[i] for i in self.outputs)
        lines.append(f"    return ({outs}{',' if len(self.outputs) == 1 else ''})")
        return "\n".join(lines) + "\n"

    def __repr__(self) -> str:
        return self.source()


def _expr(step: Step, names: Sequence[str]) -> str:
    """Source expression of ``step``; ``names`` maps value indices to variable names."""
    ops = [names[a] if isinstance(a, int) else f"({a!r})" if a < 0 else repr(a) for a in step.args]
    ops += [""] * (3 - len(ops))
    p = step.params
    return _OPS[step.op][1].format(
        x=ops[0], y=ops[1], z=ops[2], p=", ".join(map(str, p)), p0=p[0] if p else "",
        keep=bool(p[-1]) if p else "", s=step.shape, t=".mT" if p and p[0] else "",
    )  # fmt: skip
