"""How functrans meets ``torch.compile`` and ``torch.export``.

- Dynamo does not trace functrans' own machinery (caches, guards, dispatch modes, context
  variables): a jitted function, a jitted module and an eager remat region called inside
  ``torch.compile`` run as written, as one graph break, through :func:`outside_dynamo`. The
  compiled code around them is Dynamo's; what runs inside is functrans' (the jitted entry, the
  remat policy), and autograd links the two.
- ``torch.export`` has no place for a remat policy (the exported program holds ATen ops, not
  save/recompute decisions), so a remat region under export is refused by name
  (:func:`refuse_export`) instead of exporting its body without the policy.
- A ``torch.compile``-d function that functrans traces (``jit``, ``grad``, any transform, or a
  function that calls one) is traced as written: functrans compiles the whole function itself
  (:func:`inline_compiled`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._compile import _disable_dynamo

from .errors import UnsupportedOpError

__all__ = ["compiling", "inline_compiled", "outside_dynamo", "refuse_export"]


def compiling() -> bool:
    """True while Dynamo traces the caller (``torch.compile``, strict ``torch.export``) or a
    non-strict export runs it. One flag read: this is on every call's path."""
    return torch.compiler.is_compiling()


def _call(call: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    return call(*args, **kwargs)


# torch's lazy form of torch._dynamo.disable: Dynamo meets a skipped function here, breaks the
# graph, and runs the call with its frame hook off for everything the call reaches
_outside = _disable_dynamo(_call)


def outside_dynamo(call: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """``call(*args, **kwargs)``, run as written by a graph break where Dynamo traces it.

    >>> import torch
    >>> from functrans._core.dynamo_skip import outside_dynamo
    >>> f = torch.compile(lambda x: outside_dynamo(torch.sin, (x,), {}) * 2, backend="eager")
    >>> f(torch.zeros(2))
    tensor([0., 0.])
    """
    return _outside(call, args, kwargs)


def refuse_export(transform: str, name: str) -> None:
    """Raise where ``torch.export`` runs a ``transform`` region (``remat``) of ``name``: the
    exported program cannot hold its policy.

    >>> from functrans._core.dynamo_skip import refuse_export
    >>> refuse_export("remat", "block")  # not exporting: nothing happens
    """
    if not torch.compiler.is_exporting():
        return
    why = (
        f"{transform}({name}) under torch.export: an ExportedProgram holds ATen ops, not "
        "functrans' save/recompute policy, so exporting the region would drop the policy "
        f"silently. Export the model without {transform} (export the inner module, e.g. "
        "`blk.module` for `ft.remat(blk)`) and apply remat after loading, or compile "
        "instead with torch.compile or ft.jit, which keep the policy."
    )
    if torch.compiler.is_dynamo_compiling():
        # strict export: Dynamo traces this code. A raise or a graph break would be reported
        # under Dynamo's own headline ("Observed exception", "User-inserted graph break...
        # Remove the call"), this text buried in its debug context; a failed torch._assert of
        # a constant is raised at once as an AssertionError whose message is this text
        torch._assert(False, why)  # type: ignore[no-untyped-call]  # torch._assert is unannotated
    raise UnsupportedOpError(why)


@contextlib.contextmanager
def inline_compiled() -> Iterator[None]:
    """While functrans traces: a ``torch.compile``-d function is traced as the function it
    wraps (torch refuses by default, ``error_on_nested_fx_trace``). Without Dynamo imported no
    compiled function exists, and nothing is imported here.

    >>> import torch
    >>> from functrans._core.dynamo_skip import inline_compiled
    >>> with inline_compiled():
    ...     pass
    """
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        yield
        return
    with dynamo.config.patch(error_on_nested_fx_trace=False):
        yield
