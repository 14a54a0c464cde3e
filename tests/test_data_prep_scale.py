"""Long jobs: stopping one (Ctrl-C, SIGTERM) at any stage, and what it says while it runs and at its end.

A terminal's Ctrl-C signals the whole foreground process group, tokenizer workers included; SentencePiece trains
in C++ for minutes, where Python runs no signal handler; verify reads a whole corpus before saying anything.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
from tqdm import tqdm

import data_prep.encode as encode
import data_prep.progress as progress_module
import data_prep.report as report
import data_prep.tokenizer as tokenizer
from corpus_helpers import small_bpe_tokenizer, tricky_text
from data_prep.cli import main
from data_prep.tokenizer import TrainerOptions, train_tokenizer


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return small_bpe_tokenizer(tmp_path_factory.mktemp("scale-tok"))


@pytest.fixture
def ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt in this process, as in a terminal (conftest puts the handler back)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


def test_a_tokenizer_worker_leaves_ctrl_c_to_the_job(model):
    """Ctrl-C reaches every worker too: each printed a KeyboardInterrupt traceback above the job's one line.
    A worker ignores it and goes on; the job cancels the tasks and shuts the pool down."""
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=encode._init_worker,
                               initargs=(str(model), 1, "uint16", os.getpid()))
    with pool:
        assert pool.submit(signal.getsignal, signal.SIGINT).result(timeout=120) == signal.SIG_IGN
        pid = pool.submit(os.getpid).result(timeout=60)
        os.kill(pid, signal.SIGINT)
        assert pool.submit(os.getpid).result(timeout=60) == pid  # the same worker, still at work


def test_the_job_itself_keeps_ctrl_c_when_it_tokenizes_alone(model, ctrl_c_raises):
    encode._init_worker(str(model), 1, "uint16")  # --num-proc 1: the job's own process encodes
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _sentences(n: int = 500) -> list[str]:
    return [line for line in tricky_text(3000, seed=3).splitlines() if line.strip()][:n]


def test_sigusr1_to_the_whole_job_is_its_one_line_only(model, tmp_path):
    """Slurm sends `scancel --signal=USR1` (and `--signal=USR1@...`) to every process of the step. The job
    stops with its one line and 143, but multiprocessing's resource tracker (which ignores only SIGINT and
    SIGTERM) died of it too: the job started another, which printed a KeyError traceback per semaphore and
    "Some resources might leak" below that line. The signal comes here once the tokenizer pool exists."""
    import subprocess
    import sys

    raw = tmp_path / "a.txt"
    raw.write_text(tricky_text(3000, seed=4).replace("\r", ""), encoding="utf-8")
    out = tmp_path / "corpus"
    job = ("import os, signal, sys\n"
           "import data_prep.encode as encode\n"
           "from data_prep.cli import main\n"
           "enter = encode.Encoder.__enter__\n"
           "def enter_then_signal(self):\n"
           "    entered = enter(self)\n"
           "    os.killpg(os.getpgid(0), signal.SIGUSR1)  # the whole job: its pool's processes too\n"
           "    return entered\n"
           "encode.Encoder.__enter__ = enter_then_signal\n"
           "sys.exit(main(sys.argv[1:]))\n")
    done = subprocess.run([sys.executable, "-c", job, "prepare", "--out", str(out), "--train", str(raw),
                           "--tokenizer-model", str(model), "--num-proc", "2", "--quiet"],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300,
                          start_new_session=True, env=os.environ | {"USE_TORCH": "0"})
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert done.stderr.splitlines() == ["error: terminated (SIGUSR1); nothing was written"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def test_an_interrupt_while_sentencepiece_trains_stops_the_job_at_once(monkeypatch, tmp_path, ctrl_c_raises):
    """Trained in the main thread, a Ctrl-C or SIGTERM waited until the training returned (minutes for a
    million sentences; Slurm's SIGKILL comes 30 s after its SIGTERM). The job now stops while it trains."""
    release, returned = threading.Event(), threading.Event()

    def busy_training(sentence_iterator, **options):
        for _ in sentence_iterator:  # SentencePiece reads every sentence first ...
            pass
        try:
            os.kill(os.getpid(), signal.SIGINT)  # ... and the user presses Ctrl-C while it trains
            release.wait(120)  # the training: in C++, until it is done
        finally:
            returned.set()

    monkeypatch.setattr(tokenizer.spm.SentencePieceTrainer, "train", busy_training)
    try:
        with pytest.raises(KeyboardInterrupt):
            train_tokenizer(_sentences(), tmp_path / "tok.model", TrainerOptions(vocab_size=300))
        assert not returned.is_set(), "the interrupt waited for the training to end"
    finally:
        release.set()
    assert not (tmp_path / "tok.model").exists()


@pytest.mark.parametrize("main_thread", ["waiting", "starting the thread"])
def test_an_interrupt_while_sentencepiece_reads_stops_its_reading_first(monkeypatch, tmp_path, ctrl_c_raises,
                                                                        main_thread):
    """The training thread must not be left running Python code (reading sentences) while the process exits:
    ended inside SentencePiece's C++ frames it aborts the process ("terminate called without an active
    exception", exit status 134 instead of 130). Interrupted while SentencePiece reads, the job waits until
    its reading has stopped, at the next sentence. Also when the signal meets the main thread still inside
    Thread.start() (a loaded machine: the new thread read its first sentences before start() returned; seen
    once in a whole-suite run, the reading was then never cancelled)."""
    read, stopped = [], threading.Event()
    if main_thread == "starting the thread":
        start = threading.Thread.start

        def slow_start(thread):
            start(thread)
            if thread.name == "sentencepiece-training":
                time.sleep(5)  # the signal comes during this: raised inside start(), as on a loaded machine

        monkeypatch.setattr(threading.Thread, "start", slow_start)

    def reading(sentence_iterator, **options):
        try:
            for _ in sentence_iterator:  # the feed reads the whole split, to draw the sample it hands over
                pass
        finally:
            stopped.set()

    def endless():
        while True:
            for sentence in _sentences():
                read.append(sentence)
                if len(read) == 10:
                    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the training thread reads
                yield sentence

    monkeypatch.setattr(tokenizer.spm.SentencePieceTrainer, "train", reading)
    with pytest.raises(KeyboardInterrupt):
        train_tokenizer(endless(), tmp_path / "tok.model", TrainerOptions(vocab_size=300))
    assert stopped.is_set(), "the training thread was still reading when the job went on"
    assert len(read) < 10_000


def test_an_interrupted_plan_stops_reading_its_inputs(monkeypatch, tmp_path, ctrl_c_raises):
    """`prepare --plan` reads its inputs on threads, which no signal interrupts: a Ctrl-C or SIGTERM waited
    until each input being read was read to its end (minutes for an input of 100 GB). Each now stops at its
    next chunk."""
    import data_prep.seek as seek
    from data_prep.plan_file import scan_inputs
    from data_prep.sources import ReadOptions, resolve_sources

    monkeypatch.setattr(seek, "CHUNK_BYTES", 1024)
    path = tmp_path / "lines.txt"
    path.write_text("a line of text\n" * 20_000, encoding="utf-8")  # ~290 chunks
    sources = {"train": resolve_sources([str(path)], "--train")}
    chunks_read, interrupted = [], threading.Event()

    def ctrl_c(signum, frame):
        interrupted.set()
        raise KeyboardInterrupt

    def progress(n_bytes: int) -> None:
        chunks_read.append(n_bytes)
        if len(chunks_read) == 3:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the input is read
            assert interrupted.wait(60)
        elif len(chunks_read) > 3:
            time.sleep(0.01)  # a slower disk: the job has the time to stop the reading

    signal.signal(signal.SIGINT, ctrl_c)

    with pytest.raises(KeyboardInterrupt):
        scan_inputs(sources, ReadOptions(line_docs=True), progress=progress, workers=2)
    assert sum(chunks_read) < path.stat().st_size // 2, "the input was read on after the interrupt"


def small_corpus(model, tmp_path, n_words: int, seed: int):
    """A corpus prepared from one file of tricky text with the module's tokenizer."""
    raw = tmp_path / "a.txt"
    raw.write_text(tricky_text(n_words, seed=seed).replace("\r", ""), encoding="utf-8")
    corpus = tmp_path / "corpus"
    assert main(["prepare", "--out", str(corpus), "--train", str(raw), "--tokenizer-model", str(model),
                 "--num-proc", "1", "--quiet"]) == 0
    return corpus


def test_a_long_verify_says_it_is_at_work(model, tmp_path, monkeypatch, capsys):
    """verify printed nothing until it was done: minutes of silence for a corpus of tens of GB."""
    corpus = small_corpus(model, tmp_path, n_words=2000, seed=5)
    capsys.readouterr()
    ticked = threading.Semaphore(0)
    refresh = tqdm.refresh

    def counting_refresh(self, *args, **kwargs):
        ticked.release()
        return refresh(self, *args, **kwargs)

    real_verify = report.verify_corpus

    def slow_verify(*args, **kwargs):  # a corpus that takes a while: returns once the elapsed time ticked
        assert ticked.acquire(timeout=60), "nothing was shown while verify ran"
        return real_verify(*args, **kwargs)

    monkeypatch.setattr(report, "VERIFY_QUIET_S", 0.0)
    monkeypatch.setattr(progress_module, "HEARTBEAT_S", 0.01)
    monkeypatch.setattr(tqdm, "refresh", counting_refresh)
    monkeypatch.setattr(report, "verify_corpus", slow_verify)
    assert main(["verify", str(corpus)]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"OK {corpus}")
    assert "verify: checking 1 token files" in err, err
    monkeypatch.setattr(report, "verify_corpus", real_verify)
    assert main(["verify", str(corpus), "--quiet"]) == 0
    assert "verify:" not in capsys.readouterr().err


def test_a_quick_verify_prints_its_report_alone(model, tmp_path, capsys):
    corpus = small_corpus(model, tmp_path, n_words=500, seed=6)
    capsys.readouterr()
    assert main(["verify", str(corpus)]) == 0
    assert capsys.readouterr().err == ""  # far below VERIFY_QUIET_S


def test_prepare_ends_with_what_it_wrote(model, tmp_path, capsys):
    """The job ended on `wrote corpus OUT` alone: after hours, the tokens, documents and files are worth a line."""
    raw = tmp_path / "raw.jsonl"
    with open(raw, "w", encoding="utf-8") as f:
        for k in range(40):
            f.write(json.dumps({"text": tricky_text(60, seed=k)}) + "\n")
    corpus = tmp_path / "corpus"
    assert main(["prepare", "--out", str(corpus), "--train", str(raw), "--tokenizer-model", str(model),
                 "--valid-fraction", "0.1", "--num-proc", "1", "--world-size", "2", "--n-streams", "4",
                 "--quiet"]) == 0
    out = capsys.readouterr().out.splitlines()
    manifest = json.loads((corpus / "manifest.json").read_text())
    assert out[0].startswith(f"wrote corpus {corpus} in ") and "bpe tokenizer of 400 pieces, uint16" in out[0]
    for line, (name, split) in zip(out[1:], manifest["splits"].items()):
        assert line.startswith(f"  {name}: {split['n_tokens']:,} tokens, {split['n_documents']:,} documents, "
                               f"{split['n_bytes']:,} bytes of text ("), line
        assert line.endswith(f"{len(split['files'])} files")
    assert len(out) == 1 + len(manifest["splits"])


@pytest.mark.parametrize("seconds,text", [(0.42, "0.4 s"), (42.4, "42 s"), (185, "3 min 05 s"),
                                          (7620, "2 h 07 min")])
def test_durations_read_as_time(seconds, text):
    assert report.duration_text(seconds) == text
