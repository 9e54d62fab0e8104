"""Bad input over the whole public API is never silent and never raw.

The cases are generated: every public entry point crossed with bad values of each of its
arguments (None, strings, floats, out-of-range ints, numpy arrays, meta tensors, wrong pytrees,
wrong shapes and dtypes...). Each call either succeeds (where the value is legitimate) or raises
a :class:`functrans.FunctransError` whose message names the op and the argument. A raw Python or
torch error is accepted only where it comes out of the user's own function (``u_*`` below):
those propagate as they are, functrans does not wrap them. test_errors.py holds the hand-written
cases of the partition strategies' options; this file is the sweep.
"""

from __future__ import annotations

import math
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

import functrans as ft
from functrans import policies

FT_DIR = os.path.dirname(ft.__file__)
HERE = os.path.abspath(__file__)


# -- the user's functions: an error raised in these is the user's own and propagates as is ---


def u_sum(x):
    return x.sin().sum()


def u_vec(x):
    return x.sin()


def u_two(x, y):
    return (x * y).sum()


def u_pair(x):
    return x.sin(), x.cos()


def u_tree(d):
    return d["a"].sin().sum() + d["b"].cos().sum()


def u_aux(x):
    return x.sin().sum(), x.cos()


def u_raises(x):
    raise RuntimeError("the user's own error")


def u_bad_op(x):
    return x @ torch.ones(5, 5)  # shape mismatch inside the user's code


X = torch.randn(3)
XS = torch.randn(4, 3)
YS = torch.randn(4, 3)
NP = np.ones(3, dtype=np.float32)
META = torch.ones(3, device="meta")
INT = torch.arange(3)


def _is_user_frame(frame: traceback.FrameSummary) -> bool:
    return os.path.abspath(frame.filename) == HERE and frame.name.startswith("u_")


def _owner(exc: BaseException) -> str:
    """Who raised ``exc``: "user" when the deepest frame in this file or in functrans is one of
    the user's functions, else "functrans" (torch/stdlib frames are skipped: they ran on behalf
    of whichever of the two called them)."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = os.path.abspath(frame.filename)
        if path == HERE:
            return "user" if _is_user_frame(frame) else "call site"
        if path.startswith(FT_DIR):
            return "functrans"
    return "unknown"


@dataclass(frozen=True)
class Case:
    """One bad-input call: ``call()`` must raise a FunctransError naming every string in
    ``names`` (or succeed, where ``may_succeed``)."""

    id: str
    call: Callable[[], object]
    names: tuple[str, ...] = ()
    may_succeed: bool = False
    user_error: bool = field(default=False)  # a raw error from the user's function is fine


CASES: list[Case] = []


def case(
    id: str,
    call: Callable[[], object],
    *names: str,
    may_succeed: bool = False,
    user_error: bool = False,
) -> None:
    CASES.append(Case(id, call, names, may_succeed, user_error))


BAD_FUNCS = {"None": None, "str": "sin", "int": 3, "tensor": torch.ones(2)}

# -- f that is not callable, for every transform -------------------------------------------

for fname, bad in BAD_FUNCS.items():
    for op, make in {
        "grad": lambda f: ft.grad(f)(X),
        "value_and_grad": lambda f: ft.value_and_grad(f)(X),
        "jacrev": lambda f: ft.jacrev(f)(X),
        "jacfwd": lambda f: ft.jacfwd(f)(X),
        "hessian": lambda f: ft.hessian(f)(X),
        "vmap": lambda f: ft.vmap(f)(XS),
        "jit": lambda f: ft.jit(f)(X),
        "remat": lambda f: ft.remat(f)(X),
        "trace": lambda f: ft.trace(f)(X),
        "joint": lambda f: ft.joint(f)(X),
        "vjp": lambda f: ft.vjp(f, X),
        "jvp": lambda f: ft.jvp(f, (X,), (X,)),
        "linearize": lambda f: ft.linearize(f, X),
        "eval_shape": lambda f: ft.eval_shape(f, X),
        "saved_residuals": lambda f: ft.saved_residuals(f, X),
        "custom_vjp": lambda f: ft.custom_vjp(f),
        "custom_jvp": lambda f: ft.custom_jvp(f),
    }.items():
        case(f"{op}-f-{fname}", lambda make=make, bad=bad: make(bad), op, "callable")

# -- argnums --------------------------------------------------------------------------------

BAD_ARGNUMS: dict[str, Any] = {
    "out-of-range": 5,
    "negative-out-of-range": -5,
    "str": "x",
    "float": 1.5,
    "bool": True,
    "duplicate": (0, 0),
    "str-in-tuple": (0, "a"),
    "empty": (),
    "None": None,
    "dict": {"a": 0},
}
for aname, bad in BAD_ARGNUMS.items():
    for op, make in {
        "grad": lambda a: ft.grad(u_two, argnums=a)(X, X),
        "value_and_grad": lambda a: ft.value_and_grad(u_two, argnums=a)(X, X),
        "jacrev": lambda a: ft.jacrev(u_two, argnums=a)(X, X),
        "jacfwd": lambda a: ft.jacfwd(u_two, argnums=a)(X, X),
        "hessian": lambda a: ft.hessian(u_two, argnums=a)(X, X),
        "joint": lambda a: ft.joint(u_two, argnums=a)(X, X),
    }.items():
        if op == "joint" and aname == "None":
            continue  # joint(argnums=None): every argument, documented
        case(f"{op}-argnums-{aname}", lambda make=make, bad=bad: make(bad), "argnums")

# -- booleans: has_aux, strict, cse, prevent_cse --------------------------------------------

for bname, bad in {"str": "yes", "int": 1, "None": None, "list": [True]}.items():
    for op, make in {
        "grad": lambda b: ft.grad(u_aux, has_aux=b)(X),
        "value_and_grad": lambda b: ft.value_and_grad(u_aux, has_aux=b)(X),
        "jacrev": lambda b: ft.jacrev(u_aux, has_aux=b)(X),
        "jacfwd": lambda b: ft.jacfwd(u_aux, has_aux=b)(X),
        "jvp": lambda b: ft.jvp(u_aux, (X,), (X,), has_aux=b),
        "joint": lambda b: ft.joint(u_aux, has_aux=b)(X),
    }.items():
        case(f"{op}-has_aux-{bname}", lambda make=make, bad=bad: make(bad), "has_aux")
    case(f"jvp-strict-{bname}", lambda bad=bad: ft.jvp(u_vec, (X,), (X,), strict=bad), "strict")
    case(f"trace-cse-{bname}", lambda bad=bad: ft.trace(u_vec, cse=bad)(X), "cse")
    case(
        f"remat-prevent_cse-{bname}",
        lambda bad=bad: ft.remat(u_vec, prevent_cse=bad),
        "prevent_cse",
    )
    case(
        f"remat-decorator-prevent_cse-{bname}",
        lambda bad=bad: ft.remat(prevent_cse=bad),
        "prevent_cse",
    )

# -- static_argnums: jit, trace, remat ------------------------------------------------------

BAD_STATIC: dict[str, Any] = {
    "str": "x",
    "float": 1.5,
    "bool": True,
    "str-in-tuple": (0, "a"),
    "None": None,
    "float-in-tuple": (1.0,),
    "dict": {0: 1},
}
for sname, bad in BAD_STATIC.items():
    case(
        f"jit-static_argnums-{sname}",
        lambda bad=bad: ft.jit(u_two, static_argnums=bad)(X, X),
        "static_argnums",
    )
    case(
        f"trace-static_argnums-{sname}",
        lambda bad=bad: ft.trace(u_two, static_argnums=bad)(X, X),
        "static_argnums",
    )
    case(
        f"remat-static_argnums-{sname}",
        lambda bad=bad: ft.remat(u_two, static_argnums=bad),
        "static_argnums",
    )
case(
    "jit-static_argnums-out-of-range",
    lambda: ft.jit(u_two, static_argnums=(5,))(X, X),
    "static_argnums",
)
case(
    "trace-static_argnums-out-of-range",
    lambda: ft.trace(u_two, static_argnums=(5,))(X, X),
    "static_argnums",
)

# -- partition strategy and options, through every entry point that takes one ---------------

BAD_STRATEGIES: dict[str, Any] = {"int": 3, "None": None, "unknown": "nope", "list": ["min_cut"]}
for sname, bad in BAD_STRATEGIES.items():
    for op, make in {
        "grad": lambda s: ft.grad(u_sum, partition=s)(X),
        "value_and_grad": lambda s: ft.value_and_grad(u_sum, partition=s)(X),
        "vjp": lambda s: ft.vjp(u_sum, X, partition=s),
        "jit": lambda s: ft.jit(u_sum, partition=s)(X.requires_grad_()),
        "saved_residuals": lambda s: ft.saved_residuals(u_sum, X, partition=s),
        "partition": lambda s: ft.partition(ft.joint(u_sum)(X), s),
    }.items():
        case(
            f"{op}-partition-{sname}",
            lambda make=make, bad=bad: make(bad),
            "strategy" if sname != "unknown" else "nope",
        )
for op, make in {
    "grad": lambda: ft.grad(u_sum, budgt=0.3)(X),
    "vjp": lambda: ft.vjp(u_sum, X, budgt=0.3),
    "jit": lambda: ft.jit(u_sum, budgt=0.3)(X.requires_grad_()),
    "saved_residuals": lambda: ft.saved_residuals(u_sum, X, budgt=0.3),
}.items():
    case(f"{op}-unknown-option", make, "budgt")
# partition()'s own parameter given as an option: named, with the keyword that takes it
for op, make in {
    "grad": lambda: ft.grad(u_sum, strategy="min_cut"),
    "value_and_grad": lambda: ft.value_and_grad(u_sum, strategy="min_cut"),
    "vjp": lambda: ft.vjp(u_sum, X, strategy="min_cut"),
    "jit": lambda: ft.jit(u_sum, strategy="min_cut"),
    "jit-module": lambda: ft.jit(torch.nn.Linear(3, 3), joint=None),
}.items():
    case(f"{op}-partition-parameter-as-option", make, "partition=")

# every option of every built-in strategy, given nonsense
JG = None


def _jg():
    global JG
    if JG is None:
        JG = ft.joint(lambda x, w: torch.tanh(x @ w).sum())(torch.randn(4, 4), torch.randn(4, 4))
    return JG


STRATEGY_OPTIONS = {
    "min_cut": ["recompute_views", "ban_reductions", "reduction_ratio"],
    "memory_budget": ["budget", "max_bytes", "peak_bytes", "solver", "cost", "time_limit"],
    "optimal": ["budget", "cost", "time_limit"],
    "min_peak": ["cost", "time_limit"],
}
NONSENSE: dict[str, Any] = {
    "None": None,
    "str": "x",
    "nan": math.nan,
    "neg": -1,
    "obj": object(),
    "list": [1],
    "tensor": torch.ones(2),
}
for strategy, options in STRATEGY_OPTIONS.items():
    for option in options:
        for nname, bad in NONSENSE.items():
            needs_budget = strategy in ("optimal", "memory_budget")
            extra = (
                {"budget": 0.5} if needs_budget and option not in ("budget", "max_bytes") else {}
            )
            case(
                f"partition-{strategy}-{option}-{nname}",
                lambda s=strategy, o=option, b=bad, e=extra: ft.partition(_jg(), s, **{o: b}, **e),
                strategy,
                option,
                may_succeed=nname == "None" and option not in ("budget",),
            )

# -- partition / split / pareto / verify on things that are not joint graphs ----------------

for gname, bad in {"None": None, "str": "jg", "int": 3, "tensor": X, "graph": "TRACED"}.items():

    def get(bad=bad):
        return ft.trace(u_vec)(X) if bad == "TRACED" else bad

    case(f"partition-joint-{gname}", lambda get=get: ft.partition(get()), "partition", "joint")
    case(f"split-joint-{gname}", lambda get=get: ft.split(get(), []), "split", "joint")
    case(f"pareto-joint-{gname}", lambda get=get: ft.pareto(get()), "pareto", "joint")
    if gname != "graph":
        case(f"verify-{gname}", lambda get=get: ft.verify(get()), "verify", "graph")
        case(
            f"print_saved_residuals-f-{gname}",
            lambda get=get: ft.print_saved_residuals(get(), X),
            "callable",
        )
for sname, bad in {
    "None": None,
    "int": 3,
    "str": "mm",
    "unknown-name": ["nope"],
    "obj": [object()],
}.items():
    names = ("saved",) if sname == "unknown-name" else ("split", "saved")
    case(f"split-saved-{sname}", lambda bad=bad: ft.split(_jg(), bad), *names)
for bname, bad in {"str": "nope", "None": None, "int": 3}.items():
    case(f"pareto-by-{bname}", lambda bad=bad: ft.pareto(_jg(), by=bad), "pareto", "by")

# -- vjp: the cotangents given to vjp_fn ----------------------------------------------------

BAD_COTANGENTS: dict[str, Callable[[], Any]] = {
    "wrong-shape": lambda: torch.ones(5),
    "scalar": lambda: torch.tensor(1.0),
    "wrong-tree-tuple": lambda: (torch.ones(3), torch.ones(3)),
    "wrong-tree-dict": lambda: {"a": torch.ones(3)},
    "None": lambda: None,
    "str": lambda: "x",
    "float": lambda: 1.0,
    "numpy": lambda: NP,
    "meta": lambda: META,
    "int-tensor": lambda: torch.ones(3, dtype=torch.int64),
    "double": lambda: torch.ones(3, dtype=torch.float64),
    "list": lambda: [torch.ones(3)],
}
for cname, make in BAD_COTANGENTS.items():
    case(
        f"vjp_fn-cotangent-{cname}",
        lambda make=make: ft.vjp(u_vec, X)[1](make()),
        "vjp_fn",
        "cotangent",
    )
for cname, make in {
    "one-of-two": lambda: (torch.ones(3),),
    "three-of-two": lambda: (torch.ones(3),) * 3,
    "second-wrong-shape": lambda: (torch.ones(3), torch.ones(2)),
    "second-None": lambda: (torch.ones(3), None),
    "not-a-tuple": lambda: torch.ones(3),
}.items():
    case(
        f"vjp_fn-pair-cotangent-{cname}",
        lambda make=make: ft.vjp(u_pair, X)[1](make()),
        "vjp_fn",
        "cotangent",
    )

# -- jvp: primals and tangents --------------------------------------------------------------

BAD_TANGENTS: dict[str, Callable[[], Any]] = {
    "wrong-shape": lambda: (torch.ones(5),),
    "double": lambda: (X.double(),),
    "int": lambda: (INT,),
    "two-for-one": lambda: (X, X),
    "none-for-one": lambda: (),
    "wrong-tree": lambda: ({"a": X},),
    "None": lambda: (None,),
    "str": lambda: ("x",),
    "numpy": lambda: (NP,),
    "meta": lambda: (META,),
    "not-a-tuple": lambda: X,
    "None-not-a-tuple": lambda: None,
}
for tname, make in BAD_TANGENTS.items():
    case(f"jvp-tangents-{tname}", lambda make=make: ft.jvp(u_vec, (X,), make()), "jvp", "tangent")
for pname, bad in {
    "None": (None,),
    "str": ("x",),
    "float": (1.0,),
    "numpy": (NP,),
    "int": (INT,),
}.items():
    case(f"jvp-primals-{pname}", lambda bad=bad: ft.jvp(u_vec, bad, bad), "jvp", "primal")
case(
    "jvp-tree-tangents-missing-leaf",
    lambda: ft.jvp(u_tree, ({"a": X, "b": X},), ({"a": X},)),
    "jvp",
    "tangent",
)
case(
    "jvp-tree-tangents-wrong-shape",
    lambda: ft.jvp(u_tree, ({"a": X, "b": X},), ({"a": X, "b": torch.ones(2)},)),
    "jvp",
    "tangent",
)
for tname, make in {
    "wrong-shape": lambda: torch.ones(5),
    "None": lambda: None,
    "str": lambda: "x",
    "double": lambda: X.double(),
}.items():
    case(
        f"linearize-jvp_fn-{tname}",
        lambda make=make: ft.linearize(u_vec, X)[1](make()),
        "linearize",
        "tangent",
    )

# -- vmap: in_dims, out_dims, randomness, chunk_size, the batch itself -----------------------

BAD_IN_DIMS: dict[str, Any] = {
    "too-short": (0,),
    "too-long": (0, 0, 0),
    "out-of-range": 5,
    "negative-out-of-range": -5,
    "str": "x",
    "float": 1.5,
    "bool": True,
    "str-in-tuple": (0, "a"),
    "dict": {"a": 0},
    "all-None": (None, None),
    "list-too-short": [0],
}
for iname, bad in BAD_IN_DIMS.items():
    case(
        f"vmap-in_dims-{iname}",
        lambda bad=bad: ft.vmap(u_two, in_dims=bad)(XS, YS),
        "vmap",
        "in_dims",
    )
    case(
        f"vmap-of-grad-in_dims-{iname}",
        lambda bad=bad: ft.vmap(ft.grad(u_two), in_dims=bad)(XS, YS),
        "vmap",
        "in_dims",
    )
case(
    "vmap-in_dims-tree-mismatch",
    lambda: ft.vmap(u_tree, in_dims=({"a": 0},))({"a": XS, "b": YS}),
    "vmap",
    "in_dims",
)
case("vmap-batch-sizes-differ", lambda: ft.vmap(u_two)(XS, torch.ones(5, 3)), "vmap", "in_dims")
case(
    "vmap-of-grad-batch-sizes-differ",
    lambda: ft.vmap(ft.grad(u_two))(XS, torch.ones(5, 3)),
    "vmap",
    "in_dims",
)
case(
    "vmap-scalar-input",
    lambda: ft.vmap(u_two)(torch.tensor(1.0), torch.tensor(2.0)),
    "vmap",
    "in_dims",
)
for iname, bad in {"None": None, "str": "x", "numpy": NP, "float": 1.0}.items():
    case(f"vmap-input-{iname}", lambda bad=bad: ft.vmap(u_two)(bad, YS), "vmap", "in_dims")
for oname, bad in {
    "out-of-range": 5,
    "str": "x",
    "float": 1.5,
    "tuple-too-long": (0, 0),
    "bool": True,
}.items():
    case(
        f"vmap-out_dims-{oname}",
        lambda bad=bad: ft.vmap(u_vec, out_dims=bad)(XS),
        "vmap",
        "out_dims",
    )
for rname, bad in {"str": "x", "None": None, "int": 1}.items():
    case(
        f"vmap-randomness-{rname}",
        lambda bad=bad: ft.vmap(u_vec, randomness=bad)(XS),
        "vmap",
        "randomness",
    )
    case(
        f"jacfwd-randomness-{rname}",
        lambda bad=bad: ft.jacfwd(u_vec, randomness=bad)(X),
        "jacfwd",
        "randomness",
    )
for cname, bad in {"zero": 0, "str": "x", "bool": True, "float": 2.0}.items():
    case(
        f"vmap-chunk_size-{cname}",
        lambda bad=bad: ft.vmap(u_vec, chunk_size=bad)(XS),
        "vmap",
        "chunk_size",
    )
    case(
        f"jacrev-chunk_size-{cname}",
        lambda bad=bad: ft.jacrev(u_vec, chunk_size=bad)(X),
        "jacrev",
        "chunk_size",
    )

# -- inputs: non-tensors, numpy arrays, meta tensors, integer tensors -----------------------

# what the numpy message names besides the op: the argument (its name where a trace knows it)
NUMPY_NAMES = {
    "jit": ("numpy", "argument 0"),
    "grad": ("numpy", "argument 0 (x)"),
    "value_and_grad": ("numpy", "argument 0 (x)"),
    "trace": ("numpy", "u_sum: input x"),
    "joint": ("numpy", "u_sum: input x"),
    "saved_residuals": ("numpy", "u_sum: input x"),
    "jacrev": ("numpy",),
    "jacfwd": ("numpy",),
    "hessian": ("numpy",),
}
BAD_INPUTS: dict[str, Any] = {"numpy": NP, "meta": META, "None": None, "str": "x"}
for iname, bad in BAD_INPUTS.items():
    user = iname in ("None", "str")  # u_sum calls .sin() on it: the user's AttributeError
    for op, make in {
        "grad": lambda v: ft.grad(u_sum)(v),
        "value_and_grad": lambda v: ft.value_and_grad(u_sum)(v),
        "vjp": lambda v: ft.vjp(u_sum, v),
        "jit": lambda v: ft.jit(u_sum)(v),
        "trace": lambda v: ft.trace(u_sum)(v),
        "joint": lambda v: ft.joint(u_sum)(v),
        "jacrev": lambda v: ft.jacrev(u_sum)(v),
        "jacfwd": lambda v: ft.jacfwd(u_sum)(v),
        "hessian": lambda v: ft.hessian(u_sum)(v),
        "saved_residuals": lambda v: ft.saved_residuals(u_sum, v),
    }.items():
        case(
            f"{op}-input-{iname}",
            lambda make=make, bad=bad: make(bad),
            *(NUMPY_NAMES.get(op, ("numpy", "input x")) if iname == "numpy" else ()),
            op if op not in ("jit", "trace", "joint", "saved_residuals") else "",
            may_succeed=iname == "meta",  # as eager: meta tensors compute shapes
            user_error=user and op in ("jit", "trace", "joint", "vjp", "saved_residuals"),
        )
for iname, bad in {"int": INT, "bool": INT > 0, "int-in-tree": {"a": X, "b": INT}}.items():
    fn = u_tree if iname == "int-in-tree" else u_sum
    for op, make in {
        "grad": lambda f, v: ft.grad(f)(v),
        "value_and_grad": lambda f, v: ft.value_and_grad(f)(v),
        "jacrev": lambda f, v: ft.jacrev(f)(v),
        "hessian": lambda f, v: ft.hessian(f)(v),
    }.items():
        case(
            f"{op}-input-{iname}",
            lambda make=make, fn=fn, bad=bad: make(fn, bad),
            op,
            user_error=True,
        )
case("grad-input-str-leaf", lambda: ft.grad(u_tree)({"a": X, "b": "s"}), user_error=True)


def _meta_model():
    with torch.device("meta"):
        return torch.nn.Linear(3, 3)


case(
    "jit-meta-model",
    lambda: ft.jit(_meta_model())(torch.ones(2, 3, device="meta")),
    "jit",
    may_succeed=True,
)
case("jit-meta-model-real-input", lambda: ft.jit(_meta_model())(torch.ones(2, 3)), "Linear", "meta")

# -- jit options ----------------------------------------------------------------------------

for oname, bad in {"str": "nope", "int": 3, "None": None}.items():
    case(
        f"jit-backend-{oname}", lambda bad=bad: ft.jit(u_sum, backend=bad)(X), "backend", repr(bad)
    )
    case(
        f"jit-decompositions-{oname}",
        lambda bad=bad: ft.jit(u_sum, decompositions=bad)(X),
        "decompositions",
        may_succeed=bad is None,
    )
    case(
        f"jit-dynamic-{oname}",
        lambda bad=bad: ft.jit(u_sum, dynamic=bad)(X),
        "dynamic",
        may_succeed=oname == "None",
    )
    case(
        f"trace-decompositions-{oname}",
        lambda bad=bad: ft.trace(u_sum, decompositions=bad)(X),
        "decompositions",
        may_succeed=bad is None,
    )
    case(
        f"joint-decompositions-{oname}",
        lambda bad=bad: ft.joint(u_sum, decompositions=bad)(X),
        "decompositions",
        may_succeed=bad is None,
    )
    case(
        f"trace-dynamic-{oname}",
        lambda bad=bad: ft.trace(u_sum, dynamic=bad)(X),
        "dynamic",
        may_succeed=oname == "None",
    )
    case(
        f"joint-dynamic-{oname}",
        lambda bad=bad: ft.joint(u_sum, dynamic=bad)(X),
        "dynamic",
        may_succeed=oname == "None",
    )
for cname, bad in {"zero": 0, "str": "x", "bool": True, "float": 2.0, "None": None}.items():
    case(
        f"jit-cache_size-{cname}",
        lambda bad=bad: ft.jit(u_sum, cache_size=bad),
        "jit",
        "cache_size",
    )
    case(
        f"jit-decorator-cache_size-{cname}",
        lambda bad=bad: ft.jit(cache_size=bad),
        "jit",
        "cache_size",
    )
case("jit-decorator-backend", lambda: ft.jit(backend=3), "jit", "backend")
case("jit-decorator-static_argnums", lambda: ft.jit(static_argnums="x"), "jit", "static_argnums")

# -- remat policies -------------------------------------------------------------------------

for pname, bad in {"str": "nope", "int": 3, "list": [1], "tensor": X}.items():
    case(f"remat-policy-{pname}", lambda bad=bad: ft.remat(u_sum, policy=bad), "policy")
    case(f"remat-decorator-policy-{pname}", lambda bad=bad: ft.remat(policy=bad), "policy")
    case(f"normalize-{pname}", lambda bad=bad: policies.normalize(bad), "policy")
    case(
        f"save_from_both_policies-{pname}",
        lambda bad=bad: policies.save_from_both_policies(bad, None),
        "policy",
    )
for nname, bad in {"int": 3, "None": None, "tensor": X, "list": ["a"]}.items():
    case(
        f"save_only_these_names-{nname}",
        lambda bad=bad: policies.save_only_these_names(bad),
        "save_only_these_names",
        may_succeed=nname == "list",
    )
    case(
        f"save_any_names_but_these-{nname}",
        lambda bad=bad: policies.save_any_names_but_these(bad),
        "save_any_names_but_these",
        may_succeed=nname == "list",
    )
    case(
        f"checkpoint_name-name-{nname}",
        lambda bad=bad: ft.checkpoint_name(X, bad),
        "checkpoint_name",
        "name",
    )
    case(
        f"save_and_offload-{nname}",
        lambda bad=bad: policies.save_and_offload_only_these_names(names_which_can_be_saved=bad),
        "names_which_can_be_saved",
        may_succeed=nname == "list",
    )
for oname, bad in {"str": "nowhere", "int": 3, "None": None}.items():
    case(
        f"offload_dot-src-{oname}",
        lambda bad=bad: policies.offload_dot_with_no_batch_dims(offload_src=bad),
        "offload_src",
    )
    case(
        f"offload_dot-dst-{oname}",
        lambda bad=bad: policies.offload_dot_with_no_batch_dims(offload_dst=bad),
        "offload_dst",
    )
for oname, bad in {"str": "mm", "int": 3, "None": None}.items():
    case(f"save_ops-{oname}", lambda bad=bad: policies.save_ops(bad), "save_ops")
for pname, bad in {"None": None, "int": 3, "str": "x"}.items():
    case(f"convention-{pname}", lambda bad=bad: policies.convention(bad), "policy")

# -- Graph and JointGraph methods -----------------------------------------------------------

G = None


def _g():
    global G
    if G is None:
        G = ft.trace(u_vec)(X)
    return G


for iname, make in {
    "wrong-shape": lambda: (torch.ones(5),),
    "double": lambda: (X.double(),),
    "int": lambda: (INT,),
    "None": lambda: (None,),
    "str": lambda: ("x",),
    "numpy": lambda: (NP,),
    "meta": lambda: (META,),
    "two-for-one": lambda: (X, X),
    "none-for-one": lambda: (),
}.items():
    meta = iname == "meta"  # as eager: a meta input computes shapes
    names = ("numpy", "argument 0") if iname == "numpy" else ("Graph",)
    case(f"Graph-call-{iname}", lambda make=make: _g()(*make()), *names, may_succeed=meta)
    case(f"Graph-run_flat-{iname}", lambda make=make: _g().run_flat(*make()), may_succeed=meta)
for jname, make in {
    "wrong-primal-shape": lambda: ((torch.ones(2, 2), torch.ones(4, 4)), (torch.tensor(1.0),)),
    "wrong-tangent-shape": lambda: ((torch.ones(4, 4), torch.ones(4, 4)), (torch.ones(3),)),
    "missing-tangents": lambda: ((torch.ones(4, 4), torch.ones(4, 4)), ()),
    "None-primals": lambda: (None, (torch.tensor(1.0),)),
    "str-tangents": lambda: ((torch.ones(4, 4), torch.ones(4, 4)), "x"),
}.items():
    case(f"JointGraph-call-{jname}", lambda make=make: _jg()(*make()), "Graph")
for gname, bad in {"None": None, "str": "g", "int": 3}.items():
    case(f"Graph-new-{gname}", lambda bad=bad: ft.Graph(bad, None, None), "Graph", "graph")

# -- other public functions -----------------------------------------------------------------

for lname, bad in {"unknown": "nope", "int": 3, "None-in-list": [None]}.items():
    case(f"set_logs-{lname}", lambda bad=bad: ft.set_logs(bad), "set_logs")
case("set_logs-unknown-flag", lambda: ft.set_logs(nope=True), "set_logs", "nope")
for oname, bad in {"neg": -1.0, "str": "x", "nan": math.nan, "None": None}.items():
    case(f"Offload-bandwidth-{oname}", lambda bad=bad: ft.Offload(bandwidth=bad), "bandwidth")
    case(f"Offload-overlap-{oname}", lambda bad=bad: ft.Offload(overlap=bad), "overlap")
for sname, bad in {"str-shape": ("a",), "neg-shape": (-1,), "str-dtype": "float32"}.items():
    shape, dtype = (bad, torch.float32) if sname != "str-dtype" else ((2,), bad)
    case(
        f"eval_shape-ShapeDtypeStruct-{sname}",
        lambda shape=shape, dtype=dtype: ft.eval_shape(u_vec, ft.ShapeDtypeStruct(shape, dtype)),
        "ShapeDtypeStruct",
    )
case("stop_gradient-None", lambda: ft.stop_gradient(None), may_succeed=True)
case("stop_gradient-numpy", lambda: ft.stop_gradient(NP), may_succeed=True)


# -- the user's own errors propagate as they are -------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda f: ft.grad(f)(X),
        lambda f: ft.vjp(f, X),
        lambda f: ft.jit(f)(X),
        lambda f: ft.trace(f)(X),
        lambda f: ft.vmap(f)(XS),
        lambda f: ft.jvp(f, (X,), (X,)),
        lambda f: ft.remat(f)(X),
    ],
    ids=["grad", "vjp", "jit", "trace", "vmap", "jvp", "remat"],
)
def test_the_users_own_error_is_not_wrapped(call):
    with pytest.raises(RuntimeError, match="the user's own error") as info:
        call(u_raises)
    assert not isinstance(info.value, ft.FunctransError)


def test_there_are_hundreds_of_cases():
    assert len(CASES) >= 400
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_bad_input(c: Case):
    try:
        c.call()
    except ft.FunctransError as e:
        message = str(e)
        for name in c.names:
            assert name in message, f"{name!r} not in the message: {message}"
        return
    except Exception as e:  # what the sweep is about
        owner = _owner(e)
        if c.user_error and owner == "user":
            return
        pytest.fail(f"raw {type(e).__name__} raised by {owner}: {e}")
    assert c.may_succeed, "accepted silently"
