"""The sampler and the report of bench/soak.sh (the long-run check: memory, open files, disk, crash and resume).

    python bench/soak_report.py sample --segment 1 --pid 0:PID --pid 1:PID --run-dir RUN --out samples.jsonl
    python bench/soak_report.py inventory RUN_DIR              # the checkpoint folder now, as JSON (between jobs)
    python bench/soak_report.py report --scratch DIR --run-dir RUN --steps N ...   # prints the result, exit 0/1

`sample` follows the training processes of one job segment until they have all ended: every --interval
seconds one line per process (RSS, open file descriptors, threads) and the newest training step (from the
progress lines that job appends to <run>/logs/train.log); in a thread of its own, every --disk-interval
seconds, the size of <run>/checkpoints (apparent bytes of every file, and of every step_* tag), so that the
short moment of a save, when keep + 1 tags exist, is seen. Past --deadline seconds it SIGKILLs the processes
it follows (a hung job) and records that.

`report` reads the samples, the exit statuses soak.sh wrote (seg<k>.rc), the ranks' output (seg<k>-rank<r>.out),
the checkpoint inventory taken between the two jobs (after-crash.json) and the per-step loss: the progress
lines of <run>/logs/train.log (train.log_interval=1: every step of both jobs, the steps the resumed job runs
again included, to 4 decimals), checked against the exact values of the local metrics journal
<run>/tracking/metrics.jsonl where it has them (it keeps the first value of a step, so not the re-run ones).
Slopes are least squares over the second half of each job segment's steps (after start-up and warm-up).
Standard library and psutil only.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

MIB = 2**20
PROGRESS = re.compile(r"\bstep (\d+)/(\d+) \| loss (\S+) \|.*\| ([\d.]+) s/step")
TRAINING = re.compile(r"training steps \d+\.\.\d+ of \d+")
RESUMED = re.compile(r"resumed from (\S+) at step (\d+)")
SAVED = re.compile(r"checkpoint (\S+) \(([\d.]+) s\)")
EVAL = re.compile(r"(valid|test) at step (\d+): loss ([\d.]+) .*\| ([\d.]+) s$")
TIMESTAMP = re.compile(r"^(\[?\d{4}-\d\d-\d\d[ T][\d:,.]+\]?\s*|\d\d:\d\d:\d\d\s+)")


# ----------------------------------------------------------------------------------------------------
# sample


def dir_sizes(path: Path) -> tuple[int, dict[str, int]]:
    """(apparent bytes of every file under path, bytes per step_* tag folder); (0, {}) when it is missing."""
    total, tags = 0, {}
    try:
        entries = list(os.scandir(path))
    except OSError:
        return 0, {}
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                size = _tree_bytes(entry.path)
                if entry.name.startswith("step_"):
                    tags[entry.name] = size
            else:
                size = entry.stat(follow_symlinks=False).st_size
        except OSError:  # removed while we looked (retention, a rename)
            continue
        total += size
    return total, tags


def _tree_bytes(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


class StepFollower:
    """The newest `step N/M` progress line appended to train.log after this object was made."""

    def __init__(self, log: Path):
        self.log, self.step = log, None
        self.offset = log.stat().st_size if log.exists() else 0
        self._rest = b""

    def poll(self) -> int | None:
        try:
            with open(self.log, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return self.step
        self.offset += len(data)
        lines = (self._rest + data).split(b"\n")
        self._rest = lines.pop()
        for line in lines:
            m = PROGRESS.search(line.decode("utf-8", "replace"))
            if m:
                self.step = int(m.group(1))
        return self.step


class Statm:
    """Resident set size of a process from /proc/PID/statm (cheap enough to read 100 times a second)."""

    PAGE = os.sysconf("SC_PAGE_SIZE")

    def __init__(self, pid: int):
        self.fd = os.open(f"/proc/{pid}/statm", os.O_RDONLY)

    def rss(self) -> int | None:
        try:
            return int(os.pread(self.fd, 256, 0).split()[1]) * self.PAGE
        except (OSError, IndexError, ValueError):
            return None


def cmd_sample(args: argparse.Namespace) -> int:
    import psutil

    run_dir = Path(args.run_dir)
    procs, statm = {}, {}
    for item in args.pid:
        rank, pid = item.split(":")
        procs[int(rank)] = psutil.Process(int(pid))
        statm[int(rank)] = Statm(int(pid))
    for rank, p in procs.items():
        if "python" not in " ".join(p.cmdline()[:1]):
            print(f"soak_report sample: pid {p.pid} (rank {rank}) is not a python process: {p.cmdline()[:2]}",
                  file=sys.stderr)
    follower = StepFollower(run_dir / "logs" / "train.log")
    out = open(args.out, "a", buffering=1)
    lock = threading.Lock()
    start = time.time()
    done = threading.Event()

    def write(record: dict) -> None:
        with lock:
            out.write(json.dumps(record) + "\n")

    def disk_loop() -> None:
        high, ckpt = -1, run_dir / "checkpoints"
        last_written = 0.0
        while not done.is_set():
            total, tags = dir_sizes(ckpt)
            now = time.time()
            if total > high:
                high = total
                folders = sorted(p.name for p in ckpt.iterdir() if p.is_dir()) if ckpt.is_dir() else []
                write({"kind": "disk_high", "segment": args.segment, "t": now, "bytes": total, "tags": tags,
                       "folders": folders})
            if now - last_written >= args.interval:
                write({"kind": "disk", "segment": args.segment, "t": now, "bytes": total, "tags": tags})
                last_written = now
            done.wait(args.disk_interval)

    disk = threading.Thread(target=disk_loop, daemon=True)
    disk.start()
    timed_out = False
    step = None
    floor: dict[int, int] = {}  # per rank: the lowest RSS since the last progress line
    next_full = 0.0
    while True:
        now = time.time()
        for rank, st in statm.items():
            rss = st.rss()
            if rss is not None and rss > 0:
                floor[rank] = min(floor.get(rank, rss), rss)
        new_step = follower.poll()
        if new_step != step:
            # The RSS floor between two progress lines: what stays resident between steps, without the
            # transient tensors of the step in flight that a sample at a random moment would include.
            if step is not None and new_step is not None:
                for rank, low in floor.items():
                    write({"kind": "step", "segment": args.segment, "t": now, "rank": rank, "step": new_step,
                           "rss_floor": low})
            step, floor = new_step, {}
        if now >= next_full:
            next_full = now + args.interval
            alive = 0
            for rank, p in procs.items():
                try:
                    with p.oneshot():
                        rss, fds, threads = p.memory_info().rss, p.num_fds(), p.num_threads()
                    if p.status() == psutil.STATUS_ZOMBIE:
                        continue
                except psutil.Error:  # ended
                    continue
                alive += 1
                write({"kind": "proc", "segment": args.segment, "t": now, "rank": rank, "pid": p.pid,
                       "step": step, "rss": rss, "fds": fds, "threads": threads})
            if not alive:
                break
            if args.deadline and now - start > args.deadline and not timed_out:
                timed_out = True
                write({"kind": "timeout", "segment": args.segment, "t": now})
                print(f"soak_report sample: segment {args.segment} ran past {args.deadline:.0f} s; killing its "
                      "ranks", file=sys.stderr)
                for p in procs.values():
                    try:
                        p.send_signal(signal.SIGKILL)
                    except psutil.Error:
                        pass
        time.sleep(args.fast_interval)
    done.set()
    disk.join()
    total, tags = dir_sizes(run_dir / "checkpoints")
    write({"kind": "disk", "segment": args.segment, "t": time.time(), "bytes": total, "tags": tags, "final": True})
    out.close()
    return 0


# ----------------------------------------------------------------------------------------------------
# inventory


def cmd_inventory(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from txl_dist.checkpoint import inventory

    inv = inventory(Path(args.run_dir) / "checkpoints")
    print(json.dumps({"complete": inv.complete, "incomplete": inv.incomplete, "leftovers": inv.leftovers,
                      "latest": inv.latest}))
    return 0


# ----------------------------------------------------------------------------------------------------
# report


def fit(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of y over x; None with fewer than 3 points or one x."""
    if len(points) < 3 or len({x for x, _ in points}) < 2:
        return None
    xs, ys = zip(*points)
    return statistics.linear_regression(xs, ys).slope


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a torn last line
            pass
    return rows


def progress_by_job(log: Path) -> list[dict]:
    """The jobs recorded in train.log, in order (each starts at its "training steps A..B" line): per job
    {steps: {step: (loss, s/step)}, resumed: (tag path, step) or None, saves: [(tag, s)], evals: [...]}."""
    jobs: list[dict] = []
    cur, resumed = None, None
    for line in log.read_text(errors="replace").splitlines():
        m = PROGRESS.search(line)
        if m and cur is not None:
            cur["steps"][int(m.group(1))] = (float(m.group(3)), float(m.group(4)))
            continue
        m = RESUMED.search(line)
        if m:
            resumed = (m.group(1), int(m.group(2)))
            continue
        if TRAINING.search(line):
            cur = {"steps": {}, "resumed": resumed, "saves": [], "evals": []}
            jobs.append(cur)
            resumed = None
            continue
        m = SAVED.search(line)
        if m and cur is not None:
            cur["saves"].append((m.group(1), float(m.group(2))))
            continue
        m = EVAL.search(line)
        if m and cur is not None:
            cur["evals"].append((m.group(1), int(m.group(2)), float(m.group(3)), float(m.group(4))))
    return jobs


def journal_losses(path: Path) -> dict[int, float]:
    """train/loss by step from the metrics journal (the first value of each step)."""
    out: dict[int, float] = {}
    for row in read_jsonl(path):
        v = row.get("metrics", {}).get("train/loss")
        if v is not None and row.get("step") not in out:
            out[int(row["step"])] = float(v)
    return out


def distinct_warnings(paths: list[Path]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            low = line.lower()
            if "warn" in low or "traceback" in low or "error" in low:
                key = TIMESTAMP.sub("", line).strip()
                key = re.sub(r"\d+(\.\d+)?", "N", key)[:200]
                counts[key] = counts.get(key, 0) + 1
    return counts


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def cmd_report(args: argparse.Namespace) -> int:
    scratch, run_dir = Path(args.scratch), Path(args.run_dir)
    failures: list[str] = []
    p = print
    samples = read_jsonl(scratch / "samples.jsonl")
    rcs = {seg: json.loads((scratch / f"seg{seg}.rc").read_text()) for seg in (1, 2) if (scratch / f"seg{seg}.rc").exists()}
    after_crash = json.loads((scratch / "after-crash.json").read_text()) if (scratch / "after-crash.json").exists() else {}
    jobs = progress_by_job(run_dir / "logs" / "train.log") if (run_dir / "logs" / "train.log").exists() else []
    keep, interval, steps, crash = args.keep, args.ckpt_interval, args.steps, args.crash_step

    p(f"txl-dist soak: {args.config} on 2 CPU ranks (plain processes on gloo, OMP_NUM_THREADS=1 each), "
      f"{steps} steps, checkpoint every {interval} (keep {keep}), eval every {args.eval_interval}, "
      f"MLflow: {args.tracking}")
    p(f"run folder {run_dir}; samples every {args.interval:g} s (checkpoints/ size every {args.disk_interval:g} s)")

    # -- crash and resume ------------------------------------------------------------------------------
    p("")
    p("crash and resume")
    seg1_out = (scratch / "seg1-rank0.out").read_text(errors="replace") if (scratch / "seg1-rank0.out").exists() else ""
    errors = [line for line in seg1_out.splitlines() if "error:" in line]
    rc1 = rcs.get(1, {})
    p(f"  job 1: rank 1 SIGKILLed in the middle of step {crash} (tests/fault_job.py kill-at-step:1:{crash}); "
      f"exit status rank 0 {rc1.get('0')}, rank 1 {rc1.get('1')} ({rc1.get('wall_s', 0):.1f} s)")
    for line in errors:
        p(f"  rank 0: {TIMESTAMP.sub('', line).strip()}")
    if rc1.get("1") != 137:
        failures.append(f"job 1: rank 1 exit status {rc1.get('1')}, not 137 (SIGKILL)")
    if rc1.get("0") != 1:
        failures.append(f"job 1: rank 0 exit status {rc1.get('0')}, not 1")
    if len(errors) != 1 or "rank 1" not in errors[0]:
        failures.append(f"job 1: rank 0 printed {len(errors)} error line(s), not one naming rank 1")
    newest = after_crash.get("complete", [None])[-1] if after_crash.get("complete") else None
    p(f"  after job 1: complete tags {after_crash.get('complete')}, latest {after_crash.get('latest')}, "
      f"leftovers {after_crash.get('leftovers')}")
    rc2 = rcs.get(2, {})
    p(f"  job 2 (--resume auto): exit status rank 0 {rc2.get('0')}, rank 1 {rc2.get('1')} ({rc2.get('wall_s', 0):.1f} s)")
    if rc2.get("0") != 0 or rc2.get("1") != 0:
        failures.append(f"job 2: exit statuses {rc2.get('0')}, {rc2.get('1')}, not 0, 0")
    if len(jobs) != 2:
        failures.append(f"train.log holds {len(jobs)} job(s), not 2")
    resumed_step = None
    if len(jobs) >= 2:
        res = jobs[1]["resumed"]
        if res is None:
            failures.append("job 2 did not resume from a checkpoint")
        else:
            resumed_step = res[1]
            first = min(jobs[1]["steps"]) if jobs[1]["steps"] else None
            p(f"  job 2 resumed from {res[0]} at step {res[1]}; its first step: {first}")
            if newest is None or Path(res[0]).name != newest:
                failures.append(f"job 2 resumed from {Path(res[0]).name}, not from the newest complete tag {newest}")
            if first != res[1] + 1:
                failures.append(f"job 2's first step is {first}, not {res[1] + 1}")
            if max(jobs[1]["steps"]) != steps:
                failures.append(f"job 2 ended at step {max(jobs[1]['steps'])}, not {steps}")

    # -- loss -------------------------------------------------------------------------------------------
    if len(jobs) >= 2 and resumed_step is not None:
        k = resumed_step
        a, b = jobs[0]["steps"], jobs[1]["steps"]
        journal = journal_losses(run_dir / "tracking" / "metrics.jsonl")
        p("")
        p("loss (train/loss, every step, from the progress lines of logs/train.log)")
        if journal:
            both = [s for s in journal if s in a and s <= max(a)] + [s for s in journal if s in b and s > max(a)]
            diffs = [abs(journal[s] - (a[s][0] if s in a and s <= max(a) else b[s][0])) for s in both]
            p(f"  the exact values of tracking/metrics.jsonl ({len(journal)} steps) agree with the log's 4-decimal "
              f"ones within {max(diffs) if diffs else float('nan'):.1e}")
            if diffs and max(diffs) > 5.1e-5:
                failures.append(f"train.log and metrics.jsonl disagree by up to {max(diffs):.1e}")
        last_a = max(a)
        show_before = [s for s in range(k - 2, k + 1) if s in a]
        p("  job 1, just before its newest checkpoint: " + ", ".join(f"step {s} {a[s][0]:.4f}" for s in show_before)
          + f"; last full step before the crash: {last_a} {a[last_a][0]:.4f}")
        p("  job 2, at the resume: " + ", ".join(f"step {s} {b[s][0]:.4f}" for s in range(k + 1, k + 4) if s in b))
        replay = [s for s in range(k + 1, last_a + 1) if s in b and s in a]
        diffs = [abs(a[s][0] - b[s][0]) for s in replay]
        same = sum(1 for d in diffs if d < 5e-5)
        p(f"  steps {k + 1}-{last_a}, run by both jobs: {same}/{len(replay)} equal to 4 decimals "
          f"(max difference {max(diffs) if diffs else float('nan'):.4f})")
        if replay and same != len(replay):
            failures.append(f"the resumed job's steps {k + 1}-{last_a} differ from the crashed job's "
                            f"(same world size: the resume should be exact)")
        w = 20
        before = [a[s][0] for s in range(k - w + 1, k + 1) if s in a]
        after = [b[s][0] for s in range(k + 1, k + w + 1) if s in b]
        later = [b[s][0] for s in range(last_a + 1, last_a + w + 1) if s in b]
        tol = max(3 * statistics.pstdev(before), 0.1) if len(before) > 1 else 0.1
        p(f"  mean of {w} steps: {k - w + 1}-{k} (job 1) {mean(before):.4f} | {k + 1}-{k + w} (job 2) "
          f"{mean(after):.4f} | {last_a + 1}-{last_a + w} (job 2, past the crash) {mean(later):.4f}; "
          f"continuity tolerance {tol:.3f} (3 x the std of the steps before, at least 0.1)")
        if not (abs(mean(after) - mean(before)) <= tol):
            failures.append(f"the loss does not continue across the resume: {mean(before):.4f} before, "
                            f"{mean(after):.4f} after")
        curve = {s: v[0] for s, v in a.items() if s <= k} | {s: v[0] for s, v in b.items()}
        n_bins = 10
        edges = [round(steps * i / n_bins) for i in range(n_bins + 1)]
        p("  curve, mean loss per tenth of the run: " + " ".join(
            f"{mean(curve[s] for s in range(lo + 1, hi + 1) if s in curve):.3f}" for lo, hi in zip(edges, edges[1:])))
        p(f"  final step {steps}: {b.get(steps, (float('nan'),))[0]:.4f}; " + "; ".join(
            f"{name} at {st}: {loss:.4f}" for job in jobs for name, st, loss, _ in job["evals"]))

    # -- memory and open files --------------------------------------------------------------------------
    p("")
    p("memory and open files per rank: least-squares slopes per 1000 steps over the second half of each job's "
      "steps; min..max over that window [over the whole job]")
    p("  RSS floor: the lowest RSS between two progress lines (polled every "
      f"{args.fast_interval * 1000:g} ms), i.e. what stays resident between steps; "
      f"sampled: RSS, open fds and threads every {args.interval:g} s")
    p(f"  {'job':>3} {'rank':>4} {'steps':>9} | {'n':>3} {'floor MiB/1k':>12} {'floor MiB':>11} | {'n':>3} "
      f"{'RSS MiB/1k':>10} {'sampled RSS MiB':>25} | {'fds/1k':>6} {'open fds':>13} | {'threads':>11}")
    for seg in (1, 2):
        rows = [r for r in samples if r.get("kind") == "proc" and r["segment"] == seg]
        floors = [r for r in samples if r.get("kind") == "step" and r["segment"] == seg]
        stepped = [r["step"] for r in floors]
        if not stepped:
            failures.append(f"job {seg}: no samples with a training step")
            continue
        lo, hi = min(stepped), max(stepped)
        mid = (lo + hi) / 2
        for rank in (0, 1):
            mine = [r for r in rows if r["rank"] == rank]
            win = [r for r in mine if r["step"] is not None and mid <= r["step"] < hi]
            fwin = [r for r in floors if r["rank"] == rank and mid <= r["step"] <= hi]
            floor = fit([(r["step"], r["rss_floor"] / MIB) for r in fwin])
            rss = fit([(r["step"], r["rss"] / MIB) for r in win])
            fds = fit([(r["step"], r["fds"]) for r in win])
            if floor is None or rss is None or fds is None:
                failures.append(f"job {seg} rank {rank}: too few samples in the second half ({len(fwin)} "
                                f"per-step, {len(win)} sampled)")
                continue

            def span(rs, key, scale=1.0, fmt="{:.1f}", whole=None):
                w = [r[key] / scale for r in rs]
                text = f"{fmt.format(min(w))}..{fmt.format(max(w))}"
                if whole is not None:
                    al = [r[key] / scale for r in whole]
                    text += f" [{fmt.format(min(al))}..{fmt.format(max(al))}]"
                return text

            p(f"  {seg:>3} {rank:>4} {f'{int(mid)}-{hi}':>9} | {len(fwin):>3} {floor * 1000:>+12.2f} "
              f"{span(fwin, 'rss_floor', MIB):>11} | {len(win):>3} {rss * 1000:>+10.2f} "
              f"{span(win, 'rss', MIB, whole=mine):>25} | {fds * 1000:>+6.2f} "
              f"{span(win, 'fds', fmt='{:.0f}', whole=mine):>13} | {span(win, 'threads', fmt='{:.0f}', whole=mine):>11}")
            if floor * 1000 >= args.rss_bound:
                failures.append(f"job {seg} rank {rank}: the RSS floor grows {floor * 1000:.2f} MiB/1000 steps "
                                f"(bound {args.rss_bound:g})")
            if abs(fds * 1000) >= args.fd_bound:
                failures.append(f"job {seg} rank {rank}: open files change {fds * 1000:+.2f}/1000 steps "
                                f"(bound {args.fd_bound:g})")
    p(f"  bounds: RSS floor slope < {args.rss_bound:g} MiB/1000 steps, |fd slope| < {args.fd_bound:g}/1000 steps")

    # -- disk -------------------------------------------------------------------------------------------
    p("")
    highs = [r for r in samples if r.get("kind") == "disk_high"]
    finals = [r for r in samples if r.get("kind") == "disk" and r.get("final")]
    tag_sizes = [size for r in samples if r.get("kind") in ("disk", "disk_high") for size in r["tags"].values()]
    if highs and finals and tag_sizes:
        high = max(highs, key=lambda r: r["bytes"])
        final = finals[-1]
        one = max(tag_sizes)  # a complete tag (a tag folder only ever grows to its full size)
        loose = final["bytes"] - sum(final["tags"].values())  # latest, DeepSpeed's zero_to_*.py scripts
        bound = (keep + 1) * one + loose
        p(f"disk: checkpoints/ high-water {high['bytes'] / 1e6:.1f} MB (job {high['segment']}, "
          f"folders {', '.join(high.get('folders', sorted(high['tags'])))}) vs bound (keep + 1) x {one / 1e6:.2f} MB + {loose / 1e3:.0f} kB loose "
          f"files = {bound / 1e6:.1f} MB")
        p(f"  at the end: {final['bytes'] / 1e6:.1f} MB, tags {sorted(final['tags'])}")
        if high["bytes"] > bound:
            failures.append(f"checkpoints/ reached {high['bytes'] / 1e6:.1f} MB > {bound / 1e6:.1f} MB")
        want = [f"step_{s:08d}" for s in range(interval, steps + 1, interval)][-keep:]
        if keep and sorted(final["tags"]) != want:
            failures.append(f"at the end checkpoints/ holds {sorted(final['tags'])}, not {want}")
        others = []
        for rel in ("mlflow.db", "tracking/metrics.jsonl", "logs/train.log", "mlartifacts"):
            path = run_dir / rel
            if path.exists():
                size = path.stat().st_size if path.is_file() else _tree_bytes(str(path))
                others.append(f"{rel} {size / 1e6:.2f} MB")
        p("  the rest of the run folder at the end (grows with the steps, not retention's): " + ", ".join(others))
    else:
        failures.append("no disk samples")

    # -- time -------------------------------------------------------------------------------------------
    p("")
    saves = [t for job in jobs for _, t in job["saves"]]
    evals = [(n, t) for job in jobs for n, _, _, t in job["evals"]]
    if saves:
        p(f"checkpoint saves: {len(saves)}, median {statistics.median(saves):.2f} s, max {max(saves):.2f} s; "
          f"evaluations: " + ", ".join(f"{n} {t:.1f} s" for n, t in evals))
    w1, w2 = rc1.get("wall_s", 0.0), rc2.get("wall_s", 0.0)
    total = args.total_wall if args.total_wall else w1 + w2
    per_step = [v[1] for job in jobs for v in job["steps"].values()]
    trained = sum(len(job["steps"]) for job in jobs)
    p(f"wall: job 1 {w1:.1f} s, job 2 {w2:.1f} s, total {total:.1f} s (both jobs, start-up, evaluations and "
      f"the between-jobs check); {steps} steps / total = {steps / total:.2f} steps/s; "
      f"{trained} steps trained (re-run ones included), median {statistics.median(per_step):.3f} s/step "
      f"= {1 / statistics.median(per_step):.1f} steps/s while training" if per_step else f"wall: {total:.1f} s")

    warn = distinct_warnings([scratch / f"seg{s}-rank{r}.out" for s in (1, 2) for r in (0, 1)])
    if warn:
        p("")
        p("warnings and errors in the ranks' output (distinct, numbers as N, with counts):")
        for line, n in sorted(warn.items(), key=lambda kv: -kv[1]):
            p(f"  {n:>4} x {line}")
    if any(r.get("kind") == "timeout" for r in samples):
        failures.append("a job ran past its deadline and was killed")

    p("")
    if failures:
        p("result: FAIL")
        for f in failures:
            p(f"  - {f}")
        return 1
    p(f"result: PASS (RSS floor slope < {args.rss_bound:g} MiB/1000 steps and |fd slope| < {args.fd_bound:g}/1000 steps "
      f"on both ranks in both jobs; checkpoints/ within (keep + 1) tags; the crash ended job 1 with one line "
      f"naming rank 1; job 2 resumed from the newest complete checkpoint and the loss continued)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sample")
    s.add_argument("--segment", type=int, required=True)
    s.add_argument("--pid", action="append", required=True, metavar="RANK:PID")
    s.add_argument("--run-dir", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--interval", type=float, default=0.5)
    s.add_argument("--disk-interval", type=float, default=0.1)
    s.add_argument("--fast-interval", type=float, default=0.01, help="RSS polls for the per-step floor")
    s.add_argument("--deadline", type=float, default=0.0, help="seconds; 0: none")
    i = sub.add_parser("inventory")
    i.add_argument("run_dir")
    r = sub.add_parser("report")
    r.add_argument("--scratch", required=True)
    r.add_argument("--run-dir", required=True)
    r.add_argument("--config", default="configs/tiny.json")
    r.add_argument("--steps", type=int, required=True)
    r.add_argument("--crash-step", type=int, required=True)
    r.add_argument("--ckpt-interval", type=int, required=True)
    r.add_argument("--keep", type=int, required=True)
    r.add_argument("--eval-interval", type=int, required=True)
    r.add_argument("--tracking", default="the run folder's local sqlite store")
    r.add_argument("--interval", type=float, default=0.5)
    r.add_argument("--disk-interval", type=float, default=0.1)
    r.add_argument("--fast-interval", type=float, default=0.01)
    r.add_argument("--rss-bound", type=float, default=5.0, help="MiB per 1000 steps")
    r.add_argument("--fd-bound", type=float, default=1.0, help="open files per 1000 steps")
    r.add_argument("--total-wall", type=float, default=0.0)
    args = ap.parse_args(argv)
    return {"sample": cmd_sample, "inventory": cmd_inventory, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
