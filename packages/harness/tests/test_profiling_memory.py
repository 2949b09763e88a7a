"""Kernel attribution by range and the active-memory timeline, on hand-made traces and snapshots."""

from __future__ import annotations

import pytest
from cs336_harness.analysis import figures, memory, trace
from figure_checks import read_figure


def _span(name: str, ts: float, dur: float, cat: str = "user_annotation", **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args, "tid": 1}


def _trace() -> list[dict]:
    events = [_span("step", 0, 1000), _span("forward", 10, 300), _span("backward", 320, 600),
              _span("attention/softmax", 50, 20)]
    # (name, launch time on the CPU, GPU start, GPU duration); GPU work runs later than its launch.
    kernels = [("gemm_a", 20, 100, 40), ("softmax_k", 55, 140, 30), ("gemm_a", 200, 200, 40),
               ("gemm_b", 400, 450, 120), ("elementwise_x", 500, 570, 10), ("gemm_a", 1500, 1500, 99)]
    for corr, (name, launch, start, dur) in enumerate(kernels):
        events.append(_span("cudaLaunchKernel", launch, 2, cat="cuda_runtime", correlation=corr))
        events.append(_span(name, start, dur, cat="kernel", correlation=corr, stream=7))
    return events


def test_kernels_are_attributed_by_launch_time() -> None:
    rows = trace.kernel_table(_trace(), num_steps=1)
    total = {r["range"]: r["total_ms_per_step"] for r in rows if r["kernel"] == "(total)"}
    assert total == pytest.approx({"all": 0.24, "forward": 0.11, "backward": 0.13, "attention/softmax": 0.03})
    fwd = {r["kernel"]: r for r in rows if r["range"] == "forward" and r["kernel"] != "(total)"}
    assert fwd["gemm_a"]["calls_per_step"] == 2 and fwd["gemm_a"]["share_of_range"] == pytest.approx(80 / 110)
    assert list(fwd) == ["gemm_a", "softmax_k"]  # ranked by time
    assert fwd["softmax_k"]["share_of_step"] == pytest.approx(30 / 240)


def test_class_shares_and_timeline(tmp_path) -> None:
    shares = trace.class_shares(_trace(), "backward")
    assert shares == pytest.approx({"matmul": 120 / 130, "elementwise": 10 / 130})
    fig = read_figure(figures.plot_timeline(_trace(), tmp_path / "t.png"))
    assert fig.width == 1540 and fig.ink > 0.02
    assert fig.shows("tab:blue", "tab:orange", "tab:green")  # forward, backward and optimizer kernels
    with pytest.raises(ValueError, match="no 'step' range"):
        figures.plot_timeline([], tmp_path / "u.png")


def test_active_memory_timeline_adds_the_baseline(tmp_path) -> None:
    trace = [{"action": "alloc", "size": 100, "time_us": 1}, {"action": "alloc", "size": 50, "time_us": 2},
             {"action": "free_requested", "size": 100, "time_us": 3},
             {"action": "free_completed", "size": 100, "time_us": 4}]
    # Live at the end: the 50-byte block plus 1000 bytes allocated before recording began.
    blocks = [{"size": 50, "state": "active_allocated"}, {"size": 1000, "state": "active_allocated"},
              {"size": 7, "state": "inactive"}]
    snapshot = {"device_traces": [trace], "segments": [{"device": 0, "blocks": blocks}]}
    times, live = memory.active_memory_timeline(snapshot)
    assert times.tolist() == [1, 2, 4] and live.tolist() == [1100, 1150, 1050]
    fig = read_figure(figures.plot_active_memory(snapshot, tmp_path / "m.png"))
    assert (fig.width, fig.height) == (1100, 385) and fig.shows("tab:blue")  # the live-bytes line


def test_gradient_allocations_are_backward_survivors() -> None:
    ours = [{"filename": "/x/cs336_basics/model.py", "line": 1, "name": "forward"}]
    opt = [{"filename": "/x/cs336_basics/optimizer.py", "line": 2, "name": "step"}]
    trace = [
        {"action": "alloc", "addr": 1, "size": 64, "frames": ours},  # an activation, freed in backward
        {"action": "alloc", "addr": 2, "size": 8, "frames": []},  # a gradient
        {"action": "alloc", "addr": 3, "size": 16, "frames": []},  # a backward temporary
        {"action": "free_completed", "addr": 3, "size": 16},
        {"action": "free_completed", "addr": 1, "size": 64},
        {"action": "alloc", "addr": 4, "size": 8, "frames": []},  # another gradient
        {"action": "alloc", "addr": 5, "size": 8, "frames": opt},
    ]
    assert memory.gradient_allocations({"device_traces": [trace]}) == {8: 2}
    with pytest.raises(ValueError, match="optimizer"):
        memory.gradient_allocations({"device_traces": [trace[:-1]]})


@pytest.mark.parametrize(
    ("name", "short", "cls"),
    [
        ("sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x64x8_stage3_warpsize2x2x1_ffma_aligna4",
         "gemm f32f32 tn 128x64", "matmul"),
        ("void cutlass::Kernel2<cutlass_80_simt_sgemm_256x128_8x4_nt_align1>(x)", "gemm 80_simt_sgemm 256x128 nt",
         "matmul"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float, "
         "at::native::binary_internal::MulFunctor<float> >, std::array<char*, 3ul> >(int)", "elementwise: mul",
         "elementwise"),
        ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::(anonymous "
         "namespace)::masked_fill_kernel(at::TensorIterator&, c10::Scalar const&)::{lambda()#1}>(int)",
         "elementwise: masked_fill", "elementwise"),
        ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, "
         "at::native::MaxNanFunctor<float> >, unsigned int, float, 4, 4> >(x)", "reduce: maxnan", "reduction"),
        ("Memcpy DtoD (Device -> Device)", "Memcpy DtoD", "copy"),
    ],
)
def test_kernel_names_and_classes(name: str, short: str, cls: str) -> None:
    assert trace.short_kernel_name(name) == short
    assert trace.kernel_class(name) == cls


def test_host_op_times_count_only_the_first_range() -> None:
    def ev(name: str, cat: str, ts: float, dur: float) -> dict:
        return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur}

    events = [
        ev("backward", "user_annotation", 100, 100), ev("backward", "user_annotation", 500, 100),
        ev("aten::mm", "cpu_op", 110, 30), ev("aten::mm", "cpu_op", 150, 10), ev("aten::mm", "cpu_op", 520, 99),
        ev("cudaLaunchKernel", "cuda_runtime", 120, 4), ev("aten::mm", "cpu_op", 50, 7),  # before the range
    ]
    got = trace.host_op_times(events, "backward", ["aten::mm", "cudaLaunchKernel", "c10d::allreduce_"])
    assert got["aten::mm"] == {"calls": 2, "total_ms": 0.04, "median_us": 20.0}
    assert got["cudaLaunchKernel"]["calls"] == 1 and got["c10d::allreduce_"]["calls"] == 0
    with pytest.raises(ValueError, match="no 'forward' range"):
        trace.host_op_times(events, "forward", ["aten::mm"])
