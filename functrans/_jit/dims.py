"""Which dimensions of a jitted call are symbolic (``jit(dynamic=...)``), and the fallback.

:func:`chosen_dims` answers ``dynamic=`` for one compile: ``False`` none, ``True`` every
dimension of every argument (captured tensors keep their sizes, as in torch), a mapping the
named ones (:func:`~functrans._core.shapes.resolve`), and ``"auto"`` the dimensions whose size
changed since the last entry for inputs like these (a first call is static, as in
``torch.compile``). :func:`build_dynamic` builds the entry symbolic in them where it can, and
static, with a ``dynamic`` log line, where the backend compiles static shapes only, the entry
traces a plan, the inputs are tensor subclasses, or the symbolic trace fails.

>>> import torch, functrans as ft
>>> f = ft.jit(lambda x: x.sin())
>>> for n in (2, 3, 4):
...     _ = f(torch.zeros(n))
>>> f.cache_info().misses  # static at 2, symbolic from the size that changed
2
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from functrans._core.backends import capabilities, get_backend
from functrans._core.logs import log
from functrans._core.pytree import plain
from functrans._core.shapes import Dims, DynamicSpecError, EveryInput, JitDynamic, resolve

from .apply import Entry
from .build import Builder, Built, Target
from .cache import Cache, changed_dims, rank_key
from .disk.store import DiskKey

__all__ = ["chosen_dims"]


def chosen_dims(
    dynamic: JitDynamic,
    cache: Cache[Entry],
    tensors: list[torch.Tensor],
    key: Any,
    paths: list[str],
    order: list[int],
) -> Dims | None:
    """The symbolic dimensions of this compile (None: static), over the traced function's
    inputs (``order``: their flat positions, ``paths`` their names): as ``dynamic=`` asks, or
    with ``"auto"``, the dimensions whose size changed since the last entry in ``cache`` for
    inputs like these."""
    if dynamic is False:
        return None
    ordered = [tensors[i] for i in order]
    if dynamic is True:  # tensors it reads (a closure's weights) keep their sizes, as torch's
        dynamic = EveryInput(static=tuple(p for p in paths if p.endswith(" (captured)")))
    if dynamic != "auto":
        return resolve(dynamic, paths, ordered)
    rank = rank_key(key)
    last = cache.last_like(rank)
    if last is None:
        # a new group of 0/1 sizes (a batch of one): symbolic at once in the dimensions
        # already seen to vary, if a related entry is symbolic (torch keeps the 1 fixed)
        related = cache.dynamic_relative(rank)
        if related is None or related.shape is None:
            return None
        return tuple(dict.fromkeys(sorted(related.shape.symbolic[k])) for k in range(len(order)))
    changed = changed_dims(last.signature, tensors)
    before = last.shape.symbolic if last.shape is not None else [set()] * len(order)
    # last.shape.symbolic is in that entry's order, which is ours (same structure)
    dims = tuple(dict.fromkeys(sorted(changed[i] | set(before[k]))) for k, i in enumerate(order))
    return dims if any(dims) else None


def build_dynamic(
    builder: Builder,
    owner: str,
    warn_once: Callable[[str, str], None],
    target: Target,
    example: Any,
    training: bool,
    disk: Callable[..., DiskKey],
    dims: Dims | None,
) -> Built:
    """:meth:`Builder.build` with ``dims`` symbolic; where the backend compiles static shapes
    only, or the symbolic trace fails, a static entry (and a ``dynamic`` log line)."""
    if dims is None:
        return builder.build(target, example, training, disk)
    opts = builder.options
    backend = get_backend(opts.backend)
    why = None
    if not capabilities(backend).dynamic:
        why = f"backend {opts.backend!r} compiles static shapes only"
    elif target.plan is not None:
        why = "a planned gradient (grad(f, partition=...)) is traced at static shapes"
    elif not all(map(plain, [*example[0], *example[1]])):
        why = "tensor subclass inputs are traced at static shapes"
    if why is None:
        try:
            with _quiet_fake_tensor_log():
                return builder.build(target, example, training, disk, dims)
        except DynamicSpecError:  # the inputs break the user's dynamic=
            raise
        except Exception as e:  # the static trace reports real errors
            why = f"the symbolic trace failed ({type(e).__name__}: {e})"
    log("dynamic", f"{owner}: one entry per shape", lambda: why or "")
    if opts.dynamic != "auto":  # asked for by name: say so once, not only in logs
        asked = True if isinstance(opts.dynamic, EveryInput) else opts.dynamic
        warn_once(
            "dynamic",
            f"{owner}: dynamic={asked!r} was asked for, but {why}; "
            "it compiles an entry per shape (FUNCTRANS_LOGS=dynamic says why each time)",
        )
    return builder.build(target, example, training, disk)


@contextlib.contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    """torch logs every meta kernel a symbolic trace cannot run (``F.pad`` of a size-dependent
    amount) as an error with a traceback; jit then compiles the call at static shapes, so the
    traceback is noise: the ``dynamic`` log says why."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
