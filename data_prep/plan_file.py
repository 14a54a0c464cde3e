"""The plan file, PARTS/plan.json: every input read once per sharded job, so that the `prepare --shard i/N`
tasks do not each hash, count and parse all inputs.

`prepare --plan --out PARTS ...` (the same arguments as the tasks) reads each input file once and records,
per input: its identity (resolved path, size, modification time in ns), sha256, document count and seek
points (data_prep/seek.py); with the options that decide the documents (format, --line-docs, --text-field,
--errors, the held-out fractions, the seed). A task that finds PARTS/plan.json takes its counts, checksums and
seek points from it: it stats the inputs instead of hashing them, derives the shard ranges and held-out
choice from the counts, and reads only from the seek point before its first document to its last. Without
the file a task scans everything as before; both give the same shard, byte for byte.

Why a step of its own, run once before the array (launch/slurm/prep.sh submits it as a job the array
depends on), and not the first task under a lock: Slurm's dependency orders the jobs with no lock on the
shared file system (flock over NFS or Lustre differs between clusters, and a lock held by a dead node may
never be released); no task sits idle waiting for another; the file appears whole or not at all (written
atomically), so a killed or requeued job leaves nothing half-read; and it runs beside the tokenizer job.

Refused, in one line, by a task (never silently used): a plan for other inputs or options; an input whose
size or modification time differs from the plan's (stale: plan again with --overwrite; a file rewritten in
place with both kept is not noticed, as with the corpus checksums a run remembers); a damaged file (its
own sha256, over its content, must match). `prepare --plan` without --overwrite keeps a plan that fits the
inputs (a requeued planning job ends at once) and refuses one that does not.

Format: JSON, because it is small (inputs x (identity + sha256) + 1,600 seek points per 100 GB) and read once
per task, and a person can read it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data_prep.errors import PrepError
from data_prep.plan_scan import scan_input
from data_prep.seek import InputRecord
from data_prep.sources import ReadOptions, Source, source_files
from txl_dist.atomic import atomic_write

PLAN_FILE = "plan.json"
PLAN_FORMAT = "txl-dist-prep-plan"
PLAN_VERSION = 1
REPLAN = "run `prepare --plan --overwrite` with this command's inputs and options (or remove the file to scan " \
         "without it)"


@dataclass
class InputPlan:
    """A plan file as read: the options it was made with and each split's input records."""

    path: Path
    options: dict[str, Any]
    inputs: dict[str, list[InputRecord]]
    sha256: str
    """Of the file's content (the canonical JSON of everything else): shard.json's provenance names it."""


def scan_inputs(sources: dict[str, list[Source]], opts: ReadOptions, progress=None,
                workers: int = 1) -> dict[str, list[InputRecord]]:
    """The planning pass: every input read once (plan_scan.scan_input), up to `workers` inputs at a time (on
    threads: sha256 and pyarrow's JSON parser release the GIL, so they read and hash in parallel, as a parallel
    file system wants); `progress(n_bytes)` as bytes are read. The records do not depend on `workers`."""
    pairs = [(split, s) for split, ss in sources.items() for s in ss]
    stop = threading.Event()

    def read(n_bytes: int) -> None:
        # A thread cannot be interrupted: a Ctrl-C or SIGTERM of the main thread would wait for the inputs
        # being read to be read to their ends (minutes for an input of 100 GB); each stops at its next chunk.
        if stop.is_set():
            raise _Stopped()
        if progress is not None:
            progress(n_bytes)

    with ThreadPoolExecutor(max(1, min(workers, len(pairs)))) as pool:
        try:
            records = list(pool.map(lambda pair: scan_input(pair[1], opts, read), pairs))  # in input order
        except BaseException:
            stop.set()  # before the pool's exit waits for its threads
            raise
    out: dict[str, list[InputRecord]] = {split: [] for split in sources}
    for (split, _), record in zip(pairs, records):
        out[split].append(record)
    return out


class _Stopped(Exception):
    """Ends the reading of an input whose planning pass was stopped (its error is never seen)."""


def write_plan(path: Path, options: dict[str, Any], inputs: dict[str, list[InputRecord]],
               provenance: dict[str, Any]) -> str:
    """Write the plan file atomically; returns its sha256."""
    body = {"format": PLAN_FORMAT, "version": PLAN_VERSION, "options": options,
            "inputs": {s: [dataclasses.asdict(r) for r in records] for s, records in inputs.items()},
            "provenance": provenance}
    digest = _digest(body)
    atomic_write(path, _render({**body, "sha256": digest}))
    return digest


def _render(d: dict[str, Any]) -> str:
    """JSON with one line per input record (a record's seek points stay on its line)."""
    lines = []
    for key, value in d.items():
        if key != "inputs":
            lines.append(f"{json.dumps(key)}: {json.dumps(value)}")
            continue
        splits = [f"  {json.dumps(s)}: [\n" + ",\n".join(f"   {json.dumps(r)}" for r in records) + "\n  ]"
                  for s, records in value.items()]
        lines.append('"inputs": {\n' + ",\n".join(splits) + "\n }")
    return "{\n " + ",\n ".join(lines) + "\n}\n"


def read_plan(path: Path) -> InputPlan:
    """Read a plan file; a damaged one (unreadable, truncated, edited, another format) is refused."""
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
        digest = d.pop("sha256")
        if (d.get("format"), d.get("version")) != (PLAN_FORMAT, PLAN_VERSION):
            raise ValueError(f"not a {PLAN_FORMAT} v{PLAN_VERSION} file")
        if _digest(d) != digest:
            raise ValueError("its content does not match its sha256: it was changed or cut short")
        inputs = {s: [InputRecord(**r) for r in records] for s, records in d["inputs"].items()}
        return InputPlan(path, d["options"], inputs, digest)
    except OSError as e:
        raise PrepError(f"{path}: cannot be read ({e.strerror}); {REPLAN}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise PrepError(f"{path}: damaged plan file ({e}); {REPLAN}") from None


def mismatch(plan: InputPlan, options: dict[str, Any], sources: dict[str, list[Source]]) -> str | None:
    """Why the plan does not fit these options and inputs as they are now (None: it fits)."""
    for key, value in options.items():
        if plan.options.get(key) != value:
            return f"made with {_option(key, plan.options.get(key))}, this command has {_option(key, value)}"
    for split in sorted(set(plan.inputs) | set(sources), key=("train", "valid", "test").index):
        planned, given = plan.inputs.get(split, []), sources.get(split, [])
        if len(planned) != len(given):
            return f"made for other inputs: --{split} has {len(given)} input(s) here, {len(planned)} in the plan"
        for k, (record, source) in enumerate(zip(planned, given)):
            if (record.path, record.kind) != (str(source.path.resolve()), source.kind):
                return (f"made for other inputs: --{split} input {k + 1} is {source.path.resolve()} ({source.kind}) "
                        f"here, {record.path} ({record.kind}) in the plan")
            changed = _changed(record, source)
            if changed:
                return changed
    return None


def _changed(record: InputRecord, source: Source) -> str | None:
    """How an input differs from when it was planned: its files, their sizes or modification times."""
    files = source_files(source)
    if [str(p.resolve()) for p in files] != [f["path"] for f in record.files]:
        return f"input {source.path} changed since it was planned (its files differ)"
    for path, f in zip(files, record.files):
        try:
            st = path.stat()
        except OSError as e:
            return f"input {path} cannot be read now ({e.strerror})"
        if st.st_size != f["bytes"]:
            return f"input {path} changed since it was planned (size {f['bytes']} -> {st.st_size} bytes)"
        if st.st_mtime_ns != f["mtime_ns"]:
            return f"input {path} changed since it was planned (modified again, size kept)"
    return None


def provenance_entries(plan: InputPlan, sources: dict[str, list[Source]]) -> dict[str, list[dict]]:
    """split -> [{path, bytes, sha256}] per input file, as scan_sources would give them (paths as given here)."""
    return {split: [{"path": str(path), "bytes": f["bytes"], "sha256": f["sha256"]}
                    for source, record in zip(ss, plan.inputs[split])
                    for path, f in zip(source_files(source), record.files)]
            for split, ss in sources.items()}


def load_for_shard(path: Path, options: dict[str, Any], sources: dict[str, list[Source]]) -> InputPlan:
    """The plan a `prepare --shard` task follows: read, and refused unless it fits its options and inputs."""
    plan = read_plan(path)
    why = mismatch(plan, options, sources)
    if why:
        raise PrepError(f"{path} does not fit this command: {why}; {REPLAN}")
    return plan


def _option(key: str, value: Any) -> str:
    flag = "--" + key.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else f"no {flag}"
    return f"{flag} {value}"


def _digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def total_bytes(sources: dict[str, Sequence[Source]]) -> int:
    """Bytes the planning pass reads (for its progress bar)."""
    total = 0
    for ss in sources.values():
        for s in ss:
            for p in source_files(s):
                try:
                    total += os.stat(p).st_size
                except OSError:
                    pass  # the scan names it
    return total
