"""Random straight-line programs as data: :class:`Program` (inputs, steps, outputs), the op
table (:data:`STEP_KINDS`), running them and printing them as Python source. The hypothesis
strategy that draws them is :func:`functrans.testing.programs`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ._batched import batched_step

__all__ = ["INPUT_BOUND", "RANDOM_OPS", "STEP_KINDS", "InputSpec", "Program", "Step"]

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


_Impl = Callable[[list[Any], tuple[int, ...], tuple[int, ...]], torch.Tensor]


class _Op(NamedTuple):
    """How one step kind runs and prints."""

    run: _Impl  # (operands, params, result shape) -> the result, in eager PyTorch
    source: str  # its Python source: a str.format template (fields: see _expr)


def _index(x: torch.Tensor, entries: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    """A constant int64 index tensor (for ``gather``/``index_select``) on ``x``'s device."""
    return torch.tensor(list(entries), dtype=torch.long, device=x.device).reshape(tuple(shape))


def _strided(x: torch.Tensor, d: int, start: int) -> torch.Tensor:
    return x[(slice(None),) * d + (slice(start, None, 2),)]


# op -> (run, source): see _Op
_TABLE: dict[str, tuple[_Impl, str]] = {
    "neg": (lambda o, p, s: -o[0], "-{x}"),
    "tanh": (lambda o, p, s: torch.tanh(o[0]), "torch.tanh({x})"),
    "sin": (lambda o, p, s: torch.sin(o[0]), "torch.sin({x})"),
    "cos": (lambda o, p, s: torch.cos(o[0]), "torch.cos({x})"),
    "atan": (lambda o, p, s: torch.atan(o[0]), "torch.atan({x})"),
    "erf": (lambda o, p, s: torch.erf(o[0]), "torch.erf({x})"),
    "exp_tanh": (lambda o, p, s: torch.exp(torch.tanh(o[0])), "torch.exp(torch.tanh({x}))"),
    "sigmoid": (lambda o, p, s: torch.sigmoid(o[0]), "torch.sigmoid({x})"),
    "square": (lambda o, p, s: o[0] * o[0], "{x} * {x}"),
    "cube": (lambda o, p, s: o[0].pow(3), "{x}.pow(3)"),
    "relu": (lambda o, p, s: torch.relu(o[0]), "torch.relu({x})"),
    "abs": (lambda o, p, s: torch.abs(o[0]), "torch.abs({x})"),
    "clamp": (lambda o, p, s: o[0].clamp(-1.0, 1.0), "{x}.clamp(-1.0, 1.0)"),
    "gelu": (lambda o, p, s: F.gelu(o[0]), "F.gelu({x})"),
    "silu": (lambda o, p, s: F.silu(o[0]), "F.silu({x})"),
    "log1p_square": (lambda o, p, s: torch.log1p(o[0] * o[0]), "torch.log1p({x} * {x})"),
    "sqrt_1p_square": (lambda o, p, s: torch.sqrt(1 + o[0] * o[0]), "torch.sqrt(1 + {x} * {x})"),
    # on a contiguous tensor: a traced graph draws a non-contiguous input's mask in another
    # element order than eager does, so the same seed would give different (valid) masks
    "dropout": (lambda o, p, s: F.dropout(o[0].contiguous(), 0.5),
                "F.dropout({x}.contiguous(), 0.5)"),
    "clone": (lambda o, p, s: o[0].clone(), "{x}.clone()"),
    "add": (lambda o, p, s: o[0] + o[1], "{x} + {y}"),
    "sub": (lambda o, p, s: o[0] - o[1], "{x} - {y}"),
    "mul": (lambda o, p, s: o[0] * o[1], "{x} * {y}"),
    "div": (lambda o, p, s: o[0] / (1 + o[1] * o[1]), "{x} / (1 + {y} * {y})"),
    "maximum": (lambda o, p, s: torch.maximum(o[0], o[1]), "torch.maximum({x}, {y})"),
    "minimum": (lambda o, p, s: torch.minimum(o[0], o[1]), "torch.minimum({x}, {y})"),
    "gt": (lambda o, p, s: o[0] > o[1], "{x} > {y}"),  # a bool value: not differentiable
    "where": (lambda o, p, s: torch.where(o[0] > o[1], o[0], o[2]),
              "torch.where({x} > {y}, {x}, {z})"),
    "masked_fill": (lambda o, p, s: o[0].masked_fill(o[1], 0.5), "{x}.masked_fill({y}, 0.5)"),
    "unsqueeze": (lambda o, p, s: o[0].unsqueeze(p[0]), "{x}.unsqueeze({p})"),
    "squeeze": (lambda o, p, s: o[0].squeeze(p[0]), "{x}.squeeze({p})"),
    "transpose": (lambda o, p, s: o[0].transpose(p[0], p[1]), "{x}.transpose({p})"),
    "permute": (lambda o, p, s: o[0].permute(p), "{x}.permute({p})"),
    "reshape": (lambda o, p, s: o[0].reshape(s), "{x}.reshape({s})"),
    "flatten": (lambda o, p, s: o[0].flatten(), "{x}.flatten()"),
    "expand": (lambda o, p, s: o[0].expand(s), "{x}.expand({s})"),
    "narrow": (lambda o, p, s: o[0].narrow(p[0], p[1], p[2]), "{x}.narrow({p})"),
    "select": (lambda o, p, s: o[0].select(p[0], p[1]), "{x}.select({p})"),
    "slice_step": (lambda o, p, s: _strided(o[0], p[0], p[1]), "{x}[{colons}{p1}::2]"),
    "flip": (lambda o, p, s: o[0].flip(p[0]), "{x}.flip({p0})"),
    "pad": (lambda o, p, s: F.pad(o[0], (p[0], p[1])), "F.pad({x}, ({p}))"),
    "sum": (lambda o, p, s: o[0].sum(p[0], keepdim=bool(p[1])), "{x}.sum({p0}, keepdim={keep})"),
    "mean": (lambda o, p, s: o[0].mean(p[0], keepdim=bool(p[1])), "{x}.mean({p0}, keepdim={keep})"),
    "amax": (lambda o, p, s: o[0].amax(p[0], keepdim=bool(p[1])), "{x}.amax({p0}, keepdim={keep})"),
    "var": (lambda o, p, s: o[0].var(p[0], keepdim=bool(p[1]), correction=0),
            "{x}.var({p0}, keepdim={keep}, correction=0)"),
    "logsumexp": (lambda o, p, s: torch.logsumexp(o[0], p[0], keepdim=bool(p[1])),
                  "torch.logsumexp({x}, {p0}, keepdim={keep})"),
    "argmax": (lambda o, p, s: o[0].argmax(p[0], keepdim=bool(p[1])),
               "{x}.argmax({p0}, keepdim={keep})"),  # an int64 value: not differentiable
    "sum_all": (lambda o, p, s: o[0].sum(), "{x}.sum()"),
    "cumsum": (lambda o, p, s: o[0].cumsum(p[0]), "{x}.cumsum({p0})"),
    "softmax": (lambda o, p, s: torch.softmax(o[0], p[0]), "torch.softmax({x}, {p})"),
    "log_softmax": (lambda o, p, s: torch.log_softmax(o[0], p[0]), "torch.log_softmax({x}, {p})"),
    "layer_norm": (lambda o, p, s: F.layer_norm(o[0], o[0].shape[-1:]),
                   "F.layer_norm({x}, {x}.shape[-1:])"),
    "gather": (lambda o, p, s: o[0].gather(p[0], _index(o[0], p[1:], s)),
               "{x}.gather({p0}, torch.tensor({idx}).reshape({s}))"),
    "index_select": (lambda o, p, s: o[0].index_select(p[0], _index(o[0], p[1:], (-1,))),
                     "{x}.index_select({p0}, torch.tensor({idx}))"),
    "cat": (lambda o, p, s: torch.cat([o[0], o[1]], p[0]), "torch.cat([{x}, {y}], {p})"),
    "stack": (lambda o, p, s: torch.stack([o[0], o[1]], p[0]), "torch.stack([{x}, {y}], {p})"),
    "mm": (lambda o, p, s: torch.mm(o[0], o[1].mT if p[0] else o[1]), "torch.mm({x}, {y}{t})"),
    "bmm": (lambda o, p, s: torch.bmm(o[0], o[1].mT if p[0] else o[1]), "torch.bmm({x}, {y}{t})"),
    "addmm": (lambda o, p, s: torch.addmm(o[2], o[0], o[1].mT if p[0] else o[1]),
              "torch.addmm({z}, {x}, {y}{t})"),
}  # fmt: skip
_OPS = {op: _Op(*row) for op, row in _TABLE.items()}
STEP_KINDS: tuple[str, ...] = tuple(_OPS)
"""Every ``Step.op``, simplest first: the order hypothesis shrinks towards."""


_BOOL_OPS = frozenset({"gt"})
_INT_OPS = frozenset({"argmax"})
RANDOM_OPS = frozenset({"dropout"})
"""Steps that draw from torch's global RNG (compare them under the same seed)."""


@dataclass(frozen=True, repr=False)
class Program:
    """A straight-line program: ``inputs``, then ``steps``, returning the values ``outputs``.

    Values are numbered inputs first, then one per step; ``repr`` is :meth:`source`. Calling a
    program runs only the steps its outputs depend on (as a traced graph does), so random steps
    draw the same numbers eagerly and in a graph run under the same seed.
    """

    inputs: tuple[InputSpec, ...]
    steps: tuple[Step, ...]
    outputs: tuple[int, ...]
    #: dynamic-batch mode: every value has a leading batch dimension (of this size in
    #: :meth:`example_inputs`) and each step runs per example (as ``torch.func.vmap`` would;
    #: see :mod:`functrans.testing._batched`); 0: no batch dimension
    batch: int = 0

    @property
    def dtype(self) -> torch.dtype:
        """The floating dtype of the inputs and of every floating value of the program."""
        return self.inputs[0].dtype

    def value_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Shapes of all values: the inputs, then each step's result."""
        return tuple(i.shape for i in self.inputs) + tuple(s.shape for s in self.steps)

    def value_dtypes(self) -> tuple[torch.dtype, ...]:
        """Dtypes of all values: :attr:`dtype`, ``torch.bool`` for comparisons (``gt``) and
        ``torch.int64`` for indices (``argmax``); only the floating values are differentiable."""
        return tuple(i.dtype for i in self.inputs) + tuple(
            torch.bool if s.op in _BOOL_OPS else torch.int64 if s.op in _INT_OPS else self.dtype
            for s in self.steps
        )

    def output_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Shapes of the tensors the program returns."""
        shapes = self.value_shapes()
        return tuple(shapes[i] for i in self.outputs)

    def live_steps(self) -> frozenset[int]:
        """Indices (into ``steps``) of the steps the outputs depend on."""
        n, todo, live = len(self.inputs), list(self.outputs), set()
        while todo:
            v = todo.pop()
            if v >= n and v - n not in live:
                live.add(v - n)
                todo.extend(a for a in self.steps[v - n].args if isinstance(a, int))
        return frozenset(live)

    @property
    def is_random(self) -> bool:
        """Whether a step the outputs depend on draws random numbers (e.g. ``dropout``)."""
        return any(self.steps[k].op in RANDOM_OPS for k in self.live_steps())

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(tensors) != len(self.inputs):
            raise TypeError(f"program takes {len(self.inputs)} inputs, got {len(tensors)}")
        return self._run(*tensors)

    def dynamic_dims(self) -> tuple[dict[int, str], ...]:
        """``dynamic=`` for a batched program: the leading dimension of every input, one
        symbol (``batch``)."""
        return tuple({0: "batch"} for _ in self.inputs) if self.batch else ()

    def _run(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values: list[Any] = list(tensors)
        live = self.live_steps()
        for k, step in enumerate(self.steps):
            if k not in live:
                values.append(None)
                continue
            operands = [values[a] if isinstance(a, int) else a for a in step.args]
            run = _OPS[step.op].run
            if self.batch:
                values.append(batched_step(step, operands, run))
            else:
                values.append(run(operands, step.params, step.shape))
        return tuple(values[i] for i in self.outputs)

    def example_inputs(self, seed: int = 0, batch: int | None = None) -> tuple[torch.Tensor, ...]:
        """Deterministic inputs for ``seed``, uniform in ``[-INPUT_BOUND, INPUT_BOUND)``
        (with a leading dimension of ``batch``, by default :attr:`batch`, in batch mode)."""
        gen = torch.Generator().manual_seed(seed)
        lead = (self.batch if batch is None else batch,) if self.batch else ()
        return tuple(
            (torch.rand((*lead, *i.shape), generator=gen, dtype=i.dtype) * 2 - 1) * INPUT_BOUND
            for i in self.inputs
        )

    def source(self) -> str:
        """Self-contained Python source of an equivalent function named ``program``."""
        names = [f"a{i}" for i in range(len(self.inputs))]
        lines = ["import torch", "import torch.nn.functional as F", "", ""]
        if self.batch:
            lines.append(f"@torch.func.vmap  # in batch mode (traced at batch {self.batch})")
        lines.append(f"def program({', '.join(names)}):")
        for name, spec in zip(names, self.inputs, strict=True):
            lines.append(f"    # {name}: {str(spec.dtype)[6:]}{list(spec.shape)}")
        live = self.live_steps()
        for k, step in enumerate(self.steps):
            names.append(f"v{len(names)}")
            dead = "" if k in live else "# unused: "
            lines.append(f"    {dead}{names[-1]} = {_expr(step, names)}  # {list(step.shape)}")
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
    return _OPS[step.op].source.format(
        x=ops[0], y=ops[1], z=ops[2], p=", ".join(map(str, p)), p0=p[0] if p else "",
        keep=bool(p[-1]) if p else "", s=step.shape, t=".mT" if p and p[0] else "",
        p1=p[1] if len(p) > 1 else "", colons=":, " * (p[0] if p else 0), idx=list(p[1:]),
    )  # fmt: skip
