"""The Gluon backward's exp2 on the FMA pipe (gluon_common.exp2_chain), its PTX steps replayed in fp32 on the CPU
against float64's exp2: the polynomial, the rounding constant and the floor. The asm itself runs only on an sm_90 GPU
(test_gluon_attention.py)."""

from __future__ import annotations

import torch
from cs336_kernels.ops.flash_attention.gluon_common import EXP2_FLOOR, EXP2_POLY, ROUND_MAGIC


def _fma(a: torch.Tensor, b: torch.Tensor | float, c: torch.Tensor | float) -> torch.Tensor:
    # fma.rn.f32: fp32 products are exact in float64, so one rounding of the float64 sum to fp32 (a second rounding
    # can differ from fma's single one only on a tie, by one fp32 ulp).
    return (a.double() * b + c).float()


def _soft_exp2(x: torch.Tensor) -> torch.Tensor:
    # exp2_chain's PTX for the element it runs on the FMA pipe, step by step in fp32.
    c0, c1, c2, c3 = EXP2_POLY
    t = x + ROUND_MAGIC
    j = t - ROUND_MAGIC
    f = x - j
    q = _fma(_fma(_fma(f, c3, c2), f, c1), f, c0)
    # shl.b32 and add.s32 wrap modulo 2^32.
    bits = ((t.view(torch.int32).long() << 23) + q.view(torch.int32).long()) & 0xFFFFFFFF
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    return torch.where(x >= EXP2_FLOOR, bits.view(torch.float32), 0.0)


def test_soft_exp2_is_within_its_bound_of_exp2_and_normal_from_its_floor():
    # A dense grid, the rounding's ties (half-integers) and the ends of the range (x <= 0 for softmax weights, and
    # the few ulps above 0 that rounding of the scores and L may give).
    grid = torch.linspace(EXP2_FLOOR, 1.0, 2_000_001, dtype=torch.float32)
    ties = torch.arange(2 * EXP2_FLOOR, 3.0, dtype=torch.float32) / 2
    x = torch.cat([grid, ties, torch.tensor([EXP2_FLOOR, -0.0, 1e-7, -1e-7])])
    got = _soft_exp2(x)
    ref = torch.exp2(x.double())
    assert (got >= torch.finfo(torch.float32).tiny).all()
    rel = ((got.double() - ref) / ref).abs().max().item()
    # The fit's 7.5e-5 and a few fp32 roundings; a bf16 half-ulp is 2^-9 = 1.95e-3.
    assert rel < 7.6e-5, rel


def test_soft_exp2_is_zero_below_its_floor():
    # Where j's exponent add could leave the normal range (ex2.approx.ftz flushes from -126); -inf is a masked score.
    x = torch.tensor([EXP2_FLOOR - 1e-4, -125.5, -126.0, -127.0, -150.0, -1e30, float("-inf")])
    assert torch.equal(_soft_exp2(x), torch.zeros_like(x))
