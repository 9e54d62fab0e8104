"""Stage logs: print the graphs each transform produces (like ``TORCH_LOGS="aot_joint_graph"``).

Enable with the environment variable ``FUNCTRANS_LOGS=trace,joint,partition,codegen,recompiles`` (or
``all``) or at run time with :func:`set_logs`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable

__all__ = ["STAGES", "log", "set_logs"]

STAGES = ("trace", "joint", "partition", "codegen", "recompiles", "disk", "dynamic")
_enabled: set[str] = set()


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
    ``set_logs(joint=True)``, or ``set_logs()`` to turn logging off.

    >>> set_logs(joint=True); set_logs()
    """
    chosen = _parse(stages) | _parse([k for k, v in flags.items() if v])
    _enabled.clear()
    _enabled.update(chosen)


def log(stage: str, title: str, text: Callable[[], str]) -> None:
    """Print ``text()`` under a banner if ``stage`` is enabled (``text`` is built lazily)."""
    if stage in _enabled:
        print(f"===== [functrans:{stage}] {title} =====\n{text()}", file=sys.stderr)


_enabled.update(_parse(os.environ.get("FUNCTRANS_LOGS", "")))
