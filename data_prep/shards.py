"""Shard folders: the tokenized output of one `prepare --shard i/n` process, before `finalize` lays it out.

PARTS/shard-0000i-of-0000n/ holds tokenizer.model, one token stream file per split (<split>.arrow: the
shard's documents, each followed by eod_id, in the corpus format's Arrow schema) and shard.json with the
counts and the plan (inputs, options) that every shard of one job must share. PARTS/plan.json, when
`prepare --plan` wrote it, is what the shards read instead of scanning every input (data_prep/plan_file.py);
finalize does not read it.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from data_prep.errors import PrepError
from txl_dist.data.format import TokenizerEntry

SHARD_FORMAT = "txl-dist-shard"
SHARD_VERSION = 1
SHARD_FILE = "shard.json"
_NAME = re.compile(r"^shard-(\d+)-of-(\d+)$")


def shard_name(index: int, count: int) -> str:
    """Folder name of shard `index` of `count`."""
    return f"shard-{index:05d}-of-{count:05d}"


def parse_shard(text: str) -> tuple[int, int]:
    """'i/n' -> (i, n) with 0 <= i < n."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m or not 0 <= int(m.group(1)) < int(m.group(2)):
        raise PrepError(f"--shard {text!r}: expected i/n with 0 <= i < n, e.g. 0/4")
    return int(m.group(1)), int(m.group(2))


@dataclass
class SplitPart:
    """One split's share of a shard."""

    file: str
    n_tokens: int
    n_documents: int
    n_bytes: int
    n_chars: int
    sha256: str
    doc_range: list[int]
    """The split's documents [lo, hi) this shard holds."""


@dataclass
class ShardInfo:
    """shard.json."""

    index: int
    count: int
    tokenizer: TokenizerEntry
    dtype: str
    splits: dict[str, SplitPart]
    plan: dict[str, Any]
    """What every shard of the job must agree on: inputs with checksums, reading and hold-out options."""
    provenance: dict[str, Any]


def write_shard_info(folder: Path, info: ShardInfo) -> None:
    """Write folder/shard.json."""
    d = {"format": SHARD_FORMAT, "version": SHARD_VERSION, **asdict(info)}
    (folder / SHARD_FILE).write_text(json.dumps(d, indent=2) + "\n", encoding="utf-8")


def read_shard_info(folder: Path) -> ShardInfo:
    """Read folder/shard.json; a one-line error names the file when it is missing or damaged."""
    path = folder / SHARD_FILE
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
        if d.pop("format") != SHARD_FORMAT or d.pop("version") != SHARD_VERSION:
            raise PrepError(f"{path}: not a {SHARD_FORMAT} v{SHARD_VERSION} file")
        d["tokenizer"] = TokenizerEntry(**d["tokenizer"])
        d["splits"] = {k: SplitPart(**v) for k, v in d["splits"].items()}
        return ShardInfo(**d)
    except FileNotFoundError:
        raise PrepError(f"{path} is missing: this shard did not finish; re-run its prepare --shard") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise PrepError(f"{path}: damaged shard description ({e})") from None


def find_shards(parts_dir: str | os.PathLike) -> list[tuple[Path, ShardInfo]]:
    """All shards of a parts folder, checked to be one complete job: same count, plan and tokenizer."""
    parts_dir = Path(parts_dir)
    if not parts_dir.is_dir():
        raise PrepError(f"{parts_dir}: no such folder of shards (written by prepare --shard i/n --out {parts_dir})")
    found = {}
    for p in sorted(parts_dir.iterdir()):
        m = _NAME.match(p.name)
        if m and p.is_dir():
            found[(int(m.group(1)), int(m.group(2)))] = p
    if not found:
        raise PrepError(f"{parts_dir}: holds no shard-*-of-* folders; run prepare --shard i/n --out {parts_dir} first")
    counts = {n for _, n in found}
    if len(counts) > 1:
        raise PrepError(f"{parts_dir}: shards of different jobs (of {sorted(counts)} shards); keep one job per folder")
    (count,) = counts
    missing = [shard_name(i, count) for i in range(count) if (i, count) not in found]
    if missing:
        first_missing = next(i for i in range(count) if (i, count) not in found)
        raise PrepError(f"{parts_dir}: {missing[0]} is missing ({len(missing)} of {count} shards); "
                        f"run prepare --shard {first_missing}/{count} for it")
    shards = [(found[(i, count)], read_shard_info(found[(i, count)])) for i in range(count)]
    first = shards[0][1]
    for i, (folder, info) in enumerate(shards):
        if (info.index, info.count) != (i, count):
            raise PrepError(f"{folder / SHARD_FILE}: says shard {info.index}/{info.count}, the folder name differs")
        if info.plan != first.plan:
            raise PrepError(f"{folder / SHARD_FILE}: made from other inputs or options than {shards[0][0].name}; "
                            "re-run all shards with the same command")
        if info.tokenizer != first.tokenizer:
            raise PrepError(f"{folder / SHARD_FILE}: tokenizer sha256 {info.tokenizer.sha256[:12]}... differs from "
                            f"{shards[0][0].name}'s; every shard must use the same --tokenizer-model")
    return shards
