"""Does attention dropout pay for itself? The evidence behind the flex path's dropatt policy.

FlexAttention has no dropout on the attention probabilities, so a run either gives dropatt up (and may use
flex) or keeps it (and uses matmul/sdpa). This trains the same model on the same tokens from the same seed
with the matmul path at each dropatt, then reports the validation loss with long memory side by side.
Plain torch (no DeepSpeed): one process, the S streams of the corpus as the trainer cuts them.

    .venv/bin/python bench/dropatt_study.py --corpus data/shakespeare --dropatt 0 0.2 --seeds 0 1
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from txl_dist.config import MemorySettings, ModelConfig
from txl_dist.data.format import read_manifest, split_reader
from txl_dist.model import TransformerXL


def streams(corpus: Path, split: str, n_streams: int) -> torch.Tensor:
    """The split's global stream cut into n_streams contiguous rows [S, L] (docs/architecture.md)."""
    manifest = read_manifest(corpus)
    n_tokens = manifest.splits[split].n_tokens
    tokens = split_reader(corpus, manifest, split).read(0, n_tokens).astype(np.int64)
    length = n_tokens // n_streams
    return torch.from_numpy(tokens[:n_streams * length].reshape(n_streams, length))


def model_config(vocab_size: int, dropatt: float) -> ModelConfig:
    """configs/tiny.json's model with attention dropout set."""
    return ModelConfig(vocab_size=vocab_size, n_layer=4, d_model=128, n_head=4, d_head=32, d_inner=512,
                       cutoffs=[1000, 2000], div_val=2, pre_lnorm=True, tgt_len=64, mem_len=64, dropout=0.1,
                       dropatt=dropatt, attn_impl="matmul")


def train(cfg: ModelConfig, data: torch.Tensor, steps: int, seed: int, lr: float) -> TransformerXL:
    torch.manual_seed(seed)
    model = TransformerXL(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(
        math.pi * min(1.0, max(0, s - warmup) / max(1, steps - warmup))))))
    mems, pos, tgt = None, 0, cfg.tgt_len
    for _ in range(steps):
        if pos + tgt + 1 > data.shape[1]:
            mems, pos = None, 0
        out = model(data[:, pos:pos + tgt], data[:, pos + 1:pos + tgt + 1], mems)
        opt.zero_grad(set_to_none=True)
        out.nll.mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        opt.step()
        sched.step()
        mems, pos = out.mems, pos + tgt
    return model


@torch.no_grad()
def evaluate(model: TransformerXL, data: torch.Tensor, tgt_len: int, memory: MemorySettings) -> float:
    model.eval()
    mems, total, count = None, 0.0, 0
    for pos in range(0, data.shape[1] - 1, tgt_len):
        end = min(pos + tgt_len, data.shape[1] - 1)
        out = model(data[:, pos:end], data[:, pos + 1:end + 1], mems, memory=memory)
        total, count, mems = total + float(out.nll.double().sum()), count + out.nll.numel(), out.mems
    return total / count


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default="data/shakespeare")
    ap.add_argument("--dropatt", type=float, nargs="+", default=[0.0, 0.2])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    corpus = Path(args.corpus)
    train_data, valid_data = streams(corpus, "train", args.streams), streams(corpus, "valid", 2)
    vocab = read_manifest(corpus).tokenizer.vocab_size
    memory = MemorySettings(mem_len=128, clamp_len=-1, same_length=True)  # configs/tiny.json's eval
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.steps} steps x "
          f"{args.streams} streams x 64 tokens; valid: 2 streams, tgt 64, mem 128, same_length")
    results = []
    for seed in args.seeds:
        for dropatt in args.dropatt:
            start = time.perf_counter()
            model = train(model_config(vocab, dropatt), train_data, args.steps, seed, args.lr)
            loss = evaluate(model, valid_data, 64, memory)
            row = {"seed": seed, "dropatt": dropatt, "valid_loss": round(loss, 4),
                   "valid_ppl": round(math.exp(loss), 2), "seconds": round(time.perf_counter() - start, 1)}
            results.append(row)
            print(json.dumps(row), flush=True)
    for dropatt in args.dropatt:
        losses = [r["valid_loss"] for r in results if r["dropatt"] == dropatt]
        print(f"dropatt {dropatt}: mean valid loss {sum(losses) / len(losses):.4f} over seeds {args.seeds}")


if __name__ == "__main__":
    main()
