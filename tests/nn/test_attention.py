"""Attention against PyTorch's own implementations, and the invariants users trip over."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkv.nn import (
    KVCache,
    MultiHeadAttention,
    RotaryEmbedding,
    StackedSelfAttention,
    causal_mask,
    scaled_dot_product_attention,
)

B, H, T, S, D = 3, 4, 7, 5, 32


def random_mask(*shape):
    mask = torch.rand(*shape) > 0.3
    mask[..., 0] = True  # keep at least one key per query
    return mask


# --- scaled_dot_product_attention, written out --------------------------------------------------------------

@pytest.mark.parametrize("mask_kind", ["none", "causal", "random"])
def test_explicit_attention_matches_torch_sdpa(mask_kind):
    q, k, v = torch.randn(B, H, T, 8), torch.randn(B, H, T, 8), torch.randn(B, H, T, 8)
    mask = {"none": None, "causal": causal_mask(T), "random": random_mask(B, H, T, T)}[mask_kind]
    out, weights = scaled_dot_product_attention(q, k, v, mask)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(B, H, T))


def test_explicit_attention_is_the_formula():
    q, k, v = torch.randn(2, 5, 16), torch.randn(2, 6, 16), torch.randn(2, 6, 3)
    expected = torch.softmax(torch.einsum("bqd,bkd->bqk", q, k) / 4.0, dim=-1) @ v  # sqrt(16) = 4
    out, _ = scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, expected)


def test_mask_polarity_true_means_attend():
    q, k = torch.randn(1, 2, 4), torch.randn(1, 3, 4)
    v = torch.eye(3)[None]  # value j is the one-hot e_j, so the output *is* the weights
    mask = torch.tensor([[True, False, True], [False, True, False]])
    out, weights = scaled_dot_product_attention(q, k, v, mask)
    assert (weights[0][~mask] == 0).all() and (weights[0][mask] > 0).all()
    torch.testing.assert_close(out, weights)
    assert weights[0, 1, 1] == 1.0


def test_fully_masked_row_gives_zeros_not_nan():
    q = torch.randn(2, 3, 4, requires_grad=True)
    k, v = torch.randn(2, 5, 4), torch.randn(2, 5, 4)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1] = False
    out, weights = scaled_dot_product_attention(q, k, v, mask)
    assert torch.isfinite(out).all() and (out[:, 1] == 0).all() and (weights[:, 1] == 0).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


@pytest.mark.parametrize("need_weights", [False, True])
def test_module_fully_masked_query_gives_zeros(need_weights):
    mha = MultiHeadAttention(D, H, bias=False)
    x = torch.randn(2, T, D, requires_grad=True)
    row_mask = torch.ones(T, T, dtype=torch.bool)
    row_mask[2] = False
    out, _ = mha(x, attn_mask=row_mask, need_weights=need_weights)
    assert torch.isfinite(out).all()
    assert (out[:, 2] == 0).all()  # no bias: zero attention stays zero through W^O
    out.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_dropout_on_weights_is_applied_and_inverted():
    q, k, v = torch.randn(1, 1, 400, 8), torch.randn(1, 1, 400, 8), torch.ones(1, 1, 400, 1)
    out, _ = scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    # Weights sum to 1 before dropout; inverted dropout keeps the expected sum, so the mean output is near 1.
    assert 0.9 < out.mean().item() < 1.1 and out.std() > 0.05


# --- MultiHeadAttention vs nn.MultiheadAttention -----------------------------------------------------------

def from_torch_mha(ref: nn.MultiheadAttention) -> MultiHeadAttention:
    ours = MultiHeadAttention(ref.embed_dim, ref.num_heads, bias=ref.in_proj_bias is not None)
    wq, wk, wv = ref.in_proj_weight.chunk(3)
    bq, bk, bv = ref.in_proj_bias.chunk(3)
    with torch.no_grad():
        for proj, w, b in ((ours.q_proj, wq, bq), (ours.k_proj, wk, bk), (ours.v_proj, wv, bv)):
            proj.weight.copy_(w)
            proj.bias.copy_(b)
        ours.out_proj.load_state_dict(ref.out_proj.state_dict())
    return ours


@pytest.fixture
def torch_mha():
    ref = nn.MultiheadAttention(D, H, batch_first=True).eval()
    with torch.no_grad():
        ref.in_proj_bias.normal_()
        ref.out_proj.bias.normal_()
    return ref


def test_self_attention_with_causal_and_padding_masks_matches_torch(torch_mha):
    ours = from_torch_mha(torch_mha).eval()
    x = torch.randn(B, T, D)
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[0, 5:] = False
    keep[2, 3:] = False
    causal = causal_mask(T)
    # nn.MultiheadAttention masks where True; qkv attends where True: invert at the boundary.
    ref_out, ref_w = torch_mha(x, x, x, attn_mask=~causal, key_padding_mask=~keep, average_attn_weights=False)
    ours.causal = True
    out, w = ours(x, key_padding_mask=keep, need_weights=True)
    fused, _ = ours(x, key_padding_mask=keep)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(fused, ref_out, atol=1e-5, rtol=1e-5)


def test_cross_attention_with_different_lengths_matches_torch(torch_mha):
    ours = from_torch_mha(torch_mha).eval()
    x, memory = torch.randn(B, T, D), torch.randn(B, S, D)
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[1, 2:] = False
    ref_out, ref_w = torch_mha(x, memory, memory, key_padding_mask=~keep, average_attn_weights=False)
    out, w = ours(x, memory, key_padding_mask=keep, need_weights=True)
    assert w.shape == (B, H, T, S)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours(x, memory, key_padding_mask=keep)[0], ref_out, atol=1e-5, rtol=1e-5)


OPTIONS = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(causal=True, window=3),
    "window-bidirectional": dict(window=2),
    "grouped-kv": dict(causal=True, n_kv_heads=2),
    "multi-query": dict(causal=True, n_kv_heads=1),
    "gated": dict(causal=True, gated=True),
    "rotary": dict(causal=True, rotary=RotaryEmbedding(D // H)),
    "everything": dict(causal=True, window=4, n_kv_heads=2, gated=True, rotary=RotaryEmbedding(D // H)),
}


@pytest.mark.parametrize("name", OPTIONS)
@pytest.mark.parametrize("padded", [False, True])
def test_fused_path_equals_explicit_path(name, padded):
    mha = MultiHeadAttention(D, H, **OPTIONS[name]).eval()
    x = torch.randn(B, T, D)
    keep = None
    if padded:
        keep = torch.ones(B, T, dtype=torch.bool)
        keep[1, 4:] = False
    explicit, weights = mha(x, key_padding_mask=keep, need_weights=True)
    fused, none = mha(x, key_padding_mask=keep)
    assert none is None and weights.shape == (B, H, T, T)
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("masked", [False, True])
def test_attention_bias_is_added_to_the_scores_on_both_paths(masked):
    mha = MultiHeadAttention(D, H).eval()
    x, bias = torch.randn(B, T, D), torch.randn(1, H, T, T)  # one score per head and query-key pair
    mask = random_mask(T, T) if masked else None
    if masked:
        mask[3] = False  # a query with no key: zeros, not NaN, with a bias too
    explicit, weights = mha(x, attn_mask=mask, attn_bias=bias, need_weights=True)
    fused, _ = mha(x, attn_mask=mask, attn_bias=bias)
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)
    q = mha.q_proj(x).view(B, T, H, -1).transpose(1, 2)
    k = mha.k_proj(x).view(B, T, H, -1).transpose(1, 2)
    scores = q @ k.transpose(-2, -1) / math.sqrt(D // H) + bias
    if masked:
        scores = scores.masked_fill(~mask, float("-inf"))
        scores[:, :, 3] = 0.0
    expected = scores.softmax(-1)
    if masked:
        expected[:, :, 3] = 0.0
    torch.testing.assert_close(weights, expected, atol=1e-6, rtol=1e-5)
    assert torch.isfinite(fused).all()


@pytest.mark.parametrize("name", ["causal", "window", "grouped-kv", "gated", "rotary", "everything"])
def test_kv_cache_decoding_equals_full_forward(name):
    mha = MultiHeadAttention(D, H, **OPTIONS[name]).eval()
    x = torch.randn(B, T, D)
    full, _ = mha(x)
    cache = KVCache()
    prefix, _ = mha(x[:, :3], cache=cache)  # a prompt of 3, then one position at a time
    steps = [mha(x[:, t : t + 1], cache=cache)[0] for t in range(3, T)]
    torch.testing.assert_close(torch.cat([prefix, *steps], dim=1), full, atol=1e-5, rtol=1e-5)
    assert len(cache) == T


def test_cross_attention_cache_is_computed_once():
    mha = MultiHeadAttention(D, H).eval()
    x, memory = torch.randn(B, 2, D), torch.randn(B, S, D)
    cache = KVCache()
    first, _ = mha(x[:, :1], memory, cache=cache)
    k_before = cache.k.clone()
    address = cache.k.data_ptr()
    second, _ = mha(x[:, 1:], memory, cache=cache)
    assert cache.k.data_ptr() == address and torch.equal(cache.k, k_before) and len(cache) == S
    torch.testing.assert_close(torch.cat([first, second], 1), mha(x, memory)[0])


def test_kv_cache_writes_in_place_and_doubles_when_full():
    """Positions are copied into preallocated buffers; only outgrowing them allocates (4 -> 8 -> 16 here),
    and what was cached survives the move and a reordering of the batch."""
    cache, keys, values = KVCache(capacity=4), [], []
    addresses = set()
    for _ in range(10):
        k, v = torch.randn(B, H, 1, D // H), torch.randn(B, H, 1, D // H)
        keys.append(k), values.append(v)
        got_k, got_v = cache.append(k, v)
        addresses.add(got_k.data_ptr())
        assert torch.equal(got_k, torch.cat(keys, 2)) and torch.equal(got_v, torch.cat(values, 2))
    assert len(cache) == 10 and len(addresses) == 3 and cache._k.size(2) == 16
    cache.reorder(torch.tensor([1, 1]))
    assert torch.equal(cache.k, torch.cat(keys, 2)[[1, 1]])
    with pytest.raises(ValueError, match="batch size 3 does not match the cache's 2"):
        cache.append(torch.randn(3, H, 1, D // H), torch.randn(3, H, 1, D // H))


def test_grouped_kv_equals_full_heads_with_shared_weights():
    """n_kv_heads=2 of 4 is ordinary MHA whose heads (0,1) and (2,3) share key/value weights."""
    gqa = MultiHeadAttention(D, H, n_kv_heads=2, causal=True)
    full = MultiHeadAttention(D, H, causal=True)
    dh = D // H
    with torch.no_grad():
        full.q_proj.load_state_dict(gqa.q_proj.state_dict())
        full.out_proj.load_state_dict(gqa.out_proj.state_dict())
        for src, dst in ((gqa.k_proj, full.k_proj), (gqa.v_proj, full.v_proj)):
            w, b = src.weight.view(2, dh, D), src.bias.view(2, dh)
            dst.weight.copy_(w.repeat_interleave(2, dim=0).reshape(D, D))
            dst.bias.copy_(b.repeat_interleave(2, dim=0).reshape(D))
    x = torch.randn(B, T, D)
    torch.testing.assert_close(gqa(x)[0], full(x)[0])
    assert gqa.k_proj.weight.numel() == full.k_proj.weight.numel() // 2


def test_sliding_window_equals_full_attention_with_a_band_mask():
    windowed = MultiHeadAttention(D, H, causal=True, window=3)
    full = MultiHeadAttention(D, H)
    full.load_state_dict(windowed.state_dict())
    band = torch.tensor([[0 <= i - j < 3 for j in range(T)] for i in range(T)])
    x = torch.randn(B, T, D)
    out, w = windowed(x, need_weights=True)
    torch.testing.assert_close(out, full(x, attn_mask=band)[0])
    assert (w[..., ~band] == 0).all()


def test_gate_scales_heads_before_output_projection():
    gated = MultiHeadAttention(D, H, gated=True, bias=False)
    plain = MultiHeadAttention(D, H, bias=False)
    plain.load_state_dict({k: v for k, v in gated.state_dict().items() if not k.startswith("gate_proj")})
    x = torch.randn(B, T, D)
    with torch.no_grad():
        gated.gate_proj.weight.zero_()  # σ(0) = 1/2 everywhere
    torch.testing.assert_close(gated(x)[0], plain(x)[0] / 2)


def test_self_attention_without_positions_is_permutation_equivariant():
    mha = MultiHeadAttention(D, H).eval()
    x = torch.randn(B, T, D)
    perm = torch.randperm(T)
    torch.testing.assert_close(mha(x[:, perm])[0], mha(x)[0][:, perm], atol=1e-6, rtol=1e-5)


def test_causal_attention_ignores_the_future():
    mha = MultiHeadAttention(D, H, causal=True).eval()
    x = torch.randn(B, T, D)
    changed = x.clone()
    changed[:, 4:] = torch.randn(B, T - 4, D)
    torch.testing.assert_close(mha(changed)[0][:, :4], mha(x)[0][:, :4])
    assert not torch.allclose(mha(changed)[0][:, 4:], mha(x)[0][:, 4:])


def test_scale_is_one_over_sqrt_dk():
    """With identical keys except one, the weight ratio is exp(Δscore / √d_k)."""
    d = 64
    q = torch.ones(1, 1, d)
    k = torch.zeros(1, 2, d)
    k[0, 0] = 1.0
    _, w = scaled_dot_product_attention(q, k, torch.zeros(1, 2, 1))
    assert math.isclose((w[0, 0, 0] / w[0, 0, 1]).item(), math.exp(d / math.sqrt(d)), rel_tol=1e-4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(d_model=100, n_heads=3), "d_model=100 must be divisible by n_heads=3"),
        (dict(d_model=32, n_heads=4, n_kv_heads=3), "n_heads=4 must be divisible by n_kv_heads=3"),
        (dict(d_model=32, n_heads=4, window=0), "window"),
    ],
)
def test_bad_configuration_raises(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MultiHeadAttention(**kwargs)


def test_bad_inputs_raise_with_shapes():
    mha = MultiHeadAttention(D, H)
    with pytest.raises(ValueError, match=r"query must have shape \(B, T, 32\), got \(3, 7\)"):
        mha(torch.randn(3, 7))
    with pytest.raises(ValueError, match="key_value must have shape"):
        mha(torch.randn(3, 7, D), torch.randn(2, 5, D))
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(B, T_k\)=\(3, 7\)"):
        mha(torch.randn(3, 7, D), key_padding_mask=torch.ones(3, 6, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool"):
        mha(torch.randn(3, 7, D), key_padding_mask=torch.ones(3, 7))
    with pytest.raises(TypeError, match="attn_mask must be bool"):
        mha(torch.randn(3, 7, D), attn_mask=torch.zeros(7, 7))


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_stacked_projections_give_the_same_attention_cached_and_not(bias, gated):
    torch.manual_seed(0)
    x = torch.randn(2, 7, 32)
    rope = RotaryEmbedding(8, base=100.0)
    mha = MultiHeadAttention(32, 4, n_kv_heads=2, causal=True, bias=bias, gated=gated, rotary=rope).eval()
    with torch.no_grad():
        full, weights = mha(x, need_weights=True)
        cache, steps = KVCache(), []
        for t in range(7):
            steps.append(mha(x[:, t : t + 1], cache=cache)[0])
        stacked = StackedSelfAttention.from_attention(mha)
        assert not hasattr(stacked, "q_proj") and stacked.qkv_proj.out_features == 32 + 2 * 16
        assert stacked.out_proj is mha.out_proj and stacked.rotary is rope and not stacked.training
        assert {"q_proj.weight", "k_proj.weight", "v_proj.weight"} <= set(mha.state_dict())  # untouched
        torch.testing.assert_close(stacked(x)[0], full, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(stacked(x, need_weights=True)[1], weights, atol=1e-6, rtol=1e-5)
        cache = KVCache()
        stacked_steps = [stacked(x[:, t : t + 1], cache=cache)[0] for t in range(7)]
    torch.testing.assert_close(torch.cat(stacked_steps, 1), torch.cat(steps, 1), atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="stacked for self-attention"):
        stacked(x, torch.randn(2, 3, 32))


def test_only_plain_attention_is_stacked_and_a_stacked_one_can_be_built_directly():
    mha = MultiHeadAttention(32, 4)
    mha.q_proj = nn.Identity()  # not a plain nn.Linear (a quantized layer, say): no stacking
    assert StackedSelfAttention.from_attention(mha) is None
    assert StackedSelfAttention.from_attention(StackedSelfAttention(32, 4)) is None
    built = StackedSelfAttention(32, 4, n_kv_heads=2, bias=False)
    assert sorted(built.state_dict()) == ["out_proj.weight", "qkv_proj.weight"]
    assert built(torch.randn(2, 5, 32))[0].shape == (2, 5, 32)
