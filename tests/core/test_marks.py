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
