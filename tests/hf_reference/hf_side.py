"""The HuggingFace side of the parity tests; runs INSIDE `.venv-ref` (transformers 4.37.2), never imports txl_dist.

Usage: python hf_side.py JOBS.json

JOBS.json: {"jobs": [job, ...]}, each job one of
  {"kind": "build", "name", "config": TransfoXLConfig kwargs, "seed", "std", "save_dir", "safe_serialization",
   "tokens", "tgt_len", "out"}   build a random TransfoXLLMHeadModel, save_pretrained it, run it
  {"kind": "load", "name", "load_dir", "tokens", "tgt_len", "out"}   from_pretrained a folder, run it
  {"kind": "shapes", "name", "config", "out"}   build on the meta device; write `out` (JSON): config.json's
   content, tensor shapes by state-dict name, and the groups of names that share one Parameter
`tokens` is a safetensors file with "tokens" int64 [B, n_seg * tgt_len + 1]. Each job writes `out` (safetensors):
  nll.{s}       float32 [B, T]        -log p(tokens[t+1]) for segment s, from prediction_scores
  label_nll.{s} float32 [B, T-1]      the same from HF's own loss path (labels=input_ids, keep_order)
  mems.{s}.{l}  float32 [B, mlen, d]  the mems HF returns after segment s, batch-first
and, for load jobs, `out`.json with HF's loading info (missing / unexpected / mismatched keys).
The first segment starts from EMPTY mems (HF's mems=None would mean mem_len zero vectors).
"""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import TransfoXLConfig, TransfoXLLMHeadModel


def randomize(model: torch.nn.Module, seed: int, std: float) -> None:
    """Random weights everywhere (biases and layer-norm shifts too), so no mapping error hides behind a zero."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # shared (tied) parameters come once
            noise = torch.randn(p.shape, generator=gen) * std
            p.copy_(noise + 1.0 if name.endswith("layer_norm.weight") else noise)


def run_segments(model: TransfoXLLMHeadModel, tokens: torch.Tensor, tgt_len: int) -> dict[str, torch.Tensor]:
    """Feed consecutive segments with carried mems; collect per-token NLL and mems."""
    model.crit.keep_order = True  # else per-token losses come back grouped by cluster
    cfg = model.config
    bsz, n_seg = tokens.size(0), (tokens.size(1) - 1) // tgt_len
    # Empty mems give the paper's first segment; None would mean mem_len zero vectors (or no memory at all
    # when mem_len == 0, where HF returns mems=None and keeps none).
    mems = [torch.empty(0, bsz, cfg.d_model) for _ in range(cfg.n_layer)] if cfg.mem_len > 0 else None
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for s in range(n_seg):
            seg = tokens[:, s * tgt_len:(s + 1) * tgt_len]  # [B, T]
            nxt = tokens[:, s * tgt_len + 1:(s + 1) * tgt_len + 1]  # [B, T]
            res = model(input_ids=seg, mems=mems)
            logprob = res.prediction_scores  # [B, T, V]
            out[f"nll.{s}"] = -logprob.gather(-1, nxt[..., None]).squeeze(-1).contiguous()  # [B, T]
            # HF shifts labels inside: labels=input_ids scores hidden t against token t+1 -> T-1 losses.
            lab = model(input_ids=seg, mems=mems, labels=seg.clone())
            out[f"label_nll.{s}"] = lab.losses.contiguous()  # [B, T-1]
            mems = res.mems
            if mems is not None:
                for layer, m in enumerate(mems):  # m: [mlen, B, d] seq-first
                    out[f"mems.{s}.{layer}"] = m.transpose(0, 1).contiguous()  # [B, mlen, d]
    return out


def write_shapes(job: dict) -> None:
    """Names, shapes and sharing of a (possibly huge) model, without allocating it."""
    config = TransfoXLConfig(**job["config"])
    with torch.device("meta"):
        model = TransfoXLLMHeadModel(config)
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    Path(job["out"]).write_text(json.dumps({"config": json.loads(config.to_json_string()), "shapes": shapes,
                                            "shared": [g for g in groups.values() if len(g) > 1]}))
    print(f"[hf_side] shapes {job['name']}: ok", flush=True)


def main(argv: list[str] | None = None) -> None:
    """Run every job of a jobs file."""
    argv = sys.argv[1:] if argv is None else argv
    warnings.filterwarnings("ignore")
    torch.set_grad_enabled(False)
    jobs = json.loads(Path(argv[0]).read_text())["jobs"]
    for job in jobs:
        if job["kind"] == "shapes":
            write_shapes(job)
            continue
        tokens = load_file(job["tokens"])["tokens"]
        if job["kind"] == "build":
            model = TransfoXLLMHeadModel(TransfoXLConfig(**job["config"]))
            randomize(model, job["seed"], job["std"])
            model.save_pretrained(job["save_dir"], safe_serialization=job["safe_serialization"])
        elif job["kind"] == "load":
            model, info = TransfoXLLMHeadModel.from_pretrained(job["load_dir"], output_loading_info=True)
            info = {k: [str(x) for x in v] for k, v in info.items()}
            Path(job["out"] + ".json").write_text(json.dumps(info))
        else:
            raise ValueError(f"job {job['name']}: unknown kind {job['kind']!r}")
        model.eval()
        save_file(run_segments(model, tokens, job["tgt_len"]), job["out"])
        print(f"[hf_side] {job['kind']} {job['name']}: ok", flush=True)


if __name__ == "__main__":
    main()
