"""Nothing fake or traced leaves a transform (issue 48): a tensor a traced function stores where
it outlives the call (a list, a dict, a global, a ``nonlocal`` variable, an object's or a
module's attribute) is refused by name when the transform is called, instead of escaping as a
FakeTensor with no data. Values the transform hands back (outputs, ``has_aux``) are real, and
functions that only read what they reach are left alone."""

from __future__ import annotations

import re
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import functrans as ft
from functrans._trace.capture import reach

CACHE: Any = None  # the global the "global" escape assigns


class Box:
    """A plain object whose attribute a function sets."""

    h: Any = None


class Cached(torch.nn.Module):
    """A module whose forward keeps its last activation (``self.last = h``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x).sin()
        self.last = h
        return h


@dataclass(frozen=True)
class Kind:
    """One way a value escapes: ``f`` (x -> scalar) stores ``x.sin()``-like values at ``path``;
    ``stored()`` reads back what is there."""

    f: Callable[[torch.Tensor], torch.Tensor]
    stored: Callable[[], Any]
    path: str


def _list() -> Kind:
    out: list[torch.Tensor] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        out.append(y)
        return y.sum()

    return Kind(f, lambda: out[0] if out else None, "out[0]")


def _dict() -> Kind:
    holder: dict[str, torch.Tensor] = {}

    def f(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        holder["h"] = y
        return y.sum()

    return Kind(f, lambda: holder.get("h"), "holder['h']")


def _global() -> Kind:
    global CACHE
    CACHE = None

    def f(x: torch.Tensor) -> torch.Tensor:
        global CACHE
        y = x.sin()
        CACHE = y
        return y.sum()

    return Kind(f, lambda: CACHE, "CACHE")


def _nonlocal() -> Kind:
    held: Any = None

    def f(x: torch.Tensor) -> torch.Tensor:
        nonlocal held
        y = x.sin()
        held = y
        return y.sum()

    return Kind(f, lambda: held, "held")


def _attribute() -> Kind:
    box = Box()

    def f(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        box.h = y
        return y.sum()

    return Kind(f, lambda: box.h, "box.h")


def _module_attribute() -> Kind:
    torch.manual_seed(0)
    model = Cached()

    def f(x: torch.Tensor) -> torch.Tensor:
        return model(x).sum()

    return Kind(f, lambda: model.__dict__.get("last"), "model.last")


KINDS: dict[str, Callable[[], Kind]] = {
    "list": _list,
    "dict": _dict,
    "global": _global,
    "nonlocal": _nonlocal,
    "attribute": _attribute,
    "module_attribute": _module_attribute,
}

X = torch.tensor([0.5, 1.0, 2.0])

# transform name -> how it calls f on X (each traces f, except vmap, which batches it)
TRANSFORMS: dict[str, Callable[[Callable[..., Any]], Any]] = {
    "grad": lambda f: ft.grad(f)(X),
    "vjp": lambda f: ft.vjp(f, X),
    "value_and_grad": lambda f: ft.value_and_grad(f)(X),
    "jit": lambda f: ft.jit(f)(X),
    "jit_training": lambda f: ft.jit(f)(X.clone().requires_grad_()),
    "trace": lambda f: ft.trace(f)(X),
    "joint": lambda f: ft.joint(f)(X),
    "eval_shape": lambda f: ft.eval_shape(f, X),
}
_NAMES = {"jit_training": "jit"}
_GRAPHLESS = ("eval_shape",)  # no graph to find the computing line in


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_escape_is_refused_by_name(kind: str, transform: str) -> None:
    """The error names the transform, where the value escaped to, the line that computed it
    and what to do; before issue 48 the call returned and left a FakeTensor there."""
    case = KINDS[kind]()
    with pytest.raises(ft.TraceError) as info:
        TRANSFORMS[transform](case.f)
    text = str(info.value)
    name = _NAMES.get(transform, transform)
    assert text.startswith(f"{name}(f): a tensor of the trace escaped to `{case.path}`"), text
    if transform not in _GRAPHLESS:
        assert "computed at" in text and "test_escape.py" in text and ".sin()" in text, text
    assert "Return it" in text, text
    if name in ("grad", "vjp", "value_and_grad", "joint"):
        assert "has_aux=True" in text, text
    if kind == "module_attribute":
        assert "self.cache = h" in text, text


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_vmap_escape_is_refused_by_name(kind: str) -> None:
    """An eager vmap's batched tensor, stored outside, fails on first use in torch; here the
    call says so."""
    case = KINDS[kind]()
    with pytest.raises(ft.TraceError) as info:
        ft.vmap(case.f)(torch.ones(2, 3))
    assert str(info.value).startswith(f"vmap(f): a batched tensor of vmap escaped to `{case.path}`")


def test_nothing_is_put_back_silently() -> None:
    """The refused value stays where the function stored it (the message says it is a
    FakeTensor), and the same function with has_aux gives the real value."""
    out: list[torch.Tensor] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        out.append(y)
        return y.sum()

    with pytest.raises(ft.TraceError, match="a FakeTensor, left where f stored it"):
        ft.grad(f)(X)
    assert isinstance(out[0], FakeTensor)


def test_jit_module_attribute_set_in_forward() -> None:
    """``ft.jit(model)`` whose forward sets ``self.cache = h``: jit traces the forward once and
    then never sets the attribute, so the trace is refused by name (inference and training
    entries alike); the module keeps no attribute jit restored."""
    torch.manual_seed(0)
    model = Cached()
    jitted = ft.jit(model)
    for x in (torch.ones(2, 3), torch.ones(2, 3, requires_grad=True)):
        with pytest.raises(ft.TraceError) as info:
            jitted(x)
        text = str(info.value)
        assert re.match(r"jit\(Cached\): a tensor of the trace escaped to `\w+\.last`", text)
        assert "an attribute of the Cached module" in text and "later calls" in text
        del model.last


def test_nested_escape_names_the_stack() -> None:
    case = _list()
    with pytest.raises(ft.TraceError, match=r"^inside jit\(grad\(f\)\): a tensor .* `out\[0\]`"):
        ft.jit(ft.grad(case.f))(X)
    case = _list()
    with pytest.raises(ft.TraceError, match=r"^inside grad\(vmap\(f\)\): a batched .* `out\[0\]`"):
        ft.grad(lambda x: ft.vmap(case.f)(x.expand(2, 3)).sum())(X)


def test_forward_hook_capturing_activations_is_refused_by_a_trace() -> None:
    acts: dict[str, torch.Tensor] = {}
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh())
    net[0].register_forward_hook(lambda mod, args, out: acts.__setitem__("l0", out))
    with pytest.raises(ft.TraceError, match=r"escaped to `acts\['l0'\]`"):
        ft.joint(lambda x: net(x).sum())(X)


def test_forward_hook_capturing_activations_under_grad_runs_as_eager() -> None:
    """While a hook is registered ``ft.grad`` runs as written, torch's autograd eagerly (as
    ``jit`` does): the probe stores eager's activation and the gradient is eager's (it was
    refused as an escape)."""
    acts: dict[str, torch.Tensor] = {}
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh())
    net[0].register_forward_hook(lambda mod, args, out: acts.__setitem__("l0", out))
    with pytest.warns(UserWarning, match="hook"):
        got = ft.grad(lambda x: net(x).sum())(X)
    ours = acts.pop("l0")
    x = X.clone().requires_grad_()
    (want,) = torch.autograd.grad(net(x).sum(), x)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(ours, acts["l0"])


def test_static_argument_escape_names_the_argument() -> None:
    def f(x: torch.Tensor, box: Box) -> torch.Tensor:
        box.h = x.exp()
        return x.sum()

    with pytest.raises(ft.TraceError, match=r"escaped to `box\.h` \(an attribute of a Box"):
        ft.grad(f)(X, Box())
    for jitted in (ft.jit(f), ft.jit(f, static_argnums=1)):  # jit re-packs the arguments
        with pytest.raises(ft.TraceError, match=r"^jit\(f\): .* `args\[1\]\.h` \(an attr"):
            jitted(X, Box())


def test_symbolic_size_escape_is_refused() -> None:
    sizes: list[Any] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        sizes.append(x.shape[0])
        return x * 2

    with pytest.raises(ft.TraceError, match=r"symbolic size of the trace \(s\d+\) escaped"):
        ft.trace(f, dynamic=True)(torch.ones(4))


# --- what is not an escape ------------------------------------------------------------------


def test_returned_and_aux_values_are_real() -> None:
    """Outputs and aux come back as real tensors, equal to torch.func's."""

    def f(x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        y = x.sin()
        return y.sum(), {"y": y}

    grads, aux = ft.grad(f, has_aux=True)(X)
    want_grads, want_aux = torch.func.grad(f, has_aux=True)(X)
    assert type(aux["y"]) is torch.Tensor and torch.equal(aux["y"], want_aux["y"])
    torch.testing.assert_close(grads, want_grads)
    out, _, aux2 = ft.vjp(f, X, has_aux=True)
    assert type(aux2["y"]) is torch.Tensor and torch.equal(aux2["y"], X.sin())
    assert type(out) is torch.Tensor
    out, _ = ft.vjp(torch.sin, X)
    assert type(out) is torch.Tensor and torch.equal(out, X.sin())
    step = ft.jit(lambda x: (x.sin().sum(), x.sin()))
    _, h = step(X)
    assert type(h) is torch.Tensor and torch.equal(h, X.sin())


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
def test_reading_real_values_is_fine(transform: str) -> None:
    """A real tensor created outside and only read, a detached value computed outside, and a
    real tensor the function stores without computing with it: nothing is refused and all
    stay real."""
    w = torch.full((3,), 2.0)
    held = {"w": w}
    stats = [X.sin().detach()]  # computed outside the transform
    log: list[torch.Tensor] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        log.append(held["w"])  # stored without computing with it: still the real tensor
        return (x * 3 + stats[0]).sum()

    TRANSFORMS[transform](f)
    assert held["w"] is w and type(stats[0]) is torch.Tensor
    assert log and all(t is w for t in log)


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
def test_a_stored_input_is_the_real_one(transform: str) -> None:
    """An argument or a captured tensor stored as it came in is the real tensor (what running
    the function stores), except under jit, whose later calls would not store it: refused; so
    is grad's, value_and_grad's and vjp's, which trace once per input signature as jit does."""
    w = torch.full((3,), 2.0)
    seen: list[torch.Tensor] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        seen.append(w)
        if transform != "eval_shape":  # eval_shape's arguments are shapes
            seen.append(x)
        return (x * w).sum()

    if transform.startswith("jit") or transform in ("grad", "value_and_grad", "vjp"):
        with pytest.raises(ft.TraceError, match=r"\(it is the traced input .*stored as it came"):
            TRANSFORMS[transform](f)
        return
    TRANSFORMS[transform](f)
    assert seen[0] is w
    if transform != "eval_shape":
        assert seen[1] is X


def test_the_callers_own_fake_tensors_are_theirs() -> None:
    """Fake tensors the caller made in a fake mode of their own are not the trace's."""
    with FakeTensorMode():
        mine = [torch.ones(2)]

    def f(x: torch.Tensor) -> torch.Tensor:
        assert len(mine) == 1
        return x.sin().sum()

    ft.grad(f)(X)
    ft.jit(f)(X)


def test_torch_func_transforms_hand_over_real_values() -> None:
    """jvp, jacrev, jacfwd, hessian and linearize run the function for real (under
    torch.func): a stored value holds its data, as with torch.func."""
    for call in (
        lambda f: ft.jvp(f, (X,), (X,)),
        lambda f: ft.jacrev(f)(X),
        lambda f: ft.jacfwd(f)(X),
        lambda f: ft.hessian(f)(X),
        lambda f: ft.linearize(f, X),
    ):
        case = _list()
        call(case.f)
        stored = case.stored()
        assert not isinstance(stored, FakeTensor)
        torch.testing.assert_close(stored + 0, X.sin())


def test_torch_caches_are_not_escapes() -> None:
    """Torch's own caches it checks on every use are left alone: an RNN's ``_flat_weights``
    (refreshed when its parameters change) and the deprecated weight_norm's ``weight`` (set
    by its pre-hook before every call)."""
    gru = torch.nn.GRU(3, 3)
    ft.grad(lambda x: gru(x)[0].sum())(torch.ones(2, 1, 3))
    assert torch.isfinite(gru(torch.ones(2, 1, 3))[0]).all()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # weight_norm is deprecated
        lin = torch.nn.utils.weight_norm(torch.nn.Linear(3, 3))
    ft.grad(lambda x: lin(x).sum())(X)
    assert torch.isfinite(lin(X)).all()


# --- the property -----------------------------------------------------------------------------


def _fakes_reachable(f: Callable[..., Any]) -> list[str]:
    """Paths to the FakeTensors reachable from ``f`` (the walk jit's captures use)."""
    found = reach(f)
    out = []
    for paths in found.tensors.values():
        value = paths[0].read(found.root)
        if isinstance(value, FakeTensor):
            out.append(paths[0].name)
    return out


@given(
    kind=st.sampled_from(sorted(KINDS)),
    transform=st.sampled_from(sorted(TRANSFORMS)),
    escapes=st.booleans(),
    n=st.integers(1, 4),
)
def test_nothing_fake_is_reachable_unless_refused(
    kind: str, transform: str, escapes: bool, n: int
) -> None:
    """For any escape kind and transform, after the call nothing reachable from the function
    is a FakeTensor unless the call raised TraceError; and it raises exactly when a traced
    value was stored (a real value stored in the same place is fine)."""
    global CACHE
    CACHE = None  # an earlier, refused example's FakeTensor is left there (and reachable)
    case = KINDS[kind]()
    real = torch.arange(float(n))
    x = torch.linspace(0.1, 1.0, 3 * n).reshape(n, 3)  # rows of 3: Cached's Linear(3, 3)

    def f(x: torch.Tensor) -> torch.Tensor:
        loss = case.f(x)
        if not escapes:  # overwrite what was stored with a real, outside value
            _store(case, real)
        return loss

    refused = False
    try:
        {
            "grad": lambda: ft.grad(f)(x),
            "vjp": lambda: ft.vjp(f, x),
            "value_and_grad": lambda: ft.value_and_grad(f)(x),
            "jit": lambda: ft.jit(f)(x),
            "jit_training": lambda: ft.jit(f)(x.clone().requires_grad_()),
            "trace": lambda: ft.trace(f)(x),
            "joint": lambda: ft.joint(f)(x),
            "eval_shape": lambda: ft.eval_shape(f, x),
        }[transform]()
    except ft.TraceError as e:
        refused = True
        assert f"`{case.path}`" in str(e)
    assert refused == escapes
    if not refused:
        assert _fakes_reachable(f) == []
        assert case.stored() is real


def _store(case: Kind, value: torch.Tensor) -> None:
    """Put ``value`` where ``case.f`` stores its tensor (read back by ``case.stored``)."""
    f = case.f
    if case.path == "out[0]":
        _cell(f, "out")[0] = value
    elif case.path == "holder['h']":
        _cell(f, "holder")["h"] = value
    elif case.path == "CACHE":
        global CACHE
        CACHE = value
    elif case.path == "held":
        f.__closure__[f.__code__.co_freevars.index("held")].cell_contents = value
    elif case.path == "box.h":
        _cell(f, "box").h = value
    else:
        _cell(f, "model").__dict__["last"] = value


def _cell(f: Callable[..., Any], name: str) -> Any:
    code: types.CodeType = f.__code__
    return f.__closure__[code.co_freevars.index(name)].cell_contents
