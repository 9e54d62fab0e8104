"""Random ops a backward may draw again: the generator state saved, the numbers replayed.

A random op (dropout's ``bernoulli``) may not be recomputed as it is: a second run draws other
numbers. Saving its result costs a mask the size of an activation in every block, which puts
a dropout model's floor above per-block checkpointing's (torch's checkpoint replays the
generator). :func:`replayable` rewrites each random op whose value the backward reads into

- in the forward, ``run_and_save_rng_state(op, *args)``: the op as it ran, drawing from the
  global generator as eager does, and the generator's state before it (a few KiB on the CPU,
  16 bytes on CUDA), and
- for its readers, ``run_with_rng_state(state, op, *args)``: the same numbers again from that
  state, leaving the generator as it finds it; a forward-phase value like any other, so a
  strategy may save it (the mask), or recompute it, and what is computed from it, from the
  state.

After the cut, :func:`drawn_once` gives the forward graph its random ops back where nothing is
replayed: a saved mask is the forward's own draw, not a second one, and a forward whose states
the backward does not read calls the plain op. Eager's numbers either way, and the global
generator left where eager leaves it.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

from functrans._core.format import op_name
from functrans._core.graph import MADE_BY, PHASE, JointGraph, Phase, copy_joint
from functrans._core.ops import is_random, overload_of
from functrans._core.tags import REMAT, REMAT_OP

from .scratch import register_call_memory

__all__ = ["REPLAY_OPS", "SAVES_STATE", "WITH_STATE", "drawn_once", "replayable"]

#: the op that runs a random op and hands back the generator state it started from
SAVES_STATE: Any = run_and_save_rng_state
#: the op that runs a random op from a given generator state, restoring the generator after
WITH_STATE: Any = run_with_rng_state

#: The Python-level ops a partition's graphs call for replayed random ops (higher-order ops of
#: torch's, taking the op to run as an argument): an executor that runs only ATen overloads
#: calls these as Python functions.
REPLAY_OPS: frozenset[Any] = frozenset({SAVES_STATE, WITH_STATE})

#: bytes of a generator's state, by device type (what a replayed op saves)
_STATE_BYTES = {"cpu": 5056, "cuda": 16}


def _replay_scratch(node: fx.Node) -> int:
    """A replay holds the generator's state it restores after drawing: on the CPU a tensor
    of the state's size while it runs (a CUDA generator's state lives on the host)."""
    val = node.meta.get("val")
    on_cpu = isinstance(val, torch.Tensor) and val.device.type == "cpu"
    return _STATE_BYTES["cpu"] if on_cpu else 0


register_call_memory(WITH_STATE, known=_replay_scratch)


def replayable(joint: JointGraph) -> JointGraph:
    """A copy of ``joint`` whose random ops the backward may draw again (the module
    docstring); ``joint`` itself where none is read by the backward.

    >>> import torch, functrans as ft
    >>> jg = ft.joint(lambda x: torch.nn.functional.dropout(x, 0.5).sum())(torch.ones(4))
    >>> [n.target.__name__ for n in replayable(jg).fx_graph.nodes if n.target in REPLAY_OPS]
    ['run_and_save_rng_state', 'run_with_rng_state']
    """
    if not any(_replayable(n) for n in joint.fx_graph.nodes):
        return joint
    copy = copy_joint(joint)
    graph = copy.fx_graph
    for r in [n for n in graph.nodes if _replayable(n)]:
        op, val = overload_of(r), r.meta["val"]
        state_val = _state_like(val)
        with graph.inserting_before(r):
            pair = graph.call_function(SAVES_STATE, (op, *r.args), dict(r.kwargs))
            state = graph.call_function(operator.getitem, (pair, 0))
            again = graph.call_function(WITH_STATE, (state, op, *r.args), dict(r.kwargs))
        for n, v in ((pair, (state_val, val)), (state, state_val), (again, val)):
            n.meta.update(r.meta)
            n.meta["val"] = v
            n.meta[PHASE] = Phase.FORWARD
            if n is not again:  # a remat policy's tag is the numbers': the state is free
                n.meta.pop(REMAT, None)
                n.meta.pop(REMAT_OP, None)
                n.meta[MADE_BY] = f"{op_name(op)}'s generator state"
        r.replace_all_uses_with(again)
        name = r.name
        r._rename(f"{name}_replaced")  # frees its name for the replay
        graph.erase_node(r)
        again._rename(name)  # the op's own name: strategies and reports find it so
    copy.graph_module.recompile()
    return copy


def _state_like(val: torch.Tensor) -> torch.Tensor:
    """The traced value of a generator state for a random op whose value is ``val``: a fake
    tensor of the state's bytes in ``val``'s fake mode (a value of its own per draw: shared,
    two calls' states would be one value to a trace), on the host."""
    size = _STATE_BYTES.get(val.device.type, 16)
    mode = getattr(val, "fake_mode", None)
    if mode is None:
        return torch.empty(size, dtype=torch.uint8)
    with mode:
        return torch.empty(size, dtype=torch.uint8, device="cpu")


def drawn_once(graph: fx.Graph) -> bool:
    """Give a forward graph its random ops back where nothing is replayed (the module
    docstring): a replay of a draw it made is that draw's result, and a draw whose state it
    does not hand to the backward is the plain op. In place, on a graph the caller owns;
    whether anything changed."""
    changed = False
    for again in [n for n in graph.nodes if n.target is WITH_STATE]:
        state = again.args[0]
        pair = state.args[0] if _is_state(state) else None
        if pair is not None and pair.args == again.args[1:] and pair.kwargs == again.kwargs:
            with graph.inserting_after(pair):
                drawn = graph.call_function(operator.getitem, (pair, 1))
            drawn.meta.update(again.meta)
            again.replace_all_uses_with(drawn)
            name = again.name
            again._rename(f"{name}_replaced")
            graph.erase_node(again)
            drawn._rename(name)
            changed = True
    for pair in [n for n in graph.nodes if n.target is SAVES_STATE]:
        if any(u.args[1] == 0 and u.users for u in pair.users):
            continue  # its state is handed to the backward
        op, *args = pair.args
        with graph.inserting_before(pair):
            plain = graph.call_function(op, tuple(args), dict(pair.kwargs))
        plain.meta.update(pair.meta)
        plain.meta["val"] = pair.meta["val"][1]
        for u in list(pair.users):
            if u.args[1] == 1:
                u.replace_all_uses_with(plain)
                name = u.name
                u._rename(f"{name}_replaced")
                graph.erase_node(u)
                plain._rename(name)
            else:
                graph.erase_node(u)
        graph.erase_node(pair)
        changed = True
    return changed


def _is_state(node: Any) -> bool:
    return (
        bool(
            isinstance(node, fx.Node)
            and node.target is operator.getitem
            and isinstance(node.args[0], fx.Node)
            and node.args[0].target is SAVES_STATE
            and node.args[1] == 0
        )
        is True
    )


def _replayable(node: fx.Node) -> bool:
    """A forward random op of one tensor, drawing from the global generator."""
    if node.meta.get(PHASE) is not Phase.FORWARD or not is_random(node):
        return False
    if not isinstance(node.meta.get("val"), torch.Tensor):
        return False
    # not with a generator of the user's: its state is not the global one
    return node.kwargs.get("generator") is None
