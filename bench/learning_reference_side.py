"""The reference side of bench/learning_vs_reference.py; runs INSIDE `.venv-ref` (transformers 4.37.2), never
imports txl_dist.

Usage: python learning_reference_side.py JOB.json

JOB.json: {"init_dir": a save_pretrained folder (the starting weights, written by our to_hf),
           "batches": safetensors with input_ids / labels int64 [steps, S, T] (our loader's batches, in order),
           "eval": safetensors with input_ids.{i} / labels.{i} int64 [E, T_i] (the evaluation windows, in order),
           "lrs": [lr of step 1, ...], "betas", "eps", "clip", "seed", "threads",
           "eval_mem_len", "eval_clamp_len", "eval_same_length",
           "checkpoints": [steps after which the test windows are evaluated; the last is len(lrs)],
           "out": result JSON path}
Result: {"train_loss": [per step], "train_s", "eval_nll_sum", "eval_tokens", "eval_s" (those three: the
evaluation after the last step), "checkpoints": [{"step", "train_s" (train time up to that step),
"eval_nll_sum", "eval_tokens", "eval_s"}]}.

The train clock covers what our side's covers (bench/learning_vs_reference.py `train_ours`): per step the
learning rate, forward with the carried mems, loss, zero_grad, backward, clipping, optimizer step and one
`loss.item()`; it stops around every evaluation. An evaluation leaves training as it found it: torch's RNG
state is saved and restored around it (the dropout masks that follow are the ones a run without it draws),
and the training memory settings (mem_len, clamp_len, same_length) and train mode come back.

The loss is HF's own adaptive-softmax path (`model.crit` with labels) on all T next tokens: HF shifts labels
by one inside crit, so the hidden states get one dummy row at the end and the labels one dummy in front.
"""
from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import TransfoXLLMHeadModel


def segment_nll(model: TransfoXLLMHeadModel, input_ids: torch.Tensor, labels: torch.Tensor,
                mems: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Per-token NLL [B*T] of labels after input_ids (both [B, T]) and the new mems, through HF's own modules."""
    out = model.transformer(input_ids=input_ids, mems=mems)
    hidden = out.last_hidden_state  # [B, T, d]
    padded_hidden = torch.cat([hidden, hidden.new_zeros(hidden.size(0), 1, hidden.size(2))], dim=1)  # [B, T+1, d]
    padded_labels = torch.cat([labels[:, :1], labels], dim=1)  # [B, T+1]; crit drops column 0
    return model.crit(padded_hidden, padded_labels), out.mems  # [B*T]


def empty_mems(model: TransfoXLLMHeadModel, bsz: int) -> list[torch.Tensor]:
    """Empty memory (the paper's first segment); HF's mems=None would mean mem_len zero vectors."""
    return [torch.empty(0, bsz, model.config.d_model) for _ in range(model.config.n_layer)]


def evaluate(model: TransfoXLLMHeadModel, windows: dict[str, torch.Tensor], job: dict) -> tuple[float, int]:
    """Sum of test NLL (float64) and token count over the windows, in order, with the job's eval memory settings;
    the model's training settings, mode and torch's RNG state are restored afterwards."""
    train_settings = (model.transformer.mem_len, model.transformer.clamp_len, model.transformer.same_length)
    rng = torch.get_rng_state()
    model.eval()
    model.reset_memory_length(job["eval_mem_len"])
    model.transformer.clamp_len = job["eval_clamp_len"]
    model.transformer.same_length = job["eval_same_length"]
    nll_sum, tokens = 0.0, 0
    try:
        with torch.no_grad():
            mems = None
            for i in range(len(windows) // 2):
                input_ids, labels = windows[f"input_ids.{i}"], windows[f"labels.{i}"]  # [E, T_i]
                mems = empty_mems(model, input_ids.size(0)) if mems is None else mems
                nll, mems = segment_nll(model, input_ids, labels, mems)
                nll_sum += nll.double().sum().item()
                tokens += nll.numel()
    finally:
        model.reset_memory_length(train_settings[0])
        model.transformer.clamp_len, model.transformer.same_length = train_settings[1:]
        model.train()
        torch.set_rng_state(rng)
    return nll_sum, tokens


def main(argv: list[str] | None = None) -> None:
    """Train from the given weights on the given batches, evaluating at the checkpoints; write the result JSON."""
    argv = sys.argv[1:] if argv is None else argv
    warnings.filterwarnings("ignore")
    job = json.loads(Path(argv[0]).read_text())
    torch.set_num_threads(job["threads"])
    torch.manual_seed(job["seed"])  # dropout
    model = TransfoXLLMHeadModel.from_pretrained(job["init_dir"])
    batches = load_file(job["batches"])
    inputs, targets = batches["input_ids"], batches["labels"]  # [steps, S, T]
    windows = load_file(job["eval"])
    checkpoints = set(job.get("checkpoints") or [len(job["lrs"])])
    optimizer = torch.optim.AdamW(model.parameters(), lr=job["lrs"][0], betas=tuple(job["betas"]), eps=job["eps"],
                                  weight_decay=0.0, fused=job.get("fused") or None)
    model.train()
    mems = empty_mems(model, inputs.size(1))
    losses, evaluations = [], []
    train_s = 0.0
    start = time.perf_counter()
    for step, lr in enumerate(job["lrs"]):
        for group in optimizer.param_groups:
            group["lr"] = lr
        nll, mems = segment_nll(model, inputs[step], targets[step], mems)
        loss = nll.mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), job["clip"])
        optimizer.step()
        losses.append(loss.item())
        if step + 1 in checkpoints:
            train_s += time.perf_counter() - start
            eval_start = time.perf_counter()
            nll_sum, tokens = evaluate(model, windows, job)
            evaluations.append({"step": step + 1, "train_s": train_s, "eval_nll_sum": nll_sum, "eval_tokens": tokens,
                                "eval_s": time.perf_counter() - eval_start})
            start = time.perf_counter()
    final = evaluations[-1]
    Path(job["out"]).write_text(json.dumps({"train_loss": losses, "train_s": final["train_s"],
                                            "eval_nll_sum": final["eval_nll_sum"], "eval_tokens": final["eval_tokens"],
                                            "eval_s": final["eval_s"], "checkpoints": evaluations}))


if __name__ == "__main__":
    main()
