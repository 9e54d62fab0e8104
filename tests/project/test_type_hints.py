"""``typing.get_type_hints`` resolves on every public callable: CLI and config libraries
(typer, pydantic, jsonargparse, beartype) read annotations at run time (issue 52:
``get_type_hints(ft.jit)`` raised ``NameError: name 'EveryInput' is not defined``)."""

from __future__ import annotations

import inspect
import typing

import pytest

import functrans as ft
import functrans.extend as extend


def _public() -> list[tuple[str, object]]:
    found = []
    for module in (ft, extend):
        names = getattr(module, "__all__", None) or [
            n for n in dir(module) if not n.startswith("_")
        ]
        for name in names:
            obj = getattr(module, name)
            if inspect.isfunction(obj) or inspect.isclass(obj):
                found.append((f"{module.__name__}.{name}", obj))
    return found


@pytest.mark.parametrize(("name", "obj"), _public(), ids=[n for n, _ in _public()])
def test_annotations_resolve(name: str, obj: object) -> None:
    typing.get_type_hints(obj)
    if inspect.isclass(obj) and "__init__" in vars(obj):
        typing.get_type_hints(vars(obj)["__init__"])
