"""Where autograd stops inside a traced forward: ops run under ``torch.no_grad()`` and
``detach``es, noted on their nodes while a joint graph's function runs.

A joint graph's backward is autograd's own, so it already holds no gradient through such an
op. But a functional ATen graph does not say where autograd stopped: ``detach`` is dropped as
a rename, and an op under ``no_grad`` is an op like any other. A transform that
differentiates the forward graph again (a step compiled in stages, whose stages are each
traced to a joint graph of their own) would differentiate through them: a second derivative
that eager never computes. So while the function runs, an op that autograd does not record
though one of its inputs requires grad gets :data:`~functrans._core.graph.NO_GRAD` on its
node (:func:`note`, from the trace's dispatch mode: an op run with grad mode off;
:func:`note_detach`, from its torch-function mode: a ``detach`` the code calls, not the ones
autograd makes of the outputs it saves, through which a second derivative does flow); the
pass that drops a noted ``detach`` marks the edges it cut
(:data:`~functrans._core.graph.STOPPED`). A custom ``torch.autograd.Function`` runs its
``forward`` with grad mode off too, and then gives its outputs its own ``backward``: values
that require grad once the function has run lose their note, with what they were computed
from inside that ``forward`` (a re-differentiation goes through its ops, as before).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot
from torch.utils._pytree import tree_leaves

from functrans._core.dtypes import differentiable
from functrans._core.graph import NO_GRAD

from .session import Slot

__all__ = ["NOTED", "note", "note_detach", "recording"]

#: the nodes of the ops run with grad mode off while the traced function's forward runs, with
#: their values (None: it is not running, nothing is noted; the backward autograd runs after
#: it, without grad mode too, is not noted)
NOTED: Slot[list[tuple[fx.Node, torch.Tensor]] | None] = Slot("autograd stops noted", None)


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """The ops run in the body are noted (:func:`note`); then the values autograd
    differentiates after all (a custom Function's outputs) lose their notes."""
    noted: list[tuple[fx.Node, torch.Tensor]] = []
    with NOTED.bound(noted):
        yield
    _differentiated_after_all(noted)


def note(func: Any, args: Any, kwargs: Any, out: Any) -> None:
    """After ``func`` (an ATen op) ran on ``args``/``kwargs`` inside a trace and returned
    ``out``: where grad mode is off though an input requires grad, and the traced function's
    forward is running, its output nodes are noted :data:`~functrans._core.graph.NO_GRAD`."""
    if torch.is_grad_enabled():
        return
    noted = NOTED.get()
    if noted is not None:
        noted.extend(_mark(args, kwargs, out))


def note_detach(args: Any, out: Any) -> None:
    """After the traced code called ``detach`` on ``args`` and got ``out``: its node noted
    (for good: a detached value made a leaf with ``requires_grad_()`` is a new leaf)."""
    if NOTED.get() is not None:
        _mark(args, None, out)


def _mark(args: Any, kwargs: Any, out: Any) -> list[tuple[fx.Node, torch.Tensor]]:
    """Note ``out``'s nodes where an input requires grad; ``out``'s nodes, with their values
    (noted or not: a custom Function's forward is a chain of them, its first op's inputs
    requiring grad, the later ones' not)."""
    mode = get_proxy_mode()
    if mode is None:
        return []
    inputs = tree_leaves((args, kwargs))
    stops = any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)
    found = []
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor) and differentiable(t):
            slot = get_proxy_slot(t, mode.tracer, None)
            if slot is not None:
                if stops:
                    slot.proxy.node.meta[NO_GRAD] = True
                found.append((slot.proxy.node, t))
    return found


def _differentiated_after_all(noted: list[tuple[fx.Node, torch.Tensor]]) -> None:
    """Unnote the values that require grad now (a custom Function's outputs) and the values
    computed with grad mode off that they were computed from."""
    run_off = {node for node, _ in noted}
    todo = [node for node, t in noted if t.requires_grad]
    seen: set[fx.Node] = set()
    while todo:
        node = todo.pop()
        if node in seen or node not in run_off:
            continue
        seen.add(node)
        node.meta.pop(NO_GRAD, None)
        todo.extend(node.all_input_nodes)
