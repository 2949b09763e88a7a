"""The public tuning API of the FlashAttention-2 kernels: listed configs, the autotuned kernels and
extra_configs, which widens a kernel's candidate list for a sweep and restores it afterwards."""

from __future__ import annotations

import pytest
import torch
import triton
from cs336_kernels.ops.flash_attention import flash_attention, tuning


def test_listed_configs_are_copies_that_obey_the_divisibility_rules():
    for kernel in tuning.KERNELS:
        for tma in (False, True):
            listed = tuning.listed_configs(kernel, tma=tma)
            assert listed, (kernel, tma)
            for entries in listed.values():
                for block_m, block_n, _, _ in entries:
                    inner, outer = (block_m, block_n) if kernel == "dkdv" else (block_n, block_m)
                    assert outer % inner == 0, (kernel, block_m, block_n)
            next(iter(listed.values())).clear()
            assert all(tuning.listed_configs(kernel, tma=tma).values())


def test_autotuned_kernels_carry_their_tma_flag():
    for kernel in tuning.KERNELS:
        tuned = tuning.autotuned_kernel(kernel)
        assert isinstance(tuned, triton.runtime.Autotuner)
        assert tuning.TMA_FLAGS[kernel] in tuned.fn.arg_names


@pytest.mark.interpreter
def test_extra_configs_widens_one_regime_and_restores_it():
    before = {kernel: tuning.listed_configs(kernel) for kernel in tuning.KERNELS}
    extra = {"fwd": {(2, 64): [(32, 16, 4, 2), (64, 64, 4, 3)]}, "dkdv": {(4, 32): [(16, 64, 4, 1)]}}
    tuned = tuning.autotuned_kernel("fwd")
    tuned.cache[("stale",)] = tuned.configs[0]
    with tuning.extra_configs(extra):
        assert ("stale",) not in tuned.cache
        fwd, dkdv = tuning.listed_configs("fwd"), tuning.listed_configs("dkdv")
        # Appended once: (64, 64, 4, 3) is listed already.
        assert fwd[(2, 64)] == [*before["fwd"][(2, 64)], (32, 16, 4, 2)]
        assert dkdv[(4, 32)] == [*before["dkdv"][(4, 32)], (16, 64, 4, 1)]
        assert {**fwd, (2, 64): None} == {**before["fwd"], (2, 64): None}
        assert tuning.listed_configs("dq") == before["dq"]
        # The kernels still compute the same thing inside the block.
        q = torch.randn(1, 1, 20, 16, generator=torch.Generator().manual_seed(0))
        o = flash_attention(q, q, q, True)
        torch.testing.assert_close(o, torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True))
    assert {kernel: tuning.listed_configs(kernel) for kernel in tuning.KERNELS} == before


def test_extra_configs_restores_the_tables_when_the_block_raises():
    before = tuning.listed_configs("dq")
    with pytest.raises(RuntimeError, match="inside"), tuning.extra_configs({"dq": {(2, 128): [(64, 16, 4, 2)]}}):
        raise RuntimeError("inside")
    assert tuning.listed_configs("dq") == before


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"bwd": {(2, 64): [(64, 64, 4, 3)]}}, "kernel must be one of"),
        ({"fwd": {(2, 48): [(64, 64, 4, 3)]}}, "regime must be one of"),
        ({"fwd": {(2, 64): [(64, 64, 4)]}}, "four positive ints"),
        ({"fwd": {(2, 64): [(64, 64, 0, 3)]}}, "four positive ints"),
        ({"fwd": {(2, 64): [(48, 16, 4, 3)]}}, "powers of two"),
        ({"fwd": {(2, 64): [(64, 8, 4, 3)]}}, "powers of two >= 16"),
        ({"fwd": {(2, 64): [(32, 64, 4, 3)]}}, r"fwd kernel needs BLOCK_N \| BLOCK_M"),
        ({"dq": {(2, 64): [(32, 64, 4, 3)]}}, r"dq kernel needs BLOCK_N \| BLOCK_M"),
        ({"dkdv": {(2, 64): [(64, 32, 4, 3)]}}, r"dkdv kernel needs BLOCK_M \| BLOCK_N"),
    ],
)
def test_extra_configs_rejects_bad_entries_and_changes_nothing(extra, message):
    before = {kernel: tuning.listed_configs(kernel) for kernel in tuning.KERNELS}
    with pytest.raises(ValueError, match=message), tuning.extra_configs(extra):
        pass
    assert {kernel: tuning.listed_configs(kernel) for kernel in tuning.KERNELS} == before


def test_unknown_kernel_names_raise():
    with pytest.raises(ValueError, match="kernel must be one of"):
        tuning.autotuned_kernel("fwd_bwd")
    with pytest.raises(ValueError, match="kernel must be one of"):
        tuning.listed_configs("dk")


@pytest.mark.gpu
def test_gpu_extra_config_is_timed_by_the_autotuner():
    extra = (32, 16, 4, 2)
    q, k, v = (torch.randn(1, 2, 300, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    tuned = tuning.autotuned_kernel("fwd")
    with tuning.extra_configs({"fwd": {(2, 64): [extra]}}):
        flash_attention(q, k, v, is_causal=True, forward="triton")
        timed = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in tuned.configs_timings}
        assert extra in timed
    flash_attention(q, k, v, is_causal=True, forward="triton")
    timed = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in tuned.configs_timings}
    assert extra not in timed
