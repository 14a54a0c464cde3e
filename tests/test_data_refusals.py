"""Bad corpus input is refused with one line (CorpusError, a Refused) that names the file or the split, never a
traceback: paths in the manifest that could leave the corpus folder, and damaged, missing or too-short data
met by StreamLoader (train), Evaluator (eval streams) and verify_corpus."""
from __future__ import annotations

import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from corpus_helpers import edit_manifest, flip_bytes, make_corpus, synthetic_stream

from txl_dist.config import EvalConfig
from txl_dist.data import CorpusError, Layout, StreamLoader, read_manifest, verify_corpus
from txl_dist.errors import Refused
from txl_dist.evaluate import Evaluator

N_STREAMS, TGT_LEN = 8, 10
BATCH_TOKENS = 48  # record batch size of the corpus files (a damaged null count is found by it)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """train: ~125 tokens per stream; empty: 0 tokens; short: fewer than N_STREAMS * (TGT_LEN + 1)."""
    splits = {"train": synthetic_stream(1003, seed=3), "empty": np.zeros(0, dtype=np.int64),
              "short": synthetic_stream(N_STREAMS * (TGT_LEN + 1) - 1, seed=5)}
    return make_corpus(tmp_path_factory.mktemp("refusals") / "corpus", splits, layout=Layout(2, 8),
                       batch_tokens=BATCH_TOKENS)


@pytest.fixture
def corpus(pristine, tmp_path):
    """A copy of the pristine corpus that a test may damage."""
    return Path(shutil.copytree(pristine, tmp_path / "corpus"))


def assert_one_line(error: CorpusError, names: str) -> None:
    message = str(error)
    assert isinstance(error, Refused)
    assert "\n" not in message and names in message, message


# ----------------------------------------------------------------------------------------------------
# Paths a manifest names cannot leave the corpus folder


BAD_PATHS = {
    "absolute": "/etc/passwd",
    "parent": "..",
    "parent_first": "../x.arrow",
    "parent_inside": "train/../../x.arrow",
    "parent_last": "train/..",
    "windows_drive": "C:\\x.arrow",
    "windows_drive_relative": "C:x.arrow",
    "unc": "\\\\server\\share\\x.arrow",
    "unc_slashes": "//server/share/x.arrow",
    "backslash": "train\\00000.arrow",
    "nul": "train/00000.arrow\x00.txt",
    "newline": "train/\n00000.arrow",
    "empty": "",
    "dot": ".",
    "dot_segment": "./train/00000.arrow",
    "empty_segment": "train//00000.arrow",
    "trailing_slash": "train/",
    "not_a_string": 7,
}


def set_tokenizer_file(value):
    return lambda d: d["tokenizer"].update(file=value)


def set_file_path(value):
    return lambda d: d["splits"]["train"]["files"][0].update(path=value)


@pytest.mark.parametrize("key, setter", [("tokenizer.file", set_tokenizer_file),
                                         ("splits.train.files[0].path", set_file_path)], ids=["tokenizer", "file"])
@pytest.mark.parametrize("bad", list(BAD_PATHS.values()), ids=list(BAD_PATHS))
def test_a_manifest_path_that_could_leave_the_folder_is_refused(corpus, key, setter, bad):
    edit_manifest(corpus, setter(bad))
    with pytest.raises(CorpusError) as refused:
        read_manifest(corpus)
    assert_one_line(refused.value, f"{corpus / 'manifest.json'}: {key}")


def test_a_tokenizer_symlinked_out_of_the_folder_is_refused(corpus, tmp_path):
    outside = tmp_path / "elsewhere.model"
    (corpus / "tokenizer.model").rename(outside)
    (corpus / "tokenizer.model").symlink_to(outside)
    with pytest.raises(CorpusError, match="'tokenizer.model' resolves outside the corpus folder") as refused:
        read_manifest(corpus)
    assert_one_line(refused.value, str(corpus / "manifest.json"))


# ----------------------------------------------------------------------------------------------------
# Damaged, missing or too-short data: one row per case


def remove(rel):
    return lambda root: (root / rel).unlink()


def truncate(rel):
    def cut(root):
        path = root / rel
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return cut


def flip(rel):
    return lambda root: flip_bytes(root / rel)


def corrupt_null_count(rel):
    """Damage that reaches pyarrow's own checks: a record batch's null count (the token bytes themselves only
    change values, which the sha256 check catches)."""
    def damage(root):
        path = root / rel
        data = bytearray(path.read_bytes())
        node = data.find(struct.pack("<qq", BATCH_TOKENS, 0))  # a FieldNode: length, null count
        assert node >= 0
        data[node + 8] ^= 0xFF
        path.write_bytes(bytes(data))
    return damage


def name_missing_file(root):
    edit_manifest(root, set_file_path("train/99999.arrow"))


def replace_tokenizer(root):
    (root / "tokenizer.model").write_bytes(b"another tokenizer model")


def train_loader(split, verify=True):
    return lambda root: StreamLoader(root, split, rank=0, world_size=1, n_streams=N_STREAMS, micro_batch=N_STREAMS,
                                     tgt_len=TGT_LEN, verify=verify).close()


def evaluator(split):
    def build(root):
        cfg = EvalConfig(tgt_len=TGT_LEN, mem_len=TGT_LEN, n_streams=N_STREAMS)
        Evaluator(root, cfg, rank=0, world_size=1, n_streams=N_STREAMS, splits=[split]).close()
    return build


def verify(root):
    verify_corpus(root)


FIRST = "train/00000.arrow"
TRAIN = {"StreamLoader": train_loader("train"), "Evaluator": evaluator("train"), "verify_corpus": verify}
CASES = {
    # case: (damage, {entry point: call}, what the message names: a file (relative) or a split)
    "missing_arrow_file": (remove(FIRST), {**TRAIN, "StreamLoader(verify=False)": train_loader("train", False)},
                           FIRST),
    "truncated_arrow_file": (truncate(FIRST), {**TRAIN, "StreamLoader(verify=False)": train_loader("train", False)},
                             FIRST),
    "flipped_bytes_fail_sha256": (flip(FIRST), TRAIN, FIRST),
    "corrupt_arrow_metadata_without_verify": (corrupt_null_count(FIRST),
                                              {"StreamLoader(verify=False)": train_loader("train", False)}, FIRST),
    "manifest_names_a_missing_file": (name_missing_file, TRAIN, "train/99999.arrow"),
    "empty_split": (None, {"StreamLoader": train_loader("empty"), "Evaluator": evaluator("empty")}, "split 'empty'"),
    "split_too_short_for_its_streams": (None, {"StreamLoader": train_loader("short"), "Evaluator": evaluator("short")},
                                        "split 'short'"),
    "tokenizer_sha256_differs": (replace_tokenizer, TRAIN, "tokenizer.model"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_corpus_input_is_a_one_line_corpus_error(corpus, case):
    damage, entries, names = CASES[case]
    if damage is not None:
        damage(corpus)
    named = names if names.startswith("split") else str(corpus / names)
    for entry, call in entries.items():
        with pytest.raises(CorpusError) as refused:
            call(corpus)
        assert "\n" not in str(refused.value), f"{entry}: {refused.value}"
        assert named in str(refused.value), f"{entry}: {refused.value}"
        assert isinstance(refused.value, Refused), entry


# ----------------------------------------------------------------------------------------------------
# What a corpus path names, and the splits a training run needs


def test_a_corpus_path_that_is_a_file_says_so(corpus, tmp_path):
    text = tmp_path / "train.txt"
    text.write_text("some text\n")
    with pytest.raises(CorpusError, match=f"^{text}: is a file, not a corpus folder; .*--train {text}$"):
        read_manifest(text)
    with pytest.raises(CorpusError, match=f"^{corpus / 'manifest.json'}: is a file, not a corpus folder; name its "
                                          f"folder {corpus}$"):
        read_manifest(corpus / "manifest.json")
    with pytest.raises(CorpusError, match="corpus folder does not exist; run `python -m data_prep prepare"):
        read_manifest(tmp_path / "absent")


def test_an_arrow_path_that_is_a_folder_or_no_file_says_so(corpus):
    first = corpus / FIRST
    first.unlink()
    first.mkdir()
    with pytest.raises(CorpusError, match=f"^{first}: is a folder, not a file "):
        train_loader("train")(corpus)
    first.rmdir()
    first.symlink_to(corpus / "gone.arrow")
    with pytest.raises(CorpusError, match=f"^{first}: is not a regular file "):
        train_loader("train")(corpus)


@pytest.mark.parametrize("data, at_end, message", [
    ({}, True, "no split 'valid' for data.valid_split; the corpus has empty, short, train; use --set "
               "data.valid_split=train --set data.test_split=train (evaluates on training text: no held-out "
               "measure), or prepare the corpus with held-out text (`python -m data_prep prepare` with "
               "--valid-fraction F or --valid FILE and --test-fraction F or --test FILE)"),
    ({"valid_split": "short"}, True, "no split 'test' for data.test_split; the corpus has empty, short, train; use "
                                     "--set data.test_split=train (evaluates on training text: no held-out measure), "
                                     "or prepare the corpus with held-out text (`python -m data_prep prepare` with "
                                     "--test-fraction F or --test FILE), or --set eval.at_end=false (no final test "
                                     "evaluation)"),
    ({"valid_split": "short"}, False, None),
    ({"train_split": "trian"}, False, "no split 'trian' for data.train_split; the corpus has empty, short, train; "
                                      "set data.train_split to one of them"),
], ids=["no-held-out-split", "no-test-split", "no-test-split-needed", "train-split"])
def test_a_split_the_training_run_needs_is_named_with_a_way_on(corpus, data, at_end, message):
    from txl_dist.config import config_from_dict
    from txl_dist.startup import check_training_splits

    cfg = config_from_dict({"data": {"path": str(corpus), **data}, "eval": {"at_end": at_end},
                            "deepspeed": {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8}})
    if message is None:
        check_training_splits(cfg, read_manifest(corpus))
        return
    with pytest.raises(CorpusError) as refused:
        check_training_splits(cfg, read_manifest(corpus))
    assert str(refused.value) == f"{corpus / 'manifest.json'}: {message}"
