"""The public fuzzing kit can fail: sabotaged strategies and backends are caught, with messages
that show the program, the saved set and the mismatching value."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import Phase, settings

from functrans import partitioners
from functrans.codegen.aten import AtenBackend
from functrans.extend import OpClass, Policy, op_class, policy_of
from functrans.testing import (
    check_backend,
    check_partition,
    register_backend_tests,
    register_partitioner_tests,
    reproduces_eager_rng,
)

# no shrinking: the point is that a failure is found, quickly
FIND = settings(max_examples=60, database=None, derandomize=True, phases=(Phase.generate,))

BUILTIN_STRATEGIES = partitioners.names()  # at collection: before any test registers one


def _save_everything(joint):
    """Ignores remat tags: saves MUST_RECOMPUTE values too."""
    return [n for n in joint.forward_nodes() if n.op == "call_function"]


def _corrupt_backward(joint):
    """Rewrites the joint graph it was asked to read: a backward mul becomes an add."""
    for n in joint.backward_nodes():
        if n.target is torch.ops.aten.mul.Tensor:
            n.target = torch.ops.aten.add.Tensor
    joint.graph_module.recompile()
    return _save_random_outputs(joint)


_KEPT = (Policy.MUST_SAVE, Policy.MUST_OFFLOAD)


def _save_random_outputs(joint):
    """Correct: saves only what must never be recomputed (random ops, MUST_SAVE and
    MUST_OFFLOAD values)."""
    keep = [n for n in joint.forward_nodes() if op_class(n) is OpClass.RANDOM]
    return keep + [n for n in joint.forward_nodes() if policy_of(n) in _KEPT]


def test_register_partitioner_tests_passes_a_correct_strategy():
    FIND(register_partitioner_tests(_save_random_outputs))()


def test_register_partitioner_tests_catches_an_invalid_saved_set():
    # partition() saves the random op (or a MUST_SAVE value) for it (CutProblem.legalize); the
    # suite tells the author, whichever rule the first failing program shows
    broke = r"broke the op rules.*draw different random numbers|breaks the shared save/recompute"
    with pytest.raises(AssertionError, match=broke):
        FIND(register_partitioner_tests(lambda joint: []))()


def test_register_partitioner_tests_catches_ignored_remat_tags():
    with pytest.raises(AssertionError, match="ignored remat tags"):
        FIND(register_partitioner_tests(_save_everything))()


def test_register_partitioner_tests_catches_wrong_gradients():
    with pytest.raises(AssertionError, match=r"differs from eager[\s\S]*program:"):
        FIND(register_partitioner_tests(_corrupt_backward))()


def test_register_partitioner_tests_catches_a_broken_invariant():
    def recomputes_nothing(p, options):
        assert not p.recomputed, "recomputed something"

    with pytest.raises(AssertionError, match="invariant of 'full_remat'"):
        FIND(register_partitioner_tests("full_remat", invariant=recomputes_nothing))()


class _OffByAPermille:
    """A backend whose kernels are slightly wrong."""

    def compile(self, graph, example_inputs):
        run = AtenBackend().compile(graph, example_inputs)

        def wrong(*tensors):
            return [t * 1.001 if t.is_floating_point() else t for t in run(*tensors)]

        return wrong


def test_register_backend_tests_passes_aten_and_catches_a_wrong_backend():
    FIND(register_backend_tests("aten"))()
    with pytest.raises(AssertionError, match="differs from eager"):
        FIND(register_backend_tests(_OffByAPermille()))()


def test_check_backend_message_shows_program_saved_set_and_values():
    def f(x, w):
        return torch.tanh(x @ w).sum(), x.sin()

    args = (torch.randn(3, 3, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64))
    with pytest.raises(AssertionError) as info:
        check_backend(f, args, _OffByAPermille(), "min_cut")
    message = str(info.value)
    assert "output[0] differs from eager" in message
    assert "got:" in message and "expected:" in message
    assert "saved: [" in message and "'mm: aten.mm.default torch.float64 [3, 3]'" in message
    assert "strategy: 'min_cut'" in message and "program: " in message


def test_dropout_is_checked_under_the_same_seed_on_both_sides():
    def f(x, w):
        y = F.dropout(x * w, 0.5)
        return (y.sin() * w).sum(), y

    args = (torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64))
    for name in BUILTIN_STRATEGIES:  # not the ones other tests register (some recompute dropout)
        for options in partitioners.examples(name):
            check_partition(f, args, name, **options)
    check_backend(f, args, "aten", "min_cut")
    assert reproduces_eager_rng("aten")
