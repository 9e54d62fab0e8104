"""Repeated regions: a stack of identical blocks is traced once and copied per block; the
compiled step is the one unrolled tracing gives, bit for bit, and blocks that differ in
anything the trace reads are regions of their own (or traced inline)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import functrans as ft
from functrans._trace import regions as _regions


class Block(nn.Module):
    def __init__(self, d: int = 16, p: float = 0.1) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc, self.out = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.out(F.gelu(self.fc(self.ln(x)))))
        return x + h


class Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module], d: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x).square().mean()


@pytest.fixture
def regions_env() -> Iterator[Callable[[bool], None]]:
    before = os.environ.get("FUNCTRANS_REGIONS")

    def set_to(on: bool) -> None:
        os.environ["FUNCTRANS_REGIONS"] = "unrolled" if on else "0"

    yield set_to
    if before is None:
        os.environ.pop("FUNCTRANS_REGIONS", None)
    else:
        os.environ["FUNCTRANS_REGIONS"] = before


def _step(model: nn.Module, x: torch.Tensor, seed: int = 0) -> tuple[Any, ...]:
    model.zero_grad(set_to_none=True)
    f = ft.jit(model)
    torch.manual_seed(seed)
    loss = f(x)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    return loss.detach(), grads, f.cache_info()


def _compare(set_to: Callable[[bool], None], model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """Regions on vs off: equal loss and gradients (torch.equal); (traced, reused) with on."""
    set_to(False)
    off_loss, off_grads, off_info = _step(model, x)
    assert off_info.regions_reused == 0
    set_to(True)
    traced, reused = _regions.stats.traced, _regions.stats.reused
    on_loss, on_grads, on_info = _step(model, x)
    assert torch.equal(on_loss, off_loss)
    for a, b in zip(on_grads, off_grads, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)
    got = (_regions.stats.traced - traced, _regions.stats.reused - reused)
    assert on_info.regions_reused == got[1]
    return got


def _x(d: int = 16) -> torch.Tensor:
    return torch.randn(2, 5, d, generator=torch.Generator().manual_seed(1)).requires_grad_()


def test_identical_blocks_traced_once_bitwise(regions_env: Callable[[bool], None]) -> None:
    torch.manual_seed(0)
    model = Stack([Block() for _ in range(4)])
    traced, reused = _compare(regions_env, model, _x())
    # traced once (at the first call); the other 3 calls of the trace reuse it
    assert traced == 1
    assert reused == 3


def _stack_joints(
    set_to: Callable[[bool], None], head: bool = True
) -> tuple[ft.JointGraph, ft.JointGraph, int]:
    """The joint graph of a Sequential of 3 blocks (parameters passed in, so the blocks see
    fake tensors) on a transposed input, with regions off and on, and the reuses counted.
    With ``head``, a matmul follows the stack (its gradient is contiguous); without, a sum
    (the last block's gradient is an expanded scalar)."""
    torch.manual_seed(0)
    seq = nn.Sequential(*[Block(p=0.0) for _ in range(3)])
    params = {k: v.detach().requires_grad_() for k, v in seq.named_parameters()}
    w = torch.randn(16, 4, requires_grad=True)

    def g(ps: dict[str, torch.Tensor], w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = torch.func.functional_call(seq, ps, (x.transpose(0, 1),))
        return (y @ w).sum() if head else y.sum()

    x = _x().requires_grad_()
    set_to(False)
    off = ft.joint(g, argnums=(0, 1, 2))(params, w, x)
    set_to(True)
    reused = _regions.stats.reused
    on = ft.joint(g, argnums=(0, 1, 2))(params, w, x)
    return off, on, _regions.stats.reused - reused


def test_joint_graph_is_the_unrolled_one(regions_env: Callable[[bool], None]) -> None:
    off, on, reused = _stack_joints(regions_env)
    assert reused > 0  # the blocks were regions
    ops = lambda jg: [str(n.target) for n in jg.graph_module.graph.nodes]  # noqa: E731
    assert ops(on) == ops(off)
    assert str(on) == str(off)


def test_region_calls_recorded_directly_as_make_fx_would(
    regions_env: Callable[[bool], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    # a region call's node and its results' getitems are written into the trace without
    # dispatching the op (call_recorder); the graph and every value's layout are the ones the
    # op's dispatch through make_fx gives
    def kept(record: Callable[..., Any]) -> tuple[str, list[Any], int]:
        monkeypatch.setattr(_regions, "call_recorder", record)
        torch.manual_seed(0)
        seq = nn.Sequential(*[Block(p=0.0) for _ in range(3)])
        params = {k: v.detach().requires_grad_() for k, v in seq.named_parameters()}

        def g(ps: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(seq, ps, (x,)).sum()

        regions_env(True)
        with _regions.deferred():
            jg = ft.joint(g, argnums=(0, 1))(params, _x())
        calls = [n for n in jg.graph_module.graph.nodes if n.target is _regions.FORWARD_OP]
        return str(jg), _layout(jg), len(calls)

    recorded: list[bool] = []

    def spy(*args: Any) -> Any:
        got = _regions_recorder(*args)
        recorded.append(got is not None)
        return got

    _regions_recorder = _regions.call_recorder
    direct = kept(spy)
    assert recorded and all(recorded)  # every call of the 3 blocks, forward and backward
    dispatched = kept(lambda *args: None)
    assert direct[2] == 3
    assert direct == dispatched


def test_a_region_takes_its_cotangents_contiguous(regions_env: Callable[[bool], None]) -> None:
    # the region's backward was traced with a contiguous cotangent; the last block's gradient
    # from a bare sum is an expanded scalar, made contiguous once before it enters the copy
    off, on, reused = _stack_joints(regions_env, head=False)
    assert reused > 0
    clones = lambda jg: [n for n in jg.ops() if n.target is torch.ops.aten.clone.default]  # noqa: E731
    (clone,) = [c for c in clones(on) if c.name not in {n.name for n in clones(off)}]
    assert clone.args[0].target is torch.ops.aten.expand.default
    assert len(list(on.ops())) == len(list(off.ops())) + 1


def _layout(jg: ft.JointGraph) -> list[Any]:
    """Per node: each tensor's geometry and which earlier node's storage it lies on."""
    first: dict[int, int] = {}
    out: list[Any] = []
    for i, n in enumerate(jg.graph_module.graph.nodes):
        vals = n.meta.get("val")
        row = []
        for v in vals if isinstance(vals, (list, tuple)) else [vals]:
            if isinstance(v, torch.Tensor):
                owner = first.setdefault(v.untyped_storage()._cdata, i)
                row.append((tuple(v.shape), v.stride(), v.storage_offset(), v.dtype, owner))
        out.append(row)
    return out


def test_copied_values_lie_on_storages_as_unrolled_ones_do(
    regions_env: Callable[[bool], None],
) -> None:
    # a block's copies get fresh fake values without running their ops: views must still
    # share their base's storage, and no two copies (or the region itself) share one
    off, on, reused = _stack_joints(regions_env)
    assert reused > 0
    assert _layout(on) == _layout(off)


def test_partition_sees_the_whole_stack(regions_env: Callable[[bool], None]) -> None:
    torch.manual_seed(0)
    model = Stack([Block(p=0.0) for _ in range(3)])
    x = _x()
    saved = []
    for on in (False, True):
        regions_env(on)
        f = ft.jit(model, partition="min_cut")
        f(x).backward()
        (p,) = f.partitions()
        saved.append(([s.node.meta["val"].shape for s in p.saved], p.peak_bytes))
    assert saved[0] == saved[1]


@pytest.mark.parametrize("change", ["dropout_p", "eval", "shape"])
def test_a_block_that_differs_is_its_own_region(
    regions_env: Callable[[bool], None], change: str
) -> None:
    torch.manual_seed(0)
    blocks: list[nn.Module] = [Block() for _ in range(4)]
    if change == "dropout_p":
        blocks[2].drop.p = 0.5  # type: ignore[union-attr]
    elif change == "eval":
        blocks[2].eval()
    model = Stack(blocks)
    x = _x()
    if change == "shape":
        model = Stack([Block(16), Block(16), Block(16)])
        model.blocks[1].fc = nn.Linear(16, 48)  # type: ignore[index]
        model.blocks[1].out = nn.Linear(48, 16)  # type: ignore[index]
    traced, reused = _compare(regions_env, model, x)
    assert traced == 2
    n = len(model.blocks)  # type: ignore[arg-type]
    assert reused == n - 2


def test_a_hooked_block_is_traced_inline(regions_env: Callable[[bool], None]) -> None:
    torch.manual_seed(0)
    model = Stack([Block(p=0.0) for _ in range(3)])
    calls: list[int] = []

    def hook(m: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return out * 2

    model.blocks[1].register_forward_hook(hook)  # type: ignore[index]
    params = dict(model.named_parameters())

    def f(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, p, (x,))  # type: ignore[no-any-return]

    x = _x().detach().requires_grad_()
    results = []
    for on in (False, True):
        regions_env(on)
        traced, reused = _regions.stats.traced, _regions.stats.reused
        calls.clear()
        jg = ft.joint(f)(params, x)
        ones = (torch.ones(()),)
        results.append(jg((params, x), ones))
        counts = (_regions.stats.traced - traced, _regions.stats.reused - reused)
        # blocks 0 and 2 share a region; block 1 is inline
        assert counts == ((1, 1) if on else (0, 0))
        assert len(calls) == 1  # the hook ran once: the trace runs f once
    for a, b in zip(
        torch.utils._pytree.tree_leaves(results[0]),
        torch.utils._pytree.tree_leaves(results[1]),
        strict=True,
    ):
        assert torch.equal(a, b)


def test_a_block_with_side_effects_is_traced_inline(regions_env: Callable[[bool], None]) -> None:
    class Counting(Block):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls = getattr(self, "calls", 0) + 1
            return super().forward(x)

    torch.manual_seed(0)
    model = Stack([Counting(p=0.0) for _ in range(3)])
    regions_env(True)
    traced = _regions.stats.traced
    _step(model, _x())
    assert _regions.stats.traced == traced
    counts = [b.calls for b in model.blocks]  # type: ignore[attr-defined]
    assert len(set(counts)) == 1  # every block ran as often as the others


def test_region_decorator_on_a_function(regions_env: Callable[[bool], None]) -> None:
    @ft.region
    def block(w: torch.Tensor, b: torch.Tensor, x: torch.Tensor, scale: float) -> torch.Tensor:
        return x + torch.tanh(x @ w + b) * scale

    def f(ws: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
        for i, (w, b) in enumerate(ws):
            x = block(w, b, x, 0.5 if i < 3 else 0.25)
        return x.square().sum()

    gen = torch.Generator().manual_seed(0)
    ws = [(torch.randn(8, 8, generator=gen), torch.randn(8, generator=gen)) for _ in range(4)]
    x = torch.randn(3, 8, generator=gen)
    results = []
    for on in (False, True):
        regions_env(on)
        params = [(w.clone().requires_grad_(), b.clone().requires_grad_()) for w, b in ws]
        traced, reused = _regions.stats.traced, _regions.stats.reused
        loss = ft.jit(f)(params, x)
        loss.backward()
        results.append((loss.detach(), [t.grad for p in params for t in p]))
        counts = (_regions.stats.traced - traced, _regions.stats.reused - reused)
        # regions: the first call (x needs no gradient), the next two, and the last (its
        # scale differs): three traced, the third call reuses the second's
        assert counts == ((3, 1) if on else (0, 0))
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1], strict=True):
        assert torch.equal(a, b)


def test_region_rejects_a_non_callable() -> None:
    with pytest.raises(ft.InvalidArgumentError, match="region: fn=3"):
        ft.region(3)  # type: ignore[type-var]


def test_recompiles_log_reports_reuse(
    regions_env: Callable[[bool], None], capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    model = Stack([Block() for _ in range(2)])
    regions_env(True)
    ft.set_logs("recompiles")
    try:
        _step(model, _x())
    finally:
        ft.set_logs()
    err = capsys.readouterr().err
    assert "region Block" in err and "traced once" in err and "reused" in err


def test_a_symbolic_trace_reuses_regions(regions_env: Callable[[bool], None]) -> None:
    # regions are keyed by their inputs' size expressions; the sizes a block's backward reads
    # from its forward (SymInts) pass from each forward copy to its own backward copy
    torch.manual_seed(0)
    model = Stack([Block(p=0.0) for _ in range(3)])
    for on in (False, True):
        regions_env(on)
        reused = _regions.stats.reused
        jm = ft.jit(model, dynamic=True)
        for b, t in [(2, 5), (3, 7), (4, 3)]:
            x = torch.randn(b, t, 16, generator=torch.Generator().manual_seed(b))
            model.zero_grad(set_to_none=True)
            got = jm(x)
            got.backward()
            grads = [p.grad for p in model.parameters()]
            model.zero_grad(set_to_none=True)
            want = model(x)
            want.backward()
            torch.testing.assert_close(got, want)
            for g, p in zip(grads, model.parameters(), strict=True):
                torch.testing.assert_close(g, p.grad)
        assert jm.cache_info().misses == 1  # one symbolic entry for every shape
        assert (_regions.stats.reused - reused > 0) == on


def test_a_symbolic_region_trace_makes_no_fake_tensor_cache_entries(
    regions_env: Callable[[bool], None],
) -> None:
    # a symbolic block's fake-tensor cache entries cost more to make (and to rebuild outputs
    # from) than they save: a 2-block GPT's symbolic compile took 0.76 s with them, 0.62 s
    # without (benchmarks.dynamic); the whole-step trace (``symbolic_fakes``) already goes without
    from torch._subclasses.fake_tensor import FakeTensorMode

    regions_env(True)
    torch.manual_seed(0)
    model = Stack([Block(p=0.0) for _ in range(3)])
    jm = ft.jit(model, dynamic=True)
    misses, reused = FakeTensorMode.cache_misses, _regions.stats.reused
    jm(torch.randn(2, 5, 16)).backward()
    assert _regions.stats.reused > reused  # the block was traced once, as a region
    assert FakeTensorMode.cache_misses == misses


def test_symbolic_copies_keep_their_regions_storages() -> None:
    # laying a symbolic value onto a new storage recomputes its contiguity and bounds in sympy
    # (~0.3 ms a value, a fifth of a 2-block GPT's symbolic compile): a region's copies give
    # each node a fake of its own on the region value's storage instead; static values are
    # still laid onto storages of their own
    from functrans._core.shapes import symbolic_fakes
    from functrans._trace.regions.graph import Storages

    (x,) = symbolic_fakes([torch.ones(4, 6, 8)], ({0: None, 1: None},))
    view = x.transpose(0, 1)[1:]
    kept = Storages(x.fake_mode, keep_symbolic=True)
    copy = kept.fresh(view)
    assert copy is not view and copy.fake_mode is x.fake_mode
    assert (copy.shape, copy.stride(), copy.storage_offset()) == (
        view.shape,
        view.stride(),
        view.storage_offset(),
    )
    assert copy.untyped_storage()._cdata == view.untyped_storage()._cdata
    assert kept.moved(view) is view
    laid = Storages(x.fake_mode).fresh(view)
    assert laid.untyped_storage()._cdata != view.untyped_storage()._cdata
    with x.fake_mode:
        s = torch.empty(3, 2)
    assert kept.fresh(s).untyped_storage()._cdata != s.untyped_storage()._cdata


def test_symbolic_regions_trace_the_unrolled_graph(regions_env: Callable[[bool], None]) -> None:
    torch.manual_seed(0)
    seq = nn.Sequential(*[Block(p=0.0) for _ in range(3)])
    params = {k: v.detach().requires_grad_() for k, v in seq.named_parameters()}

    def g(ps: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(seq, ps, (x,)).square().sum()

    x = _x().requires_grad_()
    graphs = []
    for on in (False, True):
        regions_env(on)
        reused = _regions.stats.reused
        graphs.append(ft.joint(g, argnums=(0, 1), dynamic={"x": {0: "b", 1: "t"}})(params, x))
        assert (_regions.stats.reused - reused > 0) == on
    # the same tensor ops with the same layouts; each copy reads its sizes from its own
    # inputs (sym_size), where unrolled tracing reuses the first block's
    off, on_ = graphs

    def tensor_ops(jg: ft.JointGraph) -> list[str]:
        return [str(n.target) for n in jg.ops() if isinstance(n.meta["val"], torch.Tensor)]

    def layouts(jg: ft.JointGraph) -> list[Any]:
        return [row for row in _layout(jg) if row]

    assert tensor_ops(on_) == tensor_ops(off)
    assert [[r[:4] for r in row] for row in layouts(on_)] == [
        [r[:4] for r in row] for row in layouts(off)
    ]


class Indexed(Block):
    """A block with per-layer attributes, as Hugging Face decoder layers have: ``layer_idx``
    (read only with a KV cache) and ``scale``."""

    def __init__(self, idx: int, scale: float = 1.0, uses_idx: bool = False) -> None:
        super().__init__(p=0.0)
        self.layer_idx, self.scale, self.uses_idx = idx, scale, uses_idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x) * self.scale
        return y + self.layer_idx if self.uses_idx else y


@pytest.mark.parametrize(
    ("blocks", "traced"),
    [
        ([Indexed(i) for i in range(4)], 1),  # layer_idx never read: one region
        ([Indexed(i, scale=1.0 + (i % 2)) for i in range(4)], 2),  # scale read: two
        ([Indexed(i, uses_idx=True) for i in range(4)], 4),  # layer_idx read: one each
    ],
    ids=["unread", "read_scale", "read_idx"],
)
def test_a_region_is_keyed_by_the_attributes_its_trace_read(
    regions_env: Callable[[bool], None], blocks: list[nn.Module], traced: int
) -> None:
    torch.manual_seed(0)
    got = _compare(regions_env, Stack(blocks), _x())
    assert got == (traced, 4 - traced)


def test_a_block_reading_its_attribute_table_is_keyed_by_every_attribute(
    regions_env: Callable[[bool], None],
) -> None:
    class Reflective(Indexed):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * len(vars(self))

    torch.manual_seed(0)
    assert _compare(regions_env, Stack([Reflective(i) for i in range(3)]), _x()) == (3, 0)


def test_recording_reads_leaves_the_block_class_as_it_was(
    regions_env: Callable[[bool], None],
) -> None:
    torch.manual_seed(0)
    model = Stack([Indexed(i) for i in range(3)])
    regions_env(True)
    _step(model, _x())
    assert all(type(b) is Indexed for b in model.blocks)
    assert type(model.blocks[0].fc) is nn.Linear  # type: ignore[index]


def _scaled(scale: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def act(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * scale

    return act


class WithClosure(Block):
    """A block holding a closure of its own (torchtune gives each attention module one)."""

    def __init__(self, scale: float) -> None:
        super().__init__(p=0.0)
        self.act = _scaled(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(super().forward(x))


@pytest.mark.parametrize(
    ("scales", "traced"),
    [([1.0, 1.0, 1.0, 1.0], 1), ([1.0, 2.0, 1.0, 2.0], 2)],
    ids=["same_values", "two_values"],
)
def test_blocks_holding_closures_over_equal_values_share_a_region(
    regions_env: Callable[[bool], None], scales: list[float], traced: int
) -> None:
    """A function attribute is keyed by its code and what it closes over, not its identity:
    closures over equal values share a region, over other values they do not (and compute
    as eager does either way)."""
    torch.manual_seed(0)
    got = _compare(regions_env, Stack([WithClosure(s) for s in scales]), _x())
    assert got == (traced, 4 - traced)


class DictStack(nn.Module):
    """Blocks in an ``nn.ModuleDict``, called through ``values()`` (torchtitan's stack)."""

    def __init__(self, n: int, d: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Block(p=0.0) for i in range(n)})
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return self.head(x).square().mean()


def test_blocks_in_a_module_dict_are_one_region_and_guards_hold(
    regions_env: Callable[[bool], None],
) -> None:
    """A ``ModuleDict``'s blocks are regions; the trace-time ``values`` reads as the method
    a guard finds after the trace, so a second call hits."""
    torch.manual_seed(0)
    model = DictStack(4)
    assert _compare(regions_env, model, _x()) == (1, 3)
    f = ft.jit(model)
    for _ in range(2):
        f(_x()).backward()
    info = f.cache_info()
    assert (info.misses, info.hits) == (1, 1)


def test_a_closure_value_changed_after_compiling_is_followed() -> None:
    """A block's function attribute is keyed by what it closes over; a caller rebinding that
    value after the first call gets eager's result (the step recompiles)."""

    def scaled(scale: float) -> tuple[Callable[[torch.Tensor], torch.Tensor], Any]:
        def act(x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(x) * scale

        def rescale(value: float) -> None:
            nonlocal scale
            scale = value

        return act, rescale

    torch.manual_seed(0)
    blocks = [WithClosure(1.0) for _ in range(3)]
    setters = []
    for b in blocks:
        b.act, rescale = scaled(1.0)
        setters.append(rescale)
    model = Stack(blocks)
    f = ft.jit(model)
    f(_x()).backward()
    setters[1](3.0)
    model.zero_grad()
    want = model(_x())
    torch.testing.assert_close(f(_x()), want)
    assert f.cache_info().misses == 2
