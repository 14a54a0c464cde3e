"""Text generation with Transformer-XL memory: incremental decoding against cached mems.

```python
from txl_dist.generation import GenerationSession, SamplingSettings, generate
session = GenerationSession(model, mem_len=192, seed=0)   # model.eval() first; pure torch, any device
session.feed(prompt_ids)               # the prompt, read in segments of chunk_len that fill the memory
session.expand(4)                      # 4 streams share the prompt's mems (batch 1 -> 4)
ids = session.sample(60, SamplingSettings(temperature=0.8, top_k=40))   # [4, 60]; each token one forward
session.feed(more_ids)                 # [4, n] or [n] (the same tokens for every stream); then sample again
state = session.state_dict()           # mems, next log-probs, RNG, token count: torch.save-able, versioned
text_session = GenerationSession(model, tokenizer=Tokenizer("data/shakespeare/tokenizer.model"))
text_session.feed("ROMEO.")            # text: the first one starts a document (end-of-document id first)
text_session.sample_text(40)           # ["..."]: the continuation, one string per stream
text_session.finish_text()             # [""]: what sample_text held back (a character its bytes had not finished)
GenerationSession(model, mem_len=192).load_state_dict(state)   # continues exactly where it was
```

Decoding: the prompt is read in segments of `chunk_len` tokens (default the model's tgt_len), each against
the mems of the previous ones, as in evaluation; then every new token is one segment of length 1 against
the cached mems, so the cost of a token depends on mem_len, not on how much was generated. With mem_len at
least the whole context, the log-probabilities are those of re-running the full context (tests prove it).

Attention: the session's forwards never use the model's attn_impl "flex" or "triton" (`decoding_attn_impl`; the
fused Triton kernels' tiles hold 64 query rows where a decoding forward has one). Compiled
FlexAttention has static shapes, one kernel per key length, and here almost every forward brings a new one (a
one-token segment against mems that grow by one token up to mem_len, prompt pieces of any length): a compile
per token for the first mem_len tokens, then, past FLEX_RECOMPILE_LIMIT, an unfused eager fallback. The
implementations compute the same attention (tested against each other), so a flex model decodes with what
"auto" picks statically for its device and dtype: matmul on CUDA and mostly on a CPU (sdpa for bf16 on a CPU
without native bf16). A one-token query writes a [B*H, 1, K] score tensor, which no fused kernel would save.
The session passes that implementation to each forward; the model's own attn_impl is left as it is.

Memory settings: same_length is off. With one-token segments every query already attends to the same number
of keys (mem_len + 1), which is what same_length enforces for the multi-token segments of evaluation; turning
it on would only hide the oldest state, and in a prompt segment it would take context from its later tokens.
clamp_len defaults to the model's training value.

Sampling: temperature, then top-k, then top-p (nucleus), in float64 on the CPU with the session's own
torch.Generator (never the global RNG), so a seed gives the same tokens on every device up to the logits'
numerics. Greedy decoding (SamplingSettings(greedy=True)) takes the most probable token (lowest id on ties).
"""
from __future__ import annotations

import codecs
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from txl_dist.config import MemorySettings
from txl_dist.errors import Refused
from txl_dist.progress import Progress
from txl_dist.model.attention import resolve_attn_impl

STATE_VERSION = 1
"""Version of GenerationSession.state_dict(); load_state_dict refuses any other."""


class GenerationError(Refused, ValueError):
    """A generation argument the session will not work with; one line naming it and the fix."""


SEED_MAX = 2**64 - 1
"""The largest seed: torch.Generator keeps 64 unsigned bits. It also takes negative seeds, but maps them onto
the same range (-1 is 2**64 - 1), so a seed is refused unless it is in [0, SEED_MAX]."""


def check_seed(seed: int | None, name: str = "seed") -> None:
    """Refuse a seed torch.Generator cannot take (it would raise a bare overflow error) or would alias."""
    if seed is None:
        return
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= SEED_MAX:
        raise GenerationError(f"{name} must be an integer in [0, 2**64 - 1], got {seed!r}")


# ----------------------------------------------------------------------------------------------------
# Sampling


@dataclass(frozen=True)
class SamplingSettings:
    """How the next token is chosen from the model's log-probabilities."""

    temperature: float = 1.0
    """Divides the log-probabilities before sampling (< 1 sharper, > 1 flatter); must be > 0 when sampling."""
    top_k: int = 0
    """Sample only among the k most probable tokens (ties with the k-th kept); 0 = no limit."""
    top_p: float = 1.0
    """Nucleus: sample among the fewest most probable tokens whose probabilities sum to >= top_p; in (0, 1]."""
    greedy: bool = False
    """Take the most probable token (temperature, top_k and top_p are then not used)."""

    def check(self) -> None:
        """Refuse settings that cannot sample (one line naming the setting)."""
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise GenerationError(f"top_k must be an integer >= 0 (0 = no limit), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise GenerationError(f"top_p must be in (0, 1] (1 = no nucleus filter), got {self.top_p!r}")
        if self.greedy:
            return
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature > 0):
            raise GenerationError(f"temperature must be > 0 when sampling, got {self.temperature!r}; "
                                  "use greedy decoding for the most probable token")


def filter_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """logits [..., V] with every token below the k-th largest of its row set to -inf (ties kept); 0 = all."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]                       # [..., 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """logits [..., V] keeping, per row, the fewest most probable tokens whose probabilities reach top_p.

    A token is dropped when the tokens more probable than it already sum to >= top_p; the most probable
    token always stays, however small top_p is. Computed in float64 (a top_p below float32's smallest
    number, e.g. 1e-46, would otherwise round to 0 and drop every token); returns float64 logits.
    """
    if top_p >= 1.0:
        return logits
    logits = logits.double()
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)             # [..., V]
    probs = torch.softmax(sorted_logits, dim=-1)                                   # [..., V]
    mass_before = torch.cumsum(probs, dim=-1) - probs                              # [..., V]
    drop_sorted = mass_before >= top_p                                             # [..., V]
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)           # [..., V]
    return logits.masked_fill(drop, float("-inf"))


def next_tokens(log_probs: torch.Tensor, sampling: SamplingSettings,
                generator: torch.Generator | None) -> torch.Tensor:
    """log_probs [B, V] (float32, CPU) -> the chosen token ids [B] (int64).

    Sampling works in float64 with the most probable token of each row at 0 before the temperature divides:
    every other logit is then <= 0, so a tiny temperature (1e-38, 1e-300) sends them to -inf but never the
    best one, and sampling becomes greedy (ties among the best shared at random) instead of all -inf (NaN).
    """
    if sampling.greedy:
        return torch.argmax(log_probs, dim=-1)
    logits = log_probs.double()                                                    # [B, V]
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / sampling.temperature  # [B, V]
    logits = filter_top_p(filter_top_k(logits, sampling.top_k), sampling.top_p)   # [B, V]
    probs = torch.softmax(logits, dim=-1)                                          # [B, V]
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)            # [B]


# ----------------------------------------------------------------------------------------------------
# The attention a session decodes with


def decoding_attn_impl(attn_impl: str, device: torch.device, dtype: torch.dtype) -> str:
    """The attention implementation a session's forwards use for a model whose attn_impl is `attn_impl`.

    "flex" (compiled per key length, and nearly every decoding forward has a new one: the module doc) becomes
    what "auto" means statically on `device` for `dtype` (resolve_attn_impl), matmul should that ever be flex;
    so does "triton" (its tiles hold 64 query rows, a decoding forward has one, and every new power of two of
    key lengths would time its tiles again); every other name, "auto" included, stays as it is.
    """
    if attn_impl not in ("flex", "triton"):
        return attn_impl
    impl = resolve_attn_impl("auto", device, dtype)
    return "matmul" if impl in ("flex", "triton") else impl


def default_mem_len(cfg) -> int:
    """A session's mem_len when none is given: the model's mem_len + tgt_len, the widest context a training
    token saw (its memory and the earlier tokens of its segment)."""
    return cfg.mem_len + cfg.tgt_len


# ----------------------------------------------------------------------------------------------------
# The session


class GenerationSession:
    """Streams of text with their Transformer-XL memory: feed tokens, sample tokens, save, restore.

    Holds, per stream, the mems after the tokens read so far and the log-probabilities of the next token;
    the model's own state is never changed (pass it in eval mode). All streams read the same number of
    tokens (n_tokens). A fresh session has no streams' state yet: the first feed makes `batch_size` streams.
    """

    def __init__(self, model: torch.nn.Module, *, mem_len: int | None = None, clamp_len: int | None = None,
                 chunk_len: int | None = None, seed: int | None = None, tokenizer: Tokenizer | None = None):
        """model: a TransformerXL (eval mode); mem_len: hidden states kept per layer (None: the model's
        mem_len + tgt_len, the widest context a training token saw); clamp_len: None = the model's;
        chunk_len: prompt tokens per forward (None: the model's tgt_len); seed: of the session's torch.Generator
        (None: a random seed, still saved in state_dict); tokenizer: lets feed take text and sample_text
        return it."""
        if model.training:
            raise GenerationError("the model is in training mode (dropout on); call model.eval() before generating")
        cfg = model.config
        mem_len = default_mem_len(cfg) if mem_len is None else mem_len
        clamp_len = cfg.clamp_len if clamp_len is None else clamp_len
        chunk_len = cfg.tgt_len if chunk_len is None else chunk_len
        for name, value, low in (("mem_len", mem_len, 0), ("chunk_len", chunk_len, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise GenerationError(f"{name} must be an integer >= {low}, got {value!r}")
        if not isinstance(clamp_len, int) or isinstance(clamp_len, bool):
            raise GenerationError(f"clamp_len must be an integer (<= 0: no clamping), got {clamp_len!r}")
        check_seed(seed)
        self.model = model
        self.memory = MemorySettings(mem_len=mem_len, clamp_len=clamp_len, same_length=False)
        """What every forward of this session passes to the model (same_length off: see the module doc)."""
        self.chunk_len = chunk_len
        self.tokenizer = tokenizer
        self.generator = torch.Generator(device="cpu")
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self.mems: list[torch.Tensor] | None = None
        """n_layer x [batch, <= mem_len, d_model] on the model's device; None before the first token."""
        self.next_log_probs: torch.Tensor | None = None
        """float32 [batch, vocab] on the CPU: the distribution of each stream's next token."""
        self.n_tokens = 0
        """Tokens each stream has read (prompt and sampled)."""
        self.text_context: list[list[int]] | None = None
        """Per stream: the last ids read, as few as the text after them needs (Tokenizer.text_context): text is
        decoded after them, so that pieces join and a new document starts after a blank line."""
        self.unshown: list[tuple[list[int], list[int]]] | None = None
        """Per stream: the ids sample_text's next text continues (as text_context), and the sampled ids whose
        text it held back (the first bytes of a character spelled in byte pieces); None: nothing held back,
        the text continues text_context."""
        self._batch_size = 0

    # -- properties --------------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        """Number of streams (0 before the first feed)."""
        return self._batch_size

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # -- reading and sampling ----------------------------------------------------------------------

    def feed(self, tokens: torch.Tensor | Sequence[int] | str) -> torch.Tensor:
        """Read tokens: ids [n] (the same for every stream) or [batch, n], or text (through the tokenizer;
        the first text of a fresh session starts a document); returns next_log_probs [batch, V].

        Read in segments of chunk_len, each against the mems of what came before. Text that sample_text held
        back (an unfinished character) is dropped: call finish_text() first to have it.
        """
        if isinstance(tokens, str):
            if self.tokenizer is None:
                raise GenerationError("feeding text needs a tokenizer: GenerationSession(model, tokenizer=...)")
            tokens = self.tokenizer.encode(tokens, start_of_document=self.n_tokens == 0)
        ids = self._as_batch(tokens)                                               # [B, n]
        # Text held back by sample_text comes before the fed tokens: later samples can no longer finish it.
        self.unshown = None
        return self._read(ids)

    def _read(self, ids: torch.Tensor) -> torch.Tensor:
        """Run the model over ids [B, n] against the mems; returns next_log_probs [B, V]."""
        weight = next(self.model.parameters())
        attn_impl = decoding_attn_impl(self.model.attn_impl, weight.device, weight.dtype)
        n = ids.shape[1]
        progress = Progress("reading the prompt", n, "tokens")  # a long prompt takes minutes on a CPU
        with torch.no_grad():
            for start in range(0, n, self.chunk_len):
                if start:  # not after the last segment: the read ends there
                    progress.update(start, start)
                segment = ids[:, start:start + self.chunk_len].to(self.device)     # [B, T]
                out = self.model(segment, mems=self.mems, memory=self.memory, attn_impl=attn_impl)
                # mem_len 0 leaves empty mems; keep None so the next forward has no memory at all.
                self.mems = out.mems if self.memory.mem_len > 0 else None
            last = out.hidden[:, -1]                                               # [B, d_model]
            self.next_log_probs = self.model.log_probs(last).float().cpu()         # [B, V]
        self.n_tokens += n
        if self.tokenizer is None:  # no text to decode: the last id stands in
            self.text_context = ids[:, -1:].tolist()
        else:
            earlier = self.text_context or [[] for _ in range(ids.shape[0])]
            self.text_context = [self.tokenizer.text_context(before + row) for before, row in
                                 zip(earlier, ids.tolist())]
        return self.next_log_probs

    def sample(self, n: int, sampling: SamplingSettings = SamplingSettings()) -> torch.Tensor:
        """Choose and read n tokens per stream, one forward of length 1 each; returns them [batch, n].

        After the call the session has read them too: feed more text or sample again to continue.
        """
        sampling.check()
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise GenerationError(f"the number of tokens to sample must be an integer >= 0, got {n!r}")
        if self.next_log_probs is None:
            raise GenerationError("nothing to continue from: feed at least one token (e.g. the end-of-document "
                                  "id to start a new document) before sampling")
        chosen = []
        for _ in range(n):
            token = next_tokens(self.next_log_probs, sampling, self.generator)     # [B]
            chosen.append(token)
            self._read(self._as_batch(token.view(-1, 1)))
        return torch.stack(chosen, dim=1) if chosen else torch.empty(self.batch_size, 0, dtype=torch.long)

    def sample_text(self, n: int, sampling: SamplingSettings = SamplingSettings()) -> list[str]:
        """sample(n) as text, one string per stream, that joins the text read before (needs the tokenizer).

        Streaming: a character whose byte pieces are not all sampled yet is held back until a later call
        finishes it, so that the strings of many calls join into the text of one call; finish_text() returns
        what is still held back.
        """
        if self.tokenizer is None:
            raise GenerationError("sample_text needs a tokenizer: GenerationSession(model, tokenizer=...)")
        pending = self._pending_text()
        ids = self.sample(n, sampling)                                             # [B, n]
        texts, self.unshown = [], []
        for (context, earlier), row in zip(pending, ids.tolist()):
            unseen = earlier + row
            held = self.tokenizer.unfinished_tail(unseen)
            shown = unseen[:len(unseen) - held]
            texts.append(self.tokenizer.decode_after(context, shown))
            self.unshown.append((self.tokenizer.text_context(context + shown), unseen[len(shown):]))
        return texts

    def finish_text(self) -> list[str]:
        """The text sample_text held back, one string per stream, as decode gives it (an unfinished character
        is U+FFFD): call it when sampling ends; "" for a stream with nothing held back."""
        if self.tokenizer is None:
            raise GenerationError("finish_text needs a tokenizer: GenerationSession(model, tokenizer=...)")
        unshown = self.unshown if self.unshown is not None else [([], [])] * self.batch_size
        texts = [self.tokenizer.decode_after(context, held) for context, held in unshown]
        self.unshown = None
        return texts

    def _pending_text(self) -> list[tuple[list[int], list[int]]]:
        """Per stream: the ids the next text continues, and the ids whose text is held back."""
        if self.unshown is not None:
            return [(list(context), list(held)) for context, held in self.unshown]
        contexts = self.text_context or [[] for _ in range(self.batch_size)]
        return [(list(context), []) for context in contexts]

    def expand(self, batch_size: int) -> None:
        """Make `batch_size` streams of the one stream read so far (they share its mems and next token)."""
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise GenerationError(f"the number of streams must be an integer >= 1, got {batch_size!r}")
        if self.batch_size != 1:
            raise GenerationError(f"expand needs a session of 1 stream that has read its prompt; this one has "
                                  f"{self.batch_size}")
        if self.mems is not None:
            self.mems = [m.expand(batch_size, -1, -1).contiguous() for m in self.mems]  # [B, mlen, d_model]
        self.next_log_probs = self.next_log_probs.expand(batch_size, -1).contiguous()   # [B, V]
        self.text_context = [list(self.text_context[0]) for _ in range(batch_size)]
        if self.unshown is not None:
            self.unshown = [(list(self.unshown[0][0]), list(self.unshown[0][1])) for _ in range(batch_size)]
        self._batch_size = batch_size

    # -- state -------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything to continue this session later (CPU tensors; torch.save / torch.load(weights_only=True))."""
        return {
            "version": STATE_VERSION,
            "memory": dataclasses.asdict(self.memory),
            "chunk_len": self.chunk_len,
            "n_tokens": self.n_tokens,
            "batch_size": self.batch_size,
            "mems": None if self.mems is None else [m.detach().cpu() for m in self.mems],
            "next_log_probs": None if self.next_log_probs is None else self.next_log_probs.clone(),
            "text_context": None if self.text_context is None else [list(ids) for ids in self.text_context],
            "unshown_text": None if self.unshown is None else [[list(c), list(h)] for c, h in self.unshown],
            "rng_state": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a saved session: same memory settings, a model of the same shape."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            version = state.get("version") if isinstance(state, dict) else None
            raise GenerationError(f"generation state version {version!r} is not {STATE_VERSION}; restore it with "
                                  "the txl-dist version that saved it")
        saved = MemorySettings(**state["memory"])
        if saved != self.memory:
            raise GenerationError(f"the state was saved with {saved}, this session uses {self.memory}; build the "
                                  "session with the saved mem_len and clamp_len")
        mems = state["mems"]
        d_model, n_layer = self.model.config.d_model, self.model.config.n_layer
        if mems is not None and (len(mems) != n_layer or any(m.shape[-1] != d_model for m in mems)):
            raise GenerationError(f"the saved mems ({len(mems)} layers of width {mems[0].shape[-1]}) do not fit "
                                  f"this model ({n_layer} layers, d_model {d_model}); restore with the same model")
        log_probs = state["next_log_probs"]
        if log_probs is not None and log_probs.shape[-1] != self.model.config.vocab_size:
            raise GenerationError(f"the saved state has a vocabulary of {log_probs.shape[-1]}, the model "
                                  f"{self.model.config.vocab_size}; restore with the same model")
        self.chunk_len = state["chunk_len"]
        self.n_tokens = state["n_tokens"]
        self._batch_size = state["batch_size"]
        self.mems = None if mems is None else [m.to(self.device) for m in mems]
        self.next_log_probs = None if log_probs is None else log_probs.float().cpu().clone()
        self.text_context, self.unshown = _text_state(state)
        self.generator.set_state(state["rng_state"])

    # -- helpers -----------------------------------------------------------------------------------

    def _as_batch(self, token_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
        try:
            ids = torch.as_tensor(token_ids)
        except (TypeError, ValueError, RuntimeError) as e:  # ragged rows, strings, None
            raise GenerationError(f"tokens to feed must be integer ids [n] or [batch, n]: {e}") from None
        # A cast to int64 would truncate floats silently (1.7 -> 1); an empty list's dtype is float.
        if ids.numel() and (ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool):
            raise GenerationError(f"token ids must be integers, got {ids.dtype}")
        ids = ids.long().cpu()
        if ids.dim() == 1:
            ids = ids.view(1, -1).expand(max(self.batch_size, 1), -1)              # [B, n]
        if ids.dim() != 2 or ids.shape[1] == 0:
            raise GenerationError(f"tokens to feed must be [n] or [batch, n] with n >= 1, got shape "
                                  f"{tuple(ids.shape)}")
        if self.batch_size and ids.shape[0] != self.batch_size:
            raise GenerationError(f"the session has {self.batch_size} streams, the tokens {ids.shape[0]}; feed [n] "
                                  f"or [{self.batch_size}, n]")
        vocab = self.model.config.vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise GenerationError(f"token ids must be in [0, {vocab}), got {int(ids.min())}..{int(ids.max())}")
        self._batch_size = ids.shape[0]
        return ids


def _text_state(state: dict[str, Any]) -> tuple[list[list[int]] | None, list[tuple[list[int], list[int]]] | None]:
    """A saved state's text_context and unshown, also from states of earlier versions of this file (which
    kept each stream's last token, and the one token before what was held back)."""
    if "text_context" in state:
        contexts = state["text_context"]
        unshown = state["unshown_text"]
        return (None if contexts is None else [list(ids) for ids in contexts],
                None if unshown is None else [(list(c), list(h)) for c, h in unshown])
    last = state["last_tokens"]
    contexts = None if last is None else [[token] for token in last.tolist()]
    unshown = state.get("unshown_text_ids")                                        # absent: nothing held back
    return contexts, None if unshown is None else [(list(ids[:1]), list(ids[1:])) for ids in unshown]


# ----------------------------------------------------------------------------------------------------
# One call


def generate(model: torch.nn.Module, prompt_ids: Sequence[int], max_new_tokens: int,
             sampling: SamplingSettings = SamplingSettings(), *, num_samples: int = 1, stop_id: int | None = None,
             seed: int | None = None, mem_len: int | None = None, clamp_len: int | None = None,
             chunk_len: int | None = None) -> list[list[int]]:
    """num_samples continuations of one prompt (>= 1 token), each up to max_new_tokens ids.

    The prompt is read once and its mems shared by the samples. With stop_id, a sample ends after it
    produces that id (included), and decoding stops when every sample has.
    """
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise GenerationError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    sampling.check()
    session = GenerationSession(model, mem_len=mem_len, clamp_len=clamp_len, chunk_len=chunk_len, seed=seed)
    if len(prompt_ids) == 0:
        raise GenerationError("the prompt has no tokens; start it with the end-of-document id for a new document")
    session.feed(list(prompt_ids))
    session.expand(num_samples)
    samples: list[list[int]] = [[] for _ in range(num_samples)]
    running = [True] * num_samples
    for _ in range(max_new_tokens):
        tokens = session.sample(1, sampling)[:, 0].tolist()
        for i, token in enumerate(tokens):
            if running[i]:
                samples[i].append(token)
                running[i] = token != stop_id
        if not any(running):
            break
    return samples


# ----------------------------------------------------------------------------------------------------
# Text through the corpus' SentencePiece model


class Tokenizer:
    """A corpus' SentencePiece model: text <-> ids, and its end-of-document id (sentencepiece imported here)."""

    EOD_PIECE = "<eod>"
    """The end-of-document piece data_prep's tokenizers have (txl_dist knows nothing of data_prep)."""

    def __init__(self, model_file: str, eod_id: int | None = None):
        """eod_id: the corpus manifest's; None: the model's <eod> piece, else its eos id."""
        import sentencepiece as spm

        try:
            self.processor = spm.SentencePieceProcessor(model_file=model_file)
        except (RuntimeError, OSError) as e:
            raise GenerationError(f"{model_file}: not a SentencePiece model ({str(e).strip()[:200]})") from None
        self.vocab_size = self.processor.get_piece_size()
        if eod_id is None:
            eod_id = self.processor.piece_to_id(self.EOD_PIECE)
            if eod_id == self.processor.unk_id():
                eod_id = self.processor.eos_id()
        if not 0 <= eod_id < self.vocab_size:
            raise GenerationError(f"{model_file} has no end-of-document piece ({self.EOD_PIECE} or eos); use the "
                                  "corpus folder, whose manifest names it")
        self.eod_id = eod_id
        self.unk_id = self.processor.unk_id()
        """The id of text the model has no piece for (without byte fallback: a character or word never seen)."""

    def encode(self, text: str, start_of_document: bool = True) -> list[int]:
        """The ids of text; start_of_document puts the end-of-document id first, as in the training stream,
        where every document follows one (an empty text is then a prompt for a new document)."""
        ids = self.processor.encode(text) if text else []
        return ([self.eod_id] if start_of_document else []) + ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ids; an end-of-document id between two texts becomes a blank line."""
        texts, pieces = [], []
        for token in list(ids) + [self.eod_id]:
            if token != self.eod_id:
                pieces.append(token)
            elif pieces:
                texts.append(self.processor.decode(pieces))
                pieces = []
        return "\n\n".join(texts)

    def unfinished_tail(self, ids: Sequence[int]) -> int:
        """How many of the last ids are byte pieces (byte fallback) that begin a UTF-8 character without
        finishing it: later ids may finish it, so a stream holds them back instead of showing U+FFFD."""
        tail = []
        for token in reversed(ids):
            if token == self.eod_id or not self.processor.is_byte(token):
                break
            tail.append(token)
        if not tail:
            return 0
        tail_bytes = bytes(int(self.processor.id_to_piece(token)[3:5], 16) for token in reversed(tail))  # <0xHH>
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        decoder.decode(tail_bytes, final=False)
        return len(decoder.getstate()[0])  # the bytes it waits on: a valid start of a character, unfinished

    def text_context(self, ids: Sequence[int]) -> list[int]:
        """The fewest of the last ids that later text continues as it continues all of them: the last id, and
        before trailing end-of-document ids the last text id (decode puts the blank line after its document)."""
        if not ids or ids[-1] != self.eod_id:
            return list(ids[-1:])
        text = next((token for token in reversed(ids) if token != self.eod_id), None)
        return [self.eod_id] if text is None else [text, self.eod_id]

    def decode_after(self, before: Sequence[int], ids: Sequence[int]) -> str:
        """The text of ids as it continues the text of `before` (a leading space survives: SentencePiece
        drops the word-boundary space of a text's first piece)."""
        head = self.decode(before)
        whole = self.decode(list(before) + list(ids))
        return whole[len(head):] if whole.startswith(head) else self.decode(ids)
