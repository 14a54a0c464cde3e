"""txl_dist/trace_summary.py: the device's busy share, the host's waits and the launches of a profiled window,
against numbers worked out by hand from a synthetic window, also read from a Chrome trace; the operator times
of a real CPU profile against torch's own key_averages(); a GPU-shaped trace's device table and host list."""
from __future__ import annotations

import gzip
import json
import tempfile
from pathlib import Path

import pytest
import torch

from txl_dist.trace_summary import (Activity, activities_from_trace, analyze, busiest, kernel_kind, main,
                                    operator_table, operator_times, summarize, summary_line)

# Two steps, 0-100 us and 100-250 us; the device runs behind the host and finishes at 260 us.
# Kernels: stream 7 [10, 40] and [30, 60] (overlapping: union [10, 60]), stream 9 [50, 90] (union [10, 90]),
# step 2: stream 7 [120, 160], [200, 260]. Busy: 80 + 40 + 60 = 180 us of the window 0..260.
WINDOW = [
    Activity("step", "ProfilerStep#4", 0.0, 100.0),
    Activity("step", "ProfilerStep#5", 100.0, 250.0),
    Activity("device", "gemm", 10.0, 40.0, 7),
    Activity("device", "gemm", 30.0, 60.0, 7),
    Activity("device", "reduce", 50.0, 90.0, 9),
    Activity("device", "gemm", 120.0, 160.0, 7),
    Activity("device", "Memcpy DtoH", 200.0, 260.0, 7),
    Activity("api", "cudaLaunchKernel", 5.0, 6.0),
    Activity("api", "cudaLaunchKernel", 25.0, 26.0),
    Activity("api", "cudaLaunchKernel", 45.0, 46.0),
    Activity("api", "cudaLaunchKernel", 110.0, 111.0),
    Activity("api", "cudaStreamSynchronize", 190.0, 250.0),
    Activity("api", "cudaDeviceSynchronize", 60.0, 90.0),
]


def test_the_summary_of_a_window_matches_the_numbers_worked_out_by_hand():
    s = summarize(WINDOW)
    assert s["steps"] == [4, 5]
    assert s["window_ms"] == 0.26 and s["step_ms"] == [0.1, 0.16]
    d = s["device"]
    assert d["busy_ms"] == 0.18 and d["busy_share"] == round(180 / 260, 4)
    # Step 4: 80 us busy of 100; step 5 (100..260): 40 + 60 of 160.
    assert d["busy_share_per_step"] == [0.8, 0.625]
    assert d["activities_per_step"] == 2.5 and d["mean_activity_us"] == (30 + 30 + 40 + 40 + 60) / 5
    assert d["stream_ms"] == {"7": 0.16, "9": 0.04}
    assert d["top"][0] == {"name": "gemm", "calls": 3, "ms": 0.1, "share": 0.5}
    assert d["kinds"] == [{"name": "matmul", "calls": 3, "ms": 0.1, "share": 0.5},
                          {"name": "copies", "calls": 1, "ms": 0.06, "share": 0.3},
                          {"name": "other", "calls": 1, "ms": 0.04, "share": 0.2}]
    assert s["host_waits_per_step"] == 1.0 and s["host_wait_ms_per_step"] == 0.045
    assert s["host_waits"] == {"cudaDeviceSynchronize": {"calls": 1, "ms": 0.03},
                               "cudaStreamSynchronize": {"calls": 1, "ms": 0.06}}
    assert s["launches_per_step"] == 2.0
    line = summary_line(s)
    assert line.startswith("device busy 69.2% of 0 ms (per step 80.0%, 62.5%); host waits 1 per step")
    assert "cudaStreamSynchronize x1" in line and "busiest: gemm 50.0%" in line
    assert "by kind: matmul 50.0%, copies 30.0%, other 20.0%; busiest" in line


def test_what_lies_before_the_window_and_a_window_without_steps():
    early = [Activity("device", "gemm", -50.0, 20.0, 7), Activity("api", "cudaDeviceSynchronize", -40.0, -30.0)]
    s = summarize(WINDOW + early)
    assert s["device"]["busy_ms"] == 0.19  # the early kernel counts from the window's start: [0, 90] is busy
    assert s["host_waits_per_step"] == 1.0  # a wait before the window is not the steps'
    assert summarize([a for a in WINDOW if a.kind != "step"]) is None
    no_device = summarize([a for a in WINDOW if a.kind != "device"])
    assert no_device["device"] is None and summary_line(no_device) is None


def _chrome_trace() -> dict:
    """WINDOW as torch.profiler's Chrome trace writes it (Kineto's categories; absolute microseconds)."""
    cats = {"step": "user_annotation", "api": "cuda_runtime"}
    events = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "python"}},
              {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#4", "ts": 1e6, "dur": 300.0},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1e6, "dur": 5.0}]
    for a in WINDOW:
        e = {"ph": "X", "name": a.name, "ts": 1e6 + a.start, "dur": a.end - a.start, "pid": 0, "tid": 1}
        if a.kind == "device":
            e |= {"cat": "gpu_memcpy" if a.name.startswith("Memcpy") else "kernel", "tid": a.stream,
                  "args": {"stream": a.stream, "device": 0}}
        else:
            e["cat"] = cats[a.kind]
        events.append(e)
    return {"traceEvents": events}


def test_a_chrome_trace_gives_the_same_summary(tmp_path, capsys):
    assert summarize(activities_from_trace(_chrome_trace())) == summarize(WINDOW)
    path = tmp_path / "rank00000.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_chrome_trace(), f)
    assert main([str(path)]) == 0
    assert capsys.readouterr().out.startswith("device busy 69.2%")
    assert main([str(path), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in printed.pop("host_busiest")][:2] == ["ProfilerStep*", "cudaStreamSynchronize"]
    assert printed == summarize(WINDOW)
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"traceEvents": []}))
    assert main([str(empty)]) == 1


def test_self_cpu_times_equal_torchs_key_averages():
    """The independent reference: torch's own table of the same profile (a model's forward and backward)."""
    import dataclasses

    from txl_dist.config import ModelConfig
    from txl_dist.model import TransformerXL

    cfg = ModelConfig(vocab_size=300, n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, cutoffs=[100, 200],
                      div_val=2, tgt_len=8, mem_len=8, attn_impl="matmul")
    model = TransformerXL(dataclasses.replace(cfg))
    ids = torch.randint(0, 300, (2, 8))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for step in (3, 4):
            with torch.profiler.record_function(f"ProfilerStep#{step}"):
                model(ids, ids).nll.mean().backward()
    path = Path(tempfile.mkdtemp()) / "trace.json"
    prof.export_chrome_trace(str(path))
    times = operator_times(json.loads(path.read_text()))
    theirs = {e.key: e for e in prof.key_averages()}
    assert set(theirs) <= set(times.host) and "ProfilerStep*" in theirs
    for name, e in theirs.items():
        calls, self_us, total_us = times.host[name]
        assert calls == e.count, name
        assert self_us == pytest.approx(e.self_cpu_time_total, abs=1e-3), name
        assert total_us == pytest.approx(e.cpu_time_total, abs=1e-3), name
    assert times.device == {}
    assert busiest(times, "host", 1)[0]["name"] == max(theirs, key=lambda k: theirs[k].self_cpu_time_total)


def _gpu_trace() -> dict:
    """_chrome_trace() with the operators around the launches: the host's nesting on two threads."""
    trace = _chrome_trace()
    trace["traceEvents"] += [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1e6 + 4.0, "dur": 4.0, "pid": 0, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1e6 + 109.0, "dur": 4.0, "pid": 0, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "autograd::engine", "ts": 1e6 + 20.0, "dur": 30.0, "pid": 0, "tid": 2},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1e6 + 24.0, "dur": 4.0, "pid": 0, "tid": 2},
        {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "ts": 1e6, "dur": 400.0, "pid": 0, "tid": 1}]
    return trace


def test_a_gpu_trace_gives_kernels_by_device_time_and_operators_by_self_cpu_time(tmp_path, capsys):
    times, summary = analyze(_gpu_trace(), host_rows=3)
    assert times.device == {"gemm": [3, 100.0], "reduce": [1, 40.0], "Memcpy DtoH": [1, 60.0]}
    # Thread 1: step 4 (100 us) holds an mm of 4 us (a launch of 1 inside), two more launches and a wait of
    # 30; step 5 (150 us) an mm of 4 (a launch inside) and a wait of 60. Thread 2 (the backward's): 30 us
    # holding an mm of 4. _chrome_trace's own mm of 5 us is on a thread of its own.
    assert times.host["aten::mm"] == [4, 3.0 + 3.0 + 4.0 + 5.0, 17.0]
    assert times.host["autograd::engine"] == [1, 26.0, 30.0]
    assert times.host["ProfilerStep*"] == [2, (100 - 4 - 1 - 1 - 30) + (150 - 4 - 60), 250.0]
    assert times.host["cudaLaunchKernel"] == [4, 4.0, 4.0]
    assert "PyTorch Profiler (0)" not in times.host  # the trace's own span
    assert sum(r[1] for r in times.host.values()) == pytest.approx(250.0 + 30.0 + 5.0)  # the top-level spans
    assert busiest(times, "device", 1) == [{"name": "gemm", "calls": 3, "self_ms": 0.1, "share": 0.5}]
    assert [r["name"] for r in summary["host_busiest"]] == [r["name"] for r in busiest(times, "host", 3)]
    table = operator_table(times, 5)
    assert table.startswith("host: operators by self CPU time") and "device: kernels, copies and fills" in table
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(_gpu_trace()))
    assert main([str(path), "--table", "3"]) == 0
    out = capsys.readouterr().out
    assert "device: kernels" in out and "the host's busiest: ProfilerStep*" in out


def test_a_real_cpu_profile_has_its_steps_and_no_device(tmp_path):
    x = torch.randn(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for step in (7, 8):
            with torch.profiler.record_function(f"ProfilerStep#{step}"):
                x = x @ x / 64
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    times, s = analyze(json.loads((tmp_path / "trace.json").read_text()))
    assert s["steps"] == [7, 8] and s["device"] is None and s["launches_per_step"] == 0.0
    assert "host_busiest" not in s  # a CPU window: the operator table says it all
    assert s["window_ms"] == pytest.approx(sum(s["step_ms"]), abs=0.002)  # each rounded to a microsecond
    assert times.host["aten::mm"][0] == 2


@pytest.mark.parametrize("name, kind", [
    # Kernel names as CUDA builds of torch name them (cuBLAS, CUTLASS, inductor, ATen, Kineto's copies).
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_"
     "kernel__5x_cublas", "matmul"),
    ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NTT", "matmul"),
    ("void cutlass::Kernel2<cutlass_75_tensorop_bf16_s1688gemm_bf16_64x64_32x6_tn_align1>(...)", "matmul"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_nn", "matmul"),
    ("triton_tem_fused_mm_3", "matmul"),
    ("triton_per_fused__softmax_add_exp_native_dropout_prepare_softmax_online_sub_6", "compiled (triton)"),
    ("triton_poi_fused_add_mul_0", "compiled (triton)"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4>>(...)", "fused attention"),
    ("fmha_cutlassB_bf16_aligned_64x64_k64_sm80(...)", "fused attention"),
    ("rel_attn_bwd_dkdv", "fused attention"),  # txl_dist/model/triton_kernels.py
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>(...)", "optimizer"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>(...)",
     "softmax, norms, reductions"),
    ("void (anonymous namespace)::softmax_warp_forward<c10::BFloat16, c10::BFloat16, float, 10>(...)",
     "softmax, norms, reductions"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>(...)", "softmax, norms, reductions"),
    ("void at::native::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>(...)",
     "index, gather, cat"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>(...)", "index, gather, cat"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>(...)",
     "elementwise"),
    ("Memcpy DtoD (Device -> Device)", "copies"),
    ("Memset (Device)", "fills"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("some_custom_kernel", "other"),
])
def test_device_activity_kinds_from_kernel_names(name, kind):
    assert kernel_kind(name) == kind
