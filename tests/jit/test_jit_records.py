"""The jit layer hands data over in typed records and outcomes, not attributes and exceptions.

A function whose arguments jit re-packed carries an :class:`ArgPaths` record (errors in its
trace name the user's arguments); an internal control-flow exception passes nested transforms
as itself; a jitted function writes no ``__functrans_*__`` attribute of its own on what it
traces.
"""

from __future__ import annotations

import pytest
import torch

import functrans as ft
from functrans._core.marks import leave, read
from functrans._core.pytree import flatten
from functrans._core.stack import ControlFlow, transform_frame
from functrans._trace.trace import ArgPaths, arg_names


def test_arg_names_answer_the_record_a_transform_left() -> None:
    def packed(a, b):
        return a + b

    _, flat = flatten(((torch.ones(1), torch.ones(1)), {}))
    assert arg_names(packed, flat) == ["a", "b"]
    leave(packed, ArgPaths(("params['w']", "x")))
    assert arg_names(packed, flat) == ["params['w']", "x"]
    assert arg_names(packed, flat, every_leaf=True) == ["a", "b"]  # every leaf: its own names


def test_a_control_flow_exception_passes_nested_frames_as_itself() -> None:
    class Stop(ControlFlow):
        pass

    with pytest.raises(Stop) as caught, transform_frame("jit", len), transform_frame("grad", print):
        raise Stop
    assert type(caught.value) is Stop  # not renamed to a TransformError


def test_captured_tensors_are_lifted_without_an_error_escaping() -> None:
    holder = {"w": torch.randn(3)}
    f = ft.jit(lambda x: (x * holder["w"]).sum())
    x = torch.randn(3)
    torch.testing.assert_close(f(x), (x * holder["w"]).sum())
    holder["w"] = torch.randn(3)
    torch.testing.assert_close(f(x), (x * holder["w"]).sum())
    assert f.cache_info().entries == 1


def test_the_traced_function_carries_records_only_under_the_one_mark() -> None:
    seen = []

    def f(x):
        return x.sin()

    g = ft.jit(f)
    real = g._compiler.compile

    def spy(*a):
        slot = real(*a)
        seen.append(slot)
        return slot

    g._compiler.compile = spy  # type: ignore[method-assign]
    g(torch.randn(2))
    assert seen and not [k for k in vars(f) if k.startswith("__functrans")]
    assert read(f, ArgPaths) is None  # the record is left on jit's flat function, not on f


def test_a_trace_that_baked_in_captured_tensors_stops_before_partitioning(monkeypatch) -> None:
    # the first trace of a function that reads tensors from outside its arguments only finds
    # them: jit lifts them to inputs and traces again, so the first graph is neither
    # partitioned nor compiled (a Stopped outcome, not an entry thrown away)
    import functrans._jit.build as build

    partitioned = []
    real = build.partition
    monkeypatch.setattr(build, "partition", lambda *a, **k: partitioned.append(1) or real(*a, **k))
    held = {"scale": torch.full((3,), 2.0)}
    w = torch.randn(3, requires_grad=True)
    f = ft.jit(lambda x: (x * w * held["scale"]).sum())
    x = torch.randn(3, requires_grad=True)
    f(x).backward()
    assert len(partitioned) == 1
    assert w.grad is not None and x.grad is not None
    torch.testing.assert_close(w.grad, x.detach() * 2.0)
    torch.testing.assert_close(x.grad, w.detach() * 2.0)


def test_a_captured_tensor_that_stays_a_constant_is_reported_at_the_users_line() -> None:
    held = (torch.ones(3),)  # inside a tuple: jit cannot swap it, so it stays a constant
    f = ft.jit(lambda x: x * held[0])
    with pytest.warns(UserWarning, match=r"held\[0\] \(inside a tuple") as caught:
        f(torch.ones(3))  # the line the warning names
    assert caught[0].filename == __file__
