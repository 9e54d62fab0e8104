"""jit's cache lookup: the guarded fast path hits exactly when the exact key would.

Every change a trace depends on must retrace (``misses`` goes up) and give eager's result;
unchanged calls must hit through the guards, without optree's flatten.
"""

import collections
import dataclasses

import optree
import pytest
import torch

import functrans as ft
from functrans._core import tree_guards as _tree_guards
from functrans._jit import jitted as _jit


def loss(params, x):
    return torch.tanh(x @ params["w"] + params["b"]).pow(2).sum()


def make(requires_grad=True, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 4, generator=g, dtype=dtype).requires_grad_(requires_grad)
    b = torch.randn(4, generator=g, dtype=dtype).requires_grad_(requires_grad)
    return {"w": w, "b": b}, torch.randn(3, 4, generator=g, dtype=dtype)


def counts(f):
    info = f.cache_info()
    return info.hits, info.misses


@pytest.fixture
def no_optree_on_hits(monkeypatch):
    """Counts calls of the exact path's optree flatten."""
    calls = []
    real = _jit.leaves_of
    monkeypatch.setattr(_jit, "leaves_of", lambda tree: calls.append(1) or real(tree))
    return calls


def test_unchanged_calls_hit_through_guards_and_see_new_values(no_optree_on_hits):
    f = ft.jit(loss)
    params, x = make()
    f(params, x)
    assert len(no_optree_on_hits) == 1  # the miss
    params["w"] = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)  # same metadata
    x2 = torch.randn(3, 4, dtype=torch.float64)
    out = f(params, x2)
    assert counts(f) == (1, 1) and len(no_optree_on_hits) == 1
    torch.testing.assert_close(out, loss(params, x2))
    out.backward()
    ref = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    loss(ref, x2).backward()
    torch.testing.assert_close(params["w"].grad, ref["w"].grad)


def square(x):
    return (x @ x.mT).tanh().sum()


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda x: torch.randn(5, 4, dtype=x.dtype), id="shape"),
        pytest.param(lambda x: x.t().contiguous().t(), id="stride"),
        pytest.param(lambda x: x[:1].expand(4, 4), id="expanded"),
        pytest.param(lambda x: x.float(), id="dtype"),
        pytest.param(lambda x: x.detach().requires_grad_(), id="requires_grad"),
        pytest.param(lambda x: torch.nn.Parameter(x, requires_grad=False), id="tensor-type"),
        pytest.param(lambda x: torch.empty(4, 4, dtype=x.dtype, device="meta"), id="device"),
    ],
)
def test_tensor_changes_retrace(change):
    f = ft.jit(square)
    x = torch.randn(4, 4, dtype=torch.float64)
    f(x)
    y = change(x)
    out = f(y)
    assert counts(f) == (0, 2)
    if y.device.type != "meta":
        torch.testing.assert_close(out, square(y))
    assert out.shape == () and out.dtype == y.dtype and out.requires_grad == y.requires_grad
    f(y)
    assert counts(f) == (1, 2)


def test_conjugate_and_negative_bits_retrace():
    f = ft.jit(lambda z: (z * torch.tensor([1.0, 2.0, 3.0])).real)
    z = torch.randn(3, dtype=torch.complex128)
    f(z)
    for variant in (z.conj(), torch._neg_view(z)):
        torch.testing.assert_close(f(variant), (variant * torch.tensor([1.0, 2.0, 3.0])).real)
    assert counts(f) == (0, 3)


def test_grad_mode_retraces_and_inference_saves_nothing():
    f = ft.jit(loss)
    params, x = make()
    f(params, x)
    with torch.no_grad():
        out = f(params, x)
    assert counts(f) == (0, 2) and out.grad_fn is None
    torch.testing.assert_close(out, loss(params, x).detach())
    assert f(params, x).grad_fn is not None and counts(f) == (1, 2)


def scaled(x, s):
    if isinstance(s, str):
        return x + len(s)
    if isinstance(s, float):
        return (x + 1) / s
    return x * s


@pytest.mark.parametrize(
    "x, first, second",
    [
        (torch.arange(4), 2, 3),
        (torch.arange(4), 1, 1.0),
        (torch.arange(4).bool(), 1, True),
        (torch.arange(4.0), 0.0, -0.0),
        (torch.arange(4), "a", "bb"),
    ],
    ids=["value", "int-float", "int-bool", "zero-sign", "str"],
)
def test_static_changes_retrace(x, first, second):
    jf = ft.jit(scaled)
    jf(x, first)
    out = jf(x, second)
    assert counts(jf) == (0, 2)
    ref = scaled(x, second)
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out, ref)


def test_equal_int_and_str_statics_in_new_objects_hit_through_guards(no_optree_on_hits):
    jf = ft.jit(lambda x, n, name: x * n + len(name))
    x = torch.ones(2)
    jf(x, int("1000"), "".join(["a", "b"]))
    out = jf(x, int("1000"), "".join(["a", "b"]))
    assert counts(jf) == (1, 1) and len(no_optree_on_hits) == 1
    torch.testing.assert_close(out, x * 1000 + 2)


def test_equal_static_in_a_new_object_hits_through_the_exact_key():
    jf = ft.jit(lambda x, s: x * s)
    x = torch.ones(2)
    jf(x, 1e9 + 0.5)
    big = float("1e9") + 0.5  # equal, another object: the guard rejects, the exact key hits
    torch.testing.assert_close(jf(x, big), x * big)
    assert counts(jf) == (1, 1)


def test_static_argnums_hit_and_retrace():
    jf = ft.jit(lambda x, shape: x.reshape(shape).sum(0), static_argnums=(1,))
    x = torch.arange(6.0)
    shape = (2, 3)
    jf(x, shape)
    jf(x, shape)
    assert counts(jf) == (1, 1)
    torch.testing.assert_close(jf(x, (3, 2)), x.reshape(3, 2).sum(0))
    assert counts(jf) == (1, 2)


@dataclasses.dataclass
class Pair:
    a: torch.Tensor
    b: torch.Tensor


optree.register_pytree_node(
    Pair, lambda p: ((p.a, p.b), None, None), lambda _, c: Pair(*c), namespace="functrans"
)
Point = collections.namedtuple("Point", "a b")


def total(tree):
    return sum(t.sum() for t in optree.tree_leaves(tree, namespace="functrans"))


@pytest.mark.parametrize(
    "first, second",
    [
        ({1: torch.ones(2)}, {2: torch.ones(2)}),  # non-str keys: no guards, the exact path
        ({"a": torch.ones(2)}, {"b": torch.ones(2)}),
        ({"a": torch.ones(2)}, {"a": torch.ones(2), "b": torch.ones(2)}),
        ([torch.ones(2), torch.ones(2)], (torch.ones(2), torch.ones(2))),
        ([torch.ones(2)], [torch.ones(2), torch.ones(2)]),
        ((torch.ones(2), None), (torch.ones(2), torch.ones(2))),
        (Point(torch.ones(2), torch.ones(2)), (torch.ones(2), torch.ones(2))),
        (Pair(torch.ones(2), torch.ones(2)), Point(torch.ones(2), torch.ones(2))),
        ({"a": torch.ones(2)}, collections.OrderedDict(a=torch.ones(2))),
        ({"a": torch.ones(2)}, {"a": [torch.ones(2)]}),
    ],
)
def test_structure_changes_retrace(first, second, no_optree_on_hits):
    jf = ft.jit(total)
    jf(first)
    jf(first)
    assert counts(jf) == (1, 1)
    torch.testing.assert_close(jf(second), total(second))
    assert counts(jf) == (1, 2)
    jf(second)
    assert counts(jf) == (2, 2)
    int_keys = isinstance(first, dict) and 1 in first
    assert len(no_optree_on_hits) == (4 if int_keys else 2)


def test_dict_order_and_kwargs_hit():
    jf = ft.jit(lambda p, *, scale: (p["a"] - p["b"]) * scale)
    a, b = torch.ones(2), torch.zeros(2)
    jf({"a": a, "b": b}, scale=2)
    out = jf({"b": b, "a": a}, scale=2)  # optree sorts keys: the same spec as before
    assert counts(jf) == (1, 1)
    torch.testing.assert_close(out, torch.full((2,), 2.0))


def test_in_place_change_of_a_saved_input_still_raises_on_fast_hits():
    f = ft.jit(loss, partition="default")
    params, x = make()
    f(params, x).backward()
    out = f(params, x)  # saves x for the gradient of w
    assert counts(f) == (1, 1)
    x.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


def test_without_tensor_guards_the_exact_path_serves(monkeypatch):
    monkeypatch.setattr(_tree_guards, "_TENSOR_GUARDS", None)
    f = ft.jit(loss)
    params, x = make()
    f(params, x)
    out = f(params, x)
    f(params, x.t().contiguous().t())
    assert counts(f) == (1, 2)
    torch.testing.assert_close(out, loss(params, x))


def test_guards_hold_no_tensors():
    import weakref

    f = ft.jit(loss)
    params, x = make()
    f(params, x)
    refs = [weakref.ref(t) for t in (params["w"], params["b"], x)]
    del params, x
    assert all(r() is None for r in refs)


def test_a_mutated_static_is_compared_by_value():
    jf = ft.jit(lambda x, s: x * len(s))
    x, s = torch.ones(2), {1, 2}
    jf(x, s)
    s.add(3)
    torch.testing.assert_close(jf(x, s), x * 3)
    assert counts(jf) == (0, 2)
    jf = ft.jit(lambda x, s: x * 2)
    marker = object()  # compared by identity, as the exact key compares it
    jf(x, marker)
    jf(x, marker)
    jf(x, object())
    assert counts(jf) == (1, 2)
