"""functrans: JAX-style pure function transforms over PyTorch.

Trace a function to an ATen graph, build its joint forward+backward graph, and partition it into
forward and backward graphs that save exactly what you choose.
"""

from . import distributed as distributed
from . import viz as viz
from ._api import grad as grad
from ._api import value_and_grad as value_and_grad
from ._api import vjp as vjp
from ._custom import custom_jvp as custom_jvp
from ._custom import custom_vjp as custom_vjp
from ._errors import FunctransError as FunctransError
from ._errors import InvalidArgumentError as InvalidArgumentError
from ._errors import InvalidPartitionError as InvalidPartitionError
from ._errors import TraceError as TraceError
from ._errors import UnknownNameError as UnknownNameError
from ._errors import UnsupportedOpError as UnsupportedOpError
from ._func import ShapeDtypeStruct as ShapeDtypeStruct
from ._func import eval_shape as eval_shape
from ._func import hessian as hessian
from ._func import jacfwd as jacfwd
from ._func import jacrev as jacrev
from ._func import jvp as jvp
from ._func import linearize as linearize
from ._func import stop_gradient as stop_gradient
from ._func import vmap as vmap
from ._graph import Graph as Graph
from ._graph import GraphError as GraphError
from ._graph import JointGraph as JointGraph
from ._graph import Phase as Phase
from ._graph import Role as Role
from ._graph import verify as verify
from ._joint import joint as joint
from ._offload import Offload as Offload
from ._pareto import ParetoPoint as ParetoPoint
from ._pareto import pareto as pareto
from ._partition import Partition as Partition
from ._partition import SavedValue as SavedValue
from ._partition import partition as partition
from ._split import split as split
from ._stack import TransformError as TransformError
from ._trace import trace as trace

__version__ = "0.1.0"
from . import policies as policies
from ._checkpoint import checkpoint as checkpoint
from ._dynamo import dynamo_backend as dynamo_backend
from ._jit_api import jit as jit
from ._logs import set_logs as set_logs
from ._names import checkpoint_name as checkpoint_name
from ._regions import region as region
from ._remat import remat as remat
from ._residuals import print_saved_residuals as print_saved_residuals
from ._residuals import saved_residuals as saved_residuals
