"""Stage logs through the standard library: the graphs each transform produces (like
``TORCH_LOGS="aot_joint_graph"``) and a line for long work.

Every stage has a logger, ``functrans.<stage>`` (``functrans.trace``, ``functrans.joint``,
``functrans.partition``, ``functrans.codegen``, ``functrans.recompiles``, ``functrans.disk``,
``functrans.dynamic``), which logs at DEBUG; ``logging`` handlers, levels, filters and pytest's
``caplog`` work on them as on any library's. ``FUNCTRANS_LOGS=joint,partition`` (or ``all``),
or :func:`set_logs` at run time, sets those loggers to DEBUG and prints them to standard error
(through one handler on the ``functrans`` logger; they still propagate to yours).

``functrans.progress`` says, at INFO, what long work is doing once it has taken more than
:data:`SLOW_S` seconds (a trace, a partition, a native build): :func:`slow`. With no logging
configured in the process (no handler on the root logger) it prints to standard error on its
own, as ``logging``'s last-resort handler does for warnings; once you configure logging, it
is yours to route or silence (``logging.getLogger("functrans.progress").setLevel(...)``).

>>> import logging
>>> logging.getLogger("functrans.partition").isEnabledFor(logging.DEBUG)
False
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator

from . import switches

__all__ = ["SLOW_S", "STAGES", "counted", "log", "set_logs", "slow"]

STAGES = ("trace", "joint", "partition", "codegen", "recompiles", "disk", "dynamic")

#: seconds of work after which :func:`slow` says what is going on
SLOW_S = 2.0

_ROOT = logging.getLogger("functrans")
_PROGRESS = logging.getLogger("functrans.progress")
_chosen: set[str] = set()  # the stages set_logs / FUNCTRANS_LOGS turned on


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler writing to the current ``sys.stderr`` (pytest's capture swaps it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # a property in place of StreamHandler's attribute
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


_STAGE_HANDLER = _Stderr()
_STAGE_HANDLER.addFilter(lambda record: record.name.split(".")[-1] in _chosen)


class _Unconfigured(logging.Filter):
    """Passes records only while the process has configured no logging (the root logger
    has no handler): then nobody else would show them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not logging.getLogger().handlers


_PROGRESS_HANDLER = _Stderr()
_PROGRESS_HANDLER.addFilter(_Unconfigured())
_PROGRESS_HANDLER.setFormatter(logging.Formatter("functrans: %(message)s"))
_PROGRESS.addHandler(_PROGRESS_HANDLER)
_PROGRESS.setLevel(logging.INFO)


def _parse(spec: str | Iterable[str]) -> set[str]:
    from .errors import InvalidArgumentError

    known = f"known: {', '.join(STAGES)} (or 'all')"
    items = (
        spec.split(",")
        if isinstance(spec, str)
        else list(spec)
        if isinstance(spec, Iterable)
        else None
    )
    if items is None or any(not isinstance(s, str) for s in items):
        raise InvalidArgumentError(
            f"set_logs: stages={spec!r} is not accepted; stages must be a comma-separated str "
            f"or an iterable of stage names; {known}"
        )
    names = {s.strip() for s in items if s.strip()}
    if "all" in names:
        return set(STAGES)
    unknown = names - set(STAGES)
    if unknown:
        raise InvalidArgumentError(f"set_logs: unknown log stage(s) {sorted(unknown)}; {known}")
    return names


def set_logs(stages: str | Iterable[str] = (), **flags: bool) -> None:
    """Choose the stages whose graphs are printed: ``set_logs("joint,partition")``,
    ``set_logs(joint=True)``, or ``set_logs()`` to turn logging off. They are the loggers
    ``functrans.<stage>`` at DEBUG (see the module docstring); ``set_logs()`` gives back the
    levels it set.

    >>> set_logs(joint=True); set_logs()
    """
    chosen = _parse(stages) | _parse([k for k, v in flags.items() if v])
    for stage in _chosen - chosen:
        logging.getLogger(f"functrans.{stage}").setLevel(logging.NOTSET)
    for stage in chosen:
        logging.getLogger(f"functrans.{stage}").setLevel(logging.DEBUG)
    _chosen.clear()
    _chosen.update(chosen)
    if chosen and _STAGE_HANDLER not in _ROOT.handlers:
        _ROOT.addHandler(_STAGE_HANDLER)
    elif not chosen and _STAGE_HANDLER in _ROOT.handlers:
        _ROOT.removeHandler(_STAGE_HANDLER)


def log(stage: str, title: str, text: Callable[[], str]) -> None:
    """Log ``text()`` under a banner to ``functrans.<stage>`` at DEBUG, if that logger is
    enabled for it (``text`` is built lazily, only then)."""
    logger = logging.getLogger(f"functrans.{stage}")
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("===== [functrans:%s] %s =====\n%s", stage, title, text())


@contextlib.contextmanager
def slow(what: Callable[[], str], after: float = SLOW_S) -> Iterator[None]:
    """Say once, at INFO on ``functrans.progress``, what the work inside is doing if it is
    still running ``after`` seconds in (``what()`` names it), and how long it took once it
    ends.

    >>> with slow(lambda: "nothing", after=60):
    ...     pass
    """
    start = time.perf_counter()
    said = threading.Event()

    def say() -> None:
        said.set()
        _PROGRESS.info("%s (%.0f s so far)", what(), time.perf_counter() - start)

    timer = threading.Timer(after, say)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if said.is_set():
            _PROGRESS.info("%s: done in %.1f s", what(), time.perf_counter() - start)


@contextlib.contextmanager
def counted(what: str, total: int, every: float = SLOW_S) -> Iterator[Callable[[], None]]:
    """A sweep of ``total`` steps that may take long: the body calls the function it gets
    after each step; once the sweep has run ``every`` seconds, each step at most ``every``
    seconds after the last line says, at INFO on ``functrans.progress``, how far it is
    (``"pareto: 3 of 21 points (4 s so far)"``), and the end says how long it took.

    >>> with counted("points", 3, every=60) as step:
    ...     for _ in range(3):
    ...         step()
    """
    start = last = time.perf_counter()
    done = 0
    said = False

    def step() -> None:
        nonlocal done, last, said
        done += 1
        now = time.perf_counter()
        if now - last >= every and done < total:
            last, said = now, True
            _PROGRESS.info("%s: %d of %d (%.0f s so far)", what, done, total, now - start)

    yield step
    if said:
        _PROGRESS.info(
            "%s: %d of %d, done in %.1f s", what, done, total, time.perf_counter() - start
        )


set_logs(_parse(switches.value(switches.LOGS)))
