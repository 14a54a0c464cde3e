"""Where a profiled window's wall time went on a GPU: how busy the device was, what made the host wait for it,
how many kernels the host launched, and which kernels took the device time.

torch's operator table ranks operators and kernels; it cannot say whether the device sat idle. On a GPU a
step that takes twice the plain loop's time with the same kernels is waiting for its host, and the remedy
(fewer launches, no sync, CUDA graphs) differs from that of slow kernels. The summary answers that from the
profiler's own events (in the trainer's profile window, txl_dist/profiling.py, which writes it as
rank<r>.summary.json beside the trace) or from a Chrome trace torch wrote:

    python -m txl_dist.trace_summary runs/large/profile/steps_00000004-00000005/rank00000.trace.json.gz

- the window: from the first `ProfilerStep#<n>` span's start (the CPU side, one span per optimizer step) to
  the later of the last span's end and the last device activity's end (a device running behind its host
  finishes the last step's kernels after the span);
- device busy share: the union of the kernels, copies and fills of every stream, over the window's length;
  per step, over the time from its start to the next step's start;
- host waits: CUDA API calls that block the host until the device catches up (the *Synchronize calls and
  the blocking cudaMemcpy), per step, with the time the host spent in them;
- kernel launches per step and the mean kernel time (a launch-bound step has many short kernels);
- the busiest kernels by device time, as shares of all device activity in the window.
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

STEP_SPAN = re.compile(r"ProfilerStep#(\d+)")
DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
"""Chrome-trace categories of what runs on the device (Kineto's names)."""
API_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
HOST_WAITS = frozenset({
    "cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpy2D",
    "cudaMemcpy3D", "cuCtxSynchronize", "cuStreamSynchronize", "cuEventSynchronize"})
"""CUDA API calls that return only when the device has caught up (cudaMemcpy without Async blocks too;
`tensor.item()` shows as cudaMemcpyAsync followed by cudaStreamSynchronize)."""
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel", "cudaGraphLaunch")
"""Name prefixes of the API calls that start device work (a CUDA graph launch counts as one)."""
TOP_KERNELS = 8
KERNEL_NAME_CHARS = 160


@dataclass(frozen=True, slots=True)
class Activity:
    """One profiled event: a step span, a device activity or a CUDA API call; times in microseconds."""

    kind: str  # "step" | "device" | "api"
    name: str
    start: float
    end: float
    stream: int | None = None

    @property
    def length(self) -> float:
        return max(0.0, self.end - self.start)


def activities_from_events(events: Iterable[Any]) -> list[Activity]:
    """The activities of torch.profiler's events (`profiler.events()`, FunctionEvent objects): CPU-side
    `ProfilerStep#<n>` spans, device activities that are not annotations, and the CUDA API calls this
    summary counts."""
    out = []
    for e in events:
        device = getattr(e.device_type, "name", str(e.device_type))
        name = e.trace_name or e.name  # e.name has "ProfilerStep*" for every step: trace_name keeps the number
        start, end = e.time_range.start, e.time_range.end
        if device == "CPU":
            kind = "step" if STEP_SPAN.fullmatch(name) else "api" if _counted_api(name) else None
        else:
            kind = None if e.is_user_annotation else "device"
        if kind is not None:
            out.append(Activity(kind, name, float(start), float(end), e.device_resource_id if kind == "device"
                                else None))
    return out


def activities_from_trace(trace: dict[str, Any]) -> list[Activity]:
    """The activities of a Chrome trace as torch.profiler exports it (Kineto's categories)."""
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X":
            continue
        cat, name = e.get("cat", ""), str(e.get("name", ""))
        start = float(e.get("ts", 0.0))
        end = start + float(e.get("dur", 0.0))
        if cat in DEVICE_CATEGORIES:
            args = e.get("args") or {}
            out.append(Activity("device", name, start, end, args.get("stream", e.get("tid"))))
        elif cat in API_CATEGORIES and _counted_api(name):
            out.append(Activity("api", name, start, end))
        elif cat != "gpu_user_annotation" and STEP_SPAN.fullmatch(name):
            out.append(Activity("step", name, start, end))
    return out


def read_trace(path: str | Path) -> dict[str, Any]:
    """A Chrome trace file, gzipped (as the trainer writes it) or not."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def _counted_api(name: str) -> bool:
    return name in HOST_WAITS or name.startswith(LAUNCHES)


def summarize(activities: Sequence[Activity]) -> dict[str, Any] | None:
    """The window's summary (module docstring), or None when it holds no step span. "device" is None when no
    device activity was recorded (a CPU run, or a GPU whose kernel tracing was unavailable)."""
    steps = sorted((a for a in activities if a.kind == "step"), key=lambda a: a.start)
    if not steps:
        return None
    devices = [a for a in activities if a.kind == "device" and a.end > steps[0].start]
    end = max([steps[-1].end] + [a.end for a in devices])
    bounds = [s.start for s in steps] + [end]
    wall = end - bounds[0]
    n = len(steps)
    api = [a for a in activities if a.kind == "api" and bounds[0] <= a.start < end]
    waits: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for a in api:
        if a.name in HOST_WAITS:
            waits[a.name][0] += 1
            waits[a.name][1] += a.length
    summary: dict[str, Any] = {
        "steps": [int(STEP_SPAN.fullmatch(s.name).group(1)) for s in steps],
        "window_ms": round(wall / 1e3, 3),
        "step_ms": [round((b - a) / 1e3, 3) for a, b in zip(bounds, bounds[1:])],
        "host_waits_per_step": round(sum(c for c, _ in waits.values()) / n, 2),
        "host_wait_ms_per_step": round(sum(t for _, t in waits.values()) / n / 1e3, 3),
        "host_waits": {k: {"calls": c, "ms": round(t / 1e3, 3)} for k, (c, t) in sorted(waits.items())},
        "launches_per_step": round(sum(a.name.startswith(LAUNCHES) for a in api) / n, 1),
        "device": None,
    }
    if devices:
        summary["device"] = _device_summary(devices, bounds, n)
    return summary


def _device_summary(devices: list[Activity], bounds: list[float], n_steps: int) -> dict[str, Any]:
    merged = _union([(max(a.start, bounds[0]), a.end) for a in devices])
    per_step = [_covered(merged, a, b) / (b - a) if b > a else 0.0 for a, b in zip(bounds, bounds[1:])]
    busy = sum(e - s for s, e in merged)
    total = sum(a.length for a in devices) or 1.0
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    streams: dict[str, float] = defaultdict(float)
    for a in devices:
        by_name[a.name][0] += 1
        by_name[a.name][1] += a.length
        streams[str(a.stream)] += a.length
    top = sorted(by_name.items(), key=lambda kv: kv[1][1], reverse=True)[:TOP_KERNELS]
    return {
        "busy_share": round(busy / (bounds[-1] - bounds[0]), 4) if bounds[-1] > bounds[0] else 0.0,
        "busy_share_per_step": [round(s, 4) for s in per_step],
        "busy_ms": round(busy / 1e3, 3),
        "activities_per_step": round(len(devices) / n_steps, 1),
        "mean_activity_us": round(total / len(devices), 2),
        "stream_ms": {k: round(v / 1e3, 3) for k, v in sorted(streams.items(), key=lambda kv: -kv[1])},
        "top": [{"name": name[:KERNEL_NAME_CHARS], "calls": c, "ms": round(t / 1e3, 3), "share": round(t / total, 4)}
                for name, (c, t) in top],
    }


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def _covered(merged: list[tuple[float, float]], lo: float, hi: float) -> float:
    return sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in merged)


def summary_line(summary: dict[str, Any] | None) -> str | None:
    """One log line of a GPU window's summary (with the host's busiest operators when the summary holds them,
    "host_busiest": txl_dist/profiling.py adds them); None when there is no device activity to speak of."""
    if not summary or not summary["device"]:
        return None
    d = summary["device"]
    waits = ", ".join(f"{k} x{v['calls']}" for k, v in summary["host_waits"].items()) or "none"
    top = ", ".join(f"{k['name'][:60]} {100 * k['share']:.1f}%" for k in d["top"][:4])
    per_step = ", ".join(f"{100 * s:.1f}%" for s in d["busy_share_per_step"])
    host = ", ".join(f"{k['name'][:60]} {100 * k['share']:.1f}%" for k in summary.get("host_busiest", [])[:4])
    return (f"device busy {100 * d['busy_share']:.1f}% of {summary['window_ms']:.0f} ms "
            f"(per step {per_step}); host waits {summary['host_waits_per_step']:g} per step, "
            f"{summary['host_wait_ms_per_step']:.1f} ms ({waits}); {summary['launches_per_step']:.0f} launches per "
            f"step, mean device activity {d['mean_activity_us']:.0f} us; busiest: {top}"
            + (f"; the host's busiest: {host}" if host else ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m txl_dist.trace_summary", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  python -m txl_dist.trace_summary "
               "runs/large/profile/steps_00000004-00000005/rank00000.trace.json.gz\n"
               "  python -m txl_dist.trace_summary --json rank00000.trace.json.gz\n")
    p.add_argument("trace", help="a Chrome trace written by torch.profiler (.json or .json.gz)")
    p.add_argument("--json", action="store_true", help="print the whole summary as JSON")
    args = p.parse_args(argv)
    summary = summarize(activities_from_trace(read_trace(args.trace)))
    if summary is None:
        print(f"{args.trace}: no ProfilerStep#<n> span in the trace")
        return 1
    print(json.dumps(summary, indent=1) if args.json else
          summary_line(summary) or f"steps {summary['steps']}: {summary['window_ms']:.0f} ms, no device activity")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
