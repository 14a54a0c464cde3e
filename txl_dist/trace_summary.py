"""What a profiled window's Chrome trace says: where the steps' wall time went on a GPU (how busy the device
was, what made the host wait for it, how many kernels the host launched), and the operator table: operators
by self CPU time, and on a GPU the kernels, copies and fills by device time.

Read from the Chrome trace torch.profiler exports (the trainer's profile window, txl_dist/profiling.py, writes
rank<r>.ops.txt and rank<r>.summary.json from it beside the trace), or from any such trace:

    python -m txl_dist.trace_summary runs/large/profile/steps_00000004-00000005/rank00000.trace.json.gz

The trace, not torch's `key_averages()`: torch builds that from `profiler.events()`, whose parsing took 26 s
of the ~36 s that a window of 360k events stalled its job on a CPU. From the trace: exporting it 0.9 s,
reading it back (json) 9 s, this module's pass 0.9 s (11 s in all after the profiler stopped). The self CPU
times, calls and totals are torch's (tests/test_trace_summary.py checks them against key_averages()).

- the window: from the first `ProfilerStep#<n>` span's start (the CPU side, one span per optimizer step) to
  the later of the last span's end and the last device activity's end (a device running behind its host
  finishes the last step's kernels after the span);
- device busy share: the union of the kernels, copies and fills of every stream, over the window's length;
  per step, over the time from its start to the next step's start;
- host waits: CUDA API calls that block the host until the device catches up (the *Synchronize calls and
  the blocking cudaMemcpy), per step, with the time the host spent in them;
- kernel launches per step and the mean kernel time (a launch-bound step has many short kernels);
- the device time by kind of kernel (KERNEL_KINDS: matmul, compiled fused kernels, elementwise, softmax and
  norms, ...) and the busiest kernels, as shares of all device activity in the window, and the operators
  with the most self CPU time (where a step that waits on its host spends it).
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
import zlib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .cli_args import ArgumentParser
from .errors import EXIT_REFUSED, one_line

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
NOT_HOST = frozenset({"Trace", "gpu_user_annotation"})
"""Chrome-trace categories that are neither device activity nor host work (the whole trace's span, a
step's span on the device)."""
KERNEL_KINDS = (
    ("copies", ("memcpy",)), ("fills", ("memset",)), ("communication", ("nccl",)),
    ("fused attention", ("flash", "fmha", "sdpa", "flex_attention", "attention", "rel_attn_")),
    ("optimizer", ("multi_tensor_apply", "adam")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "triton_tem_", "s16816", "s1688", "wgmma",
                "splitkreduce")),
    ("compiled (triton)", ("triton_",)),
    ("softmax, norms, reductions", ("softmax", "layer_norm", "layernorm", "gammabeta", "reduce_kernel", "rms_norm",
                                    "batch_norm", "group_norm")),
    ("index, gather, cat", ("index", "gather", "scatter", "embedding", "catarray")),
    ("elementwise", ("elementwise", "dropout", "copy", "fill", "philox")),
)
"""Kinds of device activity by name (the first kind with a fragment in the lowercased name; else "other"):
cuBLAS and CUTLASS GEMMs (Hopper's cuBLAS names its own "nvjet_..."), inductor's matmul templates
(triton_tem_) and its other kernels (triton_poi_/per_/red_: fused pointwise and reductions), our fused
relative attention (rel_attn_*, txl_dist/model/triton_kernels.py), ATen's kernels,
Kineto's copies and fills. What a step's device time is spent on: GEMMs near the peak, or the memory-bound
rest around them."""
TOP_KERNELS = 8
KERNEL_NAME_CHARS = 160
HOST_ROWS = 8
"""How many of the host's busiest operators a GPU window's summary names."""


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


@dataclass(frozen=True)
class OperatorTimes:
    """Per name: host operators (and annotations, API calls) [calls, self CPU us, CPU total us], self being
    the time inside no other recorded event of the same thread; device activities [calls, us]."""

    host: dict[str, list[float]]
    device: dict[str, list[float]]


def operator_times(trace: dict[str, Any]) -> OperatorTimes:
    """The window's operator times (steps' spans named "ProfilerStep*", as torch's table names them)."""
    threads: dict[tuple, list[tuple[float, float, str]]] = defaultdict(list)
    device: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X":
            continue
        cat, name, dur = e.get("cat", ""), str(e.get("name", "")), float(e.get("dur", 0.0))
        if cat in DEVICE_CATEGORIES:
            device[name][0] += 1
            device[name][1] += dur
        elif cat not in NOT_HOST:
            step_named = STEP_SPAN.sub("ProfilerStep*", name)
            threads[(e.get("pid"), e.get("tid"))].append((float(e.get("ts", 0.0)), dur, step_named))
    host: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for events in threads.values():
        events.sort(key=lambda e: (e[0], -e[1]))  # a parent before the children that start with it
        parent = [-1] * len(events)
        children = [0] * len(events)
        open_spans: list[int] = []  # the enclosing events, innermost last
        for i, (start, _, _) in enumerate(events):
            while open_spans and start >= events[open_spans[-1]][0] + events[open_spans[-1]][1]:
                open_spans.pop()
            if open_spans:
                parent[i] = open_spans[-1]
                children[parent[i]] += 1
            open_spans.append(i)
        for i, (_, dur, name) in enumerate(events):
            up = parent[i]
            host[name][1] += dur
            if up >= 0:
                host[events[up][2]][1] -= dur
            # torch's table merges an operator into its parent of the same name when it is the only child (an
            # operator that redispatches to itself): one call, the pair's self time, the parent's total.
            if not (up >= 0 and events[up][2] == name and children[up] == 1):
                host[name][0] += 1
                host[name][2] += dur
    return OperatorTimes(dict(host), dict(device))


def busiest(times: OperatorTimes, side: str, limit: int) -> list[dict[str, Any]]:
    """The `limit` busiest names of one side: "device" by device time, "host" by self CPU time; name, calls,
    time in ms and its share of the side's total."""
    rows = times.device if side == "device" else times.host
    total = sum(r[1] for r in rows.values()) or 1.0
    ranked = sorted(rows.items(), key=lambda kv: kv[1][1], reverse=True)[:limit]
    return [{"name": name[:KERNEL_NAME_CHARS], "calls": int(r[0]), "self_ms": round(r[1] / 1e3, 3),
             "share": round(r[1] / total, 4)} for name, r in ranked]


def headline(times: OperatorTimes, limit: int) -> tuple[str, list[dict[str, Any]]]:
    """What a profile names first, and its `limit` busiest (busiest): the kernels, copies and fills by device
    time when the device was traced, else the operators by self CPU time."""
    if times.device:
        return "device time", busiest(times, "device", limit)
    return "self CPU time", busiest(times, "host", limit)


def shares_text(rows: list[dict[str, Any]], limit: int, name_chars: int = 60) -> str:
    """"name 12.3%, ..." of the first `limit` rows of busiest (or of a summary's "top")."""
    return ", ".join(f"{r['name'][:name_chars]} {100 * r['share']:.1f}%" for r in rows[:limit])


def operator_table(times: OperatorTimes, rows: int) -> str:
    """The operator table as text: the host's operators by self CPU time, then (when any) the device's
    kernels, copies and fills by device time."""
    lines = ["host: operators by self CPU time (inside no other recorded operator); CPU total includes the "
             "operators inside", f"{'self CPU ms':>12} {'share':>7} {'CPU total ms':>13} {'calls':>8}  name"]
    total = sum(r[1] for r in times.host.values()) or 1.0
    for name, r in sorted(times.host.items(), key=lambda kv: kv[1][1], reverse=True)[:rows]:
        lines.append(f"{r[1] / 1e3:12.3f} {100 * r[1] / total:6.1f}% {r[2] / 1e3:13.3f} {int(r[0]):8d}  {name}")
    if times.device:
        lines += ["", "device: kernels, copies and fills by device time", f"{'device ms':>12} {'share':>7} "
                  f"{'calls':>8}  name"]
        total = sum(r[1] for r in times.device.values()) or 1.0
        for name, r in sorted(times.device.items(), key=lambda kv: kv[1][1], reverse=True)[:rows]:
            lines.append(f"{r[1] / 1e3:12.3f} {100 * r[1] / total:6.1f}% {int(r[0]):8d}  {name[:KERNEL_NAME_CHARS]}")
    return "\n".join(lines) + "\n"


def analyze(trace: dict[str, Any], host_rows: int = HOST_ROWS) -> tuple[OperatorTimes, dict[str, Any] | None]:
    """The trace's operator times and its summary (summarize), which on a GPU also names the host's
    `host_rows` busiest operators ("host_busiest")."""
    times = operator_times(trace)
    summary = summarize(activities_from_trace(trace))
    if summary is not None and summary["device"] is not None:
        summary["host_busiest"] = busiest(times, "host", host_rows)
    return times, summary


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
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, (calls, t) in by_name.items():
        kind = by_kind[kernel_kind(name)]
        kind[0] += calls
        kind[1] += t
    return {
        "busy_share": round(busy / (bounds[-1] - bounds[0]), 4) if bounds[-1] > bounds[0] else 0.0,
        "busy_share_per_step": [round(s, 4) for s in per_step],
        "busy_ms": round(busy / 1e3, 3),
        "activities_per_step": round(len(devices) / n_steps, 1),
        "mean_activity_us": round(total / len(devices), 2),
        "stream_ms": {k: round(v / 1e3, 3) for k, v in sorted(streams.items(), key=lambda kv: -kv[1])},
        "top": [{"name": name[:KERNEL_NAME_CHARS], "calls": c, "ms": round(t / 1e3, 3), "share": round(t / total, 4)}
                for name, (c, t) in top],
        "kinds": [{"name": kind, "calls": int(c), "ms": round(t / 1e3, 3), "share": round(t / total, 4)}
                  for kind, (c, t) in sorted(by_kind.items(), key=lambda kv: kv[1][1], reverse=True)],
    }


def kernel_kind(name: str) -> str:
    """The KERNEL_KINDS kind of a device activity's name."""
    low = name.lower()
    for kind, fragments in KERNEL_KINDS:
        if any(f in low for f in fragments):
            return kind
    return "other"


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
    top = shares_text(d["top"], 4)
    per_step = ", ".join(f"{100 * s:.1f}%" for s in d["busy_share_per_step"])
    host = shares_text(summary.get("host_busiest", []), 4)
    return (f"device busy {100 * d['busy_share']:.1f}% of {summary['window_ms']:.0f} ms "
            f"(per step {per_step}); host waits {summary['host_waits_per_step']:g} per step, "
            f"{summary['host_wait_ms_per_step']:.1f} ms ({waits}); {summary['launches_per_step']:.0f} launches per "
            f"step, mean device activity {d['mean_activity_us']:.0f} us; by kind: {shares_text(d['kinds'], 5)}; "
            f"busiest: {top}"
            + (f"; the host's busiest: {host}" if host else ""))


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(
        prog="python -m txl_dist.trace_summary", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  python -m txl_dist.trace_summary "
               "runs/large/profile/steps_00000004-00000005/rank00000.trace.json.gz\n"
               "  python -m txl_dist.trace_summary --json rank00000.trace.json.gz\n"
               "  python -m txl_dist.trace_summary --table 30 rank00000.trace.json.gz\n")
    p.add_argument("trace", help="a Chrome trace written by torch.profiler (.json or .json.gz)")
    p.add_argument("--json", action="store_true", help="print the whole summary as JSON")
    p.add_argument("--table", type=int, metavar="ROWS", default=0,
                   help="also print the operator table, ROWS rows per side (e.g. --table 30)")
    args = p.parse_args(argv)
    try:
        trace = read_trace(args.trace)
        if not isinstance(trace, dict):
            raise ValueError(f"a JSON {type(trace).__name__}, not an object with traceEvents")
    except (OSError, ValueError, EOFError, zlib.error) as e:  # a refusal: one line, exit status 2
        if isinstance(e, FileNotFoundError):
            why = "does not exist"
        elif isinstance(e, (gzip.BadGzipFile, EOFError, zlib.error)):  # BadGzipFile is an OSError: first
            why = f"is not a whole gzip file: {one_line(e)}"
        elif isinstance(e, OSError):
            why = f"cannot be read: {e.strerror or one_line(e)}"
        elif isinstance(e, json.JSONDecodeError):
            why = f"is not JSON: {e.msg} at line {e.lineno} col {e.colno}"
        elif isinstance(e, UnicodeDecodeError):
            why = "is not UTF-8 text"
        else:
            why = f"is not a Chrome trace: {one_line(e)}"
        print(f"error: trace file {args.trace} {why} (expected a Chrome trace written by torch.profiler, "
              ".json or .json.gz)", file=sys.stderr)
        return EXIT_REFUSED
    times, summary = analyze(trace)
    if args.table:
        print(operator_table(times, args.table))
    if summary is None:
        print(f"{args.trace}: no ProfilerStep#<n> span in the trace")
        return 1
    print(json.dumps(summary, indent=1) if args.json else
          summary_line(summary) or f"steps {summary['steps']}: {summary['window_ms']:.0f} ms, no device activity")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
