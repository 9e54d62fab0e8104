"""torch's FLOP formulas (``torch.utils.flop_counter.flop_registry``), without importing triton.

``torch.utils.flop_counter`` imports triton when it is installed (``from triton.runtime.jit
import JITFunction``) only to accept triton kernels in later ``register_flop_formula`` calls.
functrans' cost model reads the formulas on every partition, and nothing outside the Triton
backend may import triton (its import costs about a second and initialises its drivers). So
the module is imported here with triton hidden, and its kernel check is then answered by
whatever triton the process has imported by the time a formula is registered: an object can be
a triton ``JITFunction`` only once ``triton.runtime.jit`` is imported.

>>> import torch
>>> from functrans._core.flop_formulas import flop_registry
>>> torch.ops.aten.mm in flop_registry
True
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = [
    "flop_registry",
    "register_flops",
]

_MODULE = "torch.utils.flop_counter"


class _JITFunctionMeta(type):
    def __instancecheck__(cls, obj: object) -> bool:
        jit = sys.modules.get("triton.runtime.jit")
        return jit is not None and isinstance(obj, jit.JITFunction)


class _JITFunction(metaclass=_JITFunctionMeta):
    """Stands for ``triton.runtime.jit.JITFunction`` in ``isinstance`` checks, importing
    nothing."""


def _import_without_triton() -> ModuleType:
    if _MODULE in sys.modules or "triton" in sys.modules:
        return importlib.import_module(_MODULE)
    log = logging.getLogger(_MODULE)  # its "triton not found" warning would be false here
    disabled, log.disabled = log.disabled, True
    sys.modules["triton"] = None  # type: ignore[assignment]  # makes `import triton` fail
    try:
        module = importlib.import_module(_MODULE)
    finally:
        if sys.modules.get("triton", 0) is None:
            del sys.modules["triton"]
        log.disabled = disabled
    module._JITFunction = _JITFunction  # type: ignore[attr-defined]  # torch's private name
    return module


flop_registry: dict[Any, Any] = _import_without_triton().flop_registry


def register_flops(packet: Any, formula: Callable[..., int]) -> None:
    """Count ``formula``'s FLOPs for calls of ``packet`` (torch's flop registry, which
    ``FlopCounterMode`` and :func:`functrans.extend.flops` read): how the module defining an
    op declares them."""
    flop_registry[packet] = formula
