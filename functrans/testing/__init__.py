"""Public testing tools: hypothesis strategies for random programs and saved sets, and checkers
that compare functrans against eager autograd. Use them to fuzz your own strategies:

>>> import torch
>>> from functrans.testing import check_partition
>>> _ = check_partition(lambda x: (x.exp() * x).sum(), (torch.randn(4),), "default")
"""

from ._check import assert_close as assert_close
from ._check import check_partition as check_partition
from ._check import check_split as check_split
from ._check import eager_vjp as eager_vjp
from ._check import saved_sets as saved_sets
from ._check import split_and_check as split_and_check
from ._programs import Program as Program
from ._programs import programs as programs
