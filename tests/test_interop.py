"""HF format import/export without transformers: config mapping, refusals, file layouts, round trips, CLI.

Parity against the real HuggingFace implementation is in test_interop_parity.py; these tests need no
reference venv.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from txl_dist.config import ConfigError, ModelConfig
from txl_dist.errors import Refused
from txl_dist.interop import (
    HFFormatError,
    from_hf,
    hf_config_from_model_config,
    hf_state_dict,
    load_native,
    model_config_from_hf,
    save_native,
    to_hf,
)
from txl_dist.interop.__main__ import main
from txl_dist.model import TransformerXL

SMALL = dict(vocab_size=53, n_layer=2, d_model=16, n_head=2, d_head=8, d_inner=24, tgt_len=5, mem_len=4,
             dropout=0.0)
CONFIGS = {
    "plain": ModelConfig(**SMALL),
    "div1_cutoffs_projs": ModelConfig(**SMALL, cutoffs=[7, 20], d_embed=12, tie_projs=[True, False, True]),
    "div2_untied": ModelConfig(**SMALL, cutoffs=[7, 20], div_val=2, d_embed=24, tie_weight=False,
                               tie_projs=[False, False, True], untie_r=False, pre_lnorm=True, same_length=True,
                               clamp_len=3),
}


def small_model(cfg: ModelConfig, seed: int = 0) -> TransformerXL:
    torch.manual_seed(seed)
    model = TransformerXL(cfg)
    with torch.no_grad():  # non-zero biases too, so a dropped or swapped tensor shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def outputs(model: TransformerXL, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model_vocab(model), (2, 11), generator=gen)
    res, mems = [], None
    with torch.no_grad():
        for s in range(2):
            out = model(tokens[:, s * 5:(s + 1) * 5], labels=tokens[:, s * 5 + 1:(s + 1) * 5 + 1], mems=mems)
            mems = out.mems
            res += [out.nll, *out.mems]
    return res


def model_vocab(model: TransformerXL) -> int:
    return model.config.vocab_size


def assert_same_model(a: TransformerXL, b: TransformerXL) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    for x, y in zip(outputs(a), outputs(b)):
        assert torch.equal(x, y)


# ------------------------------------------------------------------------------------------------
# config.json <-> ModelConfig

# What TransfoXLConfig() of transformers 4.37.2 writes with its defaults (the transfo-xl-wt103 shape),
# with the old `n_token` spelling of the vocabulary size that early configs on the hub use.
WT103_LIKE = {
    "adaptive": True, "architectures": ["TransfoXLLMHeadModel"], "attn_type": 0, "clamp_len": 1000,
    "cutoffs": [20000, 40000, 200000], "d_embed": 1024, "d_head": 64, "d_inner": 4096, "d_model": 1024,
    "div_val": 4, "dropatt": 0.0, "dropout": 0.1, "eos_token_id": 0, "init": "normal", "init_range": 0.01,
    "init_std": 0.02, "layer_norm_epsilon": 1e-05, "mem_len": 1600, "model_type": "transfo-xl",
    "n_head": 16, "n_layer": 18, "pre_lnorm": False, "proj_init_std": 0.01, "same_length": True,
    "sample_softmax": -1, "tgt_len": 128, "tie_projs": [False, True, True, True], "untie_r": True,
    "n_token": 267735,
}


def test_wt103_style_config_maps_field_by_field():
    cfg = model_config_from_hf(WT103_LIKE)
    assert (cfg.vocab_size, cfg.n_layer, cfg.d_model, cfg.d_embed, cfg.n_head, cfg.d_head, cfg.d_inner) == (
        267735, 18, 1024, 1024, 16, 64, 4096)
    assert (cfg.div_val, cfg.cutoffs, cfg.tie_projs, cfg.tie_weight) == (
        4, [20000, 40000, 200000], [False, True, True, True], True)
    assert (cfg.mem_len, cfg.clamp_len, cfg.same_length, cfg.tgt_len, cfg.pre_lnorm, cfg.untie_r) == (
        1600, 1000, True, 128, False, True)


def test_missing_keys_take_hf_defaults():
    cfg = model_config_from_hf({"model_type": "transfo-xl", "vocab_size": 300000, "proj_share_all_but_first": False})
    # HF 4.37.2 defaults: d_embed 1024 even though it is a separate key, div_val 4, 3 cutoffs, tied weights.
    assert (cfg.d_model, cfg.d_embed, cfg.div_val, cfg.cutoffs) == (1024, 1024, 4, [20000, 40000, 200000])
    assert cfg.tie_projs == [False, False, False, False] and cfg.tie_weight is True
    assert cfg.tgt_len == ModelConfig().tgt_len  # not an HF field: ours


@pytest.mark.parametrize("tgt_len", [True, False, 0, 2.5, "64"])
def test_a_tgt_len_that_is_no_length_takes_the_default_and_the_native_folder_loads(tmp_path, tgt_len):
    """tgt_len is not an HF field: a value that is no positive length is left out. JSON true passed for one (an
    int to isinstance), and from-hf wrote a native folder with "tgt_len": true that load_native refused."""
    _, src = _hf_folder(tmp_path, CONFIGS["plain"])
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "tgt_len": tgt_len}))
    assert model_config_from_hf(json.loads((src / "config.json").read_text())).tgt_len == ModelConfig().tgt_len
    assert main(["from-hf", str(src), str(tmp_path / "native")]) == 0
    assert load_native(tmp_path / "native").config.tgt_len == ModelConfig().tgt_len


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_config_round_trip(name):
    cfg = CONFIGS[name]
    back = model_config_from_hf(json.loads(json.dumps(hf_config_from_model_config(cfg))))
    want = dataclasses.replace(cfg, d_embed=cfg.resolved_d_embed(), tie_projs=cfg.resolved_tie_projs())
    assert back == want


@pytest.mark.parametrize("change, words", [
    ({"attn_type": 2}, "attn_type 2"),
    ({"sample_softmax": 1000}, "sample_softmax 1000"),
    ({"adaptive": False}, "adaptive is false"),
    ({"model_type": "gpt2"}, "model_type is 'gpt2'"),
    ({"tie_projs": [False, True]}, "tie_projs"),
    ({"d_model": "1024"}, "'d_model' must be an integer"),
    ({"div_val": 4096}, "div_val"),
    ({"cutoffs": [40000, 20000, 200000]}, "cutoffs"),
])
def test_unsupported_or_bad_hf_settings_are_refused_in_one_line(change, words):
    with pytest.raises(ConfigError) as err:
        model_config_from_hf({**WT103_LIKE, **change})
    msg = str(err.value)
    assert words in msg and "\n" not in msg


def test_adaptive_false_without_cutoffs_is_a_plain_softmax():
    cfg = model_config_from_hf({**WT103_LIKE, "adaptive": False, "cutoffs": [], "tie_projs": [False]})
    assert cfg.cutoffs == []


# ------------------------------------------------------------------------------------------------
# weights: round trips through the HF layout


@pytest.mark.parametrize("name", list(CONFIGS))
def test_to_hf_then_from_hf_gives_back_the_same_model(tmp_path, name):
    model = small_model(CONFIGS[name])
    to_hf(model, tmp_path / "hf")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}  # from_pretrained refuses a file without it
    back = from_hf(tmp_path / "hf")
    assert not back.training
    assert back.config == dataclasses.replace(
        model.config, d_embed=model.config.resolved_d_embed(), tie_projs=model.config.resolved_tie_projs())
    assert_same_model(model, back)


@pytest.mark.parametrize("name", ["div1_cutoffs_projs", "div2_untied", "plain"])
def test_padded_model_exports_the_unpadded_tensors_and_imports_back_padded(tmp_path, name):
    model = small_model(CONFIGS[name])
    padded = TransformerXL(dataclasses.replace(CONFIGS[name], pad_vocab_multiple=8)).eval()
    with torch.no_grad():  # the same real rows; the padding rows hold values no output may depend on
        for (key, a), (_, b) in zip(model.named_parameters(), padded.named_parameters()):
            b.fill_(7.0)
            b[:a.shape[0]] = a
    assert any(a.shape != b.shape for a, b in zip(model.parameters(), padded.parameters()))
    exported = hf_state_dict(padded)
    reference = hf_state_dict(model)
    assert exported.keys() == reference.keys()
    for key, tensor in reference.items():
        assert torch.equal(exported[key], tensor), key
    to_hf(padded, tmp_path / "hf")
    back = from_hf(tmp_path / "hf", pad_vocab_multiple=8)
    assert back.config == dataclasses.replace(
        padded.config, d_embed=padded.config.resolved_d_embed(), tie_projs=padded.config.resolved_tie_projs())
    for (key, a), (_, b) in zip(model.named_parameters(), back.named_parameters()):
        assert torch.equal(b[:a.shape[0]], a) and not b[a.shape[0]:].any(), key
    for x, y in zip(outputs(model), outputs(back)):
        torch.testing.assert_close(y, x, rtol=0, atol=1e-5)
    save_native(padded, tmp_path / "native")  # our own folder keeps the padded shapes and the setting
    assert_same_model(padded, load_native(tmp_path / "native"))


def test_tied_weights_are_written_once_like_save_pretrained(tmp_path):
    tied = hf_state_dict(small_model(CONFIGS["div1_cutoffs_projs"]))
    untied = hf_state_dict(small_model(CONFIGS["div2_untied"]))
    # tie_weight: the softmax weights are the embeddings; tie_projs [T, F, T] with d_embed != d_model and
    # div_val 1: clusters 0 and 2 reuse the input projection, cluster 1 has its own.
    assert "crit.out_layers.0.weight" not in tied and "crit.out_layers.0.bias" in tied
    assert "crit.out_projs.1" in tied and not {"crit.out_projs.0", "crit.out_projs.2"} & set(tied)
    assert {f"crit.out_layers.{i}.weight" for i in range(3)} <= set(untied)
    assert "crit.out_projs.2" not in untied and {"crit.out_projs.0", "crit.out_projs.1"} <= set(untied)
    # untie_r false: one shared pair at the top, as HF's safetensors save keeps it.
    assert "transformer.r_w_bias" in untied and "transformer.layers.0.dec_attn.r_w_bias" not in untied


def _hf_folder(tmp_path: Path, cfg: ModelConfig) -> tuple[TransformerXL, Path]:
    model = small_model(cfg)
    return model, to_hf(model, tmp_path / "hf")


def test_reads_pytorch_model_bin_with_the_duplicates_torch_save_keeps(tmp_path):
    model, src = _hf_folder(tmp_path, CONFIGS["div2_untied"])
    tensors = load_file(src / "model.safetensors")
    # A .bin written by save_pretrained(safe_serialization=False) also holds every shared copy.
    for i in range(2):
        tensors[f"transformer.layers.{i}.dec_attn.r_w_bias"] = tensors["transformer.r_w_bias"]
        tensors[f"transformer.layers.{i}.dec_attn.r_r_bias"] = tensors["transformer.r_r_bias"]
    tensors["crit.out_projs.2"] = tensors["transformer.word_emb.emb_projs.2"]
    (src / "model.safetensors").unlink()
    torch.save(tensors, src / "pytorch_model.bin")
    assert_same_model(model, from_hf(src))


def test_reads_sharded_safetensors(tmp_path):
    model, src = _hf_folder(tmp_path, CONFIGS["div1_cutoffs_projs"])
    tensors = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, src / shard, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_same_model(model, from_hf(src))


def test_a_tied_copy_that_disagrees_is_refused(tmp_path):
    _, src = _hf_folder(tmp_path, CONFIGS["div1_cutoffs_projs"])
    tensors = load_file(src / "model.safetensors")
    tensors["crit.out_layers.0.weight"] = tensors["transformer.word_emb.emb_layers.0.weight"] + 1.0
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HFFormatError, match="crit.out_layers.0.weight.*tied"):
        from_hf(src)


def test_missing_unexpected_and_misshapen_tensors_are_refused(tmp_path):
    _, src = _hf_folder(tmp_path, CONFIGS["plain"])
    good = load_file(src / "model.safetensors")
    cases = [
        ({k: v for k, v in good.items() if k != "transformer.layers.1.dec_attn.o_net.weight"},
         "missing.*transformer.layers.1.dec_attn.o_net.weight"),
        ({**good, "transformer.layers.2.dec_attn.o_net.weight": good["crit.out_layers.0.bias"].clone()},
         "unexpected.*transformer.layers.2.dec_attn.o_net.weight"),
        ({**good, "crit.out_layers.0.bias": torch.zeros(7)}, r"crit.out_layers.0.bias.*\(7,\).*\(53,\)"),
    ]
    for tensors, pattern in cases:
        save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(HFFormatError, match=pattern):
            from_hf(src)


def test_folder_without_weights_or_config_is_refused(tmp_path):
    with pytest.raises(HFFormatError, match="config.json does not exist"):
        from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_model_config(CONFIGS["plain"])))
    with pytest.raises(HFFormatError, match="no weights found"):
        from_hf(tmp_path)


def test_half_precision_hf_weights_load_as_float32(tmp_path):
    model, src = _hf_folder(tmp_path, CONFIGS["plain"])
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(src / "model.safetensors").items()}
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    back = from_hf(src)
    assert all(p.dtype == torch.float32 for p in back.parameters())
    for k, v in back.state_dict().items():
        assert torch.equal(v, model.state_dict()[k].to(torch.bfloat16).float()), k


def test_bfloat16_model_exports_float32(tmp_path):
    model = small_model(CONFIGS["div1_cutoffs_projs"])
    to_hf(model.to(torch.bfloat16), tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    assert {v.dtype for v in tensors.values()} == {torch.float32}
    back = from_hf(tmp_path / "hf")
    for k, v in back.state_dict().items():
        assert torch.equal(v, model.state_dict()[k].float()), k


# ------------------------------------------------------------------------------------------------
# native folder and CLI


def test_native_round_trip(tmp_path):
    model = small_model(CONFIGS["div2_untied"])
    save_native(model, tmp_path / "native")
    assert sorted(p.name for p in (tmp_path / "native").iterdir()) == ["model.safetensors", "model_config.json"]
    assert json.loads((tmp_path / "native" / "model_config.json").read_text()) == dataclasses.asdict(model.config)
    assert_same_model(model, load_native(tmp_path / "native"))


def test_native_weights_are_the_same_file_each_time_and_tied_tensors_are_stored_once(tmp_path):
    """safetensors' save_model listed the tied names it dropped in the header's metadata, which it writes in a
    random order: two exports of one checkpoint differed in their bytes. A file written so still loads."""
    from safetensors import safe_open
    from safetensors.torch import save_model

    model = small_model(CONFIGS["div1_cutoffs_projs"])  # tied weights and projections
    first = (save_native(model, tmp_path / "a") / "model.safetensors").read_bytes()
    assert all((save_native(model, tmp_path / "b") / "model.safetensors").read_bytes() == first for _ in range(3))
    with safe_open(tmp_path / "a" / "model.safetensors", "pt") as f:
        stored, metadata = set(f.keys()), f.metadata()
    assert metadata == {"format": "pt"}
    names = set(model.state_dict())
    assert stored < names and len(stored) == len({t.data_ptr() for t in model.state_dict().values()})
    assert_same_model(model, load_native(tmp_path / "a"))
    save_model(model, str(tmp_path / "a" / "model.safetensors"), metadata={"format": "pt"})  # an older export
    assert_same_model(model, load_native(tmp_path / "a"))


def test_native_folder_records_the_tokenizer_digest_and_the_conversions_carry_it(tmp_path, capsys):
    """launch/export.py records the checkpoint's tokenizer sha256 in model_config.json (and config.json); the model
    loads as before, an older folder without it too, and from-hf / to-hf carry it to the folder they write."""
    from txl_dist.interop import recorded_tokenizer_sha256

    sha = "0123456789abcdef" * 4
    model = small_model(CONFIGS["plain"])
    save_native(model, tmp_path / "native", tokenizer_sha256=sha)
    assert json.loads((tmp_path / "native" / "model_config.json").read_text()) == {
        **dataclasses.asdict(model.config), "tokenizer_sha256": sha}
    assert_same_model(model, load_native(tmp_path / "native"))
    assert recorded_tokenizer_sha256(tmp_path / "native") == sha
    assert main(["to-hf", str(tmp_path / "native"), str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["tokenizer_sha256"] == sha
    assert recorded_tokenizer_sha256(tmp_path / "hf") == sha
    assert main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "native2")]) == 0
    assert recorded_tokenizer_sha256(tmp_path / "native2") == sha
    assert_same_model(model, load_native(tmp_path / "native2"))
    save_native(model, tmp_path / "older")  # no digest recorded: None, and nothing carried
    assert recorded_tokenizer_sha256(tmp_path / "older") is None
    assert main(["to-hf", str(tmp_path / "older"), str(tmp_path / "older-hf")]) == 0
    assert "tokenizer_sha256" not in json.loads((tmp_path / "older-hf" / "config.json").read_text())
    # A damaged digest is refused in one line naming the file, by load_native and by the CLI.
    config = json.loads((tmp_path / "native" / "model_config.json").read_text())
    (tmp_path / "native" / "model_config.json").write_text(json.dumps({**config, "tokenizer_sha256": 42}))
    with pytest.raises(ConfigError, match=r"model_config.json: tokenizer_sha256 must be a sha256 \(64 hex digits\), "
                                          "got 42; the file is damaged"):
        load_native(tmp_path / "native")
    err = _cli_error(capsys, ["to-hf", str(tmp_path / "native"), str(tmp_path / "hf3")])
    assert "tokenizer_sha256 must be a sha256" in err and not (tmp_path / "hf3").exists()


def test_native_weights_of_another_shape_are_refused_in_one_line_like_the_hf_path(tmp_path, capsys):
    """An edited model_config.json (d_inner 24 -> 12) no longer fits its weights in shape: torch's load_state_dict
    raised a 40-line RuntimeError (exit 1) for launch/generate.py --model and to-hf; it is refused in one line
    (exit 2) naming the tensor, as the HF path refuses the same edit of config.json."""
    model = small_model(CONFIGS["plain"])
    native, hf = save_native(model, tmp_path / "native"), to_hf(model, tmp_path / "hf")
    for folder, name in ((native, "model_config.json"), (hf, "config.json")):
        config = json.loads((folder / name).read_text())
        (folder / name).write_text(json.dumps({**config, "d_inner": 12}))
    with pytest.raises(ConfigError) as refused:
        load_native(native)
    message = str(refused.value)
    assert message == (f"{native / 'model.safetensors'}: tensor layers.0.pos_ff.fc_in.weight has shape (24, 16) but "
                       "model_config.json implies (12, 16); the weights do not belong to this config")
    with pytest.raises(HFFormatError) as refused_hf:  # the HF path's refusal, from the same check
        from_hf(hf)
    assert str(refused_hf.value) == (f"{hf}: tensor transformer.layers.0.pos_ff.CoreNet.0.weight has shape (24, 16) "
                                     "but config.json implies (12, 16); the weights do not belong to this config")
    err = _cli_error(capsys, ["to-hf", str(native), str(tmp_path / "out")])
    assert err == f"error: {message}"
    assert not (tmp_path / "out" / "model.safetensors").exists()
    # Names still count: a tensor the config does not imply (a layer fewer in the config) is refused too.
    (native / "model_config.json").write_text(json.dumps({**dataclasses.asdict(model.config), "n_layer": 1}))
    with pytest.raises(ConfigError, match=r"does not fit model_config.json: missing \[\], unexpected \['layers.1"):
        load_native(native)


def test_native_folder_records_the_eod_id_and_to_hf_writes_it_as_eos_token_id(tmp_path, caplog):
    """launch/export.py records the corpus' end-of-document id in model_config.json (eod_id); to-hf writes it into
    config.json as eos_token_id (where HF generate() stops), as export --hf does, and from-hf carries it back. A
    native folder that records none (an older export) gets no eos_token_id and one warning line, as export gives
    when it cannot set it."""
    from txl_dist.interop.native import read_eod_id, recorded_eod_id

    model = small_model(CONFIGS["plain"])
    native = save_native(model, tmp_path / "native", tokenizer_sha256="ab" * 32, eod_id=7)
    assert json.loads((native / "model_config.json").read_text()) == {
        **dataclasses.asdict(model.config), "tokenizer_sha256": "ab" * 32, "eod_id": 7}
    assert read_eod_id(native) == 7
    assert_same_model(model, load_native(native))
    with caplog.at_level(logging.WARNING, logger="txl_dist"):
        assert main(["to-hf", str(native), str(tmp_path / "hf")]) == 0
        assert caplog.records == []
        config = json.loads((tmp_path / "hf" / "config.json").read_text())
        assert config["eos_token_id"] == 7 and config["tokenizer_sha256"] == "ab" * 32
        assert main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "native2")]) == 0
        assert read_eod_id(tmp_path / "native2") == 7 and caplog.records == []
        # An older native folder (no eod_id): no eos_token_id, one warning naming the folder and what to do.
        older = save_native(model, tmp_path / "older")
        assert read_eod_id(older) is None
        assert main(["to-hf", str(older), str(tmp_path / "older-hf")]) == 0
    assert "eos_token_id" not in json.loads((tmp_path / "older-hf" / "config.json").read_text())
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert lines[0].startswith("to-hf: no eos_token_id in the HuggingFace config.json (transformers then takes 0): "
                               f"{older} records no end-of-document id")
    # An HF folder of elsewhere: its own eos_token_id where it is a token id, else none (HF allows null, lists).
    assert recorded_eod_id(tmp_path / "hf") == 7
    for value in (None, [0, 1], 53, True):
        (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "eos_token_id": value}))
        assert recorded_eod_id(tmp_path / "hf") is None
    # A damaged eod_id in model_config.json is refused in one line naming the file.
    for value in (-1, 53, "7", 2.0):
        (native / "model_config.json").write_text(json.dumps({**dataclasses.asdict(model.config), "eod_id": value}))
        with pytest.raises(ConfigError, match=r"model_config.json: eod_id must be a token id in \[0, 53\), got "):
            load_native(native)


def test_the_conversions_carry_the_tokenizer_model_that_fits_the_recorded_digest(tmp_path, caplog):
    """export writes tokenizer.model into both its folders (generate --model then needs no --tokenizer); to-hf and
    from-hf copy the source's too. One that is not the recorded tokenizer is left out with a warning, and one that
    OUT_DIR held before never stays beside the new weights."""
    import hashlib

    model = small_model(CONFIGS["plain"])
    tokenizer = b"a SentencePiece model"
    native = save_native(model, tmp_path / "native", tokenizer_sha256=hashlib.sha256(tokenizer).hexdigest(), eod_id=1)
    (native / "tokenizer.model").write_bytes(tokenizer)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "tokenizer.model").write_bytes(b"another model's tokenizer")
    with caplog.at_level(logging.WARNING, logger="txl_dist"):
        assert main(["to-hf", str(native), str(out)]) == 0
        assert (out / "tokenizer.model").read_bytes() == tokenizer
        assert main(["from-hf", str(out), str(tmp_path / "native2")]) == 0
        assert (tmp_path / "native2" / "tokenizer.model").read_bytes() == tokenizer
        assert caplog.records == []
        (native / "tokenizer.model").write_bytes(b"another tokenizer")  # not the recorded one: left out
        assert main(["to-hf", str(native), str(out)]) == 0
    assert not (out / "tokenizer.model").exists()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "not the tokenizer" in lines[0] and "left out" in lines[0], lines
    (native / "tokenizer.model").unlink()  # none in the source: none in OUT_DIR either, no warning
    (out / "tokenizer.model").write_bytes(b"stale")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="txl_dist"):
        assert main(["to-hf", str(native), str(out)]) == 0
    assert not (out / "tokenizer.model").exists() and caplog.records == []


def test_cli_to_hf_and_back(tmp_path, capsys):
    model = small_model(CONFIGS["div1_cutoffs_projs"])
    save_native(model, tmp_path / "native")
    assert main(["to-hf", str(tmp_path / "native"), str(tmp_path / "hf")]) == 0
    assert main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "native2")]) == 0
    assert_same_model(model, load_native(tmp_path / "native2"))
    assert "wrote" in capsys.readouterr().out


def test_cli_runs_as_a_module(tmp_path):
    model = small_model(CONFIGS["plain"])
    save_native(model, tmp_path / "native")
    proc = subprocess.run([sys.executable, "-m", "txl_dist.interop", "to-hf", str(tmp_path / "native"),
                           str(tmp_path / "hf")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert_same_model(model, from_hf(tmp_path / "hf"))


def test_cli_bad_source_is_one_line_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["from-hf", str(tmp_path / "nowhere"), str(tmp_path / "out")])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err.strip()
    assert "config.json does not exist" in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_cli_config_that_our_model_cannot_build_is_one_line_error(tmp_path, capsys):
    src = to_hf(small_model(CONFIGS["plain"]), tmp_path / "hf")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "sample_softmax": 64}))
    with pytest.raises(SystemExit):
        main(["from-hf", str(src), str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "sample_softmax 64" in err and "\n" not in err


def _cli_error(capsys, argv) -> str:
    """The CLI's one error line for argv (exit status 2)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_truncated_weights_are_a_one_line_refusal_naming_the_file(tmp_path, capsys):
    model = small_model(CONFIGS["plain"])
    native, hf = save_native(model, tmp_path / "native"), to_hf(model, tmp_path / "hf")
    bin_hf = tmp_path / "bin"
    bin_hf.mkdir()
    (bin_hf / "config.json").write_text((hf / "config.json").read_text())
    torch.save(load_file(hf / "model.safetensors"), bin_hf / "pytorch_model.bin")
    for path in (native / "model.safetensors", hf / "model.safetensors", bin_hf / "pytorch_model.bin"):
        _truncate(path)
    # A copy cut short: the header promises more bytes than the file has (safetensors' own error was a traceback).
    with pytest.raises(Refused, match="model.safetensors: cannot read the weights .* truncated or damaged"):
        load_native(native)
    err = _cli_error(capsys, ["to-hf", str(native), str(tmp_path / "out")])
    assert err.startswith(f"error: {native / 'model.safetensors'}: cannot read the weights (")
    for src, name in ((hf, "model.safetensors"), (bin_hf, "pytorch_model.bin")):
        err = _cli_error(capsys, ["from-hf", str(src), str(tmp_path / "out")])
        assert err.startswith(f"error: {src / name}: cannot read the weights (")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content, what", [
    (lambda tensors: tensors["crit.out_layers.0.bias"], "an object of type Tensor"),
    (lambda tensors: list(tensors.values()), "an object of type list"),
    (lambda tensors: None, "an object of type NoneType"),
    (lambda tensors: {**tensors, "crit.out_layers.0.bias": 3}, "a dict whose 'crit.out_layers.0.bias' is no tensor "
                                                               "(type int)"),
    (lambda tensors: {7: tensors["crit.out_layers.0.bias"]}, "a dict with the key 7, which is no tensor name"),
], ids=["tensor", "list", "none", "dict-of-an-int", "int-key"])
def test_a_pytorch_model_bin_that_holds_no_state_dict_is_a_one_line_refusal(tmp_path, capsys, content, what):
    """weights_only unpickling lets through any plain object: one that is no name -> tensor dict was a traceback
    (exit 1) where the name and shape checks met it."""
    _, hf = _hf_folder(tmp_path, CONFIGS["plain"])
    src = tmp_path / "bin"
    src.mkdir()
    (src / "config.json").write_text((hf / "config.json").read_text())
    torch.save(content(load_file(hf / "model.safetensors")), src / "pytorch_model.bin")
    err = _cli_error(capsys, ["from-hf", str(src), str(tmp_path / "out")])
    assert err == (f"error: {src / 'pytorch_model.bin'}: holds no state dict (tensors by name) but {what}; it is not "
                   "a model's weights file: pass the folder save_pretrained wrote")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["to-hf", "from-hf"])
def test_converting_a_folder_into_itself_is_refused(tmp_path, capsys, monkeypatch, command):
    model = small_model(CONFIGS["plain"])
    src = save_native(model, tmp_path / "x") if command == "to-hf" else to_hf(model, tmp_path / "x")
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    monkeypatch.chdir(tmp_path)
    # Spelled differently, one folder: the output's model.safetensors would have replaced the source's (exit 0).
    err = _cli_error(capsys, [command, "x", "./x/"])
    assert "x and OUT_DIR ./x/ are the same folder" in err
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before


def test_an_output_folder_that_cannot_be_made_is_refused_before_reading(tmp_path, capsys):
    (tmp_path / "afile").write_text("a regular file\n")
    # No source at all: the output is checked first, so its refusal is the one line.
    err = _cli_error(capsys, ["to-hf", str(tmp_path / "nowhere"), str(tmp_path / "afile" / "sub")])
    assert err == f"error: OUT_DIR {tmp_path / 'afile' / 'sub'}: cannot be made ({tmp_path / 'afile'} is not a " \
                  "folder); choose another path"
    err = _cli_error(capsys, ["from-hf", str(tmp_path / "nowhere"), str(tmp_path / "afile")])
    assert err == f"error: OUT_DIR {tmp_path / 'afile'}: exists and is not a folder; choose another path"
    assert (tmp_path / "afile").read_text() == "a regular file\n"


def test_output_checks_write_nothing_and_see_unwritable_places(tmp_path):
    from txl_dist.output_paths import OutputError, check_output_file, check_output_folder

    assert check_output_folder(tmp_path / "new" / "deeper", "--out") == tmp_path / "new" / "deeper"
    assert check_output_file(tmp_path / "result.json", "--json-out") == tmp_path / "result.json"
    assert list(tmp_path.iterdir()) == []  # the probes are gone, no folder made
    if Path("/proc/self").is_dir():  # root may write nearly anywhere, but not into /proc
        with pytest.raises(OutputError, match=r"^--out /proc/txl-x: cannot be written \(.*: /proc\)"):
            check_output_folder("/proc/txl-x", "--out")
    with pytest.raises(OutputError, match="the folder .*missing does not exist"):
        check_output_file(tmp_path / "missing" / "r.json", "--json-out")
    with pytest.raises(OutputError, match="is a folder; name a file"):
        check_output_file(tmp_path, "--json-out")


# ------------------------------------------------------------------------------------------------
# Shard names from an index.json cannot leave the folder


@pytest.mark.parametrize("shard", [
    "../outside.safetensors", "/abs/outside.safetensors", "sub/outside.safetensors", "..\\outside.safetensors",
    "C:outside.safetensors", "\\\\server\\share\\outside.safetensors", "out\x00side.safetensors", "..", ".", "", 7,
], ids=["dotdot", "absolute", "subfolder", "backslash", "drive", "unc", "nul", "parent", "self", "empty", "number"])
def test_shard_names_must_be_plain_file_names_in_the_folder(tmp_path, shard):
    model, src = _hf_folder(tmp_path, CONFIGS["plain"])
    tensors = load_file(src / "model.safetensors")
    # A readable shard right outside the folder: without the check, '../outside.safetensors' would load.
    save_file(tensors, tmp_path / "outside.safetensors", metadata={"format": "pt"})
    (src / "model.safetensors").unlink()
    index = src / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {k: shard for k in tensors}}))
    with pytest.raises(HFFormatError) as refused:
        from_hf(src)
    message = str(refused.value)
    assert isinstance(refused.value, Refused)
    assert message.startswith(f"{index}: weight_map names shard {json.dumps(shard)}") and "\n" not in message


def test_an_index_whose_weight_map_is_not_an_object_is_refused(tmp_path):
    _, src = _hf_folder(tmp_path, CONFIGS["plain"])
    (src / "model.safetensors").unlink()
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    with pytest.raises(HFFormatError, match="not a shard index"):
        from_hf(src)


def test_a_write_that_fails_after_the_checks_is_a_fault_exit_1_and_leaves_no_weights(tmp_path, capsys,
                                                                                  monkeypatch):
    import errno

    import txl_dist.interop.hf_files as hf_files

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    src = save_native(small_model(CONFIGS["plain"]), tmp_path / "native")
    monkeypatch.setattr(hf_files, "save_file", disk_full)
    with pytest.raises(SystemExit) as exit_info:
        main(["to-hf", str(src), str(tmp_path / "hf")])
    # The input was fine (exit 2 would tell the user to change it): the machine failed, as a job's fault does.
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err == f"error: writing {tmp_path / 'hf'} failed: [Errno 28] No space left on device", err
    assert not (tmp_path / "hf" / "model.safetensors").exists() and not (tmp_path / "hf" / "config.json").exists()


def test_an_output_folder_in_a_checkpoint_or_a_corpus_or_empty_is_refused(tmp_path):
    """An export into a checkpoint tag would sit among checksummed files that retention removes; into a
    corpus, among its files (the export's tokenizer.model over the corpus' own)."""
    from txl_dist.output_paths import OutputError, check_output_folder

    tag = tmp_path / "run" / "checkpoints" / "step_00000002"
    (tag / "txl_state").mkdir(parents=True)
    (tag / "txl_state" / "run.json").write_text("{}")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "manifest.json").write_text("{}")
    (corpus / "tokenizer.model").write_bytes(b"x")
    for out, where in ((tag, tag), (tag / "exported", tag), (corpus, corpus), (corpus / "train" / "x", corpus)):
        with pytest.raises(OutputError, match=f"^--out {out}: lies in the (checkpoint|corpus) {where}; "):
            check_output_folder(out, "--out")
    with pytest.raises(OutputError, match="^--out: an empty path names no folder"):
        check_output_folder("", "--out")
    assert check_output_folder(tmp_path / "run" / "exported", "--out") == tmp_path / "run" / "exported"
