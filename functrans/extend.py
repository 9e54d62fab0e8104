"""The plugin surface: everything a partition strategy or codegen backend may import.

Third-party strategies and backends import from here (and torch, numpy, scipy, triton), never
from functrans' private modules, so the core can change underneath them.

>>> from functrans.extend import JointGraph, OpClass, op_class, activation_bytes

Every class and function here documents itself with an example. The other names:

- node meta keys, namespaced (match on these, never on node names): ``ROLE`` (a placeholder's
  :class:`Role`), ``PHASE`` (a joint graph node's :class:`Phase`), ``SOURCE`` (``"file:line:
  code"`` of the user's line that produced the op), ``RECOMPUTED`` (True on forward ops a
  backward graph re-runs) and ``REMAT`` (a remat region's :class:`Policy` for the op; read it
  with :func:`policy_of`);
- ``COMPUTE_INTENSIVE``: the op packets (matmul, conv, attention) whose outputs are worth saving
  rather than recomputing, :attr:`OpClass.COMPUTE`;
- ``OP_RULES``: the :class:`OpRule` (may it be saved, may it be recomputed, why not) of every
  :class:`OpClass`, which :func:`cut_problem` applies to each forward value;
- ``CostModel``: the type of a recompute cost model, ``(fx.Node) -> float`` (e.g. :func:`flops`);
- ``Strategy``: the type of a partition strategy, ``(JointGraph, **options) -> Iterable[str |
  fx.Node]`` (the forward values to save), or a :class:`Cut` (saved and offloaded values);
- ``SHARED``: the :attr:`Segments.index` of a forward value computed from no differentiated
  input (masks, rotary tables): it belongs to no segment;
- ``HOST``: node meta key, True on a value that lives in host memory (an offloaded copy and the
  backward input that receives it); ``OFFLOAD_OPS``: the ops that copy a value out, copy it
  back and wait for the copy (``functrans::to_host``, ``to_device``, ``wait_copy``);
- ``HANDOVER_OPS``: ops (a compiled region's calls) a backend's program may run by calling a
  boxed function with their inputs handed over (:func:`handover_call` gives it for a node), so
  inputs whose last use they are die inside them;
- ``REPLAY_OPS``: the Python-level ops (torch's ``run_and_save_rng_state`` and
  ``run_with_rng_state``, taking the random op to run as an argument) a partition's graphs
  call for a random op whose numbers the backward draws again from a saved generator state:
  an executor that runs only ATen overloads calls them as Python functions;
- ``RUNNING_NODE``: the words an executor puts before the name of the node whose op raised
  (in the error's message or a note, ``f"{RUNNING_NODE} {node.name}"``): ``jit`` reads the
  name back and adds the op and the user's line the node was traced from;
- ``OptionsCheck``: the type of the option check a strategy declares when it registers
  (``register_strategy(name, fn, check_options=...)``), ``(options) -> object``: it raises
  :class:`InvalidArgumentError` for a name the strategy does not take or a value it refuses,
  so ``jit(f, partition=name, **options)`` raises when it is made, not at a training step
  (:func:`check_strategy_options` runs it);
- ``local=True`` and ``peak_goal=`` of ``register_strategy``: a strategy declares that its cut
  of a block depends on that block alone, or what its options ask of the step's peak (a
  :class:`PeakGoal`, ``PeakGoalOf``); ``jit`` then plans a step of repeated blocks block by
  block (:func:`registered` reads what a strategy declared);
- ``RecomputeForm`` and :func:`register_recompute_form`: a cheaper way to re-run an op in
  backward where the backward reads only its first results (training batch norm re-runs
  without its running statistics), bit for bit the op's; :func:`split` uses it;
- ``SWITCHES``: every ``FUNCTRANS_*`` environment variable, by name (a :class:`Switch`),
  read with :func:`switch_value`, set for a block with :func:`switches_overridden`
  (``docs/switches.md`` is their table);
- ``STRATEGY_GROUP`` and ``BACKEND_GROUP``: the entry point groups installed strategies and
  backends are discovered in (the registries are the core's; ``functrans.partitioners`` and
  ``functrans.codegen`` fill them and re-export these functions under shorter names).

>>> import torch, functrans as ft
>>> from functrans import policies
>>> from functrans.extend import COMPUTE_INTENSIVE, PHASE, RECOMPUTED, REMAT, ROLE, SOURCE
>>> def f(x, w):
...     return torch.tanh(x @ w).exp().sum()
>>> jg = ft.joint(ft.remat(f, policy=policies.dots_saveable))(torch.ones(2, 2), torch.ones(2, 2))
>>> mm = next(n for n in jg.ops() if n.name == "mm")
>>> mm.meta[PHASE], mm.meta[REMAT], mm.target.overloadpacket in COMPUTE_INTENSIVE
(<Phase.FORWARD: 'forward'>, <Policy.MUST_SAVE: 'must_save'>, True)
>>> jg.primals()[0].meta[ROLE], mm.meta[SOURCE].split(": ")[-1]
(<Role.PRIMAL: 'primal'>, 'return torch.tanh(x @ w).exp().sum()')
>>> p = ft.partition(jg, "default")
>>> sorted(n.name for n in p.backward.ops() if n.meta.get(RECOMPUTED))  # the policy's choice
['exp', 'tanh']
>>> from functrans.extend import Phase, Strategy
>>> save_dots: Strategy = lambda joint: [
...     n
...     for n in joint.ops()
...     if n.meta[PHASE] is Phase.FORWARD and op_class(n) is OpClass.COMPUTE
... ]
>>> sorted(s.name for s in ft.partition(jg, save_dots).saved)
['mm', 'primals_1', 'primals_2']
>>> from functrans.extend import OP_RULES, CostModel, flops
>>> OP_RULES[OpClass.RANDOM].recompute, OP_RULES[OpClass.COMPUTE].recompute
(False, True)
>>> cost: CostModel = flops
>>> cost(mm)  # 2 * 2 * 2 * 2
16
>>> from functrans.extend import HOST, OFFLOAD_OPS, Cut
>>> plain = ft.joint(f)(torch.ones(2, 2), torch.ones(2, 2))
>>> p = ft.partition(plain, lambda jg: Cut(offloaded=["mm"]))
>>> host = p.forward.output_nodes()[-1]
>>> host.target in OFFLOAD_OPS, host.meta[HOST]
(True, True)
>>> from functrans.extend import SHARED, segments
>>> SHARED in segments(plain).index.values()
False
>>> from functrans.extend import HANDOVER_OPS
>>> sorted(op.name() for op in HANDOVER_OPS)  # an outlined block's forward and backward
['functrans::outlined_bwd', 'functrans::outlined_fwd', 'functrans::outlined_fwd_random']
>>> from functrans.extend import REPLAY_OPS
>>> drop = ft.joint(lambda x: torch.nn.functional.dropout(x, 0.5).sum())(torch.ones(64))
>>> replay = ft.partition(drop, "full_remat").backward  # draws the mask again, from its state
>>> sorted(n.target.__name__ for n in replay.fx_graph.nodes if n.target in REPLAY_OPS)
['run_with_rng_state']
>>> from functrans.extend import RUNNING_NODE
>>> RUNNING_NODE
'functrans: while running node'
>>> from dataclasses import dataclass
>>> from functrans.extend import OptionsCheck, check_strategy_options, parse_options
>>> from functrans.extend import register_strategy
>>> @dataclass(frozen=True)
... class KeepOptions:
...     keep: float = 1.0
>>> check_keep: OptionsCheck = lambda options: parse_options(KeepOptions, "keep", options)
>>> _ = register_strategy("keep", lambda joint, **o: [], check_options=check_keep, replace=True)
>>> check_strategy_options("keep", {"kep": 0.5})
Traceback (most recent call last):
...
functrans._core.errors.InvalidArgumentError: keep: unknown option kep=0.5 (did you mean keep?); ...
>>> from functrans.extend import PeakGoal, PeakGoalOf, registered
>>> cap: PeakGoalOf = lambda options: PeakGoal(options.get("cap"))  # a peak goal, planned per block
>>> _ = register_strategy("capped", lambda joint, **o: [], peak_goal=cap, replace=True)
>>> registered("capped").peak_goal({"cap": 4096}), registered("capped").local
(PeakGoal(limit=4096), False)
>>> from functrans.extend import SWITCHES, switch_value
>>> switch_value(SWITCHES["FUNCTRANS_NATIVE"])  # the C++ executor: on unless turned off
True
>>> from functrans.extend import BACKEND_GROUP, STRATEGY_GROUP
>>> STRATEGY_GROUP, BACKEND_GROUP
('functrans.partitioners', 'functrans.backends')
"""

from ._core.backends import BACKEND_GROUP as BACKEND_GROUP
from ._core.backends import Backend as Backend
from ._core.backends import Capabilities as Capabilities
from ._core.backends import backend_capabilities as backend_capabilities
from ._core.backends import backend_names as backend_names
from ._core.backends import get_backend as get_backend
from ._core.backends import register_backend as register_backend
from ._core.boxed import HANDOVER_OPS as HANDOVER_OPS
from ._core.boxed import RUNNING_NODE as RUNNING_NODE
from ._core.boxed import Boxed as Boxed
from ._core.boxed import BoxedCallable as BoxedCallable
from ._core.boxed import Picked as Picked
from ._core.boxed import boxed as boxed
from ._core.boxed import handover_call as handover_call
from ._core.errors import FunctransError as FunctransError
from ._core.errors import InvalidArgumentError as InvalidArgumentError
from ._core.errors import InvalidPartitionError as InvalidPartitionError
from ._core.errors import UnsupportedOpError as UnsupportedOpError
from ._core.graph import PHASE as PHASE
from ._core.graph import RECOMPUTED as RECOMPUTED
from ._core.graph import ROLE as ROLE
from ._core.graph import SOURCE as SOURCE
from ._core.graph import Graph as Graph
from ._core.graph import JointGraph as JointGraph
from ._core.graph import Phase as Phase
from ._core.graph import Role as Role
from ._core.name_registry import Registry as Registry
from ._core.ops import cancelled_transposes as cancelled_transposes
from ._core.ops import permutation as permutation
from ._core.plugins import PluginError as PluginError
from ._core.plugins import PluginRegistry as PluginRegistry
from ._core.plugins import PluginWarning as PluginWarning
from ._core.private_dir import cache_root as cache_root
from ._core.private_dir import private_dirs as private_dirs
from ._core.private_dir import untrusted as untrusted
from ._core.pytree import tensor_leaves as tensor_leaves
from ._core.shapes import dimension_names as dimension_names
from ._core.shapes import hint as hint
from ._core.shapes import sizes_at as sizes_at
from ._core.strategies import STRATEGY_GROUP as STRATEGY_GROUP
from ._core.strategies import OptionsCheck as OptionsCheck
from ._core.strategies import PeakGoal as PeakGoal
from ._core.strategies import PeakGoalOf as PeakGoalOf
from ._core.strategies import RegisteredStrategy as RegisteredStrategy
from ._core.strategies import check_strategy_options as check_strategy_options
from ._core.strategies import register_strategy as register_strategy
from ._core.strategies import registered as registered
from ._core.strategies import registered_strategy as registered_strategy
from ._core.strategies import strategy_examples as strategy_examples
from ._core.strategies import strategy_names as strategy_names
from ._core.switches import SWITCHES as SWITCHES
from ._core.switches import Switch as Switch
from ._core.switches import SwitchError as SwitchError
from ._core.switches import path_prefixed as path_prefixed
from ._core.switches import switch_value as switch_value
from ._core.switches import switches_overridden as switches_overridden
from ._core.tags import REMAT as REMAT
from ._core.tags import Policy as Policy
from ._core.tags import policy_of as policy_of
from ._core.validate import check_names as check_names
from ._core.validate import check_number as check_number
from ._core.validate import check_option as check_option
from ._core.validate import parse_options as parse_options
from ._cut.cost import COMPUTE_INTENSIVE as COMPUTE_INTENSIVE
from ._cut.cost import OpClass as OpClass
from ._cut.cost import activation_bytes as activation_bytes
from ._cut.cost import flops as flops
from ._cut.cost import is_collective as is_collective
from ._cut.cost import is_input_alias as is_input_alias
from ._cut.cost import is_random as is_random
from ._cut.cost import nbytes as nbytes
from ._cut.cost import op_class as op_class
from ._cut.cost import read_bytes as read_bytes
from ._cut.cost import saved_activation_bytes as saved_activation_bytes
from ._cut.cost import storage_nbytes as storage_nbytes
from ._cut.cost import storage_of as storage_of
from ._cut.memory import MemoryProfile as MemoryProfile
from ._cut.memory import MemoryStep as MemoryStep
from ._cut.memory import peak_bytes as peak_bytes
from ._cut.memory import simulate as simulate
from ._cut.offload import HOST as HOST
from ._cut.offload import Cut as Cut
from ._cut.offload import Offload as Offload
from ._cut.offload import why_not_offload as why_not_offload
from ._cut.partition import Partition as Partition
from ._cut.partition import Strategy as Strategy
from ._cut.partition import apply_cut as apply_cut
from ._cut.problem import OP_RULES as OP_RULES
from ._cut.problem import CostModel as CostModel
from ._cut.problem import CutProblem as CutProblem
from ._cut.problem import ForwardValue as ForwardValue
from ._cut.problem import OpRule as OpRule
from ._cut.problem import cut_problem as cut_problem
from ._cut.recompute_forms import RecomputeForm as RecomputeForm
from ._cut.recompute_forms import register_recompute_form as register_recompute_form
from ._cut.replay import REPLAY_OPS as REPLAY_OPS
from ._cut.scratch import scratch_bytes as scratch_bytes
from ._cut.segments import SHARED as SHARED
from ._cut.segments import Segments as Segments
from ._cut.segments import differentiated_primals as differentiated_primals
from ._cut.segments import segments as segments
from ._cut.split import ancestors as ancestors
from ._cut.split import split as split
from ._cut.transfer import OFFLOAD_OPS as OFFLOAD_OPS
from ._cut.transfer import PinnedHost as PinnedHost
from ._cut.transfer import Transfer as Transfer
from ._cut.transfer import is_transfer as is_transfer
from ._cut.transfer import use_transfer as use_transfer
from ._trace.decomp import decomposition_table_all as decomposition_table_all
from ._trace.trace import retrace as retrace
