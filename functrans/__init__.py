"""functrans: JAX-style pure function transforms over PyTorch.

Trace a function to an ATen graph, build its joint forward+backward graph, and partition it into
forward and backward graphs that save exactly what you choose.
"""

from . import distributed as distributed
from . import viz as viz
from ._core.errors import FunctransError as FunctransError
from ._core.errors import InvalidArgumentError as InvalidArgumentError
from ._core.errors import InvalidPartitionError as InvalidPartitionError
from ._core.errors import TraceError as TraceError
from ._core.errors import UnknownNameError as UnknownNameError
from ._core.errors import UnsupportedOpError as UnsupportedOpError
from ._core.graph import Graph as Graph
from ._core.graph import GraphError as GraphError
from ._core.graph import JointGraph as JointGraph
from ._core.graph import Phase as Phase
from ._core.graph import Role as Role
from ._core.graph import verify as verify
from ._core.stack import TransformError as TransformError
from ._cut.offload import Offload as Offload
from ._cut.pareto import ParetoPoint as ParetoPoint
from ._cut.pareto import pareto as pareto
from ._cut.partition import Partition as Partition
from ._cut.partition import SavedValue as SavedValue
from ._cut.partition import partition as partition
from ._cut.split import split as split
from ._jit.functional import grad as grad
from ._jit.functional import value_and_grad as value_and_grad
from ._jit.functional import vjp as vjp
from ._trace.joint import joint as joint
from ._trace.trace import trace as trace
from ._transforms.custom import custom_jvp as custom_jvp
from ._transforms.custom import custom_vjp as custom_vjp
from ._transforms.func import ShapeDtypeStruct as ShapeDtypeStruct
from ._transforms.func import eval_shape as eval_shape
from ._transforms.func import hessian as hessian
from ._transforms.func import jacfwd as jacfwd
from ._transforms.func import jacrev as jacrev
from ._transforms.func import jvp as jvp
from ._transforms.func import linearize as linearize
from ._transforms.func import stop_gradient as stop_gradient
from ._transforms.func import vmap as vmap

__version__ = "0.1.0"
from . import policies as policies
from ._core.logs import set_logs as set_logs
from ._cut.residuals import print_saved_residuals as print_saved_residuals
from ._cut.residuals import saved_residuals as saved_residuals
from ._jit.api import jit as jit
from ._jit.dynamo import dynamo_backend as dynamo_backend
from ._jit.eager_budget import remat as remat
from ._trace.names import checkpoint_name as checkpoint_name
from ._trace.regions.finding import region as region
from ._transforms.checkpoint import checkpoint as checkpoint
from ._transforms.scan import scan as scan
