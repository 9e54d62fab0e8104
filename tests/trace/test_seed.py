"""The joint-graph article's worked example, f(x, w) = tanh(x @ w).sum(), as golden text."""

import expecttest
import torch

import functrans as ft


def f(x, w):
    return torch.tanh(x @ w).sum()


def seed_args():
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g)


class TestSeedExample(expecttest.TestCase):
    def test_joint_graph(self):
        jg = ft.joint(f)(*seed_args())
        # tanh_backward decomposes to mul/sub/mul, as the article shows
        self.assertExpectedInline(
            str(jg),
            """\
def forward(primals_1: "f32[64, 64]", primals_2: "f32[64, 64]", tangents_1: "f32[]"):
    mm: "f32[64, 64]" = aten.mm.default(primals_1, primals_2)
    tanh: "f32[64, 64]" = aten.tanh.default(mm)
    sum_1: "f32[]" = aten.sum.dim_IntList(tanh, [])
    expand: "f32[64, 64]" = aten.expand.default(tangents_1, [64, 64])
    mul: "f32[64, 64]" = aten.mul.Tensor(tanh, tanh)
    sub: "f32[64, 64]" = aten.sub.Tensor(1, mul)
    mul_1: "f32[64, 64]" = aten.mul.Tensor(expand, sub)
    permute: "f32[64, 64]" = aten.permute.default(primals_1, [1, 0])
    mm_1: "f32[64, 64]" = aten.mm.default(permute, mul_1)
    permute_1: "f32[64, 64]" = aten.permute.default(primals_2, [1, 0])
    mm_2: "f32[64, 64]" = aten.mm.default(mul_1, permute_1)
    return (sum_1, mm_2, mm_1)""",
        )

    def test_default_partition_saves_tanh_like_eager(self):
        p = ft.partition(ft.joint(f)(*seed_args()), "default")
        self.assertExpectedInline(
            str(p.forward),
            """\
def forward(primals_1: "f32[64, 64]", primals_2: "f32[64, 64]"):
    mm: "f32[64, 64]" = aten.mm.default(primals_1, primals_2)
    tanh: "f32[64, 64]" = aten.tanh.default(mm)
    sum_1: "f32[]" = aten.sum.dim_IntList(tanh, [])
    return (sum_1, primals_1, primals_2, tanh)""",
        )
        self.assertExpectedInline(
            str(p.backward),
            """\
def forward(primals_1: "f32[64, 64]", primals_2: "f32[64, 64]", tanh: "f32[64, 64]", tangents_1: "f32[]"):
    expand: "f32[64, 64]" = aten.expand.default(tangents_1, [64, 64])
    mul: "f32[64, 64]" = aten.mul.Tensor(tanh, tanh)
    sub: "f32[64, 64]" = aten.sub.Tensor(1, mul)
    mul_1: "f32[64, 64]" = aten.mul.Tensor(expand, sub)
    permute: "f32[64, 64]" = aten.permute.default(primals_1, [1, 0])
    mm_1: "f32[64, 64]" = aten.mm.default(permute, mul_1)
    permute_1: "f32[64, 64]" = aten.permute.default(primals_2, [1, 0])
    mm_2: "f32[64, 64]" = aten.mm.default(mul_1, permute_1)
    return (mm_2, mm_1)""",
        )
        self.assertEqual(p.activation_bytes, 64 * 64 * 4)
        self.assertEqual(p.recomputed, ())

    def test_full_remat_saves_only_inputs(self):
        p = ft.partition(ft.joint(f)(*seed_args()), "full_remat")
        self.assertExpectedInline(
            str(p.forward),
            """\
def forward(primals_1: "f32[64, 64]", primals_2: "f32[64, 64]"):
    mm: "f32[64, 64]" = aten.mm.default(primals_1, primals_2)
    tanh: "f32[64, 64]" = aten.tanh.default(mm)
    sum_1: "f32[]" = aten.sum.dim_IntList(tanh, [])
    return (sum_1, primals_1, primals_2)""",
        )
        self.assertExpectedInline(
            str(p.backward),
            """\
def forward(primals_1: "f32[64, 64]", primals_2: "f32[64, 64]", tangents_1: "f32[]"):
    expand: "f32[64, 64]" = aten.expand.default(tangents_1, [64, 64])
    mm: "f32[64, 64]" = aten.mm.default(primals_1, primals_2)  # recomputed
    tanh: "f32[64, 64]" = aten.tanh.default(mm)  # recomputed
    mul: "f32[64, 64]" = aten.mul.Tensor(tanh, tanh)
    sub: "f32[64, 64]" = aten.sub.Tensor(1, mul)
    mul_1: "f32[64, 64]" = aten.mul.Tensor(expand, sub)
    permute: "f32[64, 64]" = aten.permute.default(primals_1, [1, 0])
    mm_1: "f32[64, 64]" = aten.mm.default(permute, mul_1)
    permute_1: "f32[64, 64]" = aten.permute.default(primals_2, [1, 0])
    mm_2: "f32[64, 64]" = aten.mm.default(mul_1, permute_1)
    return (mm_2, mm_1)""",
        )
        self.assertEqual([s.name for s in p.saved], ["primals_1", "primals_2"])
        self.assertEqual(p.activation_bytes, 0)
        self.assertEqual([n.name for n in p.recomputed], ["mm", "tanh"])
        self.assertEqual(p.recompute_flops, 2 * 64**3 + 64 * 64)

    def test_checkpoint_is_an_alias_of_full_remat(self):
        jg = ft.joint(f)(*seed_args())
        self.assertEqual(
            str(ft.partition(jg, "checkpoint").backward),
            str(ft.partition(jg, "full_remat").backward),
        )

    def test_report_table(self):
        p = ft.partition(ft.joint(f, argnums=1)(*seed_args()), "default")
        report = p.report().replace(__file__.rsplit("/", 1)[-1], "test_seed.py")
        self.assertExpectedInline(
            report,
            """\
partition 'default': 2 saved values, 16.0 KiB of activations, 0 ops recomputed (0 FLOPs)
  saved      op                 shape        dtype    bytes  input  source
  primals_1  input              f32[64, 64]  float32  16384  yes
  tanh       aten.tanh.default  f32[64, 64]  float32  16384  no     test_seed.py:10: return torch.tanh(x @ w).sum()
  activation bytes: 16384
  peak bytes (forward then backward, above the inputs): 32776
  recomputed in backward: -""",
        )

    def test_gradients_match_eager(self):
        x, w = seed_args()
        for strategy in ("default", "full_remat"):
            p = ft.partition(ft.joint(f)(x, w), strategy)
            outs, saved = p.forward(x, w)
            gx, gw = p.backward(saved, (torch.tensor(1.0),))
            xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
            f(xr, wr).backward()
            torch.testing.assert_close(outs, f(x, w))
            torch.testing.assert_close(gx, xr.grad)
            torch.testing.assert_close(gw, wr.grad)
