"""launch/export.py's output folders: a new or empty folder, or a former export of ours (native: its
model_config.json; HuggingFace: a config.json that records tokenizer_sha256), is written over; a folder holding
anything else (a model of elsewhere, the user's files) is refused with one line before the checkpoint is read,
unless --overwrite. The export of a real checkpoint over a former one is tested in tests/test_generation.py."""
from __future__ import annotations

import json
import logging

import pytest

from txl_dist.errors import EXIT_REFUSED

SHA = "ab" * 32


def _export(argv, caplog) -> tuple[int, list[str]]:
    from launch.export import main

    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="txl_dist"):
        status = main([str(a) for a in argv])
    return status, [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def _snapshot(root):
    return {p.relative_to(root): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("kind, files", [
    ("--out", {"notes.txt": "mine"}),
    ("--out", {"tokenizer.model": "a user's tokenizer"}),               # no model_config.json: not ours
    ("--hf", {"config.json": json.dumps({"model_type": "transfo-xl"}), "model.safetensors": "weights"}),
    ("--hf", {"config.json": "not JSON", "pytorch_model.bin": "weights"}),
    ("--hf", {"model_config.json": "{}"}),                              # a native folder is no HF export
])
def test_a_folder_holding_other_files_than_a_former_export_is_refused_before_the_checkpoint(tmp_path, caplog, kind,
                                                                                           files):
    folder = tmp_path / "given"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    before = _snapshot(tmp_path)
    argv = ["--checkpoint", tmp_path / "nowhere", "--out", tmp_path / "native"] + (["--hf", folder] if kind == "--hf"
                                                                                    else [])
    if kind == "--out":
        argv[3] = folder
    status, errors = _export(argv, caplog)
    assert status == EXIT_REFUSED
    shown = ", ".join(sorted(files))
    assert errors == [f"error: {kind} {folder}: holds files that are not those of a former export ({shown}); the "
                      "export would replace them or leave them beside its weights: choose a new or empty folder, or "
                      "pass --overwrite to write into it"]
    assert _snapshot(tmp_path) == before  # nothing written
    # --overwrite lets the output through: the export goes on to the checkpoint (which does not exist here).
    status, errors = _export(argv + ["--overwrite"], caplog)
    assert status == EXIT_REFUSED and len(errors) == 1 and "nowhere does not exist" in errors[0], errors
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("kind, files", [
    ("--out", {}),                                                      # empty
    ("--out", {"model_config.json": "{}", "model.safetensors": "w", "tokenizer.model": "t", "README": "x"}),
    ("--out", {"model.safetensors": "w", ".model_config.json.abc.tmp": ""}),  # an export stopped midway
    ("--hf", {"config.json": json.dumps({"tokenizer_sha256": SHA}), "model.safetensors": "w", "tokenizer.model": "t"}),
    ("--hf", {".txl-probe-x": ""}),
])
def test_a_new_empty_or_former_export_folder_is_accepted(tmp_path, caplog, kind, files):
    folder = tmp_path / "given"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    out = folder if kind == "--out" else tmp_path / "native"
    argv = ["--checkpoint", tmp_path / "nowhere", "--out", out] + (["--hf", folder] if kind == "--hf" else [])
    status, errors = _export(argv, caplog)
    assert status == EXIT_REFUSED and len(errors) == 1 and "nowhere does not exist" in errors[0], errors


def test_foreign_files_lists_what_is_not_an_export(tmp_path):
    from launch.export import foreign_files

    assert foreign_files(tmp_path / "missing", native=True) == []
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "transfo-xl"}))
    (tmp_path / "pytorch_model.bin").write_text("w")
    assert foreign_files(tmp_path, native=False) == ["config.json", "pytorch_model.bin"]
    assert foreign_files(tmp_path, native=True) == ["config.json", "pytorch_model.bin"]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "transfo-xl", "tokenizer_sha256": SHA}))
    assert foreign_files(tmp_path, native=False) == []


@pytest.mark.parametrize("corpus_readable", [True, False])
def test_export_records_the_eod_id_and_to_hf_of_its_folder_writes_eos_token_id(tmp_path, monkeypatch, caplog,
                                                                               corpus_readable):
    """The native folder records the corpus' end-of-document id (eod_id in model_config.json) beside the tokenizer's
    digest, so that `python -m txl_dist.interop to-hf` of it writes the eos_token_id export --hf writes; where
    export cannot read the corpus, neither folder has it (export warns, and so does a later to-hf).
    The checkpoint is stood in for (its reading is tested in tests/test_generation.py)."""
    import launch.export as export_module
    from txl_dist.interop.__main__ import main as interop

    sha = _stand_in_checkpoint(tmp_path, monkeypatch, corpus_readable)
    native, hf = tmp_path / "native", tmp_path / "hf"
    export_module.export("run", str(native), str(hf))
    recorded = json.loads((native / "model_config.json").read_text())
    assert recorded["tokenizer_sha256"] == sha
    assert recorded.get("eod_id") == (5 if corpus_readable else None)
    assert json.loads((hf / "config.json").read_text()).get("eos_token_id") == (5 if corpus_readable else None)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="txl_dist"):
        assert interop(["to-hf", str(native), str(tmp_path / "hf2")]) == 0
    assert json.loads((tmp_path / "hf2" / "config.json").read_text()) == json.loads((hf / "config.json").read_text())
    assert (tmp_path / "hf2" / "tokenizer.model").exists() == corpus_readable
    warnings = [r.getMessage() for r in caplog.records]
    if corpus_readable:
        assert warnings == []
    else:
        assert len(warnings) == 1 and warnings[0].startswith("to-hf: no eos_token_id"), warnings


def _stand_in_checkpoint(tmp_path, monkeypatch, corpus_readable: bool = True, attn_impl: str = "auto") -> str:
    """launch/export.py reads a stand-in checkpoint of a tiny model whose corpus has a tokenizer, or one it cannot
    read (its reading of a real one is tested in tests/test_generation.py); the tokenizer's sha256."""
    import contextlib
    import hashlib

    import launch.export as export_module
    import txl_dist.checkpoint
    import txl_dist.startup
    from txl_dist.config import ModelConfig

    cfg = ModelConfig(vocab_size=53, n_layer=1, d_model=16, n_head=2, d_head=8, d_inner=24, tgt_len=5, mem_len=4,
                      attn_impl=attn_impl)
    sha = hashlib.sha256(b"tokenizer").hexdigest()
    run_info = {"tokenizer_sha256": sha, "zero_stage": 0, "config": {"data": {"path": str(tmp_path / "corpus")}}}
    monkeypatch.setattr(txl_dist.startup, "open_export",
                        contextlib.contextmanager(lambda path: iter([(tmp_path / "tag", run_info, cfg)])))
    monkeypatch.setattr(txl_dist.checkpoint, "load_fp32_weights", lambda model, tag_dir, zero_stage: None)
    monkeypatch.setattr(export_module, "training_tokenizer",
                        lambda corpus, sha, hf: (5, b"tokenizer") if corpus_readable else None)
    return sha


@pytest.mark.parametrize("trained_with", ["triton", "flex", "sdpa"])
def test_an_exported_folder_runs_on_the_cpu_whatever_attention_the_run_trained_with(tmp_path, monkeypatch,
                                                                                       trained_with):
    """The folder recorded the run's attn_impl: one trained with 'triton' (CUDA only) loaded as a model whose
    forward on a CPU raised. The path changes speed, not the weights: the folder records "auto"."""
    import torch

    import launch.export as export_module
    from txl_dist.interop import load_native

    _stand_in_checkpoint(tmp_path, monkeypatch, attn_impl=trained_with)
    export_module.export("run", str(tmp_path / "native"))
    assert json.loads((tmp_path / "native" / "model_config.json").read_text())["attn_impl"] == "auto"
    model = load_native(tmp_path / "native").eval()
    with torch.no_grad():
        ids = torch.zeros(2, 5, dtype=torch.long)
        assert torch.isfinite(model(ids, labels=ids).nll).all()


@pytest.mark.parametrize("nesting, failing", [
    ("hf-holds-out", "to_hf"),        # --out X/native --hf X: the native folder done, the HF one failed
    ("hf-holds-out", "save_native"),  # X's former config removed first, then the native one failed
    ("out-holds-hf", "save_native"),  # --out X --hf X/hf
])
def test_an_export_into_nested_folders_that_failed_runs_again_without_overwrite(tmp_path, monkeypatch, caplog,
                                                                                nesting, failing):
    """An export that failed midway says 'run the export again': with one folder nested in the other, the outer
    one (its config removed) holds the inner folder, which is the export's own, not a file of the user's (it
    was refused as one, so that the export ran again only with --overwrite)."""
    import errno

    import txl_dist.interop

    _stand_in_checkpoint(tmp_path, monkeypatch)
    outer = tmp_path / "X"
    out, hf = (outer / "native", outer) if nesting == "hf-holds-out" else (outer, outer / "hf")
    argv = ["--checkpoint", "run", "--out", out, "--hf", hf]
    assert _export(argv, caplog) == (0, [])  # a former export, then one that fails over it (a full disk)
    real = getattr(txl_dist.interop, failing)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(txl_dist.interop, failing, disk_full)
    status, errors = _export(argv, caplog)
    assert status == 1 and len(errors) == 1 and errors[0].endswith("run the export again"), errors
    assert not (outer / ("model_config.json" if outer == out else "config.json")).exists()
    monkeypatch.setattr(txl_dist.interop, failing, real)
    (outer / "notes.txt").write_text("mine")  # a file of the user's beside the inner folder is still refused
    status, errors = _export(argv, caplog)
    assert status == EXIT_REFUSED and len(errors) == 1, errors
    listed = errors[0].split("holds files that are not those of a former export (")[1].split(")")[0].split(", ")
    assert "notes.txt" in listed and "native" not in listed and "hf" not in listed, listed
    (outer / "notes.txt").unlink()
    assert _export(argv, caplog) == (0, [])
    assert (out / "model_config.json").is_file() and (hf / "config.json").is_file()
