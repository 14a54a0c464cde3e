"""Parity with the real reference: HuggingFace transformers 4.37.2 TransfoXLLMHeadModel, run in `.venv-ref`.

Both directions, one reference subprocess for all variants:
- HF -> ours: random HF models are built and saved by HF itself (save_pretrained, safetensors and .bin),
  imported with from_hf; per-token NLL and mems agree over 3 consecutive segments (max abs diff <= 1e-5).
- ours -> HF: random models of ours are exported with to_hf; HF's from_pretrained loads them with no
  missing/unexpected keys and gives the same numbers.
Variants cover div_val 1 and 4, untie_r on/off, tied/untied output weights and projections, d_embed !=
d_model, n_head * d_head != d_model, same_length with clamp_len, pre_lnorm, mem_len below/above tgt_len and
a plain softmax (no cutoffs), and models of ours stored with vocabulary padding. Full-size HF architectures (transfo-xl-wt103's) map name for name.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_reference.refvenv import reference_python, run_hf_side  # noqa: F401  (fixture)
from txl_dist.config import ModelConfig
from txl_dist.interop import from_hf, hf_state_dict, model_config_from_hf, to_hf
from txl_dist.model import TransformerXL

TOL = 1e-5
VOCAB, BSZ, TGT_LEN, N_SEG = 61, 2, 6, 3
STD = 0.1  # random weights this large make every mapping mistake visible in the NLL

COMMON_HF = dict(vocab_size=VOCAB, n_layer=2, n_head=2, d_head=16, d_inner=48, dropout=0.0, dropatt=0.0)

# name -> (TransfoXLConfig kwargs, save_pretrained safe_serialization)
HF_VARIANTS: dict[str, tuple[dict, bool]] = {
    "div1_tied": (dict(cutoffs=[11, 31], d_model=32, d_embed=32, div_val=1, untie_r=True, pre_lnorm=False,
                       same_length=False, clamp_len=-1, mem_len=8), True),
    "div1_projs_untied_shared_r": (dict(cutoffs=[11, 31], d_model=32, d_embed=24, div_val=1, untie_r=False,
                                        tie_word_embeddings=False, tie_projs=[False, True, False],
                                        same_length=False, clamp_len=-1, mem_len=6), False),
    "div4_tied_shared_r_same_length_clamp": (dict(cutoffs=[11, 31], d_model=32, d_embed=64, div_val=4,
                                                  untie_r=False, same_length=True, clamp_len=3, mem_len=5), True),
    "div4_untied_prelnorm": (dict(cutoffs=[11, 31], d_model=32, d_embed=32, div_val=4, n_head=3, d_head=8,
                                  proj_share_all_but_first=False, tie_word_embeddings=False, pre_lnorm=True,
                                  same_length=True, clamp_len=4, mem_len=10), False),
    "plain_softmax": (dict(cutoffs=[], d_model=32, d_embed=32, div_val=1, same_length=False, clamp_len=2,
                           mem_len=6), True),
    # mem_len 0: HF keeps no mems at all (mems None), we keep empty ones; the NLL must still agree.
    "no_memory": (dict(cutoffs=[11, 31], d_model=32, d_embed=32, div_val=4, same_length=False, clamp_len=-1,
                       mem_len=0), True),
}

COMMON_OURS = dict(vocab_size=VOCAB, n_layer=2, n_head=2, d_head=16, d_inner=48, d_model=32, dropout=0.0,
                   tgt_len=TGT_LEN)
OUR_VARIANTS: dict[str, ModelConfig] = {
    "ours_div1_tied": ModelConfig(**COMMON_OURS, cutoffs=[11, 31], div_val=1, mem_len=8),
    "ours_div1_projs": ModelConfig(**COMMON_OURS, cutoffs=[11, 31], div_val=1, d_embed=24,
                                   tie_projs=[True, False, True], mem_len=6),
    "ours_div4_untied_prelnorm_same_length": ModelConfig(
        **COMMON_OURS, cutoffs=[11, 31], div_val=4, d_embed=64, tie_weight=False, tie_projs=[False, False, True],
        pre_lnorm=True, untie_r=False, same_length=True, clamp_len=3, mem_len=5),
    # Stored padded (pad_vocab_multiple); the export strips the padding, so HF must give the same numbers.
    "ours_div1_tied_padded": ModelConfig(**COMMON_OURS, cutoffs=[11, 31], div_val=1, mem_len=8,
                                         pad_vocab_multiple=8),
    "ours_div4_untied_padded": ModelConfig(**COMMON_OURS, cutoffs=[11, 31], div_val=4, d_embed=64, tie_weight=False,
                                           mem_len=5, pad_vocab_multiple=8),
}

# Full-size architectures, built on the meta device on both sides: names, shapes and tying must line up.
SHAPE_VARIANTS: dict[str, dict] = {
    "wt103_defaults": {},  # TransfoXLConfig() is the transfo-xl-wt103 architecture
    "wt103_div1_projs_untied_shared_r": dict(div_val=1, d_embed=512, untie_r=False, tie_word_embeddings=False,
                                             proj_share_all_but_first=False),
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Random weights everywhere, biases and layer-norm shifts included (shared parameters come once)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * STD
            p.copy_(noise + 1.0 if _is_norm_weight(name, p) else noise)


def _is_norm_weight(name: str, p: torch.Tensor) -> bool:
    return p.dim() == 1 and "norm" in name and name.endswith("weight")


def run_ours(model: TransformerXL, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Our model over N_SEG consecutive segments, in the layout hf_side.py writes."""
    out: dict[str, torch.Tensor] = {}
    mems = None
    with torch.no_grad():
        for s in range(N_SEG):
            seg = tokens[:, s * TGT_LEN:(s + 1) * TGT_LEN]  # [B, T]
            nxt = tokens[:, s * TGT_LEN + 1:(s + 1) * TGT_LEN + 1]  # [B, T]
            res = model(seg, labels=nxt, mems=mems)
            out[f"nll.{s}"] = res.nll  # [B, T]
            mems = res.mems
            for layer, m in enumerate(mems):
                out[f"mems.{s}.{layer}"] = m  # [B, mlen, d_model]
    return out


def assert_same(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], n_layer: int, mem_len: int) -> None:
    wanted = {f"nll.{s}" for s in range(N_SEG)}
    if mem_len:
        wanted |= {f"mems.{s}.{l}" for s in range(N_SEG) for l in range(n_layer)}
    else:
        assert not any(k.startswith("mems.") for k in ref)
        assert all(ours[f"mems.{s}.{l}"].shape[:2] == (BSZ, 0) for s in range(N_SEG) for l in range(n_layer))
    assert wanted <= set(ref), f"reference lacks {sorted(wanted - set(ref))}"
    for key in sorted(wanted):
        assert ours[key].shape == ref[key].shape, f"{key}: shape {tuple(ours[key].shape)} vs {tuple(ref[key].shape)}"
        diff = (ours[key].float() - ref[key]).abs().max().item()
        assert diff <= TOL, f"{key}: max abs diff {diff:.3g} > {TOL}"
    # A parity check is only worth something if the numbers are not trivially equal (e.g. all zero).
    assert ref["nll.0"].std() > 0.01 and (not mem_len or ref[f"mems.{N_SEG - 1}.1"].std() > 0.01)


@pytest.fixture(scope="module")
def reference_runs(reference_python, tmp_path_factory) -> Path:  # noqa: F811
    """One hf_side.py call: builds/saves the HF variants and loads our exports; returns the work folder."""
    work = tmp_path_factory.mktemp("hf_parity")
    gen = torch.Generator().manual_seed(2024)
    save_file({"tokens": torch.randint(0, VOCAB, (BSZ, N_SEG * TGT_LEN + 1), generator=gen)},
              work / "tokens.safetensors")
    jobs = []
    for i, (name, (kwargs, safe)) in enumerate(HF_VARIANTS.items()):
        jobs.append({"kind": "build", "name": name, "config": {**COMMON_HF, **kwargs}, "seed": 100 + i,
                     "std": STD, "save_dir": str(work / name), "safe_serialization": safe,
                     "tokens": str(work / "tokens.safetensors"), "tgt_len": TGT_LEN,
                     "out": str(work / f"{name}.ref.safetensors")})
    for i, (name, cfg) in enumerate(OUR_VARIANTS.items()):
        torch.manual_seed(0)
        model = TransformerXL(cfg)
        randomize(model, 200 + i)
        to_hf(model, work / name)
        ours_outputs = run_ours(model.eval(), load_file(work / "tokens.safetensors")["tokens"])
        save_file(ours_outputs, work / f"{name}.ours.safetensors")
        jobs.append({"kind": "load", "name": name, "load_dir": str(work / name),
                     "tokens": str(work / "tokens.safetensors"), "tgt_len": TGT_LEN,
                     "out": str(work / f"{name}.ref.safetensors")})
    for name, kwargs in SHAPE_VARIANTS.items():
        jobs.append({"kind": "shapes", "name": name, "config": kwargs, "out": str(work / f"{name}.shapes.json")})
    (work / "jobs.json").write_text(json.dumps({"jobs": jobs}))
    run_hf_side(reference_python, work / "jobs.json")
    return work


@pytest.mark.parametrize("name", list(HF_VARIANTS))
def test_hf_model_imported_with_from_hf_gives_the_reference_numbers(reference_runs, name):
    work = reference_runs
    kwargs, safe = HF_VARIANTS[name]
    assert (work / name / ("model.safetensors" if safe else "pytorch_model.bin")).is_file()
    ref = load_file(work / f"{name}.ref.safetensors")
    # HF's own loss path (labels shifted inside the model) agrees with what we call its per-token NLL.
    for s in range(N_SEG):
        diff = (ref[f"label_nll.{s}"] - ref[f"nll.{s}"][:, :-1]).abs().max().item()
        assert diff <= TOL, f"segment {s}: HF loss path vs prediction scores differ by {diff:.3g}"
    model = from_hf(work / name)
    assert not model.training
    ours = run_ours(model, load_file(work / "tokens.safetensors")["tokens"])
    assert_same(ours, ref, COMMON_HF["n_layer"], kwargs["mem_len"])


@pytest.mark.parametrize("name", list(OUR_VARIANTS))
def test_our_model_exported_with_to_hf_loads_in_hf_with_the_same_numbers(reference_runs, name):
    work = reference_runs
    info = json.loads((work / f"{name}.ref.safetensors.json").read_text())
    assert info == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
    ours = load_file(work / f"{name}.ours.safetensors")
    ref = load_file(work / f"{name}.ref.safetensors")
    assert_same(ours, ref, OUR_VARIANTS[name].n_layer, OUR_VARIANTS[name].mem_len)


@pytest.mark.parametrize("name", list(SHAPE_VARIANTS))
def test_full_size_hf_architecture_maps_name_for_name(reference_runs, name):
    """config.json as HF writes it -> our model (meta device) -> to_hf's tensors: exactly HF's state dict,
    with every group of shared HF parameters written once (as save_pretrained does), shapes equal."""
    hf = json.loads((reference_runs / f"{name}.shapes.json").read_text())
    cfg = model_config_from_hf(hf["config"])
    with torch.device("meta"):
        model = TransformerXL(cfg)
    ours = hf_state_dict(model)
    hf_shapes = hf["shapes"]
    shared = hf["shared"]
    assert shared, "the HF model ties something in every variant here"
    for group in shared:
        assert len(set(group) & set(ours)) == 1, f"HF shares {group}; we write {sorted(set(group) & set(ours))}"
    dropped = {n for group in shared for n in group} - set(ours)
    assert set(ours) == set(hf_shapes) - dropped
    for k, v in ours.items():
        assert list(v.shape) == hf_shapes[k], k
