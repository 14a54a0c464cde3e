"""Config files and the paths a run's config records.

A config file is read strictly (a duplicate key or a file that is not a regular one is refused; their table
cases are in docs/refusals.md), and the config a run writes (config.resolved.json, each checkpoint's run.json)
names its corpus by an absolute path: launch/eval.py, generate.py and export.py read data.path from it in
whatever folder they run.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from dist_helpers import learnable_stream, run_ranks, tiny_config, write_corpus
from txl_dist.config import ConfigError, read_json_object

VOCAB = 64


# ----------------------------------------------------------------------------------------------------
# Reading a config file


@pytest.mark.parametrize("text, key", [
    ('{"train": {"max_steps": 600, "max_steps": 2}}', "train.max_steps"),
    ('{"model": {"d_model": 32}, "model": {"d_model": 64}}', "model"),
    ('{"deepspeed": {"optimizer": {"params": {"lr": 1, "lr": 2}}}}', "deepspeed.optimizer.params.lr"),
    ('{"x": [{"a": 1}, {"b": 1, "b": 2}]}', "x[1].b"),
], ids=["train", "section", "nested", "in-a-list"])
def test_a_duplicate_key_is_refused_naming_its_path(tmp_path, text, key):
    path = tmp_path / "c.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as refused:
        read_json_object(path, label=f"config file {path}")
    assert str(refused.value) == (f"config file {path}: key '{key}' appears more than once (JSON would keep the "
                                  "last silently); keep one")


def test_the_same_key_in_two_objects_is_no_duplicate(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"model": {"dropout": 0.1}, "train": {"dropout": 0.2}}')
    assert read_json_object(path) == {"model": {"dropout": 0.1}, "train": {"dropout": 0.2}}


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)  # nobody writes: opening it to read would wait forever
    with pytest.raises(ConfigError, match=r"is a pipe or FIFO, not a regular file; write the JSON to a file"):
        read_json_object(fifo, label=f"config file {fifo}")


def test_a_symlink_to_a_config_file_is_read(tmp_path):
    (tmp_path / "real.json").write_text('{"train": {"max_steps": 2}}')
    (tmp_path / "link.json").symlink_to(tmp_path / "real.json")
    assert read_json_object(tmp_path / "link.json") == {"train": {"max_steps": 2}}


# ----------------------------------------------------------------------------------------------------
# data.path is recorded absolute


def _train_in(cwd: str, argv: list[str]) -> int:
    os.chdir(cwd)
    from launch.train import main

    return main(argv)


def _eval_in(cwd: str, argv: list[str]) -> int:
    os.chdir(cwd)
    from launch.eval import main

    return main(argv)


def _corpus(root: Path) -> Path:
    return write_corpus(root, {"train": learnable_stream(4 * 97, VOCAB, 0), "valid": learnable_stream(80, VOCAB, 1),
                               "test": learnable_stream(80, VOCAB, 2)}, vocab_size=VOCAB)


def test_a_relative_data_path_is_recorded_absolute_and_evaluates_from_elsewhere(tmp_path):
    """Trained in work/ with data.path c1: the run's config and its checkpoint name work/c1, so an evaluation
    started in another folder finds the corpus (it refused with `c1: corpus folder does not exist`, whose
    advice would prepare a new corpus with another tokenizer); --set data.path=... still overrides it, relative
    to the evaluation's folder."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    elsewhere.mkdir()
    _corpus(work / "c1")
    raw = tiny_config(Path("c1"), Path("run"), train={"max_steps": 1}, checkpoint={"interval": 1},
                      eval={"at_end": False})
    (work / "config.json").write_text(json.dumps(raw))
    assert run_ranks(_train_in, 1, str(work), ["--config", "config.json"]) == [0]

    corpus = str(work / "c1")
    assert json.loads((work / "run" / "config.resolved.json").read_text())["data"]["path"] == corpus
    run_info = json.loads((work / "run" / "checkpoints" / "step_00000001" / "txl_state" / "run.json").read_text())
    assert run_info["config"]["data"]["path"] == corpus
    assert run_info["config"]["run"]["dir"] == "run"  # as given: nothing reads it back from a checkpoint

    argv = ["--checkpoint", str(work / "run"), "--split", "valid"]
    assert run_ranks(_eval_in, 1, str(elsewhere), [*argv, "--json-out", "own.json"]) == [0]
    shutil.copytree(work / "c1", elsewhere / "c2")  # the same tokens, another folder: named relative to elsewhere
    assert run_ranks(_eval_in, 1, str(elsewhere), [*argv, "--json-out", "c2.json", "--set", "data.path=c2"]) == [0]
    own, other = (json.loads((elsewhere / name).read_text()) for name in ("own.json", "c2.json"))
    assert own["loss"] == other["loss"] and own["tokens"] == other["tokens"] > 0
