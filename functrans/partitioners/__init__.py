"""Partition strategies: one per module, each registered here under its name.

A strategy is a callable ``(joint: JointGraph, **options) -> saved nodes``; it only chooses,
``functrans.split`` does the surgery. Register your own with :func:`register`:

>>> import functrans as ft
>>> from functrans import partitioners
>>> def save_primals_only(joint):
...     return [n for n in joint.primals()]
>>> _ = partitioners.register("my_remat", save_primals_only, replace=True)
>>> "my_remat" in partitioners.names()
True

The registry fills itself on first use (importing this package loads no strategy): every public
module of this package (each ends with one ``register(...)`` call), then the installed plugins,
the entry points of group ``functrans.partitioners``. An entry point names a strategy callable
(registered under the entry point's name, run by the property suite with no options) or a module
that calls :func:`register` itself (to give aliases or example options)::

    [project.entry-points."functrans.partitioners"]
    save_inputs = "my_package.strategies:save_inputs"
"""

from functrans.extend import STRATEGY_GROUP as GROUP
from functrans.extend import RegisteredStrategy as Registered
from functrans.extend import register_strategy as register
from functrans.extend import registered_strategy as get
from functrans.extend import strategy_examples as examples
from functrans.extend import strategy_names as names

__all__ = ["GROUP", "Registered", "examples", "get", "names", "register"]
