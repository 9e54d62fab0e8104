"""The plugin surface: everything a partition strategy or codegen backend may import.

Third-party strategies and backends import from here (and torch, numpy, scipy, triton), never
from functrans' private modules, so the core can change underneath them.

>>> from functrans.extend import JointGraph, OpClass, op_class, activation_bytes
"""

from ._cost import COMPUTE_INTENSIVE as COMPUTE_INTENSIVE
from ._cost import OpClass as OpClass
from ._cost import activation_bytes as activation_bytes
from ._cost import flops as flops
from ._cost import is_input_alias as is_input_alias
from ._cost import is_random as is_random
from ._cost import nbytes as nbytes
from ._cost import op_class as op_class
from ._cost import read_bytes as read_bytes
from ._cost import saved_activation_bytes as saved_activation_bytes
from ._cost import storage_nbytes as storage_nbytes
from ._cost import storage_of as storage_of
from ._cut_problem import OP_RULES as OP_RULES
from ._cut_problem import CostModel as CostModel
from ._cut_problem import CutProblem as CutProblem
from ._cut_problem import ForwardValue as ForwardValue
from ._cut_problem import OpRule as OpRule
from ._cut_problem import cut_problem as cut_problem
from ._decomp import decomposition_table_all as decomposition_table_all
from ._errors import FunctransError as FunctransError
from ._errors import InvalidArgumentError as InvalidArgumentError
from ._errors import InvalidPartitionError as InvalidPartitionError
from ._errors import UnsupportedOpError as UnsupportedOpError
from ._graph import PHASE as PHASE
from ._graph import RECOMPUTED as RECOMPUTED
from ._graph import ROLE as ROLE
from ._graph import SOURCE as SOURCE
from ._graph import Graph as Graph
from ._graph import JointGraph as JointGraph
from ._graph import Phase as Phase
from ._graph import Role as Role
from ._memory import peak_bytes as peak_bytes
from ._partition import Strategy as Strategy
from ._plugins import PluginError as PluginError
from ._plugins import PluginRegistry as PluginRegistry
from ._plugins import PluginWarning as PluginWarning
from ._pytree import tensor_leaves as tensor_leaves
from ._registry import Registry as Registry
from ._split import ancestors as ancestors
from ._split import split as split
from ._tags import REMAT as REMAT
from ._tags import Policy as Policy
from ._tags import policy_of as policy_of
from ._trace import retrace as retrace
from ._validate import check_names as check_names
from ._validate import check_number as check_number
from ._validate import check_option as check_option
from ._validate import parse_options as parse_options
