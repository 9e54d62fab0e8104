"""An error raised inside a compiled step keeps its type and torch's message, and gains a note
with the op that raised it and the user's line that op was traced from: in a plain function,
in a block compiled once and called per layer, in the backward, under either executor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import functrans as ft


class Picked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return self.lin(x).index_select(0, i)  # the failing line


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Picked() for _ in range(3))

    def forward(self, x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x, i)
        return x.sum()


def _notes(e: BaseException) -> str:
    return "\n".join(getattr(e, "__notes__", []))


@pytest.fixture(params=["native", "python"])
def executor(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("FUNCTRANS_NATIVE", "1" if request.param == "native" else "0")
    return str(request.param)


def test_an_error_in_a_compiled_block_names_its_op_and_line(executor: str) -> None:
    torch.manual_seed(0)
    step = ft.jit(Stack())
    x = torch.randn(4, 3)
    step(x, torch.tensor([0, 1, 2, 3])).backward()
    with pytest.raises(IndexError, match="index out of range") as info:
        step(x, torch.tensor([0, 1, 2, 7]))
    notes = _notes(info.value)
    assert "raised by aten.index_select.default" in notes
    assert "in the compiled forward" in notes
    assert "test_failures.py" in notes and "# the failing line" in notes


def test_an_error_in_an_inference_entry_names_its_op_and_line(executor: str) -> None:
    def pick(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return x.index_select(0, i).sum()  # picked rows

    f = ft.jit(pick)
    x = torch.randn(4, 3)
    f(x, torch.tensor([0, 1]))
    with pytest.raises(IndexError) as info:
        f(x, torch.tensor([0, 9]))
    notes = _notes(info.value)
    assert "raised by aten.index_select.default" in notes and "# picked rows" in notes


def test_explain_follows_the_executors_node_names() -> None:
    # the native executor names the node in its message, the Python one in a note; a name the
    # graph does not hold adds nothing, and an error is explained once
    from functrans._jit.failures import explain

    g = ft.trace(lambda x: x.exp().sum())(torch.ones(3))
    (exp,) = [n for n in g.fx_graph.nodes if n.target is torch.ops.aten.exp.default]
    native = RuntimeError(f"boom (functrans: while running node {exp.name})")
    explain(native, g.graph_module, "backward")
    assert _notes(native).startswith(f"functrans: raised by aten.exp.default (node {exp.name})")
    assert "in the compiled backward, traced from" in _notes(native)
    explain(native, g.graph_module, "backward")
    assert len(native.__notes__) == 1
    python = RuntimeError("boom")
    python.add_note(f"functrans: while running node {exp.name}")
    explain(python, g.graph_module, "forward")
    assert "raised by aten.exp.default" in _notes(python)
    unknown = RuntimeError("boom (functrans: while running node nowhere)")
    explain(unknown, g.graph_module, "forward")
    assert not hasattr(unknown, "__notes__")
