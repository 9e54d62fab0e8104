"""The ``"aten"`` backend's native executor: a graph as a program of boxed dispatcher calls.

The Python executor (:mod:`functrans.codegen._pycode`) pays Python's argument parsing on every
op, about a microsecond each; on small tensors that is a large part of a step. The native
executor (``csrc/executor.cpp``) turns the graph into a flat list of calls to the very
operator handles ``OpOverload.__call__`` calls, with constant arguments converted once, and
runs the list from C++. Results are bit for bit the Python executor's.

The extension is compiled with torch's C++ extension tooling (a C++ compiler and ninja;
about half a minute, once per machine) into ``$FUNCTRANS_CACHE_DIR/native/<hash>``, by one
process at a time, and checked against its recorded sha256 before every load
(:mod:`functrans.codegen._native_build`: killed builds and torn files are rebuilt). The
project's set-up builds it (``make`` runs ``python -m functrans.codegen._native``). A first
use that finds it unbuilt never waits on the compiler: it starts the build in a detached
background process (which outlives a short script), says so in one line, and graphs
compiled meanwhile run on the Python executor (bit for bit the same results); graphs
compiled once the library is published load it and run natively.
Without a compiler, or with ``FUNCTRANS_NATIVE=0``, :func:`native_function` returns None and
the backend runs the Python executor.

>>> import torch, functrans as ft
>>> g = ft.trace(lambda x: (x * 2).sin())(torch.ones(2))
>>> run = native_function(g.graph_module)
>>> run is None or torch.equal(run(torch.ones(2))[0], torch.ones(2).mul(2).sin())
True
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import operator
import shutil
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from functrans.extend import (
    REPLAY_OPS,
    SWITCHES,
    Picked,
    handover_call,
    path_prefixed,
    switch_value,
)

from ._cache import cache_root
from ._native_build import cached_build, check, prepare
from ._pycode import FlatFunction, _attr, flat_function

__all__ = ["native_function", "native_module"]

_SOURCE = Path(__file__).resolve().parent / "csrc" / "executor.cpp"
_LOCK = threading.Lock()
_FAILED = False  # the build failed once in this process
_BACKGROUND: subprocess.Popen[bytes] | None = None  # the build started in the background


class _Unsupported(Exception):
    """The graph holds something the native executor does not run."""


def _library() -> tuple[str, Path]:
    """The extension's module name and its library's place in the cache, both named by a
    digest of the source, torch and Python (a library built for them needs no rebuild)."""
    tag = f"{torch.__version__}|{sys.version}".encode()
    digest = hashlib.sha256(_SOURCE.read_bytes() + tag).hexdigest()[:16]
    name = f"functrans_executor_{digest}"
    suffix = ".pyd" if sys.platform == "win32" else ".so"
    return name, cache_root() / "native" / digest / f"{name}{suffix}"


@functools.cache
def _build() -> Any:
    """The extension: loaded from the cache once its checksum holds, else built (see
    :mod:`functrans.codegen._native_build` for the locking and the checks)."""
    name, lib = _library()
    return cached_build(
        lib,
        compile=functools.partial(_compile, name, lib),
        load=functools.partial(_load, name),
    )


def _load(name: str, lib: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, lib)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile(name: str, lib: Path, build_dir: Path) -> Any:
    """Build and import the extension in the private ``build_dir``; cpp_extension's own lock
    lives there too, where no other process looks."""
    from torch.utils import cpp_extension

    # the venv's ninja (a pip dependency), where the venv is not activated
    venv = str(Path(sys.executable).parent)
    path = path_prefixed(venv) if shutil.which("ninja") is None else nullcontext()
    with path:
        module = cpp_extension.load(
            name=name,
            sources=[str(_SOURCE)],
            build_directory=str(build_dir),
            extra_cflags=["-O2"],
            verbose=False,
        )
    module.__file__ = str(lib)  # where the loaded file lives once published (same inode)
    return module


def native_module(wait: bool = False) -> Any | None:
    """The compiled extension; None when disabled or it cannot be built (which warns once;
    the build is not retried in this process), or, unless ``wait``, while it is being built:
    a first use that finds no built library starts the build in the background (see the
    module docstring)."""
    global _FAILED
    if not switch_value(SWITCHES["FUNCTRANS_NATIVE"]) or _FAILED:
        return None
    if not wait and _build.cache_info().currsize == 0 and not _ready():
        try:
            prepare(_library()[1])  # a cache that is not this user's is refused here, once
        except Exception as e:
            _refuse(e)
            return None
        _in_background()
        return None
    with _LOCK:
        try:
            return _build()
        except Exception as e:  # no compiler, no ninja, ...: run the Python executor
            _refuse(e)
            return None


def _refuse(e: Exception) -> None:
    """The build failed or was refused: say why once; the Python executor runs from now on."""
    global _FAILED
    _FAILED = True
    warnings.warn(
        f"functrans: the native executor could not be built ({type(e).__name__}: "
        f"{str(e).strip().splitlines()[-1] if str(e).strip() else e}); the 'aten' "
        "backend runs graphs through its Python executor. Set FUNCTRANS_NATIVE=0 to "
        "skip the build.",
        stacklevel=3,
    )


def _ready() -> bool:
    """Whether a checked library waits in the cache (loading it takes no compiler)."""
    return check(_library()[1]) is None


def _in_background() -> None:
    """Start the build in a detached process, once per process, saying so: it outlives a
    short script (a thread would die with it), and the next compile after it publishes the
    library loads it."""
    global _BACKGROUND
    with _LOCK:
        if _BACKGROUND is not None:
            return
        log = cache_root() / "native" / "build.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            _BACKGROUND = subprocess.Popen(
                [sys.executable, "-m", "functrans.codegen._native"],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # not killed with this process
            )
        print(
            "functrans: building the native executor in the background (once per machine, "
            f"about half a minute; log: {log}); graphs compiled meanwhile run on the Python "
            "executor",
            file=sys.stderr,
            flush=True,
        )


def wait_for_build() -> Any | None:
    """The extension, built now if it is not (what the set-up runs)."""
    return native_module(wait=True)


def native_function(gm: fx.GraphModule) -> Callable[..., list[Any]] | None:
    """``gm`` as a native program (flat inputs, a list of outputs; ``call_boxed(list)`` takes
    the inputs as a list it empties, freeing each after its last use), or None when the extension
    is unavailable or the graph holds a node it does not run (non-ATen calls, graph values
    inside non-tensor lists, submodules)."""
    ext = native_module()
    if ext is None:
        return None
    try:
        program = _Builder(ext.Program(), gm).build()
    except Exception:  # _Unsupported, or a constant the schema refuses: run it in Python
        return None

    flat: list[FlatFunction] = []

    def fallback(*args: Any) -> list[Any]:  # inputs __torch_function__ would intercept
        # the Python executor (built on first use): the same OpOverload calls gm makes, and
        # its handed-over calls still take their inputs over (what the memory report counts)
        if not flat:
            flat.append(flat_function(gm))
        return flat[0](*args)

    program.set_fallback(fallback)
    run: Callable[..., list[Any]] = program  # also program.call_boxed(list): the boxed call
    return run


class _Builder:
    """Registers for the graph's values, then one program step per node."""

    def __init__(self, program: Any, gm: fx.GraphModule) -> None:
        self.program, self.gm = program, gm
        self.reg: dict[fx.Node, int] = {}  # single values
        self.multi: dict[fx.Node, list[int]] = {}  # ops with several returns
        self.lists: dict[fx.Node, int] = {}  # ops returning one list of tensors
        # (program method, its arguments before `frees`, registers read, registers written)
        self.steps: list[tuple[str, tuple[Any, ...], list[int], list[int]]] = []

    def new(self) -> int:
        r: int = self.program.num_registers
        self.program.num_registers = r + 1
        return r

    def build(self) -> Any:
        outputs: list[Any] = []
        inputs: list[int] = []
        for n in self.gm.graph.nodes:
            if n.op == "placeholder":
                self.reg[n] = self.new()
                inputs.append(self.reg[n])
            elif n.op == "get_attr":
                self.reg[n] = self.new()
                self.program.constant_register(self.reg[n], _attr(self.gm, str(n.target)))
            elif n.op == "call_function" and n.target is operator.getitem:
                self._getitem(n)
            elif (fn := handover_call(n)) is not None:
                self._pycall(n, fn)
            elif n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
                self._call(n)
            elif n.op == "call_function" and n.target in _ARITH:
                self._arith(n)
            elif n.op == "call_function" and n.target in REPLAY_OPS:
                self._python_op(n)
            elif n.op == "output":
                outs = n.args[0]
                outputs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
            else:
                raise _Unsupported(f"{n.op} {n.target}")
        self.program.inputs = inputs
        out_specs = [self._value(o) for o in outputs]
        kept = {s[1] for s in out_specs if s[0] == "r"}
        self._emit(kept)
        self.program.set_outputs(out_specs)
        return self.program

    def _getitem(self, n: fx.Node) -> None:
        src, index = n.args
        if not isinstance(src, fx.Node) or not isinstance(index, int) or n.kwargs:
            raise _Unsupported("getitem")
        if src in self.multi:
            outs = self.multi[src]
            if not -len(outs) <= index < len(outs):
                raise _Unsupported(f"getitem {index} of {len(outs)} returns")
            self.reg[n] = outs[index % len(outs)]
        elif src in self.lists and index >= 0:  # C++ indexes lists from the front only
            self.reg[n] = out = self.new()
            item = (self.lists[src], index, out, n.name)
            self.steps.append(("item", item, [self.lists[src]], [out]))
        else:
            raise _Unsupported("getitem of a single value")

    def _call(self, n: fx.Node) -> None:
        schema = n.target._schema  # type: ignore[union-attr]  # a call_function target here is an OpOverload
        positional = [a for a in schema.arguments if not a.kwarg_only]
        if len(n.args) > len(positional) or not set(n.kwargs) <= {a.name for a in schema.arguments}:
            raise _Unsupported(f"{n.name}: arguments its schema does not take")  # gm raises
        specs, reads = [], []
        for i, formal in enumerate(schema.arguments):
            if i < len(n.args) and not formal.kwarg_only:
                spec = self._value(n.args[i])
            elif formal.name in n.kwargs:
                spec = self._value(n.kwargs[formal.name])
            else:
                spec = ("d",)
            specs.append(spec)
            reads += _registers(spec)
        returns = schema.returns
        if len(returns) == 1 and isinstance(returns[0].type, torch.ListType):
            outs = [self.new()]
            self.lists[n] = outs[0]
        elif len(returns) == 1:
            outs = [self.new()]
            self.reg[n] = outs[0]
        else:
            k = len(returns)
            read = {
                u.args[1] % k
                for u in n.users
                if u.target is operator.getitem
                and isinstance(u.args[1], int)
                and -k <= u.args[1] < k
            }
            outs = [self.new() if i in read else -1 for i in range(k)]
            self.multi[n] = outs
        call = (schema.name, schema.overload_name, n.name, specs, outs)
        self.steps.append(("call", call, reads, outs))

    def _pycall(self, n: fx.Node, fn: Callable[[list[Any]], list[Any]]) -> None:
        """A call of ``fn`` on a list of the node's inputs, handed over: the inputs whose last
        use it is are freed inside ``fn`` (:func:`functrans.extend.handover_call`)."""
        inputs = n.args[1] if len(n.args) == 2 and not n.kwargs else None
        if not isinstance(inputs, (list, tuple)) or not all(
            isinstance(a, fx.Node) and a in self.reg for a in inputs
        ):
            raise _Unsupported(f"{n.name}: a handed-over call's inputs are not single values")
        regs = [self.reg[a] for a in inputs]
        self.lists[n] = out = self.new()
        run, picks = (fn.run, fn.picks) if isinstance(fn, Picked) else (fn, None)
        sub = getattr(run, "__self__", None)
        if isinstance(sub, type(self.program)) and run == sub.call_boxed:
            # another native program (a region compiled natively): run from C++, no Python
            picked = list(range(sub.num_outputs)) if picks is None else list(picks)
            self.steps.append(("subcall", (sub, picked, regs, out, n.name), regs, [out]))
            return
        self.steps.append(("pycall", (fn, regs, out, n.name), regs, [out]))

    def _python_op(self, n: fx.Node) -> None:
        """A Python-level op (a random op replayed from a generator state, REPLAY_OPS) called
        from C++ on its tensor arguments: its result list, or its one tensor taken from it."""
        nodes = list(n.all_input_nodes)
        if not all(a in self.reg for a in nodes):
            raise _Unsupported(f"{n.name}: an argument is not a single value")
        where = {a: i for i, a in enumerate(nodes)}
        target, args, kwargs = n.target, n.args, n.kwargs
        assert callable(target)

        def run(vals: list[Any]) -> list[Any]:
            a, k = fx.node.map_arg((args, kwargs), lambda x: vals[where[x]])
            out = target(*a, **k)
            return list(out) if isinstance(out, (tuple, list)) else [out]

        regs = [self.reg[a] for a in nodes]
        got = self.new()
        self.steps.append(("pycall", (run, regs, got, n.name), regs, [got]))
        if isinstance(n.meta.get("val"), (tuple, list)):
            self.lists[n] = got
        else:
            self.reg[n] = out = self.new()
            self.steps.append(("item", (got, 0, out, n.name), [got], [out]))

    def _arith(self, n: fx.Node) -> None:
        """Integer arithmetic on sizes (a graph with symbolic shapes)."""
        code = _ARITH[n.target]
        args = list(n.args) + [0] * (2 - len(n.args))
        if n.kwargs or len(n.args) != (1 if code == "n" else 2):
            raise _Unsupported(f"{n.name}: {n.target} with these arguments")
        a, b = (self._value(x) for x in args)
        if any(s[0] == "c" and type(s[1]) is not int for s in (a, b)):
            raise _Unsupported(f"{n.name}: {n.target} of a non-integer")
        self.reg[n] = out = self.new()
        self.steps.append(
            ("arith", (code, a, b, out, n.name), _registers(a) + _registers(b), [out])
        )

    def _value(self, v: Any) -> tuple[Any, ...]:
        if isinstance(v, fx.Node):
            if v not in self.reg:
                raise _Unsupported(f"{v.name} is not a single value")
            return ("r", self.reg[v])
        if isinstance(v, (list, tuple)) and any(isinstance(e, fx.Node) for e in v):
            return ("l", [self._value(e) for e in v])
        return ("c", v)

    def _emit(self, kept: set[int]) -> None:
        """Add the steps, each freeing the registers it reads last (outputs are kept)."""
        last: dict[int, int] = {}
        for i, (_, _, reads, _) in enumerate(self.steps):
            for r in reads:
                last[r] = i
        dies: dict[int, set[int]] = {}
        for r, i in last.items():
            dies.setdefault(i, set()).add(r)
        for i, (method, args, _, written) in enumerate(self.steps):
            unread = {r for r in written if r >= 0 and r not in last}
            frees = sorted((dies.get(i, set()) | unread) - kept)
            getattr(self.program, method)(*args, frees)


#: Python-level size arithmetic a symbolic graph holds, by the native executor's code for it
_ARITH: dict[Any, str] = {
    operator.add: "+",
    operator.sub: "-",
    operator.mul: "*",
    operator.floordiv: "/",
    operator.mod: "%",
    operator.neg: "n",
    torch.sym_min: "<",
    torch.sym_max: ">",
}


def _registers(spec: tuple[Any, ...]) -> list[int]:
    if spec[0] == "r":
        return [spec[1]]
    if spec[0] == "l":
        return [r for s in spec[1] for r in _registers(s)]
    return []


if __name__ == "__main__":  # python -m functrans.codegen._native: build it now (the set-up)
    built = wait_for_build()
    print(f"functrans: native executor {'ready' if built is not None else 'unavailable'}")
