"""TransformerXL end to end: recurrence, causality, stop-gradient, mems, implementations, checkpointing."""
import functools

import pytest
import torch
import torch.utils.checkpoint

from txl_dist.config import MemorySettings, ModelConfig
from txl_dist.model import TransformerXL, TransformerXLOutput

VOCAB = 50


def make_model(seed=0, **overrides):
    # A larger init_std than the paper's so that attention visibly shapes the outputs of a tiny model.
    kw = dict(vocab_size=VOCAB, n_layer=3, d_model=32, n_head=2, d_head=8, d_inner=48, cutoffs=[10, 25],
              div_val=2, dropout=0.0, dropatt=0.0, tgt_len=6, mem_len=6, init_std=0.3, proj_init_std=0.3)
    kw.update(overrides)
    torch.manual_seed(seed)
    return TransformerXL(ModelConfig(**kw))


def tokens(bsz, length, seed=1):
    return torch.randint(0, VOCAB, (bsz, length), generator=torch.Generator().manual_seed(seed))


def run_segments(model, ids, labels, seg_len, memory=None):
    """Feed [B, n*seg_len] as consecutive segments, carrying mems; returns the list of outputs."""
    outs, mems = [], None
    for start in range(0, ids.shape[1], seg_len):
        out = model(ids[:, start:start + seg_len], labels[:, start:start + seg_len], mems, memory=memory)
        outs.append(out)
        mems = out.mems
    return outs


def test_output_shapes_and_types():
    model = make_model()
    ids = tokens(2, 6)
    out = model(ids, ids)
    assert isinstance(out, TransformerXLOutput)
    assert out.nll.shape == (2, 6) and out.nll.dtype == torch.float32
    assert out.hidden.shape == (2, 6, 32)
    assert [m.shape for m in out.mems] == [(2, 6, 32)] * 3
    assert model(ids).nll is None


@pytest.mark.parametrize("overrides", [
    {}, {"pre_lnorm": True}, {"untie_r": False}, {"div_val": 1, "d_embed": 16}, {"cutoffs": [], "div_val": 1}])
def test_segments_with_mems_equal_one_long_forward(overrides):
    # With mem_len >= everything seen so far, segment s with mems must see exactly what positions of
    # segment s see in one forward over all segments at once (same relative distances, same causal
    # mask): this checks the mems update, the rel-shift with mlen > 0 and the mask offsets together.
    seg, n_seg = 5, 3
    model = make_model(mem_len=seg * (n_seg - 1), **overrides).eval()
    ids, labels = tokens(2, seg * n_seg, seed=3), tokens(2, seg * n_seg, seed=4)
    with torch.no_grad():
        outs = run_segments(model, ids, labels, seg)
        whole = model(ids, labels)
    for s, out in enumerate(outs):
        window = slice(s * seg, (s + 1) * seg)
        torch.testing.assert_close(out.hidden, whole.hidden[:, window], rtol=1e-5, atol=2e-5)
        torch.testing.assert_close(out.nll, whole.nll[:, window], rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("same_length", [False, True])
def test_no_information_from_the_future(same_length):
    seg = 6
    model = make_model(same_length=same_length, mem_len=4).eval()
    ids, labels = tokens(2, 2 * seg, seed=5), tokens(2, 2 * seg, seed=6)
    with torch.no_grad():
        base = run_segments(model, ids, labels, seg)
        for t in (1, 4, seg + 2, 2 * seg - 1):  # in segment 1 and in segment 2
            changed = ids.clone()
            changed[:, t] = (changed[:, t] + 1) % VOCAB
            outs = run_segments(model, changed, labels, seg)
            for s in range(2):
                before = max(0, min(seg, t - s * seg))  # positions of segment s that precede t
                for name in ("hidden", "nll"):
                    a, b = getattr(base[s], name), getattr(outs[s], name)
                    torch.testing.assert_close(b[:, :before], a[:, :before], rtol=0, atol=1e-6)
                    if s * seg <= t < (s + 1) * seg:  # token t itself must matter (the test can fail)
                        assert not torch.allclose(b[:, before], a[:, before], atol=1e-4)


def test_stop_gradient_between_segments():
    model = make_model(dropout=0.1).train()
    ids, labels = tokens(2, 12, seed=7), tokens(2, 12, seed=8)
    emb_out = []
    handle = model.word_emb.register_forward_hook(lambda m, i, o: emb_out.append(o))
    first = model(ids[:, :6], labels[:, :6])
    second = model(ids[:, 6:], labels[:, 6:], first.mems)
    handle.remove()
    assert all(not m.requires_grad and m.grad_fn is None for m in first.mems + second.mems)
    loss2 = second.nll.mean()
    # No path from segment 2's loss into segment 1's graph ...
    assert torch.autograd.grad(loss2, emb_out[0], retain_graph=True, allow_unused=True)[0] is None
    # ... while segment 2's own inputs do get gradients (so the check above can fail).
    assert torch.autograd.grad(loss2, emb_out[1], retain_graph=True)[0].abs().sum() > 0
    # And segment 1's loss still reaches its own embeddings through the mems it produced.
    assert torch.autograd.grad(first.nll.mean(), emb_out[0])[0].abs().sum() > 0


def test_mems_shapes_truncation_and_content():
    model = make_model(mem_len=5).eval()
    ids = tokens(2, 9, seed=9)
    with torch.no_grad():
        outs = run_segments(model, ids, ids, 3)
    assert [m.shape[1] for m in outs[0].mems] == [3] * 3  # min(mem_len, 0 + 3)
    assert [m.shape[1] for m in outs[1].mems] == [5] * 3  # min(5, 3 + 3)
    assert [m.shape[1] for m in outs[2].mems] == [5] * 3  # min(5, 5 + 3)
    for layer in range(3):
        # The newest positions are kept: after segment 2, the memory is segment 1's last 2 + segment 2's 3.
        torch.testing.assert_close(outs[1].mems[layer][:, :2], outs[0].mems[layer][:, 1:], rtol=0, atol=0)
        torch.testing.assert_close(outs[2].mems[layer][:, :2], outs[1].mems[layer][:, 3:], rtol=0, atol=0)
    # mems[0] is the (dropout-free) embedding output, mems[l] the input of layer l.
    emb = model.word_emb(ids[:, 6:9])
    torch.testing.assert_close(outs[2].mems[0][:, 2:], emb, rtol=0, atol=1e-6)


def test_mem_len_zero():
    model = make_model(mem_len=0).eval()
    ids = tokens(2, 6, seed=10)
    with torch.no_grad():
        first = model(ids, ids)
        assert [m.shape for m in first.mems] == [(2, 0, 32)] * 3
        second = model(ids, ids, first.mems)
        plain = model(ids, ids)
    torch.testing.assert_close(second.nll, plain.nll, rtol=0, atol=0)
    assert [m.shape for m in second.mems] == [(2, 0, 32)] * 3


IMPL_CASES = [  # (mem_len, same_length, clamp_len, with_mems)
    (6, False, -1, False), (6, False, -1, True), (6, True, -1, True), (4, True, 3, True), (6, False, 2, True)]


@pytest.mark.parametrize("impl", ["matmul", "sdpa"])
@pytest.mark.parametrize("mem_len,same_length,clamp_len,with_mems", IMPL_CASES)
def test_model_fast_attention_equals_reference(impl, mem_len, same_length, clamp_len, with_mems):
    model = make_model(mem_len=mem_len, same_length=same_length, clamp_len=clamp_len, dropatt=0.0).train()
    ids, labels = tokens(2, 12, seed=11), tokens(2, 12, seed=12)
    results = {}
    for name in ("reference", impl):
        model.attn_impl = name
        model.zero_grad()
        with torch.no_grad():
            mems = model(ids[:, :6]).mems if with_mems else None
        out = model(ids[:, 6:], labels[:, 6:], mems)
        out.nll.sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results[name] = (out, grads)
    (ref, ref_grads), (fast, fast_grads) = results["reference"], results[impl]
    assert model.resolved_attn_impl() == impl
    torch.testing.assert_close(fast.nll, ref.nll, rtol=0, atol=1e-5)
    torch.testing.assert_close(fast.hidden, ref.hidden, rtol=0, atol=1e-5)
    for n in ref_grads:
        scale = max(1.0, ref_grads[n].abs().max().item())  # fp32 rounding grows with the gradient's size
        torch.testing.assert_close(fast_grads[n], ref_grads[n], rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("mem_len,same_length,clamp_len", [(6, True, -1), (4, True, 3), (6, False, 2)])
def test_model_flex_forward_equals_reference(mem_len, same_length, clamp_len):
    # On a CPU flex is forward-only (evaluation, generation); its backward is checked on CUDA (test_gpu.py).
    model = make_model(mem_len=mem_len, same_length=same_length, clamp_len=clamp_len).eval()
    ids, labels = tokens(2, 18, seed=11), tokens(2, 18, seed=12)
    results = {}
    with torch.no_grad():
        for name in ("reference", "flex"):
            model.attn_impl = name
            results[name] = run_segments(model, ids, labels, 6)
    assert model.resolved_attn_impl() == "flex"
    for ref, flex in zip(results["reference"], results["flex"]):
        torch.testing.assert_close(flex.nll, ref.nll, rtol=1e-5, atol=1e-5)  # nll ~7: fp32 rounding
        for m_ref, m_flex in zip(ref.mems, flex.mems):
            torch.testing.assert_close(m_flex, m_ref, rtol=0, atol=1e-5)


def test_compiled_layers_equal_eager_and_compile_once_per_shape():
    # train.compile: each layer compiled with static shapes, under torch's non-reentrant checkpoint. The
    # first segment (no memory) and the steady state (full memory) are the only two layer shapes, and the
    # layers share one graph per shape: two compiles in all, none in later steps.
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    eager, compiled = make_model().train(), make_model().train()
    counter = CompileCounterWithBackend("inductor")
    compiled.compile_layers(backend=counter)
    compiled.set_activation_checkpointing(None)
    ids, labels = tokens(2, 24, seed=21), tokens(2, 24, seed=22)

    def segment(model, mems, start):
        model.zero_grad()
        out = model(ids[:, start:start + 6], labels[:, start:start + 6], mems)
        out.nll.mean().backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters()}

    mems_eager = mems_compiled = None
    for step, start in enumerate(range(0, 24, 6)):
        out_eager, grads_eager = segment(eager, mems_eager, start)
        out_compiled, grads_compiled = segment(compiled, mems_compiled, start)
        torch.testing.assert_close(out_compiled.nll, out_eager.nll, rtol=1e-5, atol=1e-5)
        for n in grads_eager:
            torch.testing.assert_close(grads_compiled[n], grads_eager[n], rtol=1e-4, atol=1e-5, msg=n)
        mems_eager, mems_compiled = out_eager.mems, out_compiled.mems
        assert counter.frame_count == min(step + 1, 2), step
    assert set(compiled.state_dict()) == set(eager.state_dict())  # checkpoints keep their names


def test_compiled_layers_with_flex_equal_the_reference():
    # flex inside a compiled layer is fused into the layer's graph. A CPU has no flex backward, so this
    # runs the training-mode (compiled) forward without grad; eval mode runs the layers eagerly.
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    reference, compiled = make_model().train(), make_model().train()
    reference.attn_impl, compiled.attn_impl = "reference", "flex"
    counter = CompileCounterWithBackend("inductor")
    compiled.compile_layers(backend=counter)
    ids = tokens(2, 18, seed=23)
    with torch.no_grad():
        for ref, got in zip(run_segments(reference, ids, ids, 6), run_segments(compiled, ids, ids, 6)):
            torch.testing.assert_close(got.nll, ref.nll, rtol=1e-5, atol=1e-5)
        assert counter.frame_count == 2
        compiled.eval()
        for ref, got in zip(run_segments(reference, ids, ids, 6, memory=MemorySettings(12, -1, True)),
                            run_segments(compiled, ids, ids, 6, memory=MemorySettings(12, -1, True))):
            torch.testing.assert_close(got.nll, ref.nll, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 2  # evaluation's growing memory compiled nothing


def test_memory_settings_passed_to_forward_equal_building_with_them():
    built = make_model(clamp_len=2, same_length=True, mem_len=3).eval()
    other = make_model().eval()  # same seed and shapes: same weights, other training memory settings
    ids = tokens(2, 12, seed=13)
    with torch.no_grad():
        a = run_segments(built, ids, ids, 6)
        b = run_segments(other, ids, ids, 6, memory=MemorySettings(mem_len=3, clamp_len=2, same_length=True))
        default = run_segments(other, ids, ids, 6)
    for x, y in zip(a, b):
        torch.testing.assert_close(x.nll, y.nll, rtol=0, atol=0)
    assert not torch.allclose(a[1].nll, default[1].nll)


CHECKPOINT_FNS = {
    "default": None,
    "reentrant": functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True),
}


@pytest.mark.parametrize("kind", sorted(CHECKPOINT_FNS))
def test_activation_checkpointing_same_loss_and_grads(kind):
    model = make_model(dropout=0.2, dropatt=0.1).train()
    ids, labels = tokens(2, 12, seed=14), tokens(2, 12, seed=15)

    def step():
        model.zero_grad()
        torch.manual_seed(123)
        outs = run_segments(model, ids, labels, 6)
        loss = sum(o.nll.mean() for o in outs)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss_off, grads_off = step()
    calls = []
    inner = CHECKPOINT_FNS[kind] or functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    model.set_activation_checkpointing(lambda fn, *args: calls.append(1) or inner(fn, *args))
    loss_on, grads_on = step()
    assert len(calls) == 2 * 3  # every layer of both segments went through the checkpoint function
    if kind == "default":
        model.set_activation_checkpointing(None)  # None: torch's non-reentrant checkpoint
        loss_default, _ = step()
        torch.testing.assert_close(loss_default, loss_off, rtol=0, atol=1e-6)
    model.set_activation_checkpointing(enabled=False)
    loss_again, _ = step()
    torch.testing.assert_close(loss_on, loss_off, rtol=0, atol=1e-6)
    torch.testing.assert_close(loss_again, loss_off, rtol=0, atol=0)
    for n in grads_off:
        torch.testing.assert_close(grads_on[n], grads_off[n], rtol=1e-5, atol=1e-6, msg=n)


def test_bf16_model():
    model = make_model().to(torch.bfloat16).eval()
    ids = tokens(2, 6, seed=16)
    with torch.no_grad():
        first = model(ids, ids)
        second = model(ids, ids, first.mems)
        fp32 = make_model().eval()(ids, ids)
    assert second.nll.dtype == torch.float32 and torch.isfinite(second.nll).all()
    assert all(m.dtype == torch.bfloat16 for m in second.mems)
    assert (first.nll - fp32.nll).abs().max() < 0.05 * fp32.nll.abs().max()


def test_parameters_tied_as_configured():
    model = make_model(div_val=2, tie_projs=[False, True, False])
    assert model.crit.out_layers[1].weight is model.word_emb.emb_layers[1].weight
    assert model.crit.out_layers[1].bias is not None
    assert model.crit.out_projs[1] is model.word_emb.emb_projs[1]
    assert model.crit.out_projs[0] is not model.word_emb.emb_projs[0]
    assert model.crit.out_projs[2] is not model.word_emb.emb_projs[2]
    untied = make_model(tie_weight=False, div_val=1, d_embed=16, tie_projs=[True, False, True])
    assert untied.crit.out_layers[0].weight is not untied.word_emb.emb_layers[0].weight
    assert untied.crit.out_projs[0] is untied.word_emb.emb_projs[0]
    assert untied.crit.out_projs[2] is untied.word_emb.emb_projs[0]
    assert untied.crit.out_projs[1] is not untied.word_emb.emb_projs[0]


def test_initialization_statistics():
    model = make_model(n_layer=2, d_model=64, d_inner=256, init_std=0.02, proj_init_std=0.01)
    ff = model.layers[0].pos_ff
    assert abs(ff.fc_in.weight.std().item() - 0.02) < 0.002 and ff.fc_in.bias.abs().max() == 0
    assert abs(model.word_emb.emb_projs[0].std().item() - 0.01) < 0.001
    assert abs(ff.layer_norm.weight.mean().item() - 1.0) < 0.01 and ff.layer_norm.bias.abs().max() == 0
    assert abs(model.layers[0].attn.r_w_bias.std().item() - 0.02) < 0.01
    assert model.crit.cluster_bias.abs().max() == 0
    torch.testing.assert_close(make_model(seed=5).state_dict(), make_model(seed=5).state_dict())


def test_bad_inputs_are_refused_clearly():
    with pytest.raises(ValueError, match="model.vocab_size is None"):
        TransformerXL(ModelConfig(vocab_size=None))
    with pytest.raises(ValueError, match="d_model: 33 must be even"):
        make_model(d_model=33, d_embed=32)
    model = make_model()
    ids = tokens(2, 6)
    good = model(ids).mems
    with pytest.raises(ValueError, match="expected 3 tensors"):
        model(ids, mems=good[:2])
    with pytest.raises(ValueError, match=r"mems\[1\] has shape"):
        model(ids, mems=[good[0], good[1][:1], good[2]])
    with pytest.raises(ValueError, match="labels"):
        model(ids, labels=ids[:, :3])
    with pytest.raises(ValueError, match="input_ids must be"):
        model(ids[0])
    with pytest.raises(ValueError, match="same_length with mem_len 0"):
        model(ids, memory=MemorySettings(mem_len=0, same_length=True))
