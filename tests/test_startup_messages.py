"""Start-up (txl_dist/startup.py) beyond the refusal table's cases (tests/test_refusals.py): the advice of a corpus
refusal, and what the run's log file holds of the start."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from dist_helpers import learnable_corpus, run_ranks, tiny_config
from txl_dist.config import config_from_dict
from txl_dist.data import CorpusError
from txl_dist.startup import read_data_path


def test_a_data_path_under_a_tilde_is_refused_with_the_path_a_shell_would_mean(tmp_path, monkeypatch):
    """`~` is not expanded in a config: the refusal says so, instead of advising `prepare --out ~/corpus`, which a
    shell expands to another folder than the one the next start looks for."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    cfg = config_from_dict(tiny_config("~/corpus", tmp_path / "run"))
    with pytest.raises(CorpusError) as refused:
        read_data_path(cfg)
    assert str(refused.value) == ("data.path: ~/corpus does not exist: a ~ is not expanded in data.path (it names a "
                                  f"folder called ~ here); write the full path, e.g. --set data.path="
                                  f"{os.path.join(tmp_path, 'home', 'corpus')}")


def _start_with_a_log_file(raw: dict) -> str:
    """One training start with the run's log file (as launch/train.py's rank 0); the log file's text."""
    from txl_dist import distributed
    from txl_dist.run_dir import detach_log_file
    from txl_dist.startup import start_training

    env = distributed.discover()
    distributed.setup_logging(env)
    distributed.init_process_group(env)
    try:
        start = start_training(config_from_dict(raw), env, "auto", log_file=True)
        start.tracker.close()
        start.close()
    finally:
        detach_log_file(logging.getLogger(distributed.LOGGER_NAME))
        distributed.destroy_process_group()
    return (Path(raw["run"]["dir"]) / "logs" / "train.log").read_text()


def test_the_run_log_has_the_corpus_lines_of_the_start(tmp_path):
    """What start-up says of the corpus (its hashing, the advice to relayout) is in logs/train.log too: a batch
    job's user reads that file."""
    corpus = learnable_corpus(tmp_path / "corpus", 4 * 97)
    log_text = run_ranks(_start_with_a_log_file, 1, tiny_config(corpus, tmp_path / "run"))[0]
    assert "corpus: 7 file(s) verified by sha256, 0 unchanged since an earlier start of this run" in log_text
