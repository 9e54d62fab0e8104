"""Cheaper forms of ops re-run in backward: what a recomputation needs, not what the forward did.

A forward op can compute more than a recomputation of it needs. Training batch norm is the
case that matters: the functional op ``_native_batch_norm_legit_functional(x, w, b,
running_mean, running_var, ...)`` returns the normalized output, the batch mean and inverse
std, and the updated running statistics. Re-run in backward (``min_cut`` recomputes a batch
norm's output rather than save it), only the first three are read, and they do not depend on
the running statistics; re-run as written, the recomputation reads the buffers, so the forward
hands them to the backward (copied, as the step's write-back overwrites them) and the backward
clones them again. ``_native_batch_norm_legit.no_stats(x, w, b, ...)`` computes the same three
results with the same kernel, bit for bit, from ``x``, ``w`` and ``b`` alone.

A :class:`RecomputeForm` says so for one op: :func:`~functrans._cut.split.split` re-emits a
recomputed node in its form where every result the backward reads is one the form gives, and
walks the form's inputs, not the node's, to find what the backward needs. The forward graph
is untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from functrans._core.ops import is_getitem

__all__ = ["RecomputeForm", "recompute_form", "recompute_form_of", "register_recompute_form"]

aten = torch.ops.aten


@dataclass(frozen=True)
class RecomputeForm:
    """How ``op`` is re-run in backward: ``target(*args(node))``, whose results are the first
    ``results`` of the op's, where ``applies(node)``.

    >>> import torch
    >>> form = recompute_form_of(torch.ops.aten._native_batch_norm_legit_functional.default)
    >>> form.target, form.results
    (<OpOverload(op='aten._native_batch_norm_legit', overload='no_stats')>, 3)
    """

    target: Any  # an OpOverload
    args: Callable[[fx.Node], tuple[Any, ...]]  # the form's arguments, from the node's
    results: int  # the form returns the op's results [0, results)
    applies: Callable[[fx.Node], bool] = lambda node: True

    def inputs(self, node: fx.Node) -> list[fx.Node]:
        """The nodes the form of ``node`` reads."""
        found: list[fx.Node] = []
        fx.node.map_arg(self.args(node), lambda a: found.append(a) or a)  # type: ignore[func-returns-value]
        return found


def _batch_norm_args(node: fx.Node) -> tuple[Any, ...]:
    x, w, b, _mean, _var, training, momentum, eps = node.args
    return (x, w, b, training, momentum, eps)


def _training(node: fx.Node) -> bool:
    return len(node.args) == 8 and node.args[5] is True and not node.kwargs


_FORMS: dict[Any, RecomputeForm] = {
    # training batch norm: the batch statistics and output, without the running ones
    aten._native_batch_norm_legit_functional.default: RecomputeForm(
        aten._native_batch_norm_legit.no_stats, _batch_norm_args, 3, _training
    ),
}


def register_recompute_form(op: Any, form: RecomputeForm) -> None:
    """Re-run ``op`` in backward as ``form`` (a backend's or a library's cheaper form; it must
    compute the op's first ``form.results`` results bit for bit).

    >>> import torch
    >>> f = RecomputeForm(torch.ops.aten.sin.default, lambda n: n.args, 1)
    >>> register_recompute_form(torch.ops.aten.sin.default, f)
    >>> recompute_form_of(torch.ops.aten.sin.default) is f
    True
    >>> _ = _FORMS.pop(torch.ops.aten.sin.default)
    """
    _FORMS[op] = form


def recompute_form_of(op: Any) -> RecomputeForm | None:
    """The form registered for ``op`` (None: it is re-run as written)."""
    return _FORMS.get(op)


def recompute_form(node: fx.Node, needed: Container[fx.Node]) -> RecomputeForm | None:
    """The form ``node`` is re-run in, where one applies and every result of it in ``needed``
    is one the form gives (None: re-run as written)."""
    form = _FORMS.get(node.target) if node.op == "call_function" else None
    if form is None or not form.applies(node):
        return None
    for user in node.users:
        if not is_getitem(user):
            return None
        index = user.args[1]
        if user in needed and not (isinstance(index, int) and 0 <= index < form.results):
            return None
    return form
