"""Remat policies: per-op decisions of what a ``remat`` region saves for backward.

A policy (:class:`PolicyFn`) is a callable ``(op, *args, **kwargs) -> Policy | bool`` called
for every ATen op in the region (``True`` means save: ``Policy.MUST_SAVE``; ``False`` means
recompute: ``Policy.MUST_RECOMPUTE``). torch's ``CheckpointPolicy`` values and plain lists of ops
are accepted wherever a policy is (:data:`PolicyLike`). The built-ins carry JAX's names and
meanings. ``Policy.MUST_OFFLOAD`` saves a value in host memory instead of on the device (never
recomputed; copied out once after the forward, back in each backward that needs it):
:func:`save_and_offload_only_these_names` and :func:`offload_dot_with_no_batch_dims` answer it,
and so does torch's ``CheckpointPolicy.MUST_CPU_OFFLOAD``.

>>> import torch
>>> from functrans import policies
>>> aten = torch.ops.aten
>>> policies.dots_saveable(aten.mm.default), policies.dots_saveable(aten.sin.default)
(True, False)
"""

from ._transforms.policies import NAME_OP as NAME_OP
from ._transforms.policies import InvalidPolicyError as InvalidPolicyError
from ._transforms.policies import Policy as Policy
from ._transforms.policies import PolicyFn as PolicyFn
from ._transforms.policies import PolicyLike as PolicyLike
from ._transforms.policies import convention as convention
from ._transforms.policies import dots_saveable as dots_saveable
from ._transforms.policies import (
    dots_with_no_batch_dims_saveable as dots_with_no_batch_dims_saveable,
)
from ._transforms.policies import everything_saveable as everything_saveable
from ._transforms.policies import normalize as normalize
from ._transforms.policies import nothing_saveable as nothing_saveable
from ._transforms.policies import offload_dot_with_no_batch_dims as offload_dot_with_no_batch_dims
from ._transforms.policies import reshard_after_forward as reshard_after_forward
from ._transforms.policies import (
    save_and_offload_only_these_names as save_and_offload_only_these_names,
)
from ._transforms.policies import save_any_names_but_these as save_any_names_but_these
from ._transforms.policies import save_from_both_policies as save_from_both_policies
from ._transforms.policies import save_only_these_names as save_only_these_names
from ._transforms.policies import save_ops as save_ops

__all__ = [
    "NAME_OP",
    "InvalidPolicyError",
    "Policy",
    "PolicyFn",
    "PolicyLike",
    "convention",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "everything_saveable",
    "normalize",
    "nothing_saveable",
    "offload_dot_with_no_batch_dims",
    "reshard_after_forward",
    "save_and_offload_only_these_names",
    "save_any_names_but_these",
    "save_from_both_policies",
    "save_only_these_names",
    "save_ops",
]

# its error class is printed in tracebacks as this module's
InvalidPolicyError.__module__ = __name__
