"""functrans._core.marks: typed records under one attribute."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from functrans._core.marks import MARK, leave, marked, read


@dataclass(frozen=True)
class _A:
    value: int


@dataclass(frozen=True)
class _B:
    pass


def test_one_record_per_type_and_the_latest_wins() -> None:
    def f() -> None:
        pass

    leave(f, _A(1))
    leave(f, _B())
    leave(f, _A(2))
    assert read(f, _A) == _A(2)
    assert marked(f, _B)
    assert len(getattr(f, MARK)) == 2


def test_a_wrapper_carries_the_records_but_writes_its_own() -> None:
    def f() -> None:
        pass

    leave(f, _A(1))

    @functools.wraps(f)
    def g() -> None:
        pass

    assert read(g, _A) == _A(1)
    leave(g, _A(2))
    assert read(f, _A) == _A(1) and read(g, _A) == _A(2)


def test_objects_without_attributes_are_left_alone() -> None:
    leave(len, _B())  # a builtin takes no attributes
    assert not marked(len, _B)
    e = KeyError("k")
    leave(e, _B())
    assert marked(e, _B)


def test_an_object_answering_every_getattr_has_no_records() -> None:
    class Anything:
        def __getattr__(self, name: str) -> object:
            return 1

    assert read(Anything(), _A) is None


def f() -> None:
    pass


def test_exceptions_carry_what_functrans_learned_about_them_as_records() -> None:
    import pytest

    from functrans._core.stack import Named, transform_frame
    from functrans._core.torch_func_errors import UserError, user_calls

    def boom() -> None:
        raise ValueError("mine")

    with pytest.raises(ValueError) as raised:
        user_calls(boom)()
    assert marked(raised.value, UserError) and not marked(raised.value, Named)

    def nested() -> None:
        with transform_frame("jit", len), transform_frame("grad", f):
            raise ValueError("inner")

    with pytest.raises(ValueError) as named:
        nested()
    assert marked(named.value, Named) and "inside jit(grad(f))" in str(named.value)


def test_the_seeding_wrappers_are_marked_and_wrapped_once() -> None:
    import torch

    from functrans._trace.rng import Seeder, tracing_guard

    with tracing_guard(lambda: "f"):
        pass
    seeder = read(torch.manual_seed, Seeder)
    assert seeder is not None and not marked(seeder.original, Seeder)
    with tracing_guard(lambda: "f"):
        pass
    assert read(torch.manual_seed, Seeder) is seeder


def test_jit_blocks_marks_a_block_and_compiles_it_once() -> None:
    import torch

    from functrans.distributed import JitBlock, jit_blocks

    block = torch.nn.Linear(2, 2)
    model = torch.nn.Sequential(block)
    jit_blocks(model, blocks=[block])
    compiled = block.forward
    assert marked(block, JitBlock)
    jit_blocks(model, blocks=[block])
    assert block.forward is compiled
    x = torch.ones(1, 2)
    torch.testing.assert_close(model(x), torch.nn.functional.linear(x, block.weight, block.bias))


def test_the_library_writes_no_other_functrans_attribute() -> None:
    """Records travel under :data:`MARK` only; the names allowed here are keyword-argument
    keys (``_jit/captures.py``, and the keyword a diverted function's code finds its call
    through in ``_trace/regions/functions.py``), not attributes."""
    import pathlib
    import re

    import functrans

    root = pathlib.Path(functrans.__file__).parent
    found = {
        f"{path.relative_to(root)}:{name}"
        for path in root.rglob("*.py")
        for name in re.findall(r"__functrans_\w+__", path.read_text())
    }
    assert found <= {
        "_jit/captures.py:__functrans_captured__",
        "_trace/regions/functions.py:__functrans_block_call__",
    }
