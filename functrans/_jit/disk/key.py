"""The key of an on-disk trace (:mod:`functrans._jit.disk.store`): everything that decides a trace,
hashed before tracing (see that module's docstring for the soundness argument).

>>> import torch
>>> meta = _tensors((torch.ones(2, 3),))
>>> meta[0][:3], meta[0][3:5]
(((2, 3), (3, 1), 0), ('torch.float32', 'cpu'))
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from functrans._core.pytree import Flat, plain
from functrans._core.shapes import Dims
from functrans._core.state import State
from functrans._trace.decomp import Decompositions

if TYPE_CHECKING:  # the type of "a dataclass instance", which typeshed alone defines
    from _typeshed import DataclassInstance

from . import shapes as disk_shapes
from . import tree_json as tree_json
from .code_deps import functrans_digest
from .fingerprint import Fingerprint, Unhashable

__all__ = ["FORMAT", "DiskKey", "digest"]

#: The version of the entries' format (in the key and in every entry); 3: module paths of the
#: folder layout (stored type names changed); 4: entries hold what their trace read; 5: graphs
#: note where autograd stopped (``functrans.no_grad``, ``functrans.stopped``).
FORMAT = 5
# options of jit that do not reach the trace (they act on the traced graph, after it)
_TRACE_FREE = frozenset({"partition", "partition_options", "backend", "cache_size"})


@dataclass(frozen=True)
class DiskKey:
    """What decides one trace of a jitted function (everything its disk key must cover)."""

    fn: Callable[..., Any]  # the user's function (what jit wraps)
    kind: str  # "forward" (inference: trace), "joint" (training: joint), "joint-regions"
    # (a joint trace that kept its region ops: ft.jit's default)
    options: DataclassInstance  # jit's Options (strategy, backend, static_argnums, ...)
    state: State  # the global state at the call
    flat: Flat  # the call's structure and static leaves
    tensors: tuple[torch.Tensor, ...]  # the call's tensor inputs, in the traced function's order
    names: tuple[str, ...]  # readable names of those tensors
    decompositions: Decompositions  # the decompositions actually used
    dims: Dims | None = None  # symbolic dimensions of the trace (None: static shapes)
    planned: bool = False  # jit(grad(f, partition=...)): traced from a plan made outside
    #: the inputs the function writes in place, by position (traced with copies whose final
    #: values are more outputs): the trace of the same call without them is another graph
    writes: tuple[int, ...] = ()
    #: record and store on a miss (recording doubles the trace's time on CPython 3.11, so a
    #: jitted function stores its first few entries only; later misses just look up)
    store: bool = True


def digest(key: DiskKey, fp: Fingerprint) -> str:
    """The key of ``key``'s trace (raises :class:`Unhashable` where none is sound)."""
    if key.planned:
        raise Unhashable("a gradient traced from a plan (grad(f, partition=...))")
    if key.flat.wrappers:
        raise Unhashable("tensor subclass inputs")
    fp.add(_environment())
    fp.add((key.kind, key.names, key.decompositions))
    options = key.options
    fp.add(
        [
            (f.name, getattr(options, f.name))
            for f in dataclasses.fields(options)
            if f.name not in _TRACE_FREE
        ]
    )
    state = key.state._asdict()
    state["modules"] = tuple(training for _, training in state["modules"])
    fp.add(sorted(state.items()))
    fp.add(_structure(key.flat))
    # the tensors' metadata is atoms (strings, ints, bools, None and tuples of them), whose
    # repr tells them apart: hashed as one string, not walked (a model has hundreds)
    if key.dims is None:
        fp.add(repr(_tensors(key.tensors)))
    else:  # sizes of symbolic dimensions left out (:mod:`functrans._jit.disk.shapes`)
        fp.add(repr(_tensors(key.tensors, symbolic=True)))
        symbolic = disk_shapes.key_tensors(key.tensors, key.dims, key.names)
        fp.add(("dims", disk_shapes.dims_doc(key.dims), symbolic))
    if key.writes:
        fp.add(("writes", key.writes))
    fp.add(key.fn)
    return fp.digest()


def _structure(flat: Any) -> Any:
    statics = [s for s, t in zip(flat.static, flat.is_tensor, strict=True) if not t]
    spec = tree_json.spec_doc(flat.spec)
    return (json.dumps(spec), flat.is_tensor, statics, flat.static_argnums)


def _tensors(tensors: tuple[Any, ...], *, symbolic: bool = False) -> list[Any]:
    """Each tensor's metadata; ``symbolic``: without sizes, strides and offset (the key holds
    them as the symbolic trace sees them)."""
    out: list[tuple[Any, ...]] = []
    storages: dict[tuple[str, int], int] = {}
    for i, t in enumerate(tensors):
        if not plain(t) or t.layout != torch.strided:
            raise Unhashable(f"input {i} is a {type(t).__qualname__} ({t.layout})")
        where = (str(t.device), t.untyped_storage().data_ptr())
        alias = storages.setdefault(where, i) if where[1] else i
        keys = int(torch._C._dispatch_keys(t).raw_repr())
        meta: tuple[Any, ...] = (str(t.dtype), str(t.device))
        if not symbolic:
            meta = (tuple(t.shape), t.stride(), t.storage_offset(), *meta)
        out.append((*meta, t.requires_grad, type(t).__name__, keys, alias, _device(t.device)))
    return out


def _device(device: torch.device) -> Any:
    if device.type != "cuda":
        return None
    return (torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device))


_ENVIRONMENT: tuple[Any, ...] | None = None


def _environment() -> tuple[Any, ...]:
    """Versions (computed once) and the torch flags a trace reads (read every time)."""
    global _ENVIRONMENT
    if _ENVIRONMENT is None:
        _ENVIRONMENT = (
            FORMAT,
            sys.version,
            platform.machine(),
            torch.__version__,
            torch.version.git_version,
            torch.version.cuda,
            torch.version.hip,
            _version("functrans"),
            functrans_digest(),
        )
    backends: Any = torch.backends  # untyped functions
    flags = (
        backends.cuda.flash_sdp_enabled(),
        backends.cuda.mem_efficient_sdp_enabled(),
        backends.cuda.math_sdp_enabled(),
        backends.cuda.cudnn_sdp_enabled(),
        backends.mkldnn.enabled,
        backends.cudnn.enabled,
        torch.get_float32_matmul_precision(),
    )
    module = torch.nn.modules.module
    hooks = [
        (name, list(value.values()))
        for name, value in sorted(vars(module).items())
        if name.startswith("_global_") and isinstance(value, dict)
    ]
    return (*_ENVIRONMENT, flags, hooks)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
