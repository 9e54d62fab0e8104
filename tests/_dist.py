"""Run a function on 2 gloo ranks (real processes) with short timeouts, so a hang fails fast.

``run_on_ranks(worker, *args)`` spawns one process per rank; each initialises the gloo
process group (collective timeout ``COLLECTIVE_TIMEOUT``), calls ``worker(rank, world, *args)``
and sends back its (picklable) result or its traceback. The parent waits at most
``timeout`` seconds in all, kills what is left and raises naming the rank.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=20)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int,
    world: int,
    port: int,
    results: Any,
    worker: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
        try:
            results.put((rank, True, worker(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_on_ranks(
    worker: Callable[..., Any], *args: Any, world: int = 2, timeout: float = 90.0
) -> list[Any]:
    """``[worker(0, world, *args), worker(1, world, *args), ...]``, each run on its own rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, results, worker, args))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    found: dict[int, Any] = {}
    errors = []
    try:
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        while len(found) + len(errors) < world:
            left = (deadline - datetime.datetime.now()).total_seconds()
            try:
                rank, ok, value = results.get(timeout=max(left, 0.1))
            except queue.Empty:
                raise AssertionError(
                    f"ranks {sorted(set(range(world)) - set(found))} did not finish within "
                    f"{timeout} s (a hang: mismatched collectives?)"
                ) from None
            if ok:
                found[rank] = value
            else:
                errors.append(f"rank {rank} failed:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [found[r] for r in range(world)]
