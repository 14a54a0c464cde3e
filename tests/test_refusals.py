"""Every refusal in docs/refusals.md, one row = one case: exit status 2, one `error:` line with the table's
message, and nothing written.

The table is the single source of truth: the test reads docs/refusals.md and runs, for each row, the case
registered under the row's id (CASES), failing when a row has no case or a case no row. A case builds its
input in its own folder and calls the entry point's main(argv) in this process (refusals come before any
engine exists, so this is fast). The checkpoint cases copy one real run folder, trained once per module in
a child process through launch/train.py's main.

Placeholders in a message (`<run>`, `<corpus>`, `<tag>`, ...) are filled in by the case that makes the input.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

from corpus_helpers import edit_manifest, flip_bytes
from dist_helpers import REPO, free_port, learnable_stream, run_ranks, tiny_config, write_corpus
from txl_dist.errors import EXIT_REFUSED

DOC = REPO / "docs" / "refusals.md"
COLUMNS = ["case", "refused input", "entry point", "message"]
ENTRY_POINTS = ("train", "eval", "export", "data_prep")
VOCAB = 64
TRAINED_STEPS = 2
TAG = f"step_{TRAINED_STEPS:08d}"
# A refused start may hold the run folder's lock (rank 0 takes it before it looks at the checkpoints) and
# open the log it appends to from then on: nothing else may appear or change in it.
MAY_APPEAR_IN_RUN_FOLDER = (".lock", "logs", "logs/train.log")
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR",
                    "MASTER_PORT", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME")


# ----------------------------------------------------------------------------------------------------
# The table


@dataclass(frozen=True)
class Row:
    case: str
    refused_input: str
    entry_point: str
    message: str


def read_table(path: Path = DOC) -> list[Row]:
    """The rows of the one markdown table in `path` (cells split at unescaped pipes, code spans unwrapped)."""
    lines = [line.strip() for line in path.read_text().splitlines() if line.strip().startswith("|")]
    header, _separator, *body = [_cells(line) for line in lines]
    assert header == COLUMNS, header
    return [Row(*cells[:3], _code_span(cells[3])) for cells in body]


def _cells(line: str) -> list[str]:
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def _code_span(cell: str) -> str:
    """`text` or `` text with `backticks` `` -> the text."""
    ticks = re.match(r"`+", cell)
    assert ticks and cell.endswith(ticks.group()), f"the message must be a code span: {cell}"
    inner = cell[len(ticks.group()):-len(ticks.group())]
    return inner[1:-1] if len(ticks.group()) > 1 else inner


ANY_TEXT = "detail"
"""The placeholder for words a library adds (an MLflow client error): any text."""


def message_pattern(message: str, values: dict[str, str]) -> re.Pattern:
    """The message as a pattern: each <placeholder> is the case's value, <detail> any text; a placeholder
    the case did not set is an error."""
    parts = re.split(r"<([a-z0-9-]+)>", message)  # literal, name, literal, name, ..., literal
    pattern = []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            pattern.append(re.escape(part))
        elif part == ANY_TEXT:
            pattern.append(".+")
        else:
            assert part in values, f"the case sets no value for <{part}> of {message!r}"
            pattern.append(re.escape(values[part]))
    return re.compile("".join(pattern))


# ----------------------------------------------------------------------------------------------------
# What a case changed on disk


def snapshot(root: Path) -> dict[str, tuple]:
    """Every path under root: folders by name, files by size and mtime."""
    out = {}
    for p in root.rglob("*"):
        st = p.lstat()
        out[p.relative_to(root).as_posix()] = ("folder",) if p.is_dir() else (st.st_size, st.st_mtime_ns)
    return out


def changes(before: dict[str, tuple], after: dict[str, tuple]) -> dict[str, str]:
    """Path -> 'appeared', 'vanished' or 'changed'."""
    out = {p: "appeared" for p in after.keys() - before.keys()}
    out |= {p: "vanished" for p in before.keys() - after.keys()}
    out |= {p: "changed" for p in before.keys() & after.keys() if before[p] != after[p]}
    return out


class LoggedMessages(logging.Filter):
    """Notes every record logged on the "txl_dist" logger. A filter, not a handler: the entry points'
    setup_logging replaces the logger's handlers, and the logger does not propagate to pytest's."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.messages.append(record.getMessage())
        return True


# ----------------------------------------------------------------------------------------------------
# A case's world: its folder, inputs, the entry point it ran and what came back


class Scene:
    """One case: inputs under its own folder, one entry point run on them, the placeholders of the message."""

    def __init__(self, root: Path, pristine: Path, request, capsys, monkeypatch) -> None:
        self.root, self._request, self._capsys, self._monkeypatch = root, request, capsys, monkeypatch
        self.corpus = Path(shutil.copytree(pristine, root / "corpus"))
        self.run_dir = root / "run"
        self.tag = self.run_dir / "checkpoints" / TAG
        self.values = {"corpus": str(self.corpus), "run": str(self.run_dir), "tag": str(self.tag),
                       "ds-version": _deepspeed_version()}
        self.entry_point: str | None = None
        self.status: int | None = None
        self.error_lines: list[str] = []
        self.changed: dict[str, str] = {}

    # Inputs

    def config(self, **sections) -> dict:
        """The raw config the checkpoint was trained with, on this case's corpus and run folder."""
        return base_config(self.corpus, self.run_dir, **sections)

    def config_file(self, raw: dict | str, name: str = "config.json") -> Path:
        path = self.root / name
        path.write_text(raw if isinstance(raw, str) else json.dumps(raw))
        self.values["config"] = str(path)
        return path

    def corpus_like(self, name: str, seed: int = 0) -> Path:
        """Another corpus of the same tokenizer, its own tokens (seed 0: the same tokens)."""
        path = make_corpus(self.root / name, seed)
        self.values[name] = str(path)
        return path

    def trained_run(self) -> Path:
        """A copy of the trained run folder (checkpoints step 1 and 2) as this case's run folder."""
        shutil.copytree(self._request.getfixturevalue("trained_run"), self.run_dir)
        return self.run_dir

    def launcher(self, **variables: str) -> None:
        for name, value in variables.items():
            self._monkeypatch.setenv(name, value)

    @property
    def monkeypatch(self):
        """The case's pytest monkeypatch (for stand-ins of what this machine lacks, e.g. a GPU's toolkit)."""
        return self._monkeypatch

    def after_the_case(self, fn: Callable[[], None]) -> None:
        self._request.addfinalizer(fn)

    # Entry points

    def train(self, config: dict | str | Path | None = None, *args) -> None:
        """launch/train.py with `config`: a raw config (None: the base one), a config file's text, or a path."""
        from launch.train import main

        if isinstance(config, Path):
            self.values["config"] = str(config)
        else:
            config = self.config_file(self.config() if config is None else config)
        self._run("train", main, ["--config", config, *args])

    def eval(self, *args) -> None:
        from launch.eval import main

        self._run("eval", main, args)

    def export(self, *args) -> None:
        from launch.export import main

        self._run("export", main, args)

    def data_prep(self, *args) -> None:
        from data_prep.cli import main

        self._capsys.readouterr()
        self._run("data_prep", main, args)
        # data_prep prints its line to stderr instead of logging it.
        self.error_lines = [line for line in self._capsys.readouterr().err.splitlines() if "error:" in line]

    def _run(self, entry_point: str, main: Callable[[list[str]], int], argv) -> None:
        assert self.entry_point is None, "a case runs one entry point"
        self.entry_point = entry_point
        before = snapshot(self.root)
        logger = logging.getLogger("txl_dist")
        logged = LoggedMessages()
        logger.addFilter(logged)
        try:
            self.status = main([str(a) for a in argv])
        finally:
            logger.removeFilter(logged)
        self.error_lines = [m for m in logged.messages if "error:" in m]
        self.changed = changes(before, snapshot(self.root))


def _deepspeed_version() -> str:
    import deepspeed

    return deepspeed.__version__


def make_corpus(root: Path, seed: int = 0) -> Path:
    """train (4 streams of 97 tokens; `seed` picks its tokens), valid and test; `empty` (0 tokens) and
    `short` (4 streams of 8 tokens: one segment of tgt_len 8 needs 9)."""
    return write_corpus(root, {"train": learnable_stream(4 * 97, VOCAB, seed), "valid": learnable_stream(80, VOCAB, 1),
                               "test": learnable_stream(80, VOCAB, 2), "empty": np.zeros(0, dtype=np.int64),
                               "short": learnable_stream(4 * 8, VOCAB, 3)}, vocab_size=VOCAB)


def base_config(corpus: Path, run_dir: Path, **sections) -> dict:
    """The trained run's config (2 steps on 4 streams, a checkpoint after each, no final evaluation) with
    `sections` merged in."""
    trained = {"train": {"max_steps": TRAINED_STEPS}, "checkpoint": {"interval": 1, "keep": 2},
               "eval": {"at_end": False}}
    return tiny_config(corpus, run_dir, **merged(trained, sections))


def merged(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in update.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def train_in_child(argv: list[str]) -> int:
    from launch.train import main

    return main(argv)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("refusals") / "corpus")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A run folder with the checkpoints of steps 1 and 2 (ZeRO 0, 1 rank) of base_config."""
    root = tmp_path_factory.mktemp("trained")
    config = root / "config.json"
    config.write_text(json.dumps(base_config(make_corpus(root / "corpus"), root / "run")))
    assert run_ranks(train_in_child, 1, ["--config", str(config)]) == [0]
    return root / "run"


@pytest.fixture
def scene(tmp_path, pristine, request, capsys, monkeypatch):
    """A case's folder (also the working directory, so a stray relative write shows up in its snapshot), a
    launch environment of one process, and the process state a refused start must not leak."""
    environ = dict(os.environ)  # distributed.export writes the launch variables into os.environ
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))  # configure_threads leaves them as they are
    monkeypatch.chdir(tmp_path)
    yield Scene(tmp_path, pristine, request, capsys, monkeypatch)
    os.environ.clear()
    os.environ.update(environ)


# ----------------------------------------------------------------------------------------------------
# The cases, by the table's ids

CASES: dict[str, Callable[[Scene], None]] = {}


def case(case_id: str):
    def register(fn):
        assert case_id not in CASES, case_id
        CASES[case_id] = fn
        return fn
    return register


def train_with(**sections):
    """A case: train with these sections merged into the base config."""
    return lambda s: s.train(s.config(**sections))


def train_with_launcher(variables: dict[str, str], **sections):
    def run(s: Scene) -> None:
        s.launcher(**variables)
        s.train(s.config(**sections))
    return run


# Configuration

@case("config.missing-file")
def _(s):
    s.train(s.root / "absent.json")


@case("config.invalid-json")
def _(s):
    s.train('{"model": ')


@case("config.not-a-file")
def _(s):
    s.train(s.root)


@case("config.not-utf8")
def _(s):
    (s.root / "binary.json").write_bytes(b'{"model": "\xff"}')
    s.train(s.root / "binary.json")


@case("config.not-a-regular-file")
def _(s):
    if not Path("/dev/zero").is_char_device():
        pytest.skip("no /dev/zero here")
    s.train(Path("/dev/zero"))  # read to its end, it has none: a MemoryError, or the memory limit's kill


@case("config.duplicate-key")
def _(s):
    text = json.dumps(s.config()).replace('"max_steps": 2', '"max_steps": 600, "max_steps": 2')
    assert text.count('"max_steps"') == 2
    s.train(text)


@case("config.not-finite")
def _(s):
    s.train(None, "--set", "model.init_std=NaN")


@case("config.not-finite.deepspeed")
def _(s):
    s.train(None, "--set", "deepspeed.gradient_clipping=Infinity")


@case("config.integer-beyond-64-bits")
def _(s):
    s.train(None, "--set", f"model.clamp_len={2**64}")


@case("config.range.width")
def _(s):
    s.train(None, "--set", f"model.d_inner={10**18}")


@case("config.range.timeout")
def _(s):
    s.train(None, "--set", f"train.collective_timeout_s={10**9}")


@case("config.unknown-section")
def _(s):
    raw = s.config()
    raw["trian"] = raw.pop("train")
    s.train(raw)


MISSPELLED_KEYS = {"run": "dirr", "model": "n_layers", "data": "train_spilt", "eval": "memlen",
                   "checkpoint": "fallbak", "tracking": "experiment_name"}
for _section, _key in MISSPELLED_KEYS.items():
    case(f"config.unknown-key.{_section}")(train_with(**{_section: {_key: 1}}))


@case("config.unknown-key.train")
def _(s):
    s.train(None, "--set", "train.max_stepz=3")


@case("config.override-without-value")
def _(s):
    s.train(None, "--set", "train.max_steps")


@case("config.wrong-type.section")
def _(s):
    raw = s.config()
    raw["model"] = [2, 32]
    s.train(raw)


case("config.wrong-type.integer")(train_with(model={"d_model": "32"}))
case("config.wrong-type.boolean")(train_with(checkpoint={"fallback": "yes"}))
case("config.wrong-type.list")(train_with(model={"cutoffs": 32}))
case("config.range.negative-seed")(train_with(train={"seed": -1}))
case("config.range.dropout")(train_with(model={"dropout": 1.5}))
case("config.odd-d-model")(train_with(model={"d_model": 33}))


@case("config.range.length")
def _(s):
    s.train(None, "--set", f"model.mem_len={10**12}")


case("config.flex-with-dropatt")(train_with(model={"attn_impl": "flex", "dropatt": 0.1}))
case("config.flex-training-on-cpu")(train_with(model={"attn_impl": "flex"}))
case("config.triton-on-cpu")(train_with(model={"attn_impl": "triton"}))


@case("config.triton-on-cpu.eval")
def _(s):
    s.eval("--checkpoint", s.trained_run(), "--set", "model.attn_impl=triton")


case("config.range.max-steps")(train_with(train={"max_steps": 0}))
case("config.range.exit-step")(train_with(train={"exit_step": 5}))
case("config.range.metrics-interval")(train_with(tracking={"metrics_interval": 0}))
case("config.same-length-without-memory")(train_with(eval={"mem_len": 0, "same_length": True}))
case("config.empty-experiment")(train_with(tracking={"experiment": ""}))
case("config.precision-conflict")(train_with(train={"precision": "auto"}, deepspeed={"bf16": {"enabled": True}}))


@case("config.same-length-without-memory.eval")
def _(s):
    s.eval("--checkpoint", s.trained_run(), "--set", "eval.mem_len=0")


case("config.cutoffs-beyond-vocabulary")(train_with(model={"cutoffs": [32, 64]}))
case("config.vocab-size-differs-from-corpus")(train_with(model={"vocab_size": 100}))
case("config.vocab-size-and-cutoffs-differ-from-corpus")(train_with(model={"vocab_size": 100, "cutoffs": [80]}))

# The deepspeed section

case("deepspeed.unknown-key.top-level")(train_with(deepspeed={"gradient_cliping": 1.0}))
case("deepspeed.scheduler-params-not-an-object")(train_with(deepspeed={"scheduler": {"params": None}}))


@case("deepspeed.section-not-an-object")
def _(s):
    s.train(None, "--set", "deepspeed.timers=null")


case("deepspeed.scheduler-negative-learning-rate")(
    train_with(deepspeed={"scheduler": {"params": {"cos_min_ratio": -1}}}))
case("deepspeed.scheduler-ratio-above-one")(
    train_with(deepspeed={"scheduler": {"params": {"warmup_min_ratio": 2}}}))
case("deepspeed.scheduler-warmup-type")(train_with(deepspeed={"scheduler": {"params": {"warmup_type": "exp"}}}))


@case("deepspeed.scheduler-param-not-a-number")
def _(s):
    s.train(None, "--set", "deepspeed.scheduler.params.cos_min_ratio=x")


@case("deepspeed.optimizer-params-not-an-object")
def _(s):
    s.train(None, "--set", "deepspeed.optimizer.params=3")


@case("deepspeed.optimizer-type-null")
def _(s):
    s.train(None, "--set", "deepspeed.optimizer.type=null")


@case("deepspeed.optimizer-missing")
def _(s):
    raw = s.config()
    raw["deepspeed"].pop("optimizer")
    s.train(raw)


@case("config.null-for-a-string")
def _(s):
    s.train(None, "--set", "run.dir=null")


@case("config.empty-data-path")
def _(s):
    s.train(None, "--set", "data.path=")

case("deepspeed.offload-at-a-stage-that-ignores-it")(
    train_with(deepspeed={"zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"}}}))
case("deepspeed.offload-nvme-without-path")(
    train_with(deepspeed={"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}))
case("deepspeed.steps-per-print-zero")(train_with(deepspeed={"steps_per_print": 0}))
case("deepspeed.predivide-factor-zero")(train_with(deepspeed={"gradient_predivide_factor": 0}))


@case("deepspeed.gradient-clipping-negative")
def _(s):
    s.train(None, "--set", "deepspeed.gradient_clipping=-1")



@case("deepspeed.monitor-without-its-package")
def _(s):
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here: the refusal needs a machine without it (as the project's venv)")
    s.train(s.config(deepspeed={"wandb": {"enabled": True}}))



@case("deepspeed.optimizer-op-missing-on-this-device")
def _(s):
    s.train(None, "--set", 'deepspeed.optimizer={"type": "Lamb", "params": {"lr": 0.001}}')


@case("deepspeed.optimizer-op-cannot-compile")
def _(s):
    from dist_helpers import without_cuda_toolkit

    without_cuda_toolkit(s.monkeypatch, torch_cuda="13.0")
    # An empty extension cache (no op built by an earlier start), outside the case's folder: looking it up
    # creates the op's folder there, as torch's build would.
    cache = tempfile.mkdtemp(prefix="torch-extensions-")
    s.after_the_case(lambda: shutil.rmtree(cache, ignore_errors=True))
    s.launcher(TORCH_EXTENSIONS_DIR=cache)
    s.train(None, "--set", 'deepspeed.optimizer={"type": "AdamW", "params": {"lr": 0.001}}')


case("deepspeed.unknown-key.zero_optimization")(train_with(deepspeed={"zero_optimization": {"overlap_com": True}}))
case("deepspeed.unknown-key.bf16")(train_with(deepspeed={"bf16": {"enable": True}}))
case("deepspeed.unknown-key.optimizer.params")(train_with(deepspeed={"optimizer": {"params": {"weight_decy": 0.1}}}))
case("deepspeed.unknown-key.scheduler.params")(
    train_with(deepspeed={"scheduler": {"params": {"warmup_num_step": 2}}}))
case("deepspeed.scheduler-value")(
    train_with(deepspeed={"scheduler": {"params": {"warmup_num_steps": 0}}}))
case("deepspeed.optimizer-value")(train_with(deepspeed={"optimizer": {"params": {"lr": -1}}}))
case("deepspeed.optimizer-switch-not-a-boolean")(train_with(deepspeed={"optimizer": {"params": {"fused": "no"}}}))
case("deepspeed.unknown-key.activation_checkpointing")(
    train_with(deepspeed={"activation_checkpointing": {"partition_activation": True}}))
case("deepspeed.activation-checkpointing-empties-inputs")(
    train_with(deepspeed={"activation_checkpointing": {"partition_activations": True}}))


@case("deepspeed.optimizer-untested-at-zero")
def _(s):
    s.train(None, "--set", 'deepspeed.optimizer={"type": "SGD", "params": {"lr": 0.01}}',
            "--set", "deepspeed.zero_optimization.stage=2")


@case("deepspeed.optimizer-cannot-step")
def _(s):
    s.train(None, "--set", 'deepspeed.optimizer={"type": "LBFGS", "params": {"lr": 0.01}}')


case("deepspeed.wrong-type")(train_with(deepspeed={"gradient_clipping": "1.0"}))
case("deepspeed.unknown-optimizer")(train_with(deepspeed={"optimizer": {"type": "AdamWW"}}))
case("deepspeed.grad-accum-dtype-at-stage-0")(train_with(deepspeed={
    "bf16": {"enabled": True}, "zero_optimization": {"stage": 0}, "data_types": {"grad_accum_dtype": "fp32"}}))
case("deepspeed.grad-accum-dtype-bf16-at-stage-1")(train_with(deepspeed={
    "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "fp32"}}))
case("deepspeed.bfloat16-alias")(train_with(deepspeed={"bfloat16": {"enabled": True}}))
case("deepspeed.gradient-accumulation-set")(train_with(deepspeed={"gradient_accumulation_steps": 2}))
case("deepspeed.micro-batch-does-not-divide")(train_with(deepspeed={"train_micro_batch_size_per_gpu": 3}))
case("deepspeed.total-num-steps-differs")(
    train_with(deepspeed={"scheduler": {"params": {"total_num_steps": 10}}}))

# The launch environment (phase 0 refuses these before any process group: no peer is needed)

case("launch.world-size-does-not-divide-streams")(train_with_launcher({"RANK": "0", "WORLD_SIZE": "3"}))
case("launch.micro-batch-per-rank")(
    train_with_launcher({"RANK": "0", "WORLD_SIZE": "2"}, deepspeed={"train_micro_batch_size_per_gpu": 4}))
case("launch.eval-streams-not-a-multiple")(
    train_with_launcher({"RANK": "0", "WORLD_SIZE": "2"}, eval={"n_streams": 3}))


@case("launch.eval-null-streams-not-a-multiple")
def _(s):
    s.launcher(RANK="0", WORLD_SIZE="3")  # the trained run evaluated 2 streams (recorded in its run.json)
    s.eval("--checkpoint", s.trained_run(), "--set", "eval.n_streams=null")


case("launch.rank-outside-world")(train_with_launcher({"RANK": "2", "WORLD_SIZE": "2"}))
case("launch.rank-not-a-number")(train_with_launcher({"RANK": "first", "WORLD_SIZE": "2"}))
case("launch.master-port-out-of-range")(train_with_launcher({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "99999"}))

# The corpus


@case("data.corpus-missing")
def _(s):
    s.values["absent"] = str(s.root / "absent")
    s.train(s.config(data={"path": s.values["absent"]}))


@case("data.corpus-missing-at-eval")
def _(s):
    run = s.trained_run()
    s.values["absent"] = str(s.root / "absent")
    s.eval("--checkpoint", run, "--set", f"data.path={s.values['absent']}")


@case("data.corpus-is-a-file")
def _(s):
    text_file = s.root / "train.txt"
    text_file.write_text("the text a corpus is prepared from\n")
    s.values["text-file"] = str(text_file)
    s.train(s.config(data={"path": str(text_file)}))


@case("data.manifest-missing")
def _(s):
    (s.corpus / "manifest.json").unlink()
    s.train()


@case("data.manifest-path-outside-folder")
def _(s):
    edit_manifest(s.corpus, lambda d: d["splits"]["train"]["files"][0].update(path="../outside.arrow"))
    s.train()


@case("data.arrow-file-missing")
def _(s):
    (s.corpus / "train/00000.arrow").unlink()
    s.train()


@case("data.arrow-file-is-a-folder")
def _(s):
    (s.corpus / "train/00000.arrow").unlink()
    (s.corpus / "train/00000.arrow").mkdir()
    s.train()


@case("data.arrow-file-truncated")
def _(s):
    damage_arrow_file(s, lambda path: path.write_bytes(path.read_bytes()[: path.stat().st_size // 2]))
    s.train()


@case("data.arrow-file-corrupted")
def _(s):
    damage_arrow_file(s, flip_bytes)
    s.train()


@case("data.tokenizer-differs-from-manifest")
def _(s):
    replace_tokenizer(s)
    s.train()


case("data.split-empty")(train_with(data={"train_split": "empty"}))
case("data.split-too-short")(train_with(data={"train_split": "short"}))
case("data.split-unknown")(train_with(data={"valid_split": "dev"}))


@case("data.valid-split-missing")
def _(s):
    # As `python -m data_prep prepare --train FILE` makes it: no valid (nor test) split.
    root = write_corpus(s.root / "train-only", {"train": learnable_stream(4 * 97, VOCAB, 0)}, vocab_size=VOCAB)
    s.values["train-only"] = str(root)
    s.train(s.config(data={"path": str(root)}))



@case("data.eval-split-unknown")
def _(s):
    s.eval("--checkpoint", s.trained_run(), "--set", f"data.path={s.corpus}", "--split", "tset")
case("data.eval-split-too-short")(train_with(eval={"tgt_len": 64}))


@case("data.prep-verify.arrow-file-corrupted")
def _(s):
    damage_arrow_file(s, flip_bytes)
    s.data_prep("verify", s.corpus)


@case("data.prep-verify.manifest-path-outside-folder")
def _(s):
    edit_manifest(s.corpus, lambda d: d["splits"]["train"]["files"][0].update(path="../outside.arrow"))
    s.data_prep("verify", s.corpus)


@case("data.prep-verify.tokenizer-differs-from-manifest")
def _(s):
    replace_tokenizer(s)
    s.values["file-sha"] = sha256_of(s.corpus / "tokenizer.model")[:12]
    s.data_prep("verify", s.corpus)


@case("data.prep-mix.train-tokens-below-the-floor")
def _(s):
    s.data_prep("mix", "--out", s.root / "mix", "--source", f"a={s.corpus}:1", "--world-size", 2, "--n-streams", 8,
                "--train-tokens", 5, "--quiet")


def damage_arrow_file(s: Scene, damage: Callable[[Path], None]) -> None:
    """Damage train/00000.arrow; the placeholders of its sha256 and the manifest's."""
    path = s.corpus / "train/00000.arrow"
    s.values["manifest-sha"] = sha256_of(path)[:12]
    damage(path)
    s.values["file-sha"] = sha256_of(path)[:12]


def replace_tokenizer(s: Scene) -> None:
    path = s.corpus / "tokenizer.model"
    s.values["manifest-sha"] = sha256_of(path)[:12]
    path.write_bytes(b"another tokenizer model")


def sha256_of(path: Path) -> str:
    from txl_dist.data.format import sha256_file

    return sha256_file(path)


# Checkpoints

MODEL_STATES = "mp_rank_00_model_states.pt"


@case("checkpoint.resume-path-is-no-checkpoint")
def _(s):
    s.values["elsewhere"] = str(s.root / "elsewhere")
    (s.root / "elsewhere").mkdir()
    s.train(None, "--resume", s.values["elsewhere"])


@case("checkpoint.resume-path-missing")
def _(s):
    s.values["elsewhere"] = str(s.root / "elsewhere")
    s.train(None, "--resume", s.values["elsewhere"])


@case("checkpoint.model-shape-differs")
def _(s):
    s.trained_run()
    s.train(None, "--set", "model.d_inner=48")


@case("checkpoint.vocab-padding-differs")
def _(s):
    s.trained_run()
    s.train(None, "--set", "model.pad_vocab_multiple=8")


@case("checkpoint.trained-on-other-tokens")
def _(s):
    s.trained_run()
    s.train(s.config(data={"path": str(s.corpus_like("other-tokens", seed=5))}))


@case("checkpoint.trained-with-other-tokenizer")
def _(s):
    s.trained_run()
    s.train(s.config(data={"path": str(other_tokenizer_corpus(s))}))


@case("checkpoint.other-number-of-streams")
def _(s):
    s.trained_run()
    s.train(s.config(deepspeed={"train_batch_size": 2}))


@case("checkpoint.other-zero-stage")
def _(s):
    s.trained_run()
    s.train(s.config(deepspeed={"zero_optimization": {"stage": 1}}))


@case("checkpoint.other-stream-position-settings")
def _(s):
    s.trained_run()
    s.train(None, "--set", "model.tgt_len=4", "--set", "data.roll=true")


@case("checkpoint.other-precision")
def _(s):
    s.trained_run()
    s.train(s.config(train={"precision": "bf16"}))


@case("checkpoint.damaged")
def _(s):
    s.trained_run()
    flip_bytes(s.tag / MODEL_STATES)
    s.train()


@case("checkpoint.resume-none-over-checkpoints")
def _(s):
    s.trained_run()
    s.train(None, "--resume", "none")


@case("checkpoint.foreign-global")
def _(s):
    s.trained_run()
    plant_foreign_global(s.tag, MODEL_STATES)
    s.train()


@case("checkpoint.eval-not-a-checkpoint")
def _(s):
    s.values["elsewhere"] = str(s.root / "elsewhere")
    (s.root / "elsewhere").mkdir()
    s.eval("--checkpoint", s.values["elsewhere"])


@case("checkpoint.eval-path-missing")
def _(s):
    s.values["elsewhere"] = "runs/elsewhere"  # relative: the line says where it looked
    s.values["here"] = os.getcwd()
    s.eval("--checkpoint", s.values["elsewhere"])


@case("checkpoint.eval-with-other-tokenizer")
def _(s):
    s.eval("--checkpoint", s.trained_run(), "--set", f"data.path={other_tokenizer_corpus(s)}")


@case("checkpoint.eval-with-other-tokenizer-and-vocabulary")
def _(s):
    root = s.root / "other-vocabulary"
    write_corpus(root, {name: learnable_stream(80, 48, seed) for seed, name in enumerate(("train", "valid", "test"))},
                 vocab_size=48)
    s.values["other-vocabulary"] = str(root)
    s.eval("--checkpoint", s.trained_run(), "--set", f"data.path={root}")


@case("checkpoint.eval-model-differs")
def _(s):
    s.eval("--checkpoint", s.trained_run(), "--config", s.config_file(s.config(model={"cutoffs": [32, 64]})))


@case("checkpoint.export-damaged")
def _(s):
    s.trained_run()
    flip_bytes(s.tag / MODEL_STATES)
    s.export("--checkpoint", s.run_dir, "--out", s.root / "exported")


def other_tokenizer_corpus(s: Scene) -> Path:
    """The case's tokens, prepared with another tokenizer (of the same vocabulary size)."""
    root = s.corpus_like("other-tokenizer")
    (root / "tokenizer.model").write_bytes(b"another tokenizer model")
    edit_manifest(root, lambda d: d["tokenizer"].update(sha256=sha256_of(root / "tokenizer.model")))
    return root


def plant_foreign_global(tag: Path, name: str) -> None:
    """Replace a file of the tag by a pickle that needs fractions.Fraction (harmless, but no checkpoint
    of this project holds one) and record its checksum, so that only the unpickling check can refuse it."""
    from txl_dist.checkpoint import hash_file

    path = tag / name
    torch.save({"module": Fraction(1, 3)}, path)
    run_json = tag / "txl_state" / "run.json"
    info = json.loads(run_json.read_text())
    info["files"][name] = hash_file(path)
    run_json.write_text(json.dumps(info))


# The run folder


@case("run-folder.held-by-another-job")
def _(s):
    from txl_dist.run_dir import acquire_lock

    lock = acquire_lock(s.run_dir)  # a second open file description conflicts even in this process
    s.after_the_case(lock.release)
    holder = json.loads((s.run_dir / ".lock").read_text())
    s.values |= {"host": holder["host"], "pid": str(holder["pid"]), "since": holder["since"]}
    s.train()


@case("run-folder.cannot-be-created")
def _(s):
    (s.root / "file").write_text("a regular file\n")
    s.values["run"] = str(s.root / "file" / "run")
    s.train(s.config(run={"dir": s.values["run"]}))


@case("run-folder.log-file-unusable")
def _(s):
    (s.run_dir / "logs" / "train.log").mkdir(parents=True)
    s.train()


@case("run-folder.is-the-corpus")
def _(s):
    # <run> stays the case's own (absent) run folder: nothing at all may appear in the corpus, not even a lock.
    s.train(s.config(run={"dir": str(s.corpus)}))


@case("run-folder.in-the-corpus")
def _(s):
    s.train(s.config(run={"dir": str(s.corpus / "run")}))


# Outputs (checked before the checkpoint is read or evaluated; the paths are relative to the case's folder)


@case("output.export-same-folder")
def _(s):
    s.export("--checkpoint", s.trained_run(), "--out", "exported", "--hf", "./exported/")


@case("output.export-below-a-file")
def _(s):
    (s.root / "file").write_text("a regular file\n")
    s.export("--checkpoint", s.trained_run(), "--out", "file/exported")


@case("output.eval-json-out-folder-missing")
def _(s):
    s.eval("--checkpoint", s.trained_run(), "--json-out", "missing/result.json")


@case("output.eval-json-out-is-a-folder")
def _(s):
    (s.root / "results").mkdir()
    s.eval("--checkpoint", s.trained_run(), "--json-out", "results")


@case("output.eval-json-out-in-the-corpus")
def _(s):
    s.eval("--checkpoint", s.trained_run(), "--split", "valid", "--json-out", s.corpus / "manifest.json")


@case("output.eval-json-out-in-a-checkpoint")
def _(s):
    s.eval("--checkpoint", s.trained_run(), "--json-out", s.tag / "txl_state" / "run.json")


@case("output.eval-json-out-a-run-file")
def _(s):
    s.eval("--checkpoint", s.trained_run(), "--json-out", s.run_dir / "config.resolved.json")


@case("output.eval-json-out-in-a-run-folder")
def _(s):
    s.eval("--checkpoint", s.trained_run(), "--json-out", s.run_dir / "logs" / "result.json")


# Tracking


@case("tracking.unusable-uri")
def _(s):
    s.train(s.config(tracking={"enabled": True, "uri": "nosuchscheme://x", "system_metrics": False}))


@case("tracking.unreachable-uri")
def _(s):
    s.values["port"] = str(free_port())  # nothing listens there
    s.train(s.config(tracking={"enabled": True, "uri": f"http://127.0.0.1:{s.values['port']}",
                               "system_metrics": False}))


@case("tracking.empty-store")
def _(s):
    from txl_dist.tracking.journal import TrackingFolder

    database = s.run_dir / "mlflow.db"  # a copy of the run folder cut short: its store of 0 bytes
    folder = TrackingFolder(s.run_dir)
    folder.dir.mkdir(parents=True)
    folder.record("0123456789abcdef0123456789abcdef", f"sqlite:///{database}")
    database.write_bytes(b"")
    s.train(s.config(tracking={"enabled": True, "system_metrics": False}))


# ----------------------------------------------------------------------------------------------------
# The tests

ROWS = read_table() if DOC.is_file() else []
CATEGORIES = ("config", "deepspeed", "launch", "data", "checkpoint", "run-folder", "output", "tracking")


def test_every_row_has_a_case_and_every_case_a_row():
    rows = read_table()
    ids = [r.case for r in rows]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})
    assert sorted(set(ids) - set(CASES)) == [], "rows without a case"
    assert sorted(set(CASES) - set(ids)) == [], "cases without a row"
    assert all(r.entry_point in ENTRY_POINTS for r in rows), [r.entry_point for r in rows]
    categories = [CATEGORIES.index(i.split(".")[0]) for i in ids]
    assert categories == sorted(categories), "rows are grouped by category, in the order of CATEGORIES"


@pytest.mark.parametrize("row", ROWS, ids=[r.case for r in ROWS])
def test_refusal_is_one_line_exit_2_and_writes_nothing(row, scene):
    CASES[row.case](scene)
    assert scene.entry_point == row.entry_point
    assert len(scene.error_lines) == 1, scene.error_lines
    assert message_pattern(f"error: {row.message}", scene.values).fullmatch(scene.error_lines[0]), \
        scene.error_lines[0]
    assert not torch.distributed.is_initialized()
    assert deviations_from_the_promise(scene) == []


def deviations_from_the_promise(scene: Scene) -> list[str]:
    """What the run did beyond exit status 2 and writing nothing (the run folder's lock and log aside)."""
    run_folder = Path(scene.values["run"]).relative_to(scene.root).as_posix()
    # The folder itself appears when the lock is taken in a fresh one.
    may_change = {run_folder} | {f"{run_folder}/{p}" for p in MAY_APPEAR_IN_RUN_FOLDER}
    written = {p: what for p, what in sorted(scene.changed.items()) if p not in may_change or what == "vanished"}
    out = [f"wrote {written}"] if written else []
    if scene.status != EXIT_REFUSED:
        out.append(f"exit status {scene.status}")
    return out


def test_outputs_in_a_checkpoint_its_run_folder_or_a_corpus_are_refused(tmp_path):
    """The output checks behind the output.* rows, for the places the table does not run: a file in a run's
    checkpoints/ folder (its `latest`) or deeper in a corpus, a folder in checkpoints/; the run folder itself
    and a file beside the corpus stay writable."""
    from txl_dist.output_paths import OutputError, check_output_file, check_output_folder

    run = tmp_path / "run"
    tag = run / "checkpoints" / TAG
    (tag / "txl_state").mkdir(parents=True)
    (tag / "txl_state" / "run.json").write_text("{}")
    corpus = make_corpus(tmp_path / "corpus")
    refused = {
        run / "checkpoints" / "latest": f"lies in the checkpoint folder {run / 'checkpoints'} ",
        tag / "mp_rank_00_model_states.pt": f"lies in the checkpoint {tag};",
        corpus / "train" / "00000.arrow": f"lies in the corpus {corpus};",
    }
    for path, why in refused.items():
        with pytest.raises(OutputError, match=f"^--json-out {re.escape(str(path))}: {re.escape(why)}"):
            check_output_file(path, "--json-out")
    with pytest.raises(OutputError, match=f"^--out {re.escape(str(run / 'checkpoints' / 'x'))}: lies in the "
                                          "checkpoint folder"):
        check_output_folder(run / "checkpoints" / "x", "--out")
    assert check_output_file(run / "result.json", "--json-out") == run / "result.json"
    assert check_output_file(tmp_path / "result.json", "--json-out") == tmp_path / "result.json"
    assert check_output_folder(run / "exported", "--out") == run / "exported"


def test_a_trained_run_folder_holds_only_what_the_run_dir_layout_names(trained_run):
    """run_dir.OWN_FILES / OWN_FOLDERS (what `--json-out` may not replace or write into) name every entry a
    training job leaves at the top of its run folder."""
    from txl_dist.run_dir import OWN_FILES, OWN_FOLDERS

    entries = {p.name for p in trained_run.iterdir()}
    assert {"checkpoints", "logs", "config.resolved.json"} <= entries <= {*OWN_FILES, *OWN_FOLDERS}, entries


def test_a_run_folder_in_any_corpus_is_refused(tmp_path):
    """run.dir in a corpus other than data.path (found by its manifest and tokenizer) is refused too; a run folder
    beside the corpus, or one whose name merely starts like it, is not."""
    from txl_dist.run_dir import RunDirUnusable, check_run_dir_place

    corpus, other = make_corpus(tmp_path / "corpus"), make_corpus(tmp_path / "other")
    with pytest.raises(RunDirUnusable, match=f"^run.dir {re.escape(str(other / 'run'))} lies in the corpus "
                                             f"{re.escape(str(other))}; "):
        check_run_dir_place(other / "run", corpus)
    with pytest.raises(RunDirUnusable, match=r"is the corpus folder \(data.path\)"):
        check_run_dir_place(tmp_path / "corpus" / ".", tmp_path / "corpus/")
    check_run_dir_place(tmp_path / "run", corpus)
    check_run_dir_place(tmp_path / "corpus-run", corpus)
