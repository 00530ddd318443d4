"""The encoder-decoder Transformer: invariants, errors, sizes, and learning to copy."""

import pytest
import torch
import torch.nn.functional as F

from qkv import Transformer, TransformerConfig
from qkv.models import common
from qkv.models.common import WithAttention

PAD, BOS = 0, 1


def small(**overrides) -> Transformer:
    cfg = dict(src_vocab_size=23, tgt_vocab_size=29, d_model=32, n_heads=4, n_layers=2, d_ff=64, dropout=0.0,
               max_seq_len=32)
    return Transformer(TransformerConfig(**{**cfg, **overrides})).eval()


VARIANTS = {
    "post-norm": dict(norm_first=False),
    "pre-norm": dict(norm_first=True),
    "learned": dict(positional="learned"),
    "rope": dict(positional="rope"),
    "rms-swiglu": dict(norm="rms", activation="swiglu", bias=False),
    "window": dict(window=3),
    "grouped-kv": dict(n_kv_heads=2),
    "gated": dict(gated_attention=True),
    "relu2-qk-norm": dict(activation="relu2", qk_norm=True),  # the speedruns' feed-forward and attention
    "shared": dict(src_vocab_size=29, share_embeddings=True, tie_output=False),
}


def test_shapes_and_attention_maps():
    model = small()
    src = torch.randint(2, 23, (3, 7))
    src[1, 5:] = PAD
    tgt = torch.randint(2, 29, (3, 5))
    result = model(src, tgt, return_attention=True)
    assert isinstance(result, WithAttention)
    logits, att = result
    assert logits.shape == (3, 5, 29)
    assert set(att) == {"encoder", "decoder_self", "decoder_cross"}
    assert [w.shape for w in att["encoder"]] == [(3, 4, 7, 7)] * 2
    assert [w.shape for w in att["decoder_self"]] == [(3, 4, 5, 5)] * 2
    assert [w.shape for w in att["decoder_cross"]] == [(3, 4, 5, 7)] * 2
    for w in att["decoder_cross"]:
        torch.testing.assert_close(w.sum(-1), torch.ones(3, 4, 5))
        assert (w[1, ..., 5:] == 0).all()  # padding gets no weight
    torch.testing.assert_close(logits, model(src, tgt))
    memory, encoder_att = model.encode(src, return_attention=True)
    torch.testing.assert_close(memory, model.encode(src))
    assert all(torch.equal(a, b) for a, b in zip(encoder_att, att["encoder"], strict=True))
    decoded = model.decode(tgt, memory, memory_mask=model.source_mask(src), return_attention=True)
    torch.testing.assert_close(decoded.output, logits)
    assert set(decoded.attention) == {"decoder_self", "decoder_cross"}


@pytest.mark.parametrize("variant", VARIANTS)
def test_changing_a_future_target_token_changes_no_earlier_output(variant):
    model = small(**VARIANTS[variant])
    src, tgt = torch.randint(2, 23, (2, 6)), torch.randint(2, 29, (2, 8))
    changed = tgt.clone()
    changed[:, 5] = (changed[:, 5] + 1) % 27 + 2
    before, after = model(src, tgt), model(src, changed)
    torch.testing.assert_close(after[:, :5], before[:, :5])
    assert not torch.allclose(after[:, 5:], before[:, 5:])


@pytest.mark.parametrize("variant", VARIANTS)
def test_padded_batch_equals_each_sequence_alone(variant):
    model = small(**VARIANTS[variant])
    lengths_src, lengths_tgt = [7, 3, 5], [6, 2, 4]
    srcs = [torch.randint(2, 23, (n,)) for n in lengths_src]
    tgts = [torch.randint(2, 29, (n,)) for n in lengths_tgt]
    src = torch.nn.utils.rnn.pad_sequence(srcs, batch_first=True, padding_value=PAD)
    tgt = torch.nn.utils.rnn.pad_sequence(tgts, batch_first=True, padding_value=PAD)
    batched = model(src, tgt)
    for i, (s, t) in enumerate(zip(srcs, tgts, strict=True)):
        alone = model(s[None], t[None])[0]
        torch.testing.assert_close(batched[i, : len(t)], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_incremental_decoding_equals_full_forward(variant):
    model = small(**VARIANTS[variant])
    src = torch.randint(2, 23, (2, 6))
    src[1, 4:] = PAD
    memory, memory_mask = model.encode(src), model.source_mask(src)
    ys = torch.full((2, 1), BOS)
    cache = model.new_cache()
    step_logits = []
    for _ in range(8):  # greedy decoding, one token per step, feeding only the newest token
        logits = model.decode(ys[:, -1:], memory, memory_mask=memory_mask, cache=cache)
        step_logits.append(logits)
        ys = torch.cat([ys, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    full = model.decode(ys[:, :-1], memory, memory_mask=memory_mask)
    torch.testing.assert_close(torch.cat(step_logits, dim=1), full, atol=1e-5, rtol=1e-5)
    assert len(cache) == 8


def test_cache_reorder_follows_the_batch():
    model = small()
    src = torch.randint(2, 23, (3, 5))
    memory = model.encode(src)
    tgt = torch.randint(2, 29, (3, 4))
    cache = model.new_cache()
    model.decode(tgt[:, :3], memory, cache=cache)
    index = torch.tensor([2, 0, 0])
    cache.reorder(index)
    step = model.decode(tgt[index, 3:], memory[index], cache=cache)
    torch.testing.assert_close(step, model.decode(tgt[index], memory[index])[:, 3:], atol=1e-5, rtol=1e-5)


def test_gradients_are_finite_with_padding():
    model = small(dropout=0.1).train()
    src = torch.randint(2, 23, (3, 7))
    src[0, 2:] = PAD
    tgt = torch.randint(2, 29, (3, 5))
    tgt[1, 1:] = PAD
    loss = F.cross_entropy(model(src, tgt).flatten(0, 1), tgt.flatten(), ignore_index=PAD)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(grads) == len(list(model.parameters()))
    assert all(torch.isfinite(g).all() for g in grads)


def test_embeddings_sharing_and_tying():
    tied = small()
    assert tied.lm_head.weight is tied.tgt_emb.weight and tied.src_emb is not tied.tgt_emb
    shared = small(**VARIANTS["shared"])
    assert shared.src_emb is shared.tgt_emb and shared.lm_head.weight is not shared.tgt_emb.weight
    untied = small(tie_output=False)
    assert untied.num_parameters() - tied.num_parameters() == 29 * 32


def expected_parameters(d, d_ff, vocab_src, vocab_tgt, n_enc, n_dec):
    attention = 4 * (d * d + d)
    ffn = d * d_ff + d_ff + d_ff * d + d
    norm = 2 * d
    encoder = n_enc * (attention + ffn + 2 * norm) + norm
    decoder = n_dec * (2 * attention + ffn + 3 * norm) + norm
    return encoder + decoder, (vocab_src + vocab_tgt) * d


def test_parameter_counts_follow_the_architecture():
    cfg = TransformerConfig(src_vocab_size=1000, tgt_vocab_size=1200, d_model=64, n_heads=4, n_layers=3, d_ff=96,
                            n_decoder_layers=2)
    model = Transformer(cfg)
    body, embeddings = expected_parameters(64, 96, 1000, 1200, 3, 2)
    assert model.num_parameters(exclude_embeddings=True) == body
    assert model.num_parameters() == body + embeddings  # output tied to the target embedding


def test_paper_base_model_size():
    """Vaswani et al. report 65M parameters for the base model (shared 37k BPE vocabulary)."""
    cfg = TransformerConfig.from_preset("base", src_vocab_size=37000, tgt_vocab_size=37000, share_embeddings=True)
    assert 60e6 < Transformer(cfg).num_parameters() < 65e6


def test_xavier_initialisation():
    model = Transformer(TransformerConfig(src_vocab_size=4000, tgt_vocab_size=4000, d_model=256, n_heads=4,
                                          n_layers=1))
    assert abs(model.src_emb.weight.std().item() - 256**-0.5) < 0.003
    w = model.encoder.layers[0].feed_forward.up.weight  # Xavier-uniform bound sqrt(6 / (fan_in + fan_out))
    assert abs(w.abs().max().item() - (6 / (256 + 1024)) ** 0.5) < 0.002
    assert (model.encoder.layers[0].self_attn.q_proj.bias == 0).all()


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda m: m(torch.randint(2, 23, (2, 5)).float(), torch.randint(2, 29, (2, 4))), TypeError, "dtype"),
        (lambda m: m(torch.randint(2, 23, (5,)), torch.randint(2, 29, (2, 4))), ValueError, r"shape \(B, T\)"),
        (lambda m: m(torch.full((2, 5), 23), torch.randint(2, 29, (2, 4))), ValueError,
         r"token id 23, outside the vocabulary \[0, 23\)"),
        (lambda m: m(torch.randint(2, 23, (2, 5)), torch.full((2, 4), -1)), ValueError, "token id -1"),
        (lambda m: m(torch.randint(2, 23, (2, 5)), torch.randint(2, 29, (3, 4))), ValueError,
         "batch sizes differ: src has 2 rows, tgt has 3"),
        (lambda m: m(torch.randint(2, 23, (1, 33)), torch.randint(2, 29, (1, 4))), ValueError,
         "position 32 is beyond max_seq_len=32"),
        (lambda m: m([[2, 3]], torch.randint(2, 29, (1, 4))), TypeError, "LongTensor"),
        (lambda m: m.decode(torch.randint(2, 29, (2, 4)), torch.randn(2, 5, 16)), ValueError,
         r"memory must have shape \(B, S, 32\)"),
    ],
)
def test_bad_input_raises_a_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call(small())


def test_learns_to_copy_random_sequences():
    """Teacher-forced token accuracy >= 99% on fresh sequences within 600 steps. It gets there by about step 150
    (a few seconds on 2 cores) and stops; the bound is on steps, not seconds, so a busy machine cannot make it
    flaky."""
    vocab, length = 12, 10
    model = small(src_vocab_size=vocab, tgt_vocab_size=vocab, d_model=64, d_ff=128).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def batch(n):
        src = torch.randint(2, vocab, (n, length))
        return src, torch.cat([torch.full((n, 1), BOS), src[:, :-1]], 1), src  # source, decoder input, target

    accuracy = 0.0
    for step in range(1, 601):
        src, tgt_in, tgt_out = batch(64)
        for group in opt.param_groups:
            group["lr"] = 3e-3 * min(1.0, step / 50)  # short warmup
        loss = F.cross_entropy(model(src, tgt_in).flatten(0, 1), tgt_out.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0:
            model.eval()
            with torch.no_grad():
                src, tgt_in, tgt_out = batch(512)
                accuracy = (model(src, tgt_in).argmax(-1) == tgt_out).float().mean().item()
            model.train()
            if accuracy >= 0.99:
                break
    assert accuracy >= 0.99, f"copy accuracy {accuracy:.3f} after {step} steps"


def test_residual_scaling_reaches_the_blocks_outputs_and_never_the_vocabulary_layer():
    """GPT-2's 1/sqrt(2L) is for the layers that write into the residual stream (attention's output projection,
    the feed-forward's down projection), found by the block they belong to, not by a name the vocabulary layer
    could share."""
    torch.manual_seed(0)
    cfg = TransformerConfig(src_vocab_size=512, tgt_vocab_size=512, d_model=256, n_heads=4, n_layers=2, d_ff=512,
                            init="normal", init_std=0.02, tie_output=False)
    model = Transformer(cfg)
    common.init_weights(model, cfg, residual_layers=8)  # 1/sqrt(16): std 0.005
    layer = model.decoder.layers[0]
    assert layer.self_attn.out_proj.weight.std().item() == pytest.approx(0.005, rel=0.05)
    assert layer.feed_forward.down.weight.std().item() == pytest.approx(0.005, rel=0.05)
    assert layer.self_attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.lm_head.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_a_checkpoint_naming_the_vocabulary_layer_out_proj_loads():
    """Until 2026-11-24 the vocabulary layer was ``out_proj``: its weights load into ``lm_head``."""
    model = small(tie_output=False)
    state = {("out_proj.weight" if k == "lm_head.weight" else k): v for k, v in model.state_dict().items()}
    fresh = small(tie_output=False)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)
