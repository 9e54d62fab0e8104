"""The boxed calling convention: a compiled graph takes its inputs as one list and empties it.

A callable that takes ``*args`` cannot free an argument before it returns: the caller's
argument tuple holds every one of them. A backward graph's inputs are the values forward
saved, and eager autograd frees each of those as soon as the node that reads it has run; a
backward holding all of them until it returns keeps the forward's activations alive while its
gradients pile up, and its peak rises above eager's. So the compiled backward takes one list,
moves the values out of it, empties it, and drops each value after its last use (AOTAutograd's
convention, which Inductor's compiled graphs follow too).

A backend returns a :class:`BoxedCallable` (anything with ``call_boxed(args)``; :class:`Boxed`
wraps a function) to take part; a plain callable still works, run through :func:`boxed`, which
empties the list before calling it (its arguments then live until it returns).

The same holds inside a graph. An op that runs a compiled graph of its own (an outlined
region, :mod:`functrans._jit.outline`) gets its inputs through the dispatcher, whose argument
stack holds each of them until the op returns. An op registered in :data:`HANDOVER_OPS` may
instead be run by calling its boxed function (:func:`handover_call`) with a list that holds
the only references to the inputs whose last use it is: they die inside the call, after
their last reader there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, final, runtime_checkable

import torch.fx as fx  # at run time too: typing.get_type_hints(handover_call) resolves it

__all__ = [
    "HANDOVER_OPS",
    "RUNNING_NODE",
    "Boxed",
    "BoxedCallable",
    "Picked",
    "boxed",
    "handover_call",
    "register_handover",
]


@runtime_checkable
class BoxedCallable(Protocol):
    """A compiled graph that takes its flat inputs as one list, which it empties: it frees
    each input after its last use.

    >>> import torch, functrans as ft
    >>> from functrans import codegen
    >>> from functrans.extend import BoxedCallable
    >>> g = ft.trace(lambda x: x * 2)(torch.ones(2))
    >>> run = codegen.get_backend("aten").compile(g, [torch.ones(2)])
    >>> isinstance(run, BoxedCallable)
    True
    >>> args = [torch.ones(2)]
    >>> run.call_boxed(args), args
    ([tensor([2., 2.])], [])
    """

    def call_boxed(self, args: list[Any]) -> list[Any]: ...


@final
class Boxed:
    """A function of one list of inputs (which it empties) as a :class:`BoxedCallable`; called
    with ``*args`` it runs on a fresh list of them.

    >>> from functrans.extend import Boxed
    >>> def run(args):
    ...     a, b = args
    ...     args.clear()  # the caller's list no longer holds a and b
    ...     return [a + b]
    >>> add = Boxed(run)
    >>> inputs = [1, 2]
    >>> add.call_boxed(inputs), inputs, add(3, 4)
    ([3], [], [7])
    """

    __slots__ = ("run",)

    def __init__(self, run: Callable[[list[Any]], list[Any]]) -> None:
        self.run = run

    def call_boxed(self, args: list[Any]) -> list[Any]:
        return self.run(args)

    def __call__(self, *args: Any) -> list[Any]:
        return self.run(list(args))

    def __repr__(self) -> str:
        return f"Boxed({self.run!r})"


def boxed(compiled: Callable[..., Any]) -> Callable[[list[Any]], list[Any]]:
    """``compiled`` (what a backend's ``compile`` returned) as a function of one list of
    inputs that it empties: its own ``call_boxed`` where it has one, else a call with the
    list's values after emptying it.

    >>> from functrans.extend import boxed
    >>> run = boxed(lambda a, b: [a * b])
    >>> args = [3, 4]
    >>> run(args), args
    ([12], [])
    """
    if isinstance(compiled, BoxedCallable):
        return compiled.call_boxed

    def call(args: list[Any]) -> list[Any]:
        values = tuple(args)
        args.clear()
        return list(compiled(*values))

    return call


@final
@dataclass(frozen=True)
class Picked:
    """A boxed function whose results are those of ``run`` at the positions ``picks``: what
    an executor may run as ``run`` itself, keeping those results (a compiled region's forward
    returns its residuals, of which the op hands out some).

    >>> from functrans.extend import Picked
    >>> def run(args):
    ...     a, b = args
    ...     args.clear()
    ...     return [a + b, a, b]
    >>> Picked(run, (0, 2))([1, 2])
    [3, 2]
    """

    run: Callable[[list[Any]], list[Any]]
    picks: tuple[int, ...]

    def __call__(self, args: list[Any]) -> list[Any]:
        results = self.run(args)
        return [results[i] for i in self.picks]


#: How an executor names the node whose op raised (the Python executor in a note, the native
#: one in the message: ``codegen/csrc/executor.cpp`` writes these words too); ``jit`` reads
#: the name back to add the op and the user's line (:mod:`functrans._jit.failures`)
RUNNING_NODE = "functrans: while running node"

#: Ops of schema ``(int id, Tensor[] inputs) -> Tensor[]`` that an executor may run by calling
#: a boxed function directly, handing it the ``inputs`` list: by op, what gives the function
#: for one call node. Filled by the modules that define the ops.
HANDOVER_OPS: dict[Any, Callable[[fx.Node], Callable[[list[Any]], list[Any]]]] = {}


def register_handover(op: Any, rule: Callable[[fx.Node], Callable[[list[Any]], list[Any]]]) -> None:
    """Declare ``op`` one of :data:`HANDOVER_OPS`, ``rule`` giving the function for a call node
    (how the module defining the op declares it)."""
    HANDOVER_OPS[op] = rule


def handover_call(node: fx.Node) -> Callable[[list[Any]], list[Any]] | None:
    """The boxed function that runs ``node``'s op on its ``inputs`` list (its second
    argument), taking the list over, or None where the op is not in :data:`HANDOVER_OPS`.

    An executor that calls it must hold no reference of its own to an input whose last use
    this node is: the list it passes is then the only one, and the function frees each input
    after its last use inside it (the step's memory report counts on that).

    >>> import torch, functrans as ft
    >>> from functrans.extend import handover_call
    >>> g = ft.trace(lambda x: x.sin())(torch.ones(2))
    >>> handover_call(next(g.ops())) is None  # aten.sin: run through the dispatcher
    True
    """
    if node.op != "call_function":
        return None
    make = HANDOVER_OPS.get(node.target)
    return None if make is None else make(node)
