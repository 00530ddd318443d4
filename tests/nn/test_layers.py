"""Encoder and decoder layers against nn.TransformerEncoderLayer / nn.TransformerDecoderLayer."""

import pytest
import torch
from torch import nn

from qkv.nn import DecoderLayer, EncoderLayer, FeedForward, LayerNorm, MultiHeadAttention, causal_mask

D, H, F, B, T, S = 32, 4, 64, 3, 6, 5


def copy_attention(ref: nn.MultiheadAttention, ours: MultiHeadAttention) -> None:
    with torch.no_grad():
        for proj, w, b in zip((ours.q_proj, ours.k_proj, ours.v_proj), ref.in_proj_weight.chunk(3),
                              ref.in_proj_bias.chunk(3), strict=True):
            proj.weight.copy_(w)
            proj.bias.copy_(b)
        ours.out_proj.load_state_dict(ref.out_proj.state_dict())


def copy_ffn(ref, ours: FeedForward) -> None:
    ours.up.load_state_dict(ref.linear1.state_dict())
    ours.down.load_state_dict(ref.linear2.state_dict())


def perturb(module: nn.Module) -> None:
    """Random norm gains and biases, so a swapped or skipped norm cannot pass by accident."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.5)


def ours_like(activation: str, norm_first: bool, decoder: bool):
    parts = dict(
        self_attn=MultiHeadAttention(D, H, causal=decoder),
        feed_forward=FeedForward(D, F, activation=activation),
        self_attn_norm=LayerNorm(D),
        ffn_norm=LayerNorm(D),
        norm_first=norm_first,
    )
    if decoder:
        return DecoderLayer(cross_attn=MultiHeadAttention(D, H), cross_attn_norm=LayerNorm(D), **parts)
    return EncoderLayer(**parts)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_layer_matches_torch(norm_first, activation):
    # train() with dropout 0 keeps PyTorch off its fused inference fast path, which zeroes padded rows.
    ref = nn.TransformerEncoderLayer(D, H, F, dropout=0.0, activation=activation, batch_first=True,
                                     norm_first=norm_first).train()
    perturb(ref)
    ours = ours_like(activation, norm_first, decoder=False)
    copy_attention(ref.self_attn, ours.self_attn)
    copy_ffn(ref, ours.feed_forward)
    ours.self_attn_norm.load_state_dict(ref.norm1.state_dict())
    ours.ffn_norm.load_state_dict(ref.norm2.state_dict())

    x = torch.randn(B, T, D)
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[1, 4:] = False
    expected = ref(x, src_key_padding_mask=~keep)  # PyTorch: True = ignore
    torch.testing.assert_close(ours(x, key_padding_mask=keep)[0], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_decoder_layer_matches_torch(norm_first, activation):
    ref = nn.TransformerDecoderLayer(D, H, F, dropout=0.0, activation=activation, batch_first=True,
                                     norm_first=norm_first).train()
    perturb(ref)
    ours = ours_like(activation, norm_first, decoder=True)
    copy_attention(ref.self_attn, ours.self_attn)
    copy_attention(ref.multihead_attn, ours.cross_attn)
    copy_ffn(ref, ours.feed_forward)
    ours.self_attn_norm.load_state_dict(ref.norm1.state_dict())
    ours.cross_attn_norm.load_state_dict(ref.norm2.state_dict())
    ours.ffn_norm.load_state_dict(ref.norm3.state_dict())

    x, memory = torch.randn(B, T, D), torch.randn(B, S, D)
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[2, 3:] = False
    expected = ref(x, memory, tgt_mask=~causal_mask(T), memory_key_padding_mask=~keep)
    out, self_w, cross_w = ours(x, memory, memory_key_padding_mask=keep, need_weights=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert self_w.shape == (B, H, T, T) and cross_w.shape == (B, H, T, S)
    assert (cross_w[2, :, :, 3:] == 0).all()
    torch.testing.assert_close(ours(x, memory, memory_key_padding_mask=keep)[0], expected, atol=1e-5, rtol=1e-5)


def test_decoder_only_layer_rejects_memory_and_full_layer_requires_it():
    full = ours_like("relu", True, decoder=True)
    with pytest.raises(ValueError, match="needs the encoder output"):
        full(torch.randn(B, T, D))
    alone = DecoderLayer(self_attn=MultiHeadAttention(D, H, causal=True), cross_attn=None,
                         feed_forward=FeedForward(D, F), self_attn_norm=LayerNorm(D), cross_attn_norm=None,
                         ffn_norm=LayerNorm(D))
    with pytest.raises(ValueError, match="no cross-attention"):
        alone(torch.randn(B, T, D), torch.randn(B, S, D))


def test_dropout_is_active_in_training_only():
    layer = EncoderLayer(self_attn=MultiHeadAttention(D, H, dropout=0.5), feed_forward=FeedForward(D, F, dropout=0.5),
                         self_attn_norm=LayerNorm(D), ffn_norm=LayerNorm(D), dropout=0.5)
    x = torch.randn(B, T, D)
    assert not torch.equal(layer.train()(x)[0], layer(x)[0])
    assert torch.equal(layer.eval()(x)[0], layer(x)[0])
