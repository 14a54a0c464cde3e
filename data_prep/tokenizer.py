"""SentencePiece: train a model on the training split, or describe one given with --tokenizer-model.

A trained model has unk_id 0 and an end-of-document control piece "<eod>" (SentencePiece's eos slot, id 1);
no bos or pad. A control piece is never produced by encoding text, so an eod id in the stream always marks
a document end. Training keeps a random sample of sentences (lines of the training documents), so its
memory depends on --tokenizer-sample (about 20 bytes per byte of the sample), not on the corpus size; every
line is read to draw it, so its time does. Its other pieces are then numbered by their
frequency in a sample of those sentences (`_renumber_by_frequency`), as the adaptive input and softmax
expect; a model given with --tokenizer-model is used as it is.

By default (SentencePiece's defaults) the text is not kept as it is: the nmt_* normalizations turn newlines
and tabs into spaces, and extra whitespace (leading, trailing, repeated spaces) is removed, so decoding gives
the words with single spaces. A tokenizer whose ids spell every byte of its text back
(decode(encode(x)) == x) keeps newlines as a piece of their own (newline_piece), keeps every space
(no remove_extra_whitespaces), adds no "▁" before the text (no add_dummy_prefix), leaves the characters
alone (identity normalization) and spells characters outside its vocabulary as UTF-8 byte pieces
(byte_fallback); only a "▁" in the text (SentencePiece's visible space) still decodes as a space, as
SentencePiece has no option to escape it: docs/corpus_format.md, Keeping the text as it is.

`document_cuts` says where a long document may be cut so that encoding its pieces one by one gives the ids
of encoding it whole (data_prep/encode.py encodes long documents in pieces).
"""
from __future__ import annotations

import io
import itertools
import math
import os
import random
import re
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sentencepiece as spm

from data_prep.errors import PrepError
from txl_dist.data.format import TokenizerEntry, sha256_file

MODEL_TYPES = ("unigram", "bpe", "char", "word")
BYTE_FALLBACK_TYPES = ("unigram", "bpe", "char")
"""The model types SentencePiece's byte fallback is offered for (tests/test_data_prep_verbatim.py: char too)."""
EOD_PIECE = "<eod>"
TOKENIZER_FILE = "tokenizer.model"
# Lines are cut to this many characters for training: SentencePiece skips longer sentences entirely.
_MAX_SENTENCE_CHARS = 4096
TRAINING_THREADS = 16
"""Threads SentencePiece trains with, whatever the machine (--num-proc does not change it): the model then
depends only on the text and the options, never on where it was trained."""
MIN_SAMPLE_SENTENCES = 101
"""SentencePiece's smallest input_sentence_size (it refuses 1..100)."""
COVERAGE_RANGE = (0.98, 1.0)
"""SentencePiece's allowed character_coverage."""
RENUMBER_SAMPLE_SENTENCES = 100_000
"""At most this many training sentences (and at most --tokenizer-sample) are counted to number a trained
model's pieces by frequency: enough to order the pieces the adaptive softmax's cutoffs separate (on
Shakespeare, 86.09% of the training tokens in a 1,000-id head against 86.13% in the order of all their
counts), for 0.3 s of encoding on 2 cores, a few percent of the training."""


@dataclass(frozen=True)
class TrainerOptions:
    """How the tokenizer is trained (see `prepare --help`)."""

    vocab_size: int = 4096
    model_type: str = "unigram"
    sample_sentences: int = 1_000_000
    """SentencePiece input_sentence_size: sentences sampled (uniformly, seeded) from the training split."""
    byte_fallback: bool | None = None
    """Unknown characters become UTF-8 byte pieces; None: on for unigram and bpe (off for char, whose corpora
    it would change; not supported for word)."""
    character_coverage: float = 0.9995
    normalization: str = "nmt_nfkc"
    """SentencePiece normalization rule: nmt_nfkc, nfkc, nmt_nfkc_cf, nfkc_cf or identity."""
    newline_piece: bool = False
    """The newline is a piece of its own (SentencePiece's user_defined_symbols): normalization leaves it alone
    (the nmt_* rules would make it a space) and no other piece holds it (the trainer reads lines without it)."""
    remove_extra_whitespaces: bool = True
    """SentencePiece's: drop leading, trailing and repeated spaces (False: every space is a "▁" id)."""
    add_dummy_prefix: bool = True
    """SentencePiece's: a "▁" goes before the text, so that its first word encodes as after a space (False:
    the ids stand for the text's characters only, and a long document can be cut after its newlines)."""
    seed: int = 0
    num_threads: int = TRAINING_THREADS
    """SentencePiece training threads: fixed, not the machine's CPUs, since its unigram training gives another
    model for another thread count."""

    def resolved_byte_fallback(self) -> bool:
        """Byte fallback as it will be used."""
        return self.model_type in ("unigram", "bpe") if self.byte_fallback is None else self.byte_fallback

    def user_defined_symbols(self) -> list[str]:
        """The pieces SentencePiece always keeps whole, never normalizes and never merges."""
        return ["\n"] if self.newline_piece else []


def check_trainer_options(opts: TrainerOptions) -> None:
    """Refuse impossible settings before reading any input."""
    if opts.model_type not in MODEL_TYPES:
        raise PrepError(f"--model-type {opts.model_type!r}: choose one of {', '.join(MODEL_TYPES)}")
    if opts.byte_fallback and opts.model_type not in BYTE_FALLBACK_TYPES:
        raise PrepError(f"--byte-fallback works with {', '.join(BYTE_FALLBACK_TYPES)} models, not "
                        f"{opts.model_type}; drop it or pass --no-byte-fallback")
    fixed = 2 + (256 if opts.resolved_byte_fallback() else 0) + len(opts.user_defined_symbols())
    if opts.vocab_size < fixed + 1:
        extra = [what for what, on in (("256 byte pieces", opts.resolved_byte_fallback()),
                                       ("the newline piece", opts.newline_piece)) if on]
        raise PrepError(f"--vocab-size {opts.vocab_size} is too small: the special pieces"
                        f"{''.join(f' and {e}' for e in extra)} need {fixed}; use at least {fixed + 1}")
    if opts.sample_sentences < MIN_SAMPLE_SENTENCES:
        raise PrepError(f"--tokenizer-sample must be >= {MIN_SAMPLE_SENTENCES} (SentencePiece samples at least "
                        f"that many sentences), got {opts.sample_sentences}")
    low, high = COVERAGE_RANGE
    if not low <= opts.character_coverage <= high:
        raise PrepError(f"--character-coverage must be in [{low}, {high}] (SentencePiece's range), "
                        f"got {opts.character_coverage}")
    if not 1 <= opts.num_threads <= 1024:
        raise PrepError(f"training threads must be in [1, 1024] (SentencePiece's range), got {opts.num_threads}")


_LINE_BREAK = re.compile("\r\n|\r|\n")


def training_sentences(documents: Iterable[str]) -> Iterator[str]:
    """The sentences SentencePiece trains on: the non-empty lines of each document, long lines cut. Lines end
    at "\\n", "\\r\\n" or "\\r": a document keeps its line breaks as they are in its file (sources.py), and
    the trainer reads lines as --line-docs does."""
    for doc in documents:
        for line in _LINE_BREAK.split(doc):
            while len(line) > _MAX_SENTENCE_CHARS:
                cut = line.rfind(" ", 0, _MAX_SENTENCE_CHARS)
                cut = cut if cut > 0 else _MAX_SENTENCE_CHARS
                yield line[:cut]
                line = line[cut:]
            if line.strip():
                yield line


def train_tokenizer(sentences: Iterable[str], out: str | os.PathLike, opts: TrainerOptions,
                    verbose: bool = False) -> Path:
    """Train a SentencePiece model on `sentences` (sampled down to opts.sample_sentences) and write it to out."""
    check_trainer_options(opts)
    spm.set_random_generator_seed(opts.seed)
    model = io.BytesIO()
    feed = _RecordingFeed(sentences, min(opts.sample_sentences, RENUMBER_SAMPLE_SENTENCES), opts.seed,
                          train_on=opts.sample_sentences)
    try:
        _train_off_main_thread(
            feed, model_writer=model,
            vocab_size=opts.vocab_size, model_type=opts.model_type,
            input_sentence_size=opts.sample_sentences, shuffle_input_sentence=True,
            max_sentence_length=4 * _MAX_SENTENCE_CHARS,
            byte_fallback=opts.resolved_byte_fallback(), character_coverage=opts.character_coverage,
            normalization_rule_name=opts.normalization, **_text_keeping_options(opts),
            unk_id=0, eos_id=1, eos_piece=EOD_PIECE, bos_id=-1, pad_id=-1,
            num_threads=opts.num_threads, minloglevel=0 if verbose else 2)
    except (RuntimeError, OSError) as e:
        if feed.error is not None:
            raise feed.error from None
        if feed.count == 0:  # SentencePiece's own words for it: "[!sentences_.empty()]"
            raise PrepError("the training text has no non-empty line (its documents are empty or whitespace); "
                            "give --train inputs with text") from None
        raise PrepError(f"sentencepiece training failed: {_sp_message(e)}") from None
    if feed.error is not None:
        raise feed.error
    out = Path(out)
    out.write_bytes(_renumber_by_frequency(model.getvalue(), feed.sample))
    return out


TRAINING_WAIT_S = 0.2
"""How often the main thread wakes while SentencePiece trains, to run a signal handler that is due."""
CANCEL_WAIT_S = 10.0
"""How long an interrupted job waits for SentencePiece to stop reading sentences (it stops at the next one)."""


def _train_off_main_thread(feed: _RecordingFeed, **options) -> None:
    """spm.SentencePieceTrainer.train(sentence_iterator=feed, **options), run in a thread while the main thread
    waits for it, so that Ctrl-C and SIGTERM stop the job at once.

    After reading its sentences SentencePiece trains in C++ for minutes (a million sentences) without returning
    to Python, and Python runs signal handlers only in the main thread, between bytecodes: trained in the main
    thread, a Ctrl-C or SIGTERM waited for the training to end, and Slurm's SIGKILL, 30 s after its SIGTERM,
    came first and left the job's scratch folder behind. Waiting in short waits lets the handler run within
    TRAINING_WAIT_S wherever the kernel delivered the signal. The interrupted training is abandoned (a daemon
    thread: the process exits without it); its reading stops at the next sentence."""
    failure: list[BaseException] = []
    # Waited for with an event, not Thread.join: a join interrupted by a signal marks a live thread as ended
    # (CPython 3.11, bpo-45274's fix), and the wait below would then not wait.
    ended = threading.Event()

    def train() -> None:
        try:
            spm.SentencePieceTrainer.train(sentence_iterator=iter(feed), **options)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread, which raises it
            failure.append(e)
        finally:
            ended.set()

    try:
        # Started inside the try: a signal that the new thread's first sentences meet may interrupt start()
        # itself (its wait for the thread to run), and the reading must be cancelled and waited for then too.
        threading.Thread(target=train, name="sentencepiece-training", daemon=True).start()
        while not ended.wait(TRAINING_WAIT_S):
            pass
    except BaseException:
        reading = not feed.finished
        feed.cancel()
        # A thread that runs Python code at the interpreter's exit is ended inside SentencePiece's C++ frames,
        # which aborts the process ("terminate called without an active exception"). One still reading stops at
        # its next sentence and returns: wait for that. One training in C++ touches Python again only when the
        # training ends, long after this process has exited: do not wait for it.
        deadline = time.monotonic() + CANCEL_WAIT_S
        while reading and not ended.wait(TRAINING_WAIT_S) and time.monotonic() < deadline:
            pass
        raise
    if failure:
        raise failure[0]


def _renumber_by_frequency(model: bytes, sample: list[str]) -> bytes:
    """The model with its pieces renumbered by how often they occur in `sample`, most frequent first.

    The adaptive input and softmax give the ids below model.cutoffs[0] the full-size head, which pays off only
    when those ids are the frequent ones; SentencePiece numbers its control pieces, then the 256 byte pieces
    (byte fallback), then the others by score or merge order, only loosely by frequency. The unknown and
    control pieces keep their ids (unk_id 0, the eod id 1); every other piece takes a free slot in order of
    its count, ties by its old id, so unseen pieces keep their old order at the end. A piece keeps its string,
    score and type, and segmentation looks pieces up by string and compares scores (ties broken by position
    in the text, never by id), so every text gives the same pieces as before, under new ids."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(model)
    sp = spm.SentencePieceProcessor(model_proto=model)
    ids = sp.encode(sample, num_threads=os.cpu_count() or 1)
    counts = np.bincount(np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64),
                         minlength=len(proto.pieces))
    types = pb.ModelProto.SentencePiece
    for i, piece in enumerate(proto.pieces):
        if piece.piece == "\n" and piece.type == types.USER_DEFINED:
            # The trainer's sentences are lines without their line break: one newline ended each of them.
            counts[i] = len(sample)
    fixed = {types.UNKNOWN, types.CONTROL}
    slots = [i for i, piece in enumerate(proto.pieces) if piece.type not in fixed]
    order = sorted(slots, key=lambda i: (-counts[i], i))
    new_order = list(range(len(proto.pieces)))
    for slot, old in zip(slots, order):
        new_order[slot] = old
    renumbered = pb.ModelProto()
    renumbered.CopyFrom(proto)
    del renumbered.pieces[:]
    renumbered.pieces.extend(proto.pieces[old] for old in new_order)
    return renumbered.SerializeToString()


def _text_keeping_options(opts: TrainerOptions) -> dict:
    """The SentencePiece options that keep more of the text, passed only where they differ from SentencePiece's
    defaults: a value passed is written into the model file even when it is the default, which would change
    the file (and its sha256, recorded by corpora and checkpoints) of every tokenizer trained before them."""
    options = {"user_defined_symbols": opts.user_defined_symbols(),
               "remove_extra_whitespaces": opts.remove_extra_whitespaces, "add_dummy_prefix": opts.add_dummy_prefix}
    defaults = {"user_defined_symbols": [], "remove_extra_whitespaces": True, "add_dummy_prefix": True}
    return {name: value for name, value in options.items() if value != defaults[name]}


class _Cancelled(Exception):
    """Raised to SentencePiece by a cancelled feed."""


class _RecordingFeed:
    """The sentences for SentencePiece, keeping what their reading raised: SentencePiece aborts on it but turns
    it into a RuntimeError of several lines (an input's one-line refusal inside its own C++ message).

    Given `train_on`, it hands SentencePiece a uniform sample of at most that many of them, seeded, in the order
    they were read (all of them where there are no more): SentencePiece's own sampling (input_sentence_size)
    draws from a generator its seed does not reach (sentencepiece 0.2: set_random_generator_seed changed
    nothing), so each run of the same command trained another tokenizer. Handed no more than that, it samples
    nothing. The whole split is read before the first sentence is handed over. It also keeps a second uniform
    sample, of at most `keep` sentences (reservoir sampling, seeded), which the pieces are counted on."""

    def __init__(self, sentences: Iterable[str], keep: int = 0, seed: int = 0, train_on: int | None = None):
        self.sentences = sentences
        self.error: BaseException | None = None
        self.count = 0
        """Sentences read so far."""
        self.keep = keep
        self.sample: list[str] = []
        self._rng = random.Random(seed)
        self._training_sample = _SkippingReservoir(train_on, random.Random(f"sentencepiece sample {seed}")) \
            if train_on is not None else None
        self._cancelled = threading.Event()
        self.finished = False
        """Whether the feed has ended (all read, failed or cancelled)."""

    def cancel(self) -> None:
        """Stop feeding: the job was interrupted, nobody waits for the training any more."""
        self._cancelled.set()

    def __iter__(self) -> Iterator[str]:
        try:
            for sentence in self.sentences:
                if self._cancelled.is_set():
                    raise _Cancelled()  # SentencePiece stops reading, and trains nothing
                if self.count < self.keep:
                    self.sample.append(sentence)
                else:
                    j = self._rng.randrange(self.count + 1)
                    if j < self.keep:
                        self.sample[j] = sentence
                self.count += 1
                if self._training_sample is None:
                    yield sentence
                else:
                    self._training_sample.offer(sentence)
            if self._training_sample is not None:
                for sentence in self._training_sample.in_order():
                    if self._cancelled.is_set():
                        raise _Cancelled()
                    yield sentence
        except BaseException as e:  # noqa: BLE001 - also Ctrl-C and SIGTERM, re-raised as they were
            self.error = e
            raise
        finally:
            self.finished = True


class _SkippingReservoir:
    """A uniform sample of at most `size` of the items offered (reservoir sampling that draws how many items to
    skip, Li's algorithm L: O(size * log(n / size)) draws for n items instead of one per item); in_order()
    gives them in the order they were offered."""

    def __init__(self, size: int, rng: random.Random):
        self.size, self._rng = size, rng
        self._items: list[tuple[int, str]] = []
        self._offered = 0
        self._w = 1.0
        self._next = 0
        """Once the reservoir is full: the index of the next item it takes (drawn by _skip)."""

    def _uniform(self) -> float:
        return 1.0 - self._rng.random()  # in (0, 1]: its log is finite

    def _skip(self) -> None:
        self._w *= math.exp(math.log(self._uniform()) / self.size)
        self._next += (math.floor(math.log(self._uniform()) / math.log1p(-self._w)) if self._w < 1.0 else 0) + 1

    def offer(self, item: str) -> None:
        i = self._offered
        self._offered += 1
        if i < self.size:
            self._items.append((i, item))
            if i + 1 == self.size:
                self._next = i
                self._skip()
        elif i == self._next:
            self._items[self._rng.randrange(self.size)] = (i, item)
            self._skip()

    def in_order(self) -> list[str]:
        return [item for _, item in sorted(self._items, key=lambda pair: pair[0])]


def _sp_message(e: Exception) -> str:
    """SentencePiece's error text on one line, without the C++ source location, in this CLI's option names."""
    text = " ".join(str(e).split())
    if text.lower().startswith("internal:") and "] " in text:
        text = text.split("] ", 1)[1]
    for theirs, ours in (("Please set it to a value <=", "use --vocab-size <="),
                         ("Increase vocab_size", "increase --vocab-size"),
                         ("--character_coverage option", "--character-coverage")):
        text = text.replace(theirs, ours)
    return text


def load_processor(path: str | os.PathLike) -> spm.SentencePieceProcessor:
    """Load a SentencePiece model; a one-line error names the file when it is not one."""
    path = Path(path)
    if path.is_dir():
        raise PrepError(f"tokenizer {path}: is a folder; give the model file (e.g. {path / TOKENIZER_FILE})")
    if not path.is_file():
        raise PrepError(f"tokenizer {path}: no such file")
    try:
        with open(path, "rb"):
            pass  # SentencePiece would call an unreadable file "not a model"
    except OSError as e:
        raise PrepError(f"tokenizer {path}: cannot be read ({e.strerror}); check its permissions") from None
    sp = spm.SentencePieceProcessor()
    try:
        sp.load(str(path))
    except (RuntimeError, OSError) as e:
        raise PrepError(f"tokenizer {path}: not a SentencePiece model ({_sp_message(e)})") from None
    return sp


def describe_tokenizer(path: str | os.PathLike, eod_piece: str | None = None) -> TokenizerEntry:
    """The manifest entry of a model file: sha256, vocabulary size, type and special ids.

    The end-of-document id is the model's eos piece, or `eod_piece` when given (a model without eos needs it).
    """
    path = Path(path)
    sp = load_processor(path)
    if eod_piece is not None:
        eod_id = sp.piece_to_id(eod_piece)
        if eod_id == sp.unk_id() and eod_piece != sp.id_to_piece(sp.unk_id()):
            raise PrepError(f"tokenizer {path}: --eod-piece {eod_piece!r} is not in its vocabulary")
        # encoding text never produces a control piece, so only one can mark document ends unambiguously
        if not sp.is_control(eod_id) or eod_id == sp.unk_id():
            raise PrepError(f"tokenizer {path}: --eod-piece {eod_piece!r} is not a control piece (text can "
                            f"encode to it); pass one of its control pieces: {control_pieces(sp)}")
    else:
        eod_id = sp.eos_id()
        if eod_id < 0:
            raise PrepError(f"tokenizer {path} has no eos piece to end documents with; "
                            "pass --eod-piece PIECE naming one of its control pieces")
    return TokenizerEntry(file=TOKENIZER_FILE, sha256=sha256_file(path), vocab_size=sp.get_piece_size(),
                          model_type=model_type(path), eod_id=eod_id, unk_id=sp.unk_id(), bos_id=sp.bos_id(),
                          pad_id=sp.pad_id())


TRAINING_OPTIONS = {"vocab_size": "--vocab-size", "model_type": "--model-type",
                    "sample_sentences": "--tokenizer-sample", "byte_fallback": "--byte-fallback",
                    "character_coverage": "--character-coverage", "normalization": "--normalization",
                    "newline_piece": "--newline-piece", "remove_extra_whitespaces": "--remove-extra-whitespaces",
                    "add_dummy_prefix": "--add-dummy-prefix"}
"""TrainerOptions field -> its command-line option (seed and threads are no option of their own here)."""


def check_trained_with(path: str | os.PathLike, given: dict) -> None:
    """Refuse tokenizer-training options (TrainerOptions field -> value) that the reused model at `path` was not
    trained with: they cannot change it, and passing them over would record values that did not apply. Those
    it was trained with are accepted, so that one set of options can serve the tokenizer job and the jobs that
    reuse its model (launch/slurm/prep.sh)."""
    if not given:
        return
    load_processor(path)  # its one-line refusals of a missing file or a file that is no model
    actual = trained_values(_model_proto(path))
    wrong = [f"{_option_text(name, value)} (the model's: {_model_text(name, actual[name])})"
             for name, value in given.items() if not _agrees(name, value, actual)]
    if wrong:
        raise PrepError(f"--tokenizer-model {path} was not trained with {', '.join(wrong)}; tokenizer-training "
                        "options cannot change a reused model: drop them or give the model's values")


def trained_values(proto) -> dict:
    """What a model was trained with, by TrainerOptions field (vocab_size: the size SentencePiece recorded,
    which is the number of pieces unless the model was trained without a hard limit)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    spec, norm = proto.trainer_spec, proto.normalizer_spec
    return {"vocab_size": spec.vocab_size or len(proto.pieces), "model_type": model_type_of(proto),
            "sample_sentences": spec.input_sentence_size, "byte_fallback": spec.byte_fallback,
            "character_coverage": spec.character_coverage, "normalization": norm.name,
            "newline_piece": any(p.piece == "\n" and p.type == pb.ModelProto.SentencePiece.USER_DEFINED
                                 for p in proto.pieces),
            "remove_extra_whitespaces": norm.remove_extra_whitespaces, "add_dummy_prefix": norm.add_dummy_prefix}


def _agrees(name: str, given, actual: dict) -> bool:
    if name == "vocab_size" and actual["model_type"] == "char":
        # A char model has a piece per character up to the size asked for, and records the size it reached:
        # asked for more, it would have come out the same.
        return given >= actual["vocab_size"]
    if isinstance(given, float):  # the model file keeps the coverage as a float32
        return abs(given - actual[name]) < 1e-6
    return given == actual[name]


def _model_text(name: str, value) -> str:
    if isinstance(value, bool):
        return _option_text(name, value)
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _option_text(name: str, value) -> str:
    option = TRAINING_OPTIONS[name]
    if name == "newline_piece":
        return option if value else "no newline piece"
    if isinstance(value, bool):
        return option if value else f"--no-{option[2:]}"
    if isinstance(value, float):
        return f"{option} {value:.6g}"
    return f"{option} {value}"


def control_pieces(sp: spm.SentencePieceProcessor, most: int = 8) -> str:
    """The model's control pieces (never produced by encoding text), quoted, for a message."""
    pieces = [repr(sp.id_to_piece(i)) for i in range(sp.get_piece_size()) if sp.is_control(i)]
    return ", ".join(pieces[:most]) + (f" (and {len(pieces) - most} more)" if len(pieces) > most else "") or "none"


def model_type(path: str | os.PathLike) -> str:
    """unigram, bpe, word or char, read from the model's trainer spec."""
    return model_type_of(_model_proto(path))


def sp_model_proto(sp: spm.SentencePieceProcessor):
    """The ModelProto of a loaded model (no second read of its file)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(sp.serialized_model_proto())
    return proto


def model_type_of(proto) -> str:
    """unigram, bpe, word or char, from a ModelProto."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    return pb.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type).lower()


def _model_proto(path: str | os.PathLike):
    # sentencepiece ships the protobuf schema of its model file; protobuf comes with mlflow.
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    try:
        proto.ParseFromString(Path(path).read_bytes())
    except Exception as e:  # protobuf's DecodeError is not exported under a stable name
        raise PrepError(f"tokenizer {path}: cannot parse the model file ({e})") from None
    return proto


SPACE = "\u2581"
"""SentencePiece's visible space ("▁"), which escaped whitespace becomes."""
BUILTIN_NORMALIZATIONS = ("nmt_nfkc", "nfkc", "nmt_nfkc_cf", "nfkc_cf", "identity")
"""The rules `--normalization` offers: no rule of theirs maps a sequence holding a space or newline, so a cut
after one never splits a normalization (tests/test_data_prep_pieces.py checks each on real models)."""


@dataclass(frozen=True)
class DocumentCuts:
    """Where a document may be cut for this tokenizer: just after one of `chars` (in order of preference),
    or nowhere (`chars` empty, `why_not` says why)."""

    chars: tuple[bytes, ...]
    why_not: str = ""


def document_cuts(path: str | os.PathLike) -> DocumentCuts:
    """The characters after which a document may be cut: encoding the pieces one by one then gives exactly the
    ids of the whole document.

    Why a cut after whitespace is exact: with SentencePiece's default normalizer flags (a dummy "▁" prefix,
    extra whitespace removed, whitespace escaped as "▁"), the normalized whole is the normalized first piece
    (its trailing whitespace dropped) followed by the normalized second (its leading whitespace dropped, the
    dummy prefix standing for the run of whitespace between them). The ids then agree when no vocabulary
    piece holds a "▁" after its first character (no piece can span the cut), "▁" is a piece of its own (no
    unknown-piece run is merged across the cut, as SentencePiece merges consecutive unknowns) and the model
    is not `word` (which makes a whole unknown word one unknown id and merges unknown words: two unknown
    words on either side of a cut would become two ids instead of one). A newline is whitespace to the nmt_*
    normalizations only (the others keep it as a character): those cut after newlines, the others after
    spaces. A normalizer that keeps the text (neither a dummy prefix nor whitespace removal) cuts after
    newlines when "\n" is a user-defined piece (`_verbatim_cuts`). (Unigram models sum path scores in float32,
    so at near-ties a long text encoded in one call may choose differently than its pieces:
    docs/corpus_format.md, Long documents.)
    """
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = _model_proto(path)
    norm, kind = proto.normalizer_spec, model_type_of(proto)
    types = pb.ModelProto.SentencePiece
    if kind not in ("unigram", "bpe", "char"):
        return DocumentCuts((), f"its model type is {kind}")
    if norm.name not in BUILTIN_NORMALIZATIONS:
        return DocumentCuts((), f"its normalization rule {norm.name!r} is none of {', '.join(BUILTIN_NORMALIZATIONS)}")
    if proto.trainer_spec.treat_whitespace_as_suffix:
        return DocumentCuts((), "it treats whitespace as a suffix")
    if not norm.add_dummy_prefix and not norm.remove_extra_whitespaces:
        return _verbatim_cuts(proto)
    if not (norm.add_dummy_prefix and norm.remove_extra_whitespaces and norm.escape_whitespaces):
        return DocumentCuts((), "its normalizer keeps extra whitespace or has no dummy prefix")
    words = [p.piece for p in proto.pieces if p.type in (types.NORMAL, types.USER_DEFINED)]
    if SPACE not in words:
        return DocumentCuts((), f"{SPACE!r} is not a piece of its vocabulary")
    if any(SPACE in w[1:] for w in words):
        return DocumentCuts((), f"a piece of its vocabulary holds {SPACE!r} after its first character")
    user = [p.piece for p in proto.pieces if p.type == types.USER_DEFINED]
    sp = load_processor(path)
    chars = tuple(c.encode() for c in ("\n", " ")
                  if sp.normalize(f"a{c}b") == f"{SPACE}a{SPACE}b" and not any(c in u for u in user))
    return DocumentCuts(chars, "" if chars else "neither a newline nor a space is whitespace to it")


def _verbatim_cuts(proto) -> DocumentCuts:
    """Cuts for a normalizer without a dummy prefix and without whitespace removal (--newline-piece
    --no-remove-extra-whitespaces --no-add-dummy-prefix): it adds nothing at the start of a text and drops no
    whitespace, and no built-in rule maps a sequence holding a newline, so the normalized whole is its
    normalized pieces end to end. Just after a newline that is a user-defined piece (always one id, never
    normalized) and that no other piece holds, no id can span the cut, so each side is encoded alone: a char
    model one character at a time, BPE merging pairs that never include the newline, unigram's best path
    passing through it (up to its float32 sums, as for the other cuts); nor can a run of unknown characters
    (one id) reach across it."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    holding_newline = [(p.piece, p.type) for p in proto.pieces if "\n" in p.piece]
    if holding_newline != [("\n", pb.ModelProto.SentencePiece.USER_DEFINED)]:
        return DocumentCuts((), "its normalizer keeps whitespace and has no dummy prefix, but a newline is not "
                                "a user-defined piece of its own (--newline-piece)")
    return DocumentCuts((b"\n",))
