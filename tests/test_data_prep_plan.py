"""`prepare --plan` and the `prepare --shard` tasks that follow its plan.json (data_prep/plan_file.py,
data_prep/seek.py): the same shard folders, byte for byte (token files and shard.json but for its provenance),
and the same corpus as shards that scan every input and as one `prepare`; without reading all inputs; and
every plan that does not fit is refused in one line.

Seek points are made tiny here (a point per KiB, 256-byte chunks), so that inputs hold many of them,
documents straddle their nominal boundaries and every shard but the first starts in the middle of a file.
Inputs: plain text with --line-docs (CRLF, lone CR, blank lines, a BOM, no final newline, line separators that
are not line breaks to `datasets`), JSON Lines (a BOM, blank lines; other fields of mixed types), a JSON array
(read by `datasets` from its start), Parquet (row groups of 7 rows), a save_to_disk folder, and plain text
one document per file; with --valid-fraction/--test-fraction and several inputs per split.
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import data_prep.plan
import data_prep.prepare
import data_prep.seek as seek
import data_prep.sources
from data_prep.encode import Encoder
from data_prep.plan_scan import scan_input
from data_prep.cli import main
from test_data_prep_errors import fail, run
from txl_dist.data.format import read_manifest, sha256_file

N_SHARDS = 3
WORDS = ["ka", "tor", "rine", "mo", "sa", "lupe", "di", "fo", "gaz", "hi", "ju", "be", "zo", "wa", "é", "日本",
         "naïve", "😀", "x\u2028y", "a\x85b", "c\x0cd", "tab\there", "\u3000"]




def text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("plan-tok")
    rng = random.Random(1)
    (root / "sample.txt").write_text("\n".join(text(rng, 12) for _ in range(400)), encoding="utf-8")
    run("train-tokenizer", "--out", root / "tok.model", "--train", root / "sample.txt", "--vocab-size", 300,
        "--model-type", "bpe", "--quiet", "--num-proc", 1)
    return root / "tok.model"


@pytest.fixture
def small_seeks(monkeypatch):
    """Seek points every KiB; and batches of 16 documents (of 300 bytes for one-document files) and tokenizer
    tasks of 300 bytes, so that a shard's token files hold many record batches: they come out the same only
    where a shard following the plan hands on the very batches that reading from the start does."""
    monkeypatch.setattr(seek, "SEEK_BYTES", 1024)
    monkeypatch.setattr(seek, "CHUNK_BYTES", 256)
    monkeypatch.setattr(data_prep.sources, "BATCH_ROWS", 16)
    monkeypatch.setattr(data_prep.sources, "_TEXT_BATCH_BYTES", 300)
    real_init = Encoder.__init__
    monkeypatch.setattr(Encoder, "__init__", lambda self, *a, **k: real_init(self, *a, **{**k, "task_bytes": 300}))


def write_lines(root: Path) -> list[str]:
    """Two plain-text files of lines, every line ending and oddity datasets' text loader distinguishes."""
    rng = random.Random(2)
    for name, n in (("a.txt", 160), ("b.txt", 120)):
        parts = ["\ufeff"] if name == "a.txt" else []
        for i in range(n):
            parts += [text(rng, rng.randint(0, 14)), rng.choice(["\n", "\n", "\r\n", "\r", "\n\n", "\r\n\r\n"])]
        data = "".join(parts)
        (root / name).write_bytes((data.rstrip("\r\n") if name == "b.txt" else data).encode())
    return ["--line-docs", "--train", root / "a.txt", root / "b.txt", "--valid-fraction", "0.1",
            "--test-fraction", "0.05"]


def write_mixed(root: Path) -> list[str]:
    """JSON Lines, a JSON array, Parquet and a save_to_disk folder as train, JSON Lines as valid."""
    import datasets

    rng = random.Random(3)

    def jsonl(path: Path, n: int, bom: bool = False, blank: bool = False, mixed: bool = False) -> None:
        lines = []
        for i in range(n):
            other = rng.choice([1, "one", [1, 2], {"k": None}]) if mixed else i  # not the text field
            lines.append(json.dumps({"id": i, "body": text(rng, rng.randint(1, 40)), "other": other}))
            if blank and i % 9 == 0:
                lines.append(rng.choice(["", "   "]))  # blank lines start no document
        path.write_bytes(("\ufeff" if bom else "").encode() + ("\n".join(lines) + "\n").encode())

    # (blank lines and other fields of mixed types in one file: datasets itself cannot read that)
    jsonl(root / "a.jsonl", 70, bom=True, blank=True)
    (root / "c.json").write_text(json.dumps([{"body": text(rng, 9)} for _ in range(8)]))
    pq.write_table(pa.table({"body": pa.array([text(rng, rng.randint(1, 30)) for _ in range(60)], pa.large_string()),
                             "n": list(range(60))}), root / "b.parquet", row_group_size=7)
    datasets.Dataset.from_dict({"body": [text(rng, rng.randint(1, 20)) for _ in range(25)]}).save_to_disk(
        str(root / "d"))
    jsonl(root / "e.jsonl", 40, mixed=True)
    jsonl(root / "v.jsonl", 12)
    return ["--text-field", "body", "--train", root / "a.jsonl", root / "c.json", root / "b.parquet", root / "d",
            root / "e.jsonl", "--valid", root / "v.jsonl", "--test-fraction", "0.1"]


def write_files(root: Path, holdout: bool = True) -> list[str]:
    """Plain text, one document per file (some starting with a byte order mark); valid held out, or from files
    of its own."""
    rng = random.Random(4)
    for split, n in (("train", 40), ("valid", 0 if holdout else 5)):
        (root / split).mkdir()
        for i in range(n):
            bom = "\ufeff" if i % 7 == 3 else ""  # dropped when read: the plan's text sizes must say so too
            (root / split / f"{i:02d}.txt").write_text(bom + text(rng, rng.randint(3, 30)) + "\r\n",
                                                        encoding="utf-8")
    valid = ["--valid-fraction", "0.2", "--seed", "5"] if holdout else ["--valid", root / "valid" / "*.txt"]
    return ["--train", root / "train" / "*.txt", *valid]


def write_files_and_valid(root: Path) -> list[str]:
    return write_files(root, holdout=False)


def shard_contents(parts: Path) -> dict:
    """Every shard's token files (sha256) and shard.json: all but its provenance's time, command line and
    arguments (and the plan file it followed, the one field a plan adds)."""
    out = {}
    for d in sorted(parts.glob("shard-*")):
        info = json.loads((d / "shard.json").read_text())
        for key in ("created", "command", "args", "plan"):
            info["provenance"].pop(key, None)
        out[d.name] = {"info": info, **{p.name: sha256_file(p) for p in sorted(d.glob("*.arrow"))}}
    return out


@pytest.mark.parametrize("write", [write_lines, write_mixed, write_files, write_files_and_valid],
                         ids=["lines", "mixed", "files", "files-and-valid"])
def test_shards_following_the_plan_are_the_shards_that_scan(model, tmp_path, small_seeks, monkeypatch, write):
    inputs = [str(a) for a in write(tmp_path)]
    common = [*inputs, "--tokenizer-model", model, "--num-proc", 1, "--quiet", "--world-size", 2, "--n-streams", 2]
    run("prepare", "--out", tmp_path / "single", *common)
    for i in range(N_SHARDS):
        run("prepare", "--out", tmp_path / "scanned", "--shard", f"{i}/{N_SHARDS}", *common)
    run("prepare", "--plan", "--out", tmp_path / "planned", *common)
    plan = json.loads((tmp_path / "planned" / "plan.json").read_text())
    # --num-proc: inputs read on several threads give the same records.
    run("prepare", "--plan", "--out", tmp_path / "planned-3", *common, "--num-proc", 3)
    assert json.loads((tmp_path / "planned-3" / "plan.json").read_text())["inputs"] == plan["inputs"]
    seeks = {Path(r["path"]).name: (r["seek"], len(r["points"])) for rs in plan["inputs"].values() for r in rs}
    if write is write_mixed:  # every kind of seek point, and a JSON array that datasets reads from its start
        assert {name: how for name, (how, _) in seeks.items()} == {
            "a.jsonl": "bytes", "c.json": "start", "b.parquet": "row_groups", "d": "rows", "e.jsonl": "bytes",
            "v.jsonl": "bytes"}
        assert seeks["a.jsonl"][1] > 3
        assert seeks["b.parquet"][1] == pq.ParquetFile(tmp_path / "b.parquet").num_row_groups
    elif write is write_lines:
        assert seeks["a.txt"][0] == "bytes" and seeks["a.txt"][1] > 3

    # Following the plan: no input is hashed or counted as a whole; record where each shard starts reading.
    def refuse(*args, **kwargs):
        raise AssertionError("a shard following the plan scanned or counted all inputs")

    starts: list[tuple[int, int]] = []
    offsets: list[int] = []
    real_from, real_chunks = seek.documents_from, seek.read_chunks

    def recording_from(sources, records, start, opts, **kwargs):
        first, batches = real_from(sources, records, start, opts, **kwargs)
        starts.append((start, first))
        return first, batches

    def recording_chunks(f, start):
        offsets.append(start)
        return real_chunks(f, start)

    with monkeypatch.context() as patch:
        patch.setattr(data_prep.prepare, "_scan", refuse)
        patch.setattr(data_prep.plan, "count_documents", refuse)
        patch.setattr(data_prep.plan, "documents_from", recording_from)
        patch.setattr(seek, "read_chunks", recording_chunks)
        for i in range(N_SHARDS):
            run("prepare", "--out", tmp_path / "planned", "--shard", f"{i}/{N_SHARDS}", *common)
    assert starts and all(first <= start for start, first in starts)
    assert any(first > 0 for _, first in starts)  # a shard that did not start at its group's first document
    if write in (write_lines, write_mixed):
        assert any(o > 0 for o in offsets)  # ... and started reading in the middle of a file

    assert shard_contents(tmp_path / "planned") == shard_contents(tmp_path / "scanned")
    for parts in ("scanned", "planned"):
        run("finalize", tmp_path / parts, "--out", tmp_path / f"{parts}-corpus", "--world-size", 2, "--n-streams", 2,
            "--quiet")
    digests = {name: read_manifest(tmp_path / name).digest() for name in ("single", "scanned-corpus", "planned-corpus")}
    assert len(set(digests.values())) == 1, digests
    manifest = read_manifest(tmp_path / "planned-corpus")
    assert set(manifest.splits) == ({"train", "valid", "test"} if write in (write_lines, write_mixed)
                                    else {"train", "valid"})
    shard0 = json.loads((tmp_path / "planned" / "shard-00000-of-00003" / "shard.json").read_text())
    assert shard0["provenance"]["plan"]["file"] == str(tmp_path / "planned" / "plan.json")


def test_a_plain_text_file_drops_its_byte_order_mark(model, tmp_path):
    """As JSON Lines readers do: the mark is no text, so neither the tokens nor the byte and character counts
    hold it (the plan's text size of the file neither)."""
    import sentencepiece as spm
    from data_prep.sources import ReadOptions, resolve_sources

    body = text(random.Random(6), 40) + "\r\n" + text(random.Random(7), 9) + "\n"
    (tmp_path / "a.txt").write_bytes("\ufeff".encode() + body.encode())
    run("prepare", "--out", tmp_path / "c", "--train", tmp_path / "a.txt", "--tokenizer-model", model,
        "--num-proc", 1, "--quiet")
    read = body  # its bytes, "\r\n" included: only the mark is dropped
    split = read_manifest(tmp_path / "c").splits["train"]
    assert (split.n_bytes, split.n_chars) == (len(read.encode()), len(read))
    sp = spm.SentencePieceProcessor(model_file=str(model))
    tokens = pa.ipc.open_file(str(tmp_path / "c/train/00000.arrow")).read_all().column(0).to_pylist()
    assert tokens == sp.encode(read) + [sp.eos_id()]
    record = scan_input(resolve_sources([str(tmp_path / "a.txt")], "--train")[0], ReadOptions())
    assert record.files[0]["text_bytes"] == len(read.encode())


def test_line_docs_drop_each_files_byte_order_mark_read_whole_or_from_the_plan(model, tmp_path):
    """With --line-docs the mark was kept in the file's first document (by `datasets`, and by the seek reader of
    a plan's shards), so counted: n_bytes 27 / n_chars 25 against 24 / 24 without it. Now the corpus is that of
    the file without the mark, read whole or following a plan."""
    from data_prep.sources import ReadOptions, iter_documents, resolve_sources

    body = "hello world\nthe quick fox\n"
    (tmp_path / "plain.txt").write_text(body, encoding="utf-8")
    (tmp_path / "marked.txt").write_text("\ufeff" + body, encoding="utf-8")
    common = ["--line-docs", "--tokenizer-model", model, "--num-proc", 1, "--quiet"]
    for name in ("plain", "marked"):
        run("prepare", "--out", tmp_path / name, "--train", tmp_path / f"{name}.txt", *common)
    run("prepare", "--plan", "--out", tmp_path / "parts", "--train", tmp_path / "marked.txt", *common)
    run("prepare", "--out", tmp_path / "parts", "--shard", "0/1", "--train", tmp_path / "marked.txt", *common)
    run("finalize", tmp_path / "parts", "--out", tmp_path / "planned", "--quiet")
    split = read_manifest(tmp_path / "marked").splits["train"]
    assert (split.n_bytes, split.n_chars) == (24, 24)
    digests = {name: read_manifest(tmp_path / name).digest() for name in ("plain", "marked", "planned")}
    assert len(set(digests.values())) == 1, digests
    marked = resolve_sources([str(tmp_path / "marked.txt")], "--train")
    opts = ReadOptions(line_docs=True)
    assert [t for _, c in iter_documents(marked, opts) for t in c.to_pylist()] == ["hello world", "the quick fox"]
    _, batches = seek.documents_from(marked, [scan_input(marked[0], opts)], 0, opts)
    assert [t for _, c in batches for t in c.to_pylist()] == ["hello world", "the quick fox"]


def test_line_counts_and_lines_are_what_datasets_reads(tmp_path, small_seeks):
    """Counted on bytes in the planning pass, split from a seek point in a shard: datasets' own lines."""
    from data_prep.sources import ReadOptions, iter_documents, resolve_sources

    write_lines(tmp_path)
    for name in ("a.txt", "b.txt"):
        source = resolve_sources([str(tmp_path / name)], "--train")
        opts = ReadOptions(line_docs=True)
        want = [t for _, column in iter_documents(source, opts) for t in column.to_pylist()]
        record = scan_input(source[0], opts)
        assert record.documents == len(want) and len(record.points) > 3
        for doc, offset in record.points:
            _, batches = seek.documents_from(source, [record], doc, opts)
            got = [t for _, column in batches for t in column.to_pylist()]
            assert got == want[doc:], (name, doc, offset)


def test_a_json_object_longer_than_a_parse_block_is_read():
    long = "word " * 300_000  # 1.5 MB: more than pyarrow's first block size
    chunk = "".join(json.dumps({"text": t}) + "\n" for t in ["a", long, "b"]).encode()
    assert seek.parse_json_chunk(chunk, "text", first=False).to_pylist() == ["a", long, "b"]
    assert seek.parse_json_chunk(b'{"text": 3}\n', "text", first=False) is None  # datasets reads that one
    assert seek.parse_json_chunk(b'{"other": "x"}\n', "text", first=False) is None


# ----------------------------------------------------------------------------------------------------
# Refusals


@pytest.fixture
def planned(model, tmp_path, small_seeks):
    """A plan for two JSON Lines inputs; returns the folder and the arguments of a shard task
    (`args(*train files, *more options)`; by default the planned inputs)."""
    write_mixed(tmp_path)

    def args(*train, extra=(), command=("--shard", "1/2")):
        train = train or (tmp_path / "a.jsonl", tmp_path / "e.jsonl")
        return ["prepare", *command, "--out", tmp_path / "parts", "--text-field", "body", "--train", *train,
                "--tokenizer-model", model, "--num-proc", 1, "--quiet", *extra]

    run(*args(command=["--plan"]))
    return tmp_path, args


def test_a_plan_for_other_inputs_or_options_is_refused(planned, capsys):
    tmp_path, args = planned
    a, e = tmp_path / "a.jsonl", tmp_path / "e.jsonl"
    msg = fail(capsys, *args(a, e, tmp_path / "v.jsonl"))
    assert "parts/plan.json does not fit this command: made for other inputs: --train has 3 input(s) here, 2 in " \
           "the plan" in msg and "prepare --plan --overwrite" in msg
    msg = fail(capsys, *args(e, a))
    assert f"--train input 1 is {e} (json) here, {a} (json) in the plan" in msg
    msg = fail(capsys, *args(extra=["--seed", 7]))
    assert "made with --seed 0, this command has --seed 7" in msg
    msg = fail(capsys, *args(extra=["--valid-fraction", "0.1"]))
    assert "made with --valid-fraction 0.0, this command has --valid-fraction 0.1" in msg
    msg = fail(capsys, *args(extra=["--valid", tmp_path / "v.jsonl"]))
    assert "made for other inputs: --valid has 1 input(s) here, 0 in the plan" in msg
    assert sorted(p.name for p in (tmp_path / "parts").iterdir()) == ["plan.json"]
    # prepare --plan keeps a plan that fits, refuses one that does not unless --overwrite
    capsys.readouterr()
    run(*args(command=["--plan"]))
    assert "kept plan" in capsys.readouterr().out
    msg = fail(capsys, *args(extra=["--seed", 7], command=["--plan"]))
    assert "plan.json already exists, made with --seed 0" in msg and "pass --overwrite" in msg
    run(*args(extra=["--seed", 7, "--overwrite"], command=["--plan"]))
    assert json.loads((tmp_path / "parts" / "plan.json").read_text())["options"]["seed"] == 7
    msg = fail(capsys, *args(command=["--plan", "--shard", "0/2"]))
    assert "--plan writes the plan every --shard task reads" in msg


@pytest.mark.parametrize("change", ["append", "touch"])
def test_an_input_changed_after_planning_is_refused(planned, capsys, change):
    tmp_path, args = planned
    path = tmp_path / "e.jsonl"
    if change == "append":
        with open(path, "a") as f:
            f.write(json.dumps({"body": "one more"}) + "\n")
        want = "changed since it was planned (size"
    else:
        st = path.stat()
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        want = "changed since it was planned (modified again, size kept)"
    msg = fail(capsys, *args())
    assert f"input {path} {want}" in msg and "plan.json does not fit this command" in msg
    assert sorted(p.name for p in (tmp_path / "parts").iterdir()) == ["plan.json"]


@pytest.mark.parametrize("damage", ["truncated", "edited", "not-json"])
def test_a_damaged_plan_file_is_refused(planned, capsys, damage):
    tmp_path, args = planned
    path = tmp_path / "parts" / "plan.json"
    data = path.read_text()
    if damage == "truncated":
        path.write_text(data[:len(data) // 2])
    elif damage == "edited":  # still valid JSON: one document count changed
        d = json.loads(data)
        d["inputs"]["train"][0]["documents"] += 1
        path.write_text(json.dumps(d))
    else:
        path.write_bytes(b"\x00" * 64)
    msg = fail(capsys, *args())
    assert f"{path}: damaged plan file" in msg and "prepare --plan --overwrite" in msg
    if damage == "edited":
        assert "does not match its sha256" in msg


def test_a_refused_or_interrupted_plan_leaves_no_empty_out_folder(model, tmp_path, monkeypatch, capsys):
    write_mixed(tmp_path)
    args = ["prepare", "--plan", "--out", tmp_path / "parts", "--text-field", "body", "--train",
            tmp_path / "a.jsonl", "--tokenizer-model", model, "--num-proc", 1, "--quiet"]
    # A hold-out that leaves no training document is refused after the inputs were read.
    msg = fail(capsys, *args, "--valid-fraction", "0.9", "--test-fraction", "0.1")
    assert "fraction" in msg and not (tmp_path / "parts").exists()

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(data_prep.prepare, "scan_inputs", interrupted)  # Ctrl-C while the inputs are read
    assert main([str(a) for a in args]) == 130
    assert not (tmp_path / "parts").exists()
    (tmp_path / "parts").mkdir()  # a folder the user made stays
    assert main([str(a) for a in args]) == 130
    assert (tmp_path / "parts").is_dir() and not any((tmp_path / "parts").iterdir())
