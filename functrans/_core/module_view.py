"""A module that is another module with another forward (``jit(module)``, ``remat(module)``).

The view shares the module's own tables of parameters, buffers and submodules, so
``state_dict`` keys, ``named_parameters``, ``load_state_dict``, ``to``, ``train``/``eval`` and
optimizers see exactly the module's (no ``module.`` prefix, nested or not); other attributes
(``config``, ``generate``) are the module's; copies (``copy.deepcopy``, ``pickle``,
``torch.save``) rebuild what the view derived from the module (compiled entries, closures)
instead of copying it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["ModuleView", "is_fsdp_module"]

_SHARED = ("_parameters", "_buffers", "_modules")


class ModuleView(torch.nn.Module):
    """Base class: subclasses set their derived state in :meth:`_derive` (called on
    construction and after every copy) and list its attribute names in ``_derived``.

    >>> class Doubled(ModuleView):
    ...     def forward(self, x):
    ...         return 2 * self.module(x)
    >>> net = torch.nn.Linear(2, 2)
    >>> view = Doubled(net)
    >>> list(view.state_dict()) == list(net.state_dict()), view.in_features
    (True, 2)
    """

    _derived: tuple[str, ...] = ()

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.__dict__["module"] = module  # not a submodule: the tables below are the module's
        for table in _SHARED:
            self.__dict__[table] = module.__dict__[table]
        self.__dict__["_version"] = getattr(module, "_version", 1)

    def _derive(self) -> None:
        """Build what the view derives from ``self.module`` (nothing by default)."""

    @property
    def _wrapped(self) -> torch.nn.Module:
        module: torch.nn.Module = self.__dict__["module"]
        return module

    # the module's flag is the flag: model.eval() and view.eval() are one switch
    @property
    def training(self) -> bool:
        module = self.__dict__.get("module")
        return True if module is None else bool(module.training)

    @training.setter
    def training(self, mode: bool) -> None:
        module = self.__dict__.get("module")
        if module is not None:
            module.training = mode

    def named_modules(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.nn.Module]]:
        found: Iterator[tuple[str, torch.nn.Module]] = self._wrapped.named_modules(*args, **kwargs)
        return found

    def apply(self, fn: Any) -> ModuleView:
        self._wrapped.apply(fn)
        return self

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("module")
            if module is None or name == "module":
                raise
            return getattr(module, name)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in self._derived:
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._derive()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._wrapped!r})"


def is_fsdp_module(module: Any) -> bool:
    """Whether ``module`` was given to FSDP2's ``fully_shard``.

    >>> is_fsdp_module(torch.nn.Linear(2, 2))
    False
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return False
    return isinstance(module, FSDPModule)
