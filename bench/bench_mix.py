"""`mix` benchmark: copy and index mode against copying the same bytes, peak RSS, and the loader on each.

Two real sources, Shakespeare (one line per document) and PTB (one sentence per document), are prepared
once with one small tokenizer, then each train stream is repeated whole (documents intact) into a source
corpus of half the mixture's size. The mixture (weights 3:1, default length: the sum of the sources) is
timed end to end in each mode (`python -m data_prep mix [--index]`: the sources' checksums and document
scan, the schedule, the copy or the index, the held-out splits, the manifest), then `cp -r` of the sources'
train folders (the same bytes as the mixture's train split) right after; all read from the page cache the
first mix left warm. `cp` hands the copy to the kernel (copy_file_range: no byte passes through user space,
and a filesystem with reflinks copies nothing), so it is a floor, not the disk's speed; `dd bs=4M
conv=fsync` of the same files (read, written and flushed, as mix writes and fsyncs) is the disk's write
speed, and `mix/dd s` the figure that says whether mix runs at disk speed (<= 1: as fast as the disk).
Wall and CPU seconds are printed: on a shared machine the CPU seconds are the comparable numbers. Short
documents (15-60 tokens) are the hard case: the bookkeeping grows with documents, not tokens. Last, the
loader: StreamLoader micro batches (rank 0 of 2, 64 streams, 8 per micro batch, tgt_len 128) read from the
copy and from the index, in tokens per CPU second.

    python bench/bench_mix.py                                  # mixtures of 100 and 400 MB, both modes
    python -m bench.bench_mix --sizes-mb 1     # the smallest: each source once (~4 MB; 16 MB with --documents long)
    python bench/bench_mix.py --sizes-mb 2000 --modes index    # the issue's >= 2 GB run, index mode only
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from txl_dist.data.format import read_manifest

try:  # python -m bench.bench_mix
    from bench.bench_data import ROOT, data_prep
except ModuleNotFoundError:  # python bench/bench_mix.py: this script's folder is on sys.path, its parent is not
    from bench_data import ROOT, data_prep


def run_measured(cmd: list[str]) -> tuple[float, float, float, float]:
    """(wall s, CPU s, peak anonymous MiB, peak total RSS MiB) of a command; memory polled from /proc every 10 ms.

    The total RSS (what ru_maxrss reports) counts the memory-mapped source pages mix touches; they are page
    cache, dropped under pressure. The anonymous part is the memory the process itself holds. CPU time
    (user + system) is the fair comparison on a shared machine, where wall time depends on the neighbours.
    """
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    anon = total = 0
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        try:
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines())
            anon = max(anon, int(fields["RssAnon"].split()[0]))
            total = max(total, int(fields["VmHWM"].split()[0]))
        except (OSError, KeyError, ValueError):
            pass
        time.sleep(0.01)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(map(str, cmd))}")
    return time.perf_counter() - start, usage.ru_utime + usage.ru_stime, anon / 1024, total / 1024


def tile(corpus: Path, out: Path, n_tokens: int) -> None:
    """A corpus whose train split is `corpus`'s train stream repeated whole until n_tokens (at least)."""
    import numpy as np

    from data_prep.layout import SplitWriter
    from txl_dist.data.format import Layout, Manifest, SplitEntry, TokenReader, write_manifest

    m = read_manifest(corpus)
    src = m.splits["train"]
    reps = -(-n_tokens // src.n_tokens)
    out.mkdir(parents=True)
    shutil.copyfile(corpus / m.tokenizer.file, out / m.tokenizer.file)
    writer = SplitWriter(out, "train", reps * src.n_tokens, Layout(2, 8), m.dtype, m.tokenizer.vocab_size)
    with TokenReader(corpus, m, "train") as reader:
        stream = np.array(reader.read(0, src.n_tokens))
    for _ in range(reps):
        writer.write(stream, str(corpus))
    files, sha = writer.close()
    train = SplitEntry(n_tokens=reps * src.n_tokens, n_documents=reps * src.n_documents, n_bytes=reps * src.n_bytes,
                       n_chars=reps * src.n_chars, tokens_sha256=sha, layout=Layout(2, 8), files=files)
    write_manifest(out, Manifest(tokenizer=m.tokenizer, dtype=m.dtype, splits={"train": train},
                                 provenance={"tool": "bench_mix", "tiled_from": str(corpus), "repeats": reps}))


def write_through(files: list[Path], dest: Path) -> float:
    """Wall seconds of `dd bs=4M conv=fsync` of `files` into `dest` (then removed): the bytes read, written
    through user space and flushed to the disk, as mix writes (and fsyncs) its files. `cp` is no such
    baseline: it hands the copy to the kernel (copy_file_range, a reflink where the filesystem has them)."""
    dest.mkdir()
    start = time.perf_counter()
    for f in files:
        subprocess.run(["dd", f"if={f}", f"of={dest / f.name}", "bs=4M", "conv=fsync", "status=none"], check=True)
    seconds = time.perf_counter() - start
    shutil.rmtree(dest)
    return seconds


def loader_speed(corpus: Path, seconds: float = 3.0) -> float:
    """Tokens per CPU second of StreamLoader micro batches (rank 0 of 2, 64 streams, micro batch 8, tgt_len 128),
    the files already verified (verify=False: the read path only), for about `seconds` of CPU time."""
    from txl_dist.data.loader import StreamLoader

    loader = StreamLoader(corpus, "train", rank=0, world_size=2, n_streams=64, micro_batch=8, tgt_len=128,
                          verify=False)
    tokens, start = 0, time.process_time()
    for batch in loader:
        tokens += batch.input_ids.size
        if time.process_time() - start > seconds:
            break
    rate = tokens / (time.process_time() - start)
    loader.close()
    return rate


def line_sources(scratch: Path, small: Path) -> None:
    """small/sh and small/ptb: Shakespeare one line per document, PTB one sentence per document, one tokenizer."""
    raw = scratch / "raw"
    for name in ("shakespeare", "ptb"):
        subprocess.run(data_prep("fetch-corpus", name, raw / name), check=True, stdout=subprocess.DEVNULL)
    plays = sorted((raw / "shakespeare" / "train").glob("*.txt"))[:10]
    subprocess.run(data_prep("train-tokenizer", "--out", small / "tok.model", "--train", *plays,
                             raw / "ptb" / "train.txt", "--vocab-size", 4096, "--model-type", "bpe",
                             "--tokenizer-sample", 50000, "--num-proc", 2, "--quiet"), check=True,
                   stdout=subprocess.DEVNULL)
    for name, inputs in (("sh", plays), ("ptb", [raw / "ptb" / "train.txt"])):
        subprocess.run(data_prep("prepare", "--out", small / name, "--line-docs", "--train", *inputs,
                                 "--tokenizer-model", small / "tok.model", "--num-proc", 2, "--quiet"),
                       check=True, stdout=subprocess.DEVNULL)


def long_sources(scratch: Path, small: Path) -> None:
    """small/sh and small/ptb (the same names): synthetic Zipf text in documents of ~1,000 tokens, one
    (synthetic) tokenizer: the common case of web pages and articles, where mix's cost is per token."""
    try:
        from bench.synthetic_corpus import write_corpus
    except ModuleNotFoundError:  # run as a script (see the imports above)
        from synthetic_corpus import write_corpus
    from txl_dist.data.format import Layout

    for k, name in enumerate(("sh", "ptb")):
        write_corpus(small / name, {"train": 4_000_000}, 4096, Layout(2, 8), seed=k, mean_doc=1000)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 400], help="mixture sizes (MB of tokens)")
    p.add_argument("--modes", nargs="+", choices=["copy", "index"], default=["copy", "index"],
                   help="mix modes to time (default both)")
    p.add_argument("--documents", choices=["lines", "long"], default="lines",
                   help="lines: Shakespeare lines and PTB sentences (~11 tokens, the worst case); long: synthetic "
                        "Zipf text in documents of ~1,000 tokens (web pages, articles)")
    p.add_argument("--scratch", default=None, help="a new scratch folder, kept after (default: a temporary one)")
    args = p.parse_args(argv)
    if args.scratch and Path(args.scratch).exists():
        raise SystemExit(f"--scratch {args.scratch} exists; give a new folder")
    os.environ["PYTHONPATH"] = str(ROOT)
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="bench_mix-"))
    try:
        small = scratch / "small"
        (long_sources if args.documents == "long" else line_sources)(scratch, small)
        print(f"{'mixture MB':>10} {'documents':>11} {'mode':>5} {'mix s':>7} {'mix cpu s':>9} {'MB/cpu s':>9} "
              f"{'cp s':>6} {'cp cpu s':>8} {'mix/cp cpu':>10} {'dd s':>6} {'mix/dd s':>8} {'peak anon MiB':>13} "
              f"{'peak RSS MiB':>12} {'index MB':>8} {'loader Mtok/cpu s':>17}")
        for size in args.sizes_mb:
            work = scratch / f"{size}mb"
            for name in ("sh", "ptb"):
                tile(small / name, work / name, size * 1_000_000 // 4)  # uint16: half the mixture's bytes each
            train_bytes = sum(f.stat().st_size for name in ("sh", "ptb") for f in (work / name / "train").iterdir())
            for mode in args.modes:
                out = work / f"mix-{mode}"
                wall, cpu, anon, rss = run_measured(data_prep(
                    "mix", "--out", out, "--source", f"sh={work / 'sh'}:3", "--source", f"ptb={work / 'ptb'}:1",
                    "--world-size", 2, "--n-streams", 8, "--quiet", *(["--index"] if mode == "index" else [])))
                (work / "cp").mkdir()
                cp_wall, cp_cpu, _, _ = run_measured(["cp", "-r", str(work / "sh" / "train"),
                                                      str(work / "ptb" / "train"), str(work / "cp")])
                shutil.rmtree(work / "cp")
                dd_wall = write_through(sorted((work / "sh" / "train").iterdir())
                                        + sorted((work / "ptb" / "train").iterdir()), work / "dd")
                m = read_manifest(out)
                index_mb = (out / m.mixture.documents_file).stat().st_size / 1e6
                mb = train_bytes / 1e6
                print(f"{mb:>10.0f} {m.splits['train'].n_documents:>11,} {mode:>5} {wall:>7.1f} {cpu:>9.1f} "
                      f"{mb / cpu:>9.1f} {cp_wall:>6.2f} {cp_cpu:>8.2f} {cpu / max(cp_cpu, 1e-3):>10.1f} "
                      f"{dd_wall:>6.1f} {wall / dd_wall:>8.2f} {anon:>13.0f} {rss:>12.0f} {index_mb:>8.0f} "
                      f"{loader_speed(out) / 1e6:>17.2f}", flush=True)
            shutil.rmtree(work)
    finally:
        if args.scratch is None:
            shutil.rmtree(scratch, ignore_errors=True)

if __name__ == "__main__":
    main()
