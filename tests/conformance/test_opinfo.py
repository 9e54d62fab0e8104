"""OpInfo conformance: torch's op database through trace, joint and every partition strategy.

``make test`` runs a fixed subset (``CI_OPS``, first ``CI_SAMPLES`` samples each) and checks the
committed ``opinfo_status.json``. ``make conformance`` (``FUNCTRANS_CONFORMANCE=full``) runs the
full sweep over every OpInfo with float32 autograd on CPU and rewrites that file. Both hold
every result to the same bar: its error against a float64 reference at most 2x eager float32's
(``_sweep.BOUND``, plus ``_sweep.FLOOR``), random ops drawing what eager draws.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import _run
import _sweep
import pytest
import torch

FULL = os.environ.get("FUNCTRANS_CONFORMANCE") == "full"
STATUS = pathlib.Path(__file__).with_name("opinfo_status.json")
MIN_PASS_RATE = 0.95
CI_SAMPLES = 2
FULL_SAMPLES = 10  # per op in the full sweep ("all" through FUNCTRANS_CONFORMANCE_SAMPLES)

CI_OPS = {
    "unary pointwise": [
        "abs", "exp", "log", "sin", "tanh", "sigmoid", "rsqrt", "erf", "nn.functional.gelu",
        "nn.functional.silu", "nn.functional.relu", "nn.functional.softplus",
    ],
    "binary pointwise": [
        "add", "mul", "sub", "div.no_rounding_mode", "pow", "atan2", "maximum", "lerp",
        "addcmul", "xlogy",
    ],
    "reductions": [
        "sum", "mean", "amax", "prod", "var", "std_mean", "logsumexp", "norm",
        "max.reduction_with_dim", "linalg.vector_norm",
    ],
    "views and shapes": [
        "reshape", "view", "permute", "transpose", "expand", "squeeze", "unsqueeze", "flatten",
        "slice", "select", "movedim", "repeat", "flip", "roll", "as_strided", "split",
        "unbind", "diagonal", "tril", "nn.functional.pad.constant",
    ],
    "indexing": [
        "gather", "scatter", "scatter_add", "index_select", "index_add", "index_copy",
        "take_along_dim", "masked_fill", "__getitem__", "scatter_reduce.sum",
        "nn.functional.embedding",
    ],
    "linear algebra": [
        "mm", "bmm", "matmul", "addmm", "baddbmm", "einsum", "outer", "linalg.det",
        "linalg.solve", "linalg.inv",
    ],
    "nn.functional": [
        "softmax", "log_softmax", "nn.functional.layer_norm", "nn.functional.group_norm",
        "nn.functional.conv2d", "nn.functional.conv_transpose1d", "nn.functional.max_pool2d",
        "nn.functional.avg_pool2d", "nn.functional.adaptive_avg_pool2d",
        "nn.functional.cross_entropy", "nn.functional.nll_loss", "nn.functional.mse_loss",
        "nn.functional.binary_cross_entropy_with_logits", "nn.functional.linear",
        "nn.functional.scaled_dot_product_attention", "nn.functional.interpolate.bilinear",
        "nn.functional.smooth_l1_loss",
    ],
    "cat and stack": ["cat", "stack", "hstack", "vstack"],
    "cumulative": ["cumsum", "cumprod", "logcumsumexp", "cummax"],
    "comparisons and where": [
        "where", "clamp", "clamp_min", "nn.functional.hardtanh", "topk", "sort", "masked.amax",
    ],
    # OpInfo reseeds these inside the op; the harness seeds outside, as a traced function must
    "random": ["bernoulli", "nn.functional.dropout"],
}  # fmt: skip
CI_KEYS = [key for keys in CI_OPS.values() for key in keys]


@pytest.mark.parametrize("key", CI_KEYS)
def test_op_conforms(key: str) -> None:
    (op,) = _sweep.select_ops([key])
    result = _sweep.run_op(op, max_samples=CI_SAMPLES)
    assert result["status"] == "passed", f"{key}: {result}"
    assert result["samples"].get("passed", 0) >= 1, f"{key}: no sample was checked: {result}"


def check_report(report: dict[str, Any]) -> None:
    """The bar the sweep must clear: pass rate, no silent wrong results, reasons everywhere."""
    ops = report["ops"]
    totals = report["totals"]
    assert totals["ops"] == len(ops) == sum(totals[s] for s in _sweep.RANK)
    for status in _sweep.RANK:
        assert totals[status] == sum(1 for r in ops.values() if r["status"] == status)
    wrong = {k: r["reason"] for k, r in ops.items() if r["status"] == "wrong"}
    assert not wrong, f"silently wrong results: {wrong}"
    crashed = {k: r["reason"] for k, r in ops.items() if r["status"] == "error"}
    assert not crashed, f"crashes that are not functrans errors: {crashed}"
    for key, r in ops.items():
        if r["status"] != "passed":
            assert r.get("reason", "").strip(), f"{key} is {r['status']} without a reason"
    # the numerics bar, read back from the figures (two significant digits: 5% slack)
    worse = {
        k: r["error"]
        for k, r in ops.items()
        if r["status"] == "passed"
        and "error" in r
        and r["error"]["functrans"] > 1.05 * (_sweep.BOUND * r["error"]["eager"] + _sweep.FLOOR)
    }
    assert not worse, f"errors against float64 past {_sweep.BOUND:g}x eager's: {worse}"
    checked = totals["ops"] - totals["skipped"]
    assert totals["passed"] >= MIN_PASS_RATE * checked, (
        f"pass rate {totals['passed']}/{checked} is below {MIN_PASS_RATE:.0%}"
    )


def test_status_file() -> None:
    """The committed sweep result clears the bar and covers exactly today's op selection."""
    report = json.loads(STATUS.read_text())
    check_report(report)
    assert set(report["ops"]) == {_sweep.op_key(op) for op in _sweep.select_ops()}, (
        "opinfo_status.json is stale: run `make conformance`"
    )
    for key in CI_KEYS:
        assert report["ops"][key]["status"] == "passed", key


def test_check_report_rejects_wrong_results() -> None:
    """The bar itself can fail: one silently wrong op is enough."""
    ops = {f"op{i}": {"status": "passed"} for i in range(40)}
    ops["bad"] = {"status": "wrong", "reason": "grad differs"}
    totals = {s: sum(1 for r in ops.values() if r["status"] == s) for s in _sweep.RANK}
    with pytest.raises(AssertionError, match="silently wrong"):
        check_report({"ops": ops, "totals": {"ops": len(ops), **totals}})


class _Op:
    """A stand-in OpInfo whose op computes something else while functrans traces it."""

    name, variant_test_name = "differs_when_traced", ""

    def __call__(self, x: Any) -> Any:
        from functrans._core.context import is_tracing

        return x.sin() * (2.0 if is_tracing() else 1.0)


def test_a_silent_mismatch_is_classified_wrong() -> None:
    """The harness can fail: a graph that disagrees with eager (in float64 too) is "wrong"."""
    from torch.testing._internal.opinfo.core import SampleInput

    sample = SampleInput(torch.randn(3, requires_grad=True))
    status, reason = _sweep.run_sample(_Op(), sample, _sweep.strategies())
    assert status == "wrong" and "float64" in reason, (status, reason)


class _Imprecise(_Op):
    """Computes ``sin`` less accurately than eager while traced, in float32 only: within the
    1e-4 tolerance of eager's result, but hundreds of times further from float64."""

    name = "imprecise_when_traced"

    def __call__(self, x: Any) -> Any:
        from functrans._core.context import is_tracing

        off = 3e-5 if is_tracing() and x.dtype == torch.float32 else 0.0
        return x.sin() * (1 + off)


def test_a_precision_loss_past_the_bound_is_classified_wrong() -> None:
    """The numerics bar: an error against float64 over 2x eager float32's is "wrong", and the
    reason says the float64 run agrees (precision lost, not the math)."""
    from torch.testing._internal.opinfo.core import SampleInput

    sample = SampleInput(torch.linspace(-3, 3, 16).requires_grad_())
    numerics = _sweep.Numerics()
    status, reason = _sweep.run_sample(_Imprecise(), sample, _sweep.strategies(), numerics)
    assert status == "wrong" and "precision lost" in reason, (status, reason)
    assert numerics.ours > 10 * numerics.eager, numerics
    assert numerics.share() > 1


class _Redraws(_Op):
    """A random op whose graph draws other numbers than eager (one draw more, first)."""

    name = "redraws_when_traced"

    def __call__(self, x: Any) -> Any:
        from functrans._core.context import is_tracing

        first = torch.rand_like(x) if is_tracing() else torch.zeros_like(x)
        return x * torch.rand_like(x) + 0 * first


def test_a_random_op_is_compared_with_eager_not_skipped() -> None:
    """Random ops are checked against eager under one generator state: a graph that draws
    other numbers is "wrong", not skipped; one that draws the same passes."""
    from torch.testing._internal.opinfo.core import SampleInput

    sample = SampleInput(torch.randn(8, requires_grad=True))
    status, reason = _sweep.run_sample(_Redraws(), sample, _sweep.strategies())
    assert status == "wrong", (status, reason)
    (op,) = _sweep.select_ops(["bernoulli"])
    assert _sweep.run_op(op, max_samples=1)["status"] == "passed"


def test_opinfos_reseeding_is_taken_out_of_the_traced_function() -> None:
    """OpInfo's random ops reseed inside (``wrapper_set_seed``), which functrans refuses in a
    traced function; the harness's version of the op does not, and draws from the caller's
    generator state."""
    (op,) = _sweep.select_ops(["nn.functional.dropout"])
    x = torch.ones(64)
    plain = _sweep.unseeded(op)
    assert plain is not op
    torch.manual_seed(0)
    a = plain(x, p=0.5, training=True)
    torch.manual_seed(1)
    b = plain(x, p=0.5, training=True)
    assert not torch.equal(a, b)  # OpInfo's op draws the same under any outer seed
    torch.manual_seed(1)
    assert torch.equal(b, plain(x, p=0.5, training=True))
    (abs_op,) = _sweep.select_ops(["abs"])
    assert _sweep.unseeded(abs_op) is abs_op


@pytest.mark.skipif(
    not FULL, reason="full OpInfo sweep: FUNCTRANS_CONFORMANCE=full (make conformance)"
)
def test_full_sweep() -> None:
    max_samples = os.environ.get("FUNCTRANS_CONFORMANCE_SAMPLES", str(FULL_SAMPLES))
    report = _run.sweep(
        max_samples=int(max_samples) if max_samples != "all" else None,
        workers=int(os.environ.get("FUNCTRANS_CONFORMANCE_WORKERS", "2")),
    )
    STATUS.write_text(json.dumps(report, indent=1) + "\n")
    check_report(report)
