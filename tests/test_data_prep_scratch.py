"""data_prep/atomic.py and txl_dist/scratch.py: a job's hidden scratch folders are owned (flock) and a killed job's are removed by the
next job for the same output, never a live job's. Real processes, really killed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from data_prep.atomic import OWNER_LOCK, atomic_dir, owned_scratch, remove_abandoned

REPO = Path(__file__).resolve().parents[1]

HOLDER = """
import sys, time
from pathlib import Path
from data_prep.atomic import owned_scratch
with owned_scratch(Path(sys.argv[1]), sys.argv[2]) as folder:
    (folder / "part-0.arrow").write_bytes(b"x" * 4096)
    print(folder, flush=True)
    time.sleep(600)
"""


def start_holder(out: Path, kind: str) -> tuple[subprocess.Popen, Path]:
    """A process that owns a scratch folder of `out` and waits (to be killed)."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(out), kind], stdout=subprocess.PIPE, text=True,
                            env=env)
    folder = Path(proc.stdout.readline().strip())
    assert folder.is_dir() and folder.name.startswith(f".{out.name}.{kind}-")
    return proc, folder


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)


@pytest.mark.parametrize("kind", ["tmp", "scan"])
def test_a_killed_jobs_folder_is_removed_by_the_next_job(tmp_path, kind, capsys):
    out = tmp_path / "corpus"
    proc, folder = start_holder(out, kind)
    kill(proc)
    assert folder.is_dir()  # SIGKILL: nothing cleaned up
    with atomic_dir(out) as work:
        (work / "manifest.json").write_text("{}")
    assert not folder.exists()
    assert f"removed {folder}: left by a job for corpus that was killed" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"]  # no lock file in the output


def test_a_live_jobs_folder_is_kept(tmp_path):
    out = tmp_path / "corpus"
    proc, folder = start_holder(out, "tmp")
    try:
        assert remove_abandoned(out) == []
        with owned_scratch(out, "scan") as mine:
            assert folder.is_dir() and mine.is_dir()
        assert folder.is_dir() and (folder / "part-0.arrow").is_file()
    finally:
        kill(proc)
    assert remove_abandoned(out) == [folder] and not folder.exists()


def test_own_folders_survive_a_nested_job(tmp_path):
    """mix holds a scan folder while its atomic_dir starts: the cleanup must not take this process's own."""
    out = tmp_path / "mixture"
    with owned_scratch(out, "scan") as scan:
        (scan / "stops.bin").write_bytes(b"\0" * 64)
        with atomic_dir(out) as work:
            assert scan.is_dir() and work.is_dir()
        assert (scan / "stops.bin").is_file()
    assert not scan.exists()


def test_folders_without_an_owner_file_are_left_alone(tmp_path):
    """An older version's folder, or one between mkdtemp and its lock: not ours to judge."""
    out = tmp_path / "corpus"
    other = tmp_path / ".corpus.tmp-legacy"
    other.mkdir()
    unrelated = tmp_path / ".corpus2.tmp-x"
    unrelated.mkdir()
    (unrelated / OWNER_LOCK).write_text("")
    assert remove_abandoned(out) == []
    assert other.is_dir() and unrelated.is_dir()


@pytest.mark.parametrize("swap", [True, False])
def test_overwrite_replaces_the_output_whole(tmp_path, monkeypatch, swap):
    """--overwrite: the new output replaces the old in one step where renameat2 can swap them, else in two
    renames; either way nothing but the new output is left."""
    import data_prep.atomic as atomic

    if not swap:
        monkeypatch.setattr(atomic, "exchange", lambda a, b: False)
    out = tmp_path / "corpus"
    out.mkdir()
    (out / "old.arrow").write_text("old")
    with atomic_dir(out, overwrite=True) as work:
        (work / "new.arrow").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]
    assert sorted(p.name for p in out.iterdir()) == ["new.arrow"]


def test_exchange_swaps_or_declines(tmp_path):
    from data_prep.atomic import exchange

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "from_a").touch()
    if exchange(a, b):
        assert [p.name for p in b.iterdir()] == ["from_a"] and not any(a.iterdir())
    else:  # this file system cannot: nothing moved
        assert [p.name for p in a.iterdir()] == ["from_a"] and not any(b.iterdir())


SWAPPER = """
import sys, time
from pathlib import Path
import data_prep.atomic as atomic
if sys.argv[2] == "two-renames":
    atomic.exchange = lambda a, b: False
swap = atomic.replace_dir
def swap_then_wait(src, dst):
    swap(src, dst)
    print("swapped", flush=True)
    time.sleep(600)
atomic.replace_dir = swap_then_wait
with atomic.atomic_dir(Path(sys.argv[1]), overwrite=True) as work:
    (work / "new.arrow").write_text("new")
"""


@pytest.mark.parametrize("how", ["exchange", "two-renames"])
def test_a_job_killed_right_after_the_swap_leaves_the_old_output_to_the_next_job(tmp_path, how):
    """The previous output lands inside the killed job's owned scratch folder, so the next job removes it."""
    out = tmp_path / "corpus"
    out.mkdir()
    (out / "old.arrow").write_bytes(b"o" * 4096)
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen([sys.executable, "-c", SWAPPER, str(out), how], stdout=subprocess.PIPE, text=True,
                            env=env)
    assert proc.stdout.readline().strip() == "swapped"
    kill(proc)
    assert sorted(p.name for p in out.iterdir()) == ["new.arrow"]
    [left] = [p for p in tmp_path.iterdir() if p.name != "corpus"]
    assert (left / OWNER_LOCK).is_file() and list(left.rglob("old.arrow"))
    assert remove_abandoned(out) == [left]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


def test_a_scratch_folder_loses_its_lock_file_last(tmp_path, monkeypatch):
    """Killed in the middle of a removal, a scratch folder must still carry its lock file."""
    import shutil

    from txl_dist import scratch

    folder = tmp_path / ".corpus.tmp-x"
    (folder / "output" / "sub").mkdir(parents=True)
    (folder / OWNER_LOCK).write_text("")
    (folder / "a.arrow").write_text("a")
    (folder / "z.arrow").write_text("z")
    removed = []
    rmtree, unlink = shutil.rmtree, Path.unlink

    def record_rmtree(path, *a, **k):
        removed.append(Path(path).name)
        rmtree(path, *a, **k)

    def record_unlink(self, *a, **k):
        removed.append(self.name)
        unlink(self, *a, **k)

    monkeypatch.setattr(shutil, "rmtree", record_rmtree)
    monkeypatch.setattr(Path, "unlink", record_unlink)
    scratch.remove_scratch(folder)
    assert not folder.exists()
    assert removed[-1] == folder.name and OWNER_LOCK not in removed[:-1]
    assert sorted(removed[:-1]) == ["a.arrow", "output", "z.arrow"]


SOURCES_JOB = """
import sys, time
import data_prep.mix as mix
def stop_before_mixing(specs, out, **kwargs):
    print(specs[0].corpus.parent, flush=True)  # the per-source corpora are written: wait to be killed
    time.sleep(600)
mix.mix = stop_before_mixing
from data_prep.cli import main
main(sys.argv[1:])
"""


def test_a_killed_prepare_sources_job_leaves_its_corpora_to_the_next_job(tmp_path, capsys):
    """`prepare --source` keeps its per-source corpora in an owned scratch folder: killed (SIGKILL) after
    preparing them, it leaves them behind, and the next job for the same output removes them."""
    from corpus_helpers import tricky_text
    from data_prep.cli import main
    from data_prep.tokenizer import TrainerOptions, train_tokenizer, training_sentences

    for name, seeds in (("a", range(10)), ("b", range(100, 110))):  # two texts: one text twice is refused by mix
        (tmp_path / name).mkdir()
        for k in seeds:
            (tmp_path / name / f"{k}.txt").write_text(tricky_text(100, seed=k), encoding="utf-8")
    model = train_tokenizer(training_sentences(tricky_text(100, seed=k) for k in range(10)), tmp_path / "tok.model",
                            TrainerOptions(vocab_size=400, model_type="bpe"))
    out = tmp_path / "mixture"
    argv = ["prepare", "--out", str(out), "--source", f"a={tmp_path / 'a'}/*.txt:1", "--source",
            f"b={tmp_path / 'b'}/*.txt:2", "--valid-fraction", "0.2", "--tokenizer-model", str(model),
            "--num-proc", "1", "--quiet"]
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen([sys.executable, "-c", SOURCES_JOB, *argv], stdout=subprocess.PIPE, text=True, env=env)
    work = Path(proc.stdout.readline().strip())
    kill(proc)
    assert work.parent == tmp_path and work.name.startswith(".mixture.sources-")
    assert (work / "a" / "manifest.json").is_file() and (work / "b" / "manifest.json").is_file()
    assert main(argv) == 0
    assert not work.exists()
    assert f"removed {work}: left by a job for mixture that was killed" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "mixture", "tok.model"]


TOKENIZING_JOB = """
import sys, time
import data_prep.encode as encode
def stop_while_tokenizing(self, batches, sink):
    print("tokenizing", flush=True)  # the work folder holds the token stream being written: wait to be killed
    time.sleep(600)
encode.Encoder.run = stop_while_tokenizing
from data_prep.cli import main
main(sys.argv[1:])
"""


def test_a_killed_prepare_leaves_its_work_dir_folder_to_the_next_job(tmp_path, capsys):
    """With --work-dir the token stream (as large as the corpus) is written there: a killed job's folder stayed
    for good, a rerun making a new one beside it. Now the next job for the same output removes it."""
    from corpus_helpers import small_bpe_tokenizer, tricky_text
    from data_prep.cli import main

    model = small_bpe_tokenizer(tmp_path)
    raw = tmp_path / "raw.txt"
    raw.write_text(tricky_text(300, seed=1).replace("\r", ""), encoding="utf-8")
    work_dir, out = tmp_path / "work", tmp_path / "corpus"
    argv = ["prepare", "--out", str(out), "--train", str(raw), "--tokenizer-model", str(model), "--num-proc", "1",
            "--work-dir", str(work_dir), "--quiet"]
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen([sys.executable, "-c", TOKENIZING_JOB, *argv], stdout=subprocess.PIPE, text=True,
                            env=env)
    assert proc.stdout.readline().strip() == "tokenizing"
    kill(proc)
    (left,) = list(work_dir.iterdir())
    assert (left / "shard-00000-of-00001").is_dir()
    assert main(argv) == 0
    assert list(work_dir.iterdir()) == []
    assert f"removed {left}: left by a job for corpus that was killed" in capsys.readouterr().err
