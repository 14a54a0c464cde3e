"""What the entry points other than training do when the disk they write to fills up or turns read-only in the
middle of their work: one `error:` line naming the file and what to do, exit status 1 (a fault, not a
refusal), nothing half-written that looks finished, and a rerun that works once the disk has room.

Found on a real 20 MiB tmpfs filled to the last byte (these tests cannot mount one: CI may not be root), and
simulated here the way each failure really arrives: safetensors' Rust writer reports a full disk as a
SafetensorError (not an OSError), shutil.copyfile's ENOSPC names the source file first, os.write of the
replay's delivery record names no file, and stdout redirected to a full disk is /dev/full.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from dist_helpers import run_ranks, sentencepiece_corpus, tiny_config
from txl_dist.data import read_manifest
from txl_dist.errors import EXIT_FAILED
from txl_dist.write_faults import mount_point, write_fault_line

# What safetensors 0.4 raises when its file cannot be written (seen on a full tmpfs).
SAFETENSORS_FULL_DISK = "Error while serializing: I/O error: No space left on device (os error 28)"

WORDS = "the king queen crown sword night day love war peace lord lady speak hear gentle noble".split()


def _train_main(argv):
    from launch.train import main

    return main(argv)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A corpus with a real SentencePiece model and a run trained on it for 2 steps, with a local MLflow store."""
    root = tmp_path_factory.mktemp("full-disk")
    corpus = sentencepiece_corpus(root, WORDS, (6, 1, 1))
    config = root / "config.json"
    config.write_text(json.dumps(tiny_config(corpus, root / "run", train={"max_steps": 2}, eval={"at_end": False},
                                             tracking={"enabled": True})))
    assert run_ranks(_train_main, 1, ["--config", str(config)]) == [0]
    return corpus, root / "run"


def one_error_line(capfd, caplog) -> str:
    """The one `error:` line the command printed (its own stderr, or the txl_dist logger's), and no traceback."""
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    lines += [r.getMessage() for r in caplog.records if r.getMessage().startswith("error: ")]
    caplog.clear()
    assert len(lines) == 1, lines
    return lines[0]


@contextlib.contextmanager
def stdout_on_a_full_disk():
    """sys.stdout redirected to a full disk, as `> out.json` there: every write fails with ENOSPC."""
    full = open("/dev/full", "w")
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(sys, "stdout", full)
            yield
    finally:
        with contextlib.suppress(OSError):  # closing flushes what the failed writes left in its buffer
            full.close()


# ----------------------------------------------------------------------------------------------------
# launch/export.py


def safetensors_disk_full(*args, **kwargs):
    from safetensors import SafetensorError

    raise SafetensorError(SAFETENSORS_FULL_DISK)


def test_export_onto_a_full_disk_is_one_line_exit_1_and_a_rerun_works(trained, tmp_path, monkeypatch, capfd, caplog):
    import txl_dist.interop.native as native
    from launch.export import main

    _, run = trained
    out = tmp_path / "exported"
    with monkeypatch.context() as m:
        m.setattr(native, "save_file", safetensors_disk_full)
        assert main(["--checkpoint", str(run), "--out", str(out)]) == EXIT_FAILED
    line = one_error_line(capfd, caplog)
    assert line.startswith(f"error: export failed: {out / 'model.safetensors'}: [Errno 28] No space left on device; "
                           f"free space on {mount_point(out)}"), line
    assert line.endswith(f"{out} hold(s) no complete export (no config), run the export again"), line
    assert sorted(p.name for p in out.iterdir()) == []  # no temporary left, nothing that looks finished
    assert main(["--checkpoint", str(run), "--out", str(out)]) == 0  # space freed: the same command works
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "model_config.json", "tokenizer.model"]


def test_an_export_that_fails_after_the_weights_leaves_no_old_config_beside_them(trained, tmp_path, monkeypatch,
                                                                                 capfd, caplog):
    """Over a former export, new weights written and then the config's write failing left the old config beside
    the new weights: a folder that loaded as a finished model, with the former export's settings."""
    import txl_dist.interop.native as native
    from launch.export import main

    _, run = trained
    out = tmp_path / "exported"
    assert main(["--checkpoint", str(run), "--out", str(out)]) == 0
    real_write = native.atomic_write

    def config_disk_full(path, data):
        if Path(path).name == native.MODEL_CONFIG_NAME:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_write(path, data)

    with monkeypatch.context() as m:
        m.setattr(native, "atomic_write", config_disk_full)
        assert main(["--checkpoint", str(run), "--out", str(out)]) == EXIT_FAILED
    assert "model_config.json: [Errno 28]" in one_error_line(capfd, caplog)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]  # not loadable as a finished export
    assert main(["--checkpoint", str(run), "--out", str(out)]) == 0  # no --overwrite needed
    assert (out / "model_config.json").is_file()


def test_an_export_that_fails_with_any_error_leaves_no_config_in_the_folder_it_did_not_finish(trained, tmp_path,
                                                                                             monkeypatch):
    """Found by raising an error at a random call of launch/export.py: only an OSError or a stop signal removed the
    config of the folder being written. An error in the HuggingFace folder's tokenizer write (after its weights and
    config.json) left a folder that looked finished without its tokenizer."""
    import launch.export as export

    _, run = trained
    out, hf = tmp_path / "native", tmp_path / "hf"
    real_write = export.atomic_write

    def tokenizer_write_fails_in_hf(path, data):
        if Path(path).parent == hf:
            raise RuntimeError("a bug")
        return real_write(path, data)

    with monkeypatch.context() as m:
        m.setattr(export, "atomic_write", tokenizer_write_fails_in_hf)
        with pytest.raises(RuntimeError, match="a bug"):
            export.main(["--checkpoint", str(run), "--out", str(out), "--hf", str(hf)])
    assert sorted(p.name for p in hf.iterdir()) == ["model.safetensors"]  # no config.json: not an export
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "model_config.json", "tokenizer.model"]
    assert export.main(["--checkpoint", str(run), "--out", str(out), "--hf", str(hf)]) == 0  # no --overwrite needed
    assert sorted(p.name for p in hf.iterdir()) == ["config.json", "model.safetensors", "tokenizer.model"]


def test_export_with_stdout_on_a_full_disk_still_succeeds(trained, tmp_path, monkeypatch, capfd):
    from launch.export import main

    _, run = trained
    with stdout_on_a_full_disk():
        assert main(["--checkpoint", str(run), "--out", str(tmp_path / "e")]) == 0  # the folder is the result
    assert (tmp_path / "e" / "model_config.json").is_file()
    assert "Traceback" not in capfd.readouterr().err


# ----------------------------------------------------------------------------------------------------
# python -m txl_dist.interop


@pytest.mark.parametrize("command, writer", [("to-hf", "txl_dist.interop.hf_files.save_file"),
                                             ("from-hf", "txl_dist.interop.native.save_file")])
def test_interop_onto_a_full_disk_is_one_line_exit_1(trained, tmp_path, monkeypatch, capfd, caplog, command,
                                                     writer):
    from launch.export import main as export
    from txl_dist.interop.__main__ import main

    _, run = trained
    assert export(["--checkpoint", str(run), "--out", str(tmp_path / "native"), "--hf", str(tmp_path / "hf")]) == 0
    capfd.readouterr()
    src = tmp_path / ("native" if command == "to-hf" else "hf")
    out = tmp_path / "converted"
    with monkeypatch.context() as m:
        m.setattr(writer, safetensors_disk_full)
        with pytest.raises(SystemExit) as exit_info:
            main([command, str(src), str(out)])
    assert exit_info.value.code == EXIT_FAILED
    line = one_error_line(capfd, caplog)
    assert line == (f"error: writing {out} failed: {out / 'model.safetensors'}: [Errno 28] No space left on device; "
                    f"free space on {mount_point(out)} or choose another OUT_DIR"), line
    assert list(out.iterdir()) == []
    assert main([command, str(src), str(out)]) == 0


@pytest.mark.parametrize("command", ["to-hf", "from-hf"])
def test_a_conversion_that_fails_with_any_error_leaves_no_config(trained, tmp_path, monkeypatch, command):
    """Only an OSError removed the new config when the tokenizer's write after it failed: a Ctrl-C or an error of
    the process there left a folder that looked finished without its tokenizer."""
    import txl_dist.interop.__main__ as interop
    from launch.export import main as export

    _, run = trained
    assert export(["--checkpoint", str(run), "--out", str(tmp_path / "native"), "--hf", str(tmp_path / "hf")]) == 0
    src = tmp_path / ("native" if command == "to-hf" else "hf")
    out = tmp_path / "converted"
    real_write = interop.atomic_write

    def tokenizer_write_fails(path, data):
        if Path(path).name == interop.TOKENIZER_NAME:
            raise KeyboardInterrupt
        return real_write(path, data)

    with monkeypatch.context() as m:
        m.setattr(interop, "atomic_write", tokenizer_write_fails)
        with pytest.raises(KeyboardInterrupt):
            interop.main([command, str(src), str(out)])
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert interop.main([command, str(src), str(out)]) == 0
    assert len(list(out.iterdir())) == 3


# ----------------------------------------------------------------------------------------------------
# launch/generate.py (and launch/eval.py: print_result) with stdout redirected to a full disk


def test_generate_with_stdout_on_a_full_disk_is_one_line_exit_1(trained, monkeypatch, capfd, caplog):
    from launch.generate import main

    _, run = trained
    with stdout_on_a_full_disk():
        assert main(["--checkpoint", str(run), "--prompt", "The king", "--max-new-tokens", "3", "--json"]) == 1
    assert one_error_line(capfd, caplog) == (
        "error: the standard output cannot be written ([Errno 28] No space left on device): the file it is "
        "redirected to is on a full or read-only file system; free space there, or redirect it elsewhere, and run "
        "again")


# ----------------------------------------------------------------------------------------------------
# python -m txl_dist.tracking replay


def test_replay_onto_a_full_run_dir_is_one_line_exit_1_and_a_rerun_sends_the_rest(trained, tmp_path, monkeypatch,
                                                                                   capfd, caplog):
    from txl_dist.tracking import journal
    from txl_dist.tracking.__main__ import main

    _, trained_run = trained
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    tracking = run / "tracking"
    (tracking / "uri").write_text(f"sqlite:///{run / 'mlflow.db'}\n")
    (tracking / "delivered.jsonl").unlink()  # nothing recorded as sent: replay has the whole journal to send

    def disk_full(self, seqs):  # as os.write fails: an OSError that names no file
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as m:
        m.setattr(journal._DeliveryLog, "record", disk_full)
        assert main(["replay", str(run)]) == EXIT_FAILED
    line = one_error_line(capfd, caplog)
    assert line.startswith(f"error: replay stopped after 0 metric values: {tracking / 'delivered.jsonl'}: [Errno 28] "
                           f"No space left on device; free space on {mount_point(run)} or move the run dir"), line
    assert main(["replay", str(run)]) == 0
    assert "replay: sent " in capfd.readouterr().out
    assert main(["replay", str(run)]) == 0
    assert "replay: sent 0 metric values" in capfd.readouterr().out


# ----------------------------------------------------------------------------------------------------
# python -m data_prep: a copy that fails names the file being written, not the one copied


def test_a_failed_copy_names_its_destination_not_its_source(tmp_path):
    error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    error.filename, error.filename2 = "/elsewhere/shards/tokenizer.model", str(tmp_path / "out" / "tokenizer.model")
    assert write_fault_line(error, tmp_path, "choose another --out") == (
        f"{tmp_path / 'out' / 'tokenizer.model'}: [Errno 28] No space left on device; free space on "
        f"{mount_point(tmp_path)} or choose another --out")


def test_prepare_whose_tokenizer_copy_fails_names_the_output(trained, tmp_path, monkeypatch, capsys):
    """shutil.copyfile's ENOSPC names the source first: finalize and prepare --tokenizer-model said "free space
    on <the source's file system>", another disk than the full one."""
    from data_prep.cli import main

    corpus, _ = trained

    def sendfile_disk_full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shutil, "_USE_CP_SENDFILE", True)
    monkeypatch.setattr(os, "sendfile", sendfile_disk_full)
    out = tmp_path / "out"
    raw = corpus.parent / "raw" / "train" / "00.txt"
    argv = ["prepare", "--out", str(out), "--train", str(raw), "--tokenizer-model", str(corpus / "tokenizer.model"),
            "--num-proc", "1", "--quiet", "--no-space-check"]
    assert main(argv) == EXIT_FAILED
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {tmp_path}/.out.tmp-"), err
    assert err[0].endswith(f"tokenizer.model: [Errno 28] No space left on device; free space on "
                           f"{mount_point(tmp_path)} or choose another --out"), err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("failure", ["stdout on a full disk", "an error in the summary", "Ctrl-C in the summary"])
def test_a_failure_after_the_corpus_is_complete_is_a_warning_and_the_corpus_stays(trained, tmp_path, monkeypatch,
                                                                                   capsys, failure):
    """Found by raising an error at a random call of prepare (bench/entry_fault_probe.py): the closing summary reads
    the finished corpus back, and an error there ended the job with exit 1 (a Ctrl-C: "interrupted; nothing was
    written") beside the complete corpus, which the same command then refused as existing."""
    import data_prep.report as report
    from data_prep.cli import main

    corpus, _ = trained
    out = tmp_path / "out"
    argv = ["prepare", "--out", str(out), "--train", str(corpus.parent / "raw" / "train" / "00.txt"),
            "--tokenizer-model", str(corpus / "tokenizer.model"), "--num-proc", "1", "--quiet"]
    if failure == "stdout on a full disk":
        with stdout_on_a_full_disk():
            assert main(argv) == 0
        said = "the standard output cannot be written ([Errno 28] No space left on device)"
    else:
        def summary_fails(*args, **kwargs):
            raise RuntimeError("a bug") if failure == "an error in the summary" else KeyboardInterrupt

        monkeypatch.setattr(report, "written_summary", summary_fails)
        assert main(argv) == 0
        said = "RuntimeError: a bug" if failure == "an error in the summary" else "KeyboardInterrupt"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"warning: wrote {out} (complete); its report could not be printed: "), err
    assert said in err[0], err
    assert read_manifest(out).splits["train"].n_tokens > 0
