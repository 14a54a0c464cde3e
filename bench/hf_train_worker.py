"""The reference side of the training-speed comparison; runs INSIDE `.venv-ref` (transformers 4.37.2).

Never imports txl_dist. Driven over stdin/stdout, one JSON object per line, so that the driver can
interleave the reference's repetitions with its own (load changes on a shared machine hit both alike):

    -> {"config": TransfoXLConfig kwargs, "dtype": "fp32"|"bf16", "batch", "tgt_len", "threads", "seed"}
    <- {"ready": true, "n_params": ...}
    -> {"steps": k}            k training steps (forward with carried mems, backward, AdamW step)
    <- {"seconds": s}
    -> {"quit": true}
"""
from __future__ import annotations

import json
import sys
import time
import warnings

import torch
from transformers import TransfoXLConfig, TransfoXLLMHeadModel

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def zipf_segments(vocab_size: int, n: int, batch: int, tgt_len: int, seed: int) -> torch.Tensor:
    """[n, batch, tgt_len] ids with p ~ 1/rank, as in real text (the same draw as the driver's)."""
    g = torch.Generator().manual_seed(seed)
    zipf = 1.0 / torch.arange(1, vocab_size + 1, dtype=torch.float64)
    return torch.multinomial(zipf, n * batch * tgt_len, replacement=True, generator=g).view(n, batch, tgt_len)


def main() -> None:
    warnings.filterwarnings("ignore")
    setup = json.loads(sys.stdin.readline())
    torch.set_num_threads(setup["threads"])
    torch.manual_seed(setup["seed"])
    model = TransfoXLLMHeadModel(TransfoXLConfig(**setup["config"])).to(DTYPES[setup["dtype"]]).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # the same optimizer as our side
    segments = zipf_segments(model.config.vocab_size, 16, setup["batch"], setup["tgt_len"], setup["seed"])
    state = {"mems": None, "i": 0}

    def step() -> None:
        seg = segments[state["i"] % len(segments)]
        state["i"] += 1
        # labels=input_ids: HF shifts inside and scores tgt_len - 1 tokens per row.
        out = model(input_ids=seg, labels=seg, mems=state["mems"])
        out.losses.float().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        state["mems"] = out.mems

    import transformers
    print(json.dumps({"ready": True, "n_params": sum(p.numel() for p in model.parameters()),
                      "transformers": transformers.__version__, "torch": torch.__version__}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        start = time.perf_counter()
        for _ in range(cmd["steps"]):
            step()
        print(json.dumps({"seconds": time.perf_counter() - start}), flush=True)


if __name__ == "__main__":
    main()
