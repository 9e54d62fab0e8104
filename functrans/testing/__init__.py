"""Public testing tools: hypothesis strategies for random programs, saved sets and remat
policies; checkers that compare functrans (partitions, codegen backends) against eager
autograd; and the whole property suite for your own strategy or backend. Fuzz your own:

>>> import torch
>>> from functrans.testing import check_backend, check_partition
>>> _ = check_partition(lambda x: (x.exp() * x).sum(), (torch.randn(4),), "default")
>>> _ = check_backend(lambda x: (x.exp() * x).sum(), (torch.randn(4),), "aten", "full_remat")

In a test file, ``test_mine = register_partitioner_tests("my_strategy")`` (or
``register_backend_tests("my_backend")``) runs the property suite under pytest.

``measure_peak(step)`` measures what a step makes the allocator hold, the figure
:attr:`functrans.Partition.peak_bytes` reports:

>>> import torch, functrans as ft
>>> from functrans.testing import measure_peak
>>> p = ft.partition(ft.joint(lambda x: x.exp().sum())(torch.ones(256)), "default")
>>> def step():
...     out, saved = p.forward(torch.ones(256))
...     return p.backward(saved, (torch.tensor(1.0),))
>>> measure_peak(step).peak_bytes == p.peak_bytes
True
"""

from ._backend import check_backend as check_backend
from ._check import assert_close as assert_close
from ._check import check_dynamic_partition as check_dynamic_partition
from ._check import check_partition as check_partition
from ._check import check_split as check_split
from ._check import eager_vjp as eager_vjp
from ._check import saved_sets as saved_sets
from ._check import seeded as seeded
from ._check import split_and_check as split_and_check
from ._check import tolerances as tolerances
from ._peak import PeakMemory as PeakMemory
from ._peak import measure_peak as measure_peak
from ._program import Program as Program
from ._random_programs import programs as programs
from ._suite import check_policy_tags as check_policy_tags
from ._suite import register_backend_tests as register_backend_tests
from ._suite import register_partitioner_tests as register_partitioner_tests
from ._suite import remat_policies as remat_policies
from ._suite import reproduces_eager_rng as reproduces_eager_rng
