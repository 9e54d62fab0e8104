"""The tensors a jitted function captures (closures, globals, module attributes), lifted to inputs.

A trace that reads a tensor from outside its arguments bakes it in as a constant. jit finds such
constants after each trace (:func:`~functrans._trace.capture.captured_constants`), finds a path
to each from the function (:func:`~functrans._trace.capture.reach`) and *lifts* it: from then on
the tensor at that path is read on every call, travels with the arguments under the keyword
:data:`CAPTURED` (so the key and guards cover its metadata), and the trace swaps it in where the
path leads (:func:`~functrans._trace.capture.swapped`), so it is a graph input and a replaced
tensor is seen. Lifting new paths changes the call's key: :meth:`Captures.lift` reports it with a
:class:`Lifted` result and the caller looks the call up again. A captured tensor with no
writable path stays a constant, with a warning (an error where it requires grad: it would get no
gradient).

>>> import torch, functrans as ft
>>> holder = {"w": torch.ones(2)}
>>> f = ft.jit(lambda x: x * holder["w"])
>>> f(torch.ones(2)).tolist()
[1.0, 1.0]
>>> holder["w"] = torch.full((2,), 3.0)
>>> f(torch.ones(2)).tolist()
[3.0, 3.0]
"""

from __future__ import annotations

import functools
import json
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from functrans._core.context import user_stacklevel
from functrans._core.errors import TraceError
from functrans._core.pytree import plain
from functrans._trace.capture import Path, Reach, Reader, captured_constants, reach, swapped

__all__ = ["CAPTURED", "Captures", "Lifted"]

#: The keyword under which captured tensors travel with the arguments (the flat argument tree
#: then names them ``__functrans_captured__[i]``: see :meth:`Captures.name`).
CAPTURED = "__functrans_captured__"
_PREFIX = f"{CAPTURED}["


@dataclass(frozen=True)
class Lifted:
    """A compile's result where the trace baked in captured tensors that can be lifted: the
    new paths, now read on every call; the call must be keyed again with them as inputs."""

    paths: tuple[Path, ...]


class Captures:
    """The captured tensors one jitted function lifted: their paths and a reader of them."""

    def __init__(self, f: Callable[..., Any], owner: str, warned: set[str]) -> None:
        """``warned``: the jitted function's set of warnings given once."""
        self._f, self._owner, self._warned = f, owner, warned
        self.paths: tuple[Path, ...] = ()
        self.reader = Reader(())

    def forget(self) -> None:
        """A captured tensor moved: forget every path (the next trace finds them again)."""
        self.paths, self.reader = (), Reader(())

    def name(self, arg_name: str) -> str:
        """``arg_name`` (an :func:`~functrans._trace.trace.arg_names` entry) as the user reads
        it: a captured tensor by its path (``holder['w'] (captured)``)."""
        if not arg_name.startswith(_PREFIX):
            return arg_name
        i = int(arg_name[len(_PREFIX) :].split("]", 1)[0])
        return f"{self.paths[i].name} (captured)"

    def call(self, *args: Any, **kwargs: Any) -> Any:
        """The user's function, with captured tensors swapped for the traced ones."""
        captured = kwargs.pop(CAPTURED, None)
        if captured is None:
            return self._f(*args, **kwargs)
        with swapped(self.paths, self._f, captured):
            return self._f(*args, **kwargs)

    def swapping(self, f: Callable[..., Any]) -> Callable[..., Any]:
        """``f`` with this function's captured tensors swapped for the traced ones (passed
        under :data:`CAPTURED`), as :meth:`call` does for the whole function."""

        def target(*a: Any, **kw: Any) -> Any:
            captured = kw.pop(CAPTURED, None)
            if captured is None:
                return f(*a, **kw)
            with swapped(self.paths, self._f, captured):
                return f(*a, **kw)

        functools.update_wrapper(target, f, updated=())
        return target

    def prelift(self, found: Reach, given: Sequence[torch.Tensor]) -> Lifted | None:
        """Before a first trace: lift the registered buffers (and parameters, see below) of
        the modules the function reaches (``found``), unless they are among its arguments
        ``given``.

        A function that calls a module through ``functional_call(model, params, x)`` reads
        the module's buffers (position ids, rotary frequencies, normalization statistics)
        from outside its arguments; lifted only after a trace baked them in, it would be
        traced twice. Lifted first, it is traced once, with the inputs the second trace would
        have had. A buffer the trace then does not read is an input the graph ignores; any
        other tensor the trace reads is lifted by :meth:`lift` afterwards, as before.

        Buffers of one element are left to :meth:`lift`: flags and counters (``initialized``,
        ``num_batches_tracked``) that a forward may read as Python values, which a traced
        input cannot give. A path the walk found that no longer leads to the same tensor (the
        module changed since) is skipped.

        Parameters are lifted too where no argument requires grad: a loss closing over its
        model (``lambda ids: model(ids).loss``) is then traced once, as the training step it
        is. Lifted after a first trace, that trace would be an inference trace, thrown away
        once it found them (the whole model traced twice). Left to :meth:`lift` where the
        arguments may stand in for them (``functional_call(model, params, x)``, a step
        taking the parameters): where an argument requires grad, or is a tensor of the
        parameter's shape and dtype. Lifting one the trace does not read costs an input the
        graph ignores; lifting is never wrong, only sooner."""
        given_ids = {id(t) for t in given}
        params = not any(t.requires_grad for t in given)
        stand_ins = {(t.shape, t.dtype) for t in given}
        lifted = {p.steps for p in self.paths}
        new: list[Path] = []
        for tid, paths in found.tensors.items():
            kinds = {p.steps[-1][0] for p in paths}
            if tid in given_ids or not ("buffer" in kinds or (params and "param" in kinds)):
                continue
            current = [p for p in paths if _leads_to(p, found.root, tid)]
            if not current:
                continue
            t = current[0].read(found.root)
            if "buffer" in kinds:
                wanted = not t.requires_grad and t.numel() > 1
            else:  # frozen parameters too (a LoRA's base weights), of more than one element
                wanted = params and (t.shape, t.dtype) not in stand_ins
                wanted = wanted and (t.requires_grad or t.numel() > 1)
            if not plain(t) or not wanted:
                continue
            fresh = [p for p in current if p.writable and p.steps not in lifted]
            lifted.update(p.steps for p in fresh)
            new.extend(fresh)
        if not new:
            return None
        self.paths = (*self.paths, *new)
        self.reader = Reader(self.paths)
        return Lifted(tuple(new))

    def lift(self, gm: torch.fx.GraphModule) -> Lifted | None:
        """Lift the captured tensors the trace baked into ``gm`` as constants (the result says
        which; None: nothing new to lift); tell the user about those it cannot lift."""
        constants = captured_constants(gm)
        if not constants:
            return None
        found = reach(self._f)
        lifted = {p.steps for p in self.paths}
        new: list[Path] = []
        for t, where in constants:
            paths = found.tensors.get(id(t), [])
            # every path to it: a tensor tied into two modules is two inputs (autograd adds
            # up their gradients), and stays right if the tie is broken later
            fresh = [p for p in paths if p.writable and p.steps not in lifted]
            lifted.update(p.steps for p in fresh)
            new.extend(fresh)
            if not fresh:
                self._baked(t, paths, where)
        if not new:
            return None
        self.paths = (*self.paths, *new)
        self.reader = Reader(self.paths)
        return Lifted(tuple(new))

    def lift_steps(self, steps: Sequence[Any]) -> Lifted | None:
        """Lift the tensors at the paths with these ``steps`` (as JSON gives them back: an
        earlier process lifted them, see :class:`~functrans._jit.disk.store.WritesHint`);
        None where none is found now or all are lifted already."""
        wanted = {json.dumps(s) for s in steps}
        lifted = {p.steps for p in self.paths}
        found = reach(self._f)
        new: list[Path] = []
        for paths in found.tensors.values():
            for p in paths:
                try:
                    named = json.dumps([list(step) for step in p.steps])
                except (TypeError, ValueError):
                    continue
                if (
                    named in wanted
                    and p.writable
                    and p.steps not in lifted
                    and plain(p.read(found.root))
                ):
                    lifted.add(p.steps)
                    new.append(p)
        if not new:
            return None
        self.paths = (*self.paths, *new)
        self.reader = Reader(self.paths)
        return Lifted(tuple(new))

    def lift_tensors(self, tensors: Sequence[torch.Tensor]) -> Lifted | None:
        """Lift the captured ``tensors`` (a trace writes to them in place: as inputs, the
        write is copied back after each call); None where none has a writable path."""
        found = reach(self._f)
        lifted = {p.steps for p in self.paths}
        new = [
            p
            for t in tensors
            for p in found.tensors.get(id(t), [])
            if p.writable and p.steps not in lifted
        ]
        if not new:
            return None
        self.paths = (*self.paths, *new)
        self.reader = Reader(self.paths)
        return Lifted(tuple(new))

    def _baked(self, t: torch.Tensor, paths: list[Path], where: str) -> None:
        if not paths:
            what = f"a captured tensor ({_describe(t)}) that functrans cannot find a path to"
        elif all(p.writable for p in paths):
            what = (
                f"captured tensor {paths[0].name} through a path functrans cannot find (it "
                "only finds closures, globals, attributes, containers and module tables)"
            )
        else:
            stuck = next(p for p in paths if not p.writable)
            what = (
                f"captured tensor {stuck.name} (inside a tuple or an object functrans "
                "cannot write to while tracing)"
            )
        hint = (
            "Pass it as an argument (or keep it in a list, dict, closure variable, module "
            "attribute or parameter, where it is lifted to a graph input automatically)."
        )
        if t.requires_grad:
            raise TraceError(
                f"{self._owner} reads {what}{where}, and it requires grad: compiled as a "
                f"constant it would get no gradient. {hint}"
            )
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(
                f"{self._owner} reads {what}{where}; it is compiled in as a constant, so "
                f"replacing that tensor later will not be seen. {hint}",
                stacklevel=user_stacklevel(),
            )


def _leads_to(path: Path, root: Any, tid: int) -> bool:
    """Whether ``path`` still leads from ``root`` to the object of id ``tid``."""
    try:
        return id(path.read(root)) == tid
    except (LookupError, AttributeError, TypeError, ValueError):
        return False


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"
