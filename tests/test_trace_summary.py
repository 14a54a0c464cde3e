"""txl_dist/trace_summary.py: the device's busy share, the host's waits and the launches of a profiled window,
against numbers worked out by hand from a synthetic window; the same from torch's event objects and from a
Chrome trace; and a real CPU profile (steps, no device)."""
from __future__ import annotations

import gzip
import json

import pytest
import torch

from txl_dist.trace_summary import (Activity, activities_from_events, activities_from_trace, main, summarize,
                                    summary_line)

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
    assert s["host_waits_per_step"] == 1.0 and s["host_wait_ms_per_step"] == 0.045
    assert s["host_waits"] == {"cudaDeviceSynchronize": {"calls": 1, "ms": 0.03},
                               "cudaStreamSynchronize": {"calls": 1, "ms": 0.06}}
    assert s["launches_per_step"] == 2.0
    line = summary_line(s)
    assert line.startswith("device busy 69.2% of 0 ms (per step 80.0%, 62.5%); host waits 1 per step")
    assert "cudaStreamSynchronize x1" in line and "busiest: gemm 50.0%" in line


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
    assert json.loads(capsys.readouterr().out) == summarize(WINDOW)
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"traceEvents": []}))
    assert main([str(empty)]) == 1


def _function_events() -> list:
    """WINDOW as torch.profiler's event objects (`profiler.events()`), with a step's span on the device and an
    operator, which are neither steps nor device activity."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    def event(a: Activity, **kw) -> FunctionEvent:
        kw.setdefault("device_type", DeviceType.CUDA if a.kind == "device" else DeviceType.CPU)
        e = FunctionEvent(id=0, name=a.name, thread=1, start_us=a.start, end_us=a.end, trace_name=a.name,
                          device_resource_id=a.stream, **kw)
        if a.kind == "step":  # torch names every step "ProfilerStep*" in `name`
            e.name = "ProfilerStep*"
        return e

    events = [event(a, is_user_annotation=a.kind == "step") for a in WINDOW]
    return events + [event(Activity("step", "ProfilerStep#4", 0.0, 300.0), device_type=DeviceType.CUDA,
                           is_user_annotation=True), event(Activity("api", "aten::mm", 1.0, 2.0))]


def test_torch_event_objects_give_the_same_summary():
    assert summarize(activities_from_events(_function_events())) == summarize(WINDOW)


def test_a_gpu_window_names_where_the_host_spent_its_time():
    """profiling.window_summary adds the entries with the most self CPU time when the device was traced (a step
    that waits on its host spends it there), and the log line names them."""
    from torch.autograd.profiler_util import FunctionEventAvg

    from txl_dist.profiling import window_summary

    def entry(name, cpu_us):
        e = FunctionEventAvg()
        e.key, e.count, e.self_cpu_time_total = name, 1, cpu_us
        return e

    averages = [entry("aten::mm", 100.0), entry("ProfilerStep*", 300.0), entry("cudaLaunchKernel", 600.0)]
    summary = window_summary(_function_events(), averages, host_rows=2)
    assert [op["name"] for op in summary["host_busiest"]] == ["cudaLaunchKernel", "ProfilerStep*"]
    assert summary_line(summary).endswith("; the host's busiest: cudaLaunchKernel 60.0%, ProfilerStep* 30.0%")
    cpu_only = [e for e in _function_events() if getattr(e.device_type, "name", "") == "CPU"]
    assert "host_busiest" not in window_summary(cpu_only, averages)  # nothing traced on a device


def test_a_real_cpu_profile_has_its_steps_and_no_device():
    x = torch.randn(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for step in (7, 8):
            with torch.profiler.record_function(f"ProfilerStep#{step}"):
                x = x @ x / 64
    s = summarize(activities_from_events(prof.events()))
    assert s["steps"] == [7, 8] and s["device"] is None and s["launches_per_step"] == 0.0
    assert s["window_ms"] == pytest.approx(sum(s["step_ms"]))
