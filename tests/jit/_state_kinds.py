"""State of many kinds that a jitted function reads besides its arguments, for the properties in
``test_reads_properties.py``: each kind makes a *piece*, a reader (``x -> tensor``) that reads
some state, a change to state it reads and a change to state beside it that it does not read.
The module's globals are that state for the kinds that read globals of another module.

Every piece is made fresh for an example (its own objects), and every change returns the undo
that puts the module's globals back.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# -- globals of a module other than the function's (read through it, or by its helpers)

SCALE = 2.0
UNUSED = 1.0
CFG = {"mult": 1.5, "other": 0.0}
TABLE = [1.0, 2.0]


def scale(x: torch.Tensor) -> torch.Tensor:
    return x * SCALE


def act(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x)


def apply_act(x: torch.Tensor) -> torch.Tensor:
    return act(x) + x


Undo = Callable[[], None]


@dataclass
class Piece:
    """A reader of some state and two changes: to what it reads, and to what it does not."""

    read: Callable[[torch.Tensor], torch.Tensor]
    change: Callable[[], Undo]
    change_unread: Callable[[], Undo] | None


def _set(obj: Any, name: str, value: Any) -> Undo:
    old = getattr(obj, name)
    setattr(obj, name, value)
    return lambda: setattr(obj, name, old)


def _item(d: dict[str, Any], key: str, value: Any) -> Undo:
    old = d[key]
    d[key] = value
    return lambda: d.__setitem__(key, old)


def _nothing() -> None:
    return None


def closure_float() -> Piece:
    k = 1.25
    unread = 3.0

    def read(x: torch.Tensor) -> torch.Tensor:
        return x * k

    def change() -> Undo:
        read.__closure__[0].cell_contents = -0.5  # type: ignore[index]
        return _nothing

    def beside() -> Undo:
        nonlocal unread
        unread = 4.0
        return _nothing

    return Piece(read, change, beside)


def closure_dict() -> Piece:
    cfg = {"mult": 2.0, "other": 1}
    return Piece(
        lambda x: x * cfg["mult"],
        lambda: _item(cfg, "mult", 3.0),
        lambda: _item(cfg, "other", 5),
    )


def closure_nested() -> Piece:
    cfg = {"opt": {"lr": 0.5, "wd": 0.1}, "layers": [{"p": 2.0}, {"p": 3.0}]}
    return Piece(
        lambda x: x * cfg["opt"]["lr"] + cfg["layers"][1]["p"],
        lambda: _item(cfg["layers"][1], "p", -1.0),
        lambda: _item(cfg["opt"], "wd", 0.3),
    )


def module_global() -> Piece:
    return Piece(
        lambda x: scale(x),
        lambda: _set(_this, "SCALE", 0.25),
        lambda: _set(_this, "UNUSED", 7.0),
    )


def module_global_dict() -> Piece:
    return Piece(
        lambda x: x * _this.CFG["mult"],
        lambda: _item(_this.CFG, "mult", -2.0),
        lambda: _item(_this.CFG, "other", 9.0),
    )


def module_global_list() -> Piece:
    return Piece(
        lambda x: x * sum(_this.TABLE),
        lambda: _set(_this, "TABLE", [1.0, 5.0]),
        None,
    )


def patched_helper() -> Piece:
    return Piece(lambda x: apply_act(x), lambda: _set(_this, "act", torch.cos), None)


def patched_torch_function() -> Piece:
    def change() -> Undo:
        return _set(torch.nn.functional, "softsign", lambda t: torch.tanh(t) * 2)

    return Piece(lambda x: torch.nn.functional.softsign(x), change, None)


def argparse_namespace() -> Piece:
    ns = argparse.Namespace(k=3.0, j=1.0)
    return Piece(lambda x: x * ns.k, lambda: _set(ns, "k", 12.0), lambda: _set(ns, "j", 2.0))


def simple_namespace() -> Piece:
    ns = types.SimpleNamespace(scale=1.5, other=0.0)
    return Piece(lambda x: x * ns.scale, lambda: _set(ns, "scale", 4.0), None)


@dataclass
class Sub:
    x: float = 0.75
    y: float = 0.0


@dataclass
class Conf:
    sub: Sub = dataclasses.field(default_factory=Sub)
    flag: bool = False
    name: str = "a"


def nested_config() -> Piece:
    conf = Conf()
    return Piece(
        lambda x: (x * conf.sub.x) if not conf.flag else (x * conf.sub.x).exp(),
        lambda: _set(conf, "flag", True),
        lambda: _set(conf.sub, "y", 5.0),
    )


class WithClassAttr:
    K = 2.0

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return x * type(self).K


def class_attribute() -> Piece:
    # a fresh class per piece: a change stays with it
    cls = type("WithK", (WithClassAttr,), {"K": 2.0})
    obj = cls()
    return Piece(lambda x: obj.apply(x), lambda: _set(cls, "K", 7.0), None)


class Scaler(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.act = torch.nn.Tanh()
        self.scale = 0.5
        self.other = 1.0
        self.dims = [2, 2]
        self.cfg = types.SimpleNamespace(mult=2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.act(self.lin(x)) * self.scale * self.cfg.mult).reshape(self.dims).flatten()


def module_attribute() -> Piece:
    m = Scaler()
    return Piece(lambda x: m(x), lambda: _set(m, "scale", 3.0), lambda: _set(m, "other", 2.0))


def module_list_attribute() -> Piece:
    m = Scaler()

    def change() -> Undo:
        m.dims[:] = [4, 1]
        return _nothing

    return Piece(lambda x: m(x), change, lambda: _set(m, "other", 4.0))


def module_config() -> Piece:
    m = Scaler()
    return Piece(lambda x: m(x), lambda: _set(m.cfg, "mult", -1.0), lambda: _set(m, "other", 3.0))


def patched_forward() -> Piece:
    m = Scaler()

    def change() -> Undo:
        m.act.forward = torch.sigmoid
        return _nothing

    return Piece(lambda x: m(x), change, None)


KINDS: dict[str, Callable[[], Piece]] = {
    f.__name__: f
    for f in (
        closure_float,
        closure_dict,
        closure_nested,
        module_global,
        module_global_dict,
        module_global_list,
        patched_helper,
        patched_torch_function,
        argparse_namespace,
        simple_namespace,
        nested_config,
        class_attribute,
        module_attribute,
        module_list_attribute,
        module_config,
        patched_forward,
    )
}

_this = __import__(__name__)
