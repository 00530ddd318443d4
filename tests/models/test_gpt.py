"""Decoder-only GPT: causality, KV cache, left padding, initialisation, errors."""

import pytest
import torch
import torch.nn.functional as F

from qkv import GPT, GPTConfig
from qkv.models.common import WithAttention

VARIANTS = {
    "gpt2": {},
    "llama": dict(norm="rms", positional="rope", activation="swiglu", bias=False, n_kv_heads=2),
    "sinusoidal": dict(positional="sinusoidal"),
    "window": dict(window=4),
    "window-rope": dict(window=3, positional="rope"),
    "gated": dict(gated_attention=True),
    "post-norm": dict(norm_first=False),
    "relu2-qk-norm": dict(activation="relu2", qk_norm=True),  # the speedruns' feed-forward and attention
}


def small(**overrides) -> GPT:
    cfg = dict(vocab_size=50, d_model=32, n_heads=4, n_layers=2, max_seq_len=40)
    return GPT(GPTConfig(**{**cfg, **overrides})).eval()


@pytest.mark.parametrize("variant", VARIANTS)
def test_causality(variant):
    model = small(**VARIANTS[variant])
    ids = torch.randint(0, 50, (2, 12))
    changed = ids.clone()
    changed[:, 7:] = torch.randint(0, 50, (2, 5))
    torch.testing.assert_close(model(changed)[:, :7], model(ids)[:, :7])


@pytest.mark.parametrize("variant", VARIANTS)
def test_kv_cache_equals_full_forward(variant):
    model = small(**VARIANTS[variant])
    ids = torch.randint(0, 50, (2, 14))
    full = model(ids)
    cache = model.new_cache()
    parts = [model(ids[:, :5], cache=cache)]  # prompt, then one token at a time
    parts += [model(ids[:, t : t + 1], cache=cache) for t in range(5, 14)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)


def test_last_only_is_the_last_row_of_the_logits():
    model = small(**VARIANTS["llama"])
    ids = torch.randint(0, 50, (2, 9))
    last = model(ids, last_only=True)
    assert last.shape == (2, 1, 50)
    torch.testing.assert_close(last, model(ids)[:, -1:], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("variant", ["gpt2", "llama", "window-rope"])
def test_left_padded_batch_equals_each_prompt_alone(variant):
    model = small(pad_id=0, **VARIANTS[variant])
    prompts = [torch.randint(1, 50, (n,)) for n in (9, 4, 6)]
    width = max(len(p) for p in prompts)
    batch = torch.stack([F.pad(p, (width - len(p), 0), value=0) for p in prompts])  # left padding
    logits = model(batch)
    for i, p in enumerate(prompts):
        torch.testing.assert_close(logits[i, width - len(p) :], model(p[None])[0], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(logits).all()  # padding queries see nothing: zeros, not NaN


def test_left_padded_incremental_decoding_continues_each_prompt():
    model = small(pad_id=0, **VARIANTS["llama"])
    prompts = [torch.randint(1, 50, (n,)) for n in (6, 3)]
    batch = torch.stack([F.pad(p, (6 - len(p), 0), value=0) for p in prompts])
    mask = batch != 0
    cache = model.new_cache()
    model(batch, attention_mask=mask, cache=cache)
    nxt = torch.randint(1, 50, (2, 1))
    mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.bool)], 1)
    step = model(nxt, attention_mask=mask, cache=cache)
    for i, p in enumerate(prompts):
        alone = model(torch.cat([p, nxt[i]])[None])[0, -1]
        torch.testing.assert_close(step[i, 0], alone, atol=1e-5, rtol=1e-5)


def test_attention_weights_per_layer():
    model = small()
    ids = torch.randint(0, 50, (2, 6))
    result = model(ids, return_attention=True)
    assert isinstance(result, WithAttention)
    torch.testing.assert_close(result.output, model(ids))
    logits, att = result  # a pair, as before the names
    assert logits is result.output and att is result.attention
    assert len(att) == 2 and att[0].shape == (2, 4, 6, 6)
    assert (att[0].triu(1) == 0).all()  # nothing above the diagonal: no peeking ahead


def test_initialisation_gpt2_style():
    model = GPT(GPTConfig(vocab_size=3000, d_model=256, n_heads=4, n_layers=8))
    assert abs(model.tok_emb.weight.std().item() - 0.02) < 0.002
    residual = model.decoder.layers[0].self_attn.out_proj.weight.std().item()
    assert abs(residual - 0.02 / 4) < 0.001  # 0.02 / sqrt(2 * 8 layers)
    assert model.lm_head.weight is model.tok_emb.weight


def test_parameter_counts():
    model = small()
    per_layer = 4 * (32 * 32 + 32) + (32 * 128 + 128 + 128 * 32 + 32) + 2 * 2 * 32
    body = 2 * per_layer + 2 * 32  # + final norm
    assert model.num_parameters(exclude_embeddings=True) == body
    assert model.num_parameters() == body + 50 * 32 + 40 * 32  # token + position tables; head tied
    assert small(tie_embeddings=False).num_parameters() == model.num_parameters() + 50 * 32


def test_finite_gradients():
    model = small(dropout=0.1, pad_id=0).train()
    ids = torch.randint(1, 50, (3, 10))
    ids[0, :4] = 0
    F.cross_entropy(model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_errors():
    model = small()
    with pytest.raises(ValueError, match="position 40 is beyond max_seq_len=40"):
        model(torch.randint(0, 50, (1, 41)))
    with pytest.raises(ValueError, match=r"token id 50, outside the vocabulary \[0, 50\)"):
        model(torch.tensor([[1, 50]]))
    with pytest.raises(ValueError, match=r"attention_mask must have shape \(2, 5\)"):
        model(torch.randint(0, 50, (2, 5)), attention_mask=torch.ones(2, 4, dtype=torch.bool))
    rope = small(positional="rope")
    assert rope(torch.randint(0, 50, (1, 60))).shape == (1, 60, 50)  # rotary positions have no table limit


def test_skip_init_builds_without_drawing_and_restores_init():
    from torch import nn

    from qkv.models.common import skip_init

    normal = nn.init.normal_
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with skip_init():
        GPT(GPTConfig(vocab_size=50, d_model=32, n_heads=4, n_layers=2))
    assert torch.equal(torch.get_rng_state(), before)  # no random number was drawn
    assert nn.init.normal_ is normal
    GPT(GPTConfig(vocab_size=50, d_model=32, n_heads=4, n_layers=2))
    assert not torch.equal(torch.get_rng_state(), before)  # outside the block, models are initialised again


def test_a_padded_vocabulary_table_changes_nothing_but_its_shape():
    """Rows added to reach a multiple of 64 are never a token: the logits are the unpadded model's exactly."""
    torch.manual_seed(0)
    plain = GPT(GPTConfig(vocab_size=100, d_model=32, n_heads=2, n_layers=1))
    padded = GPT(GPTConfig(vocab_size=100, d_model=32, n_heads=2, n_layers=1, vocab_multiple=64))
    assert padded.tok_emb.weight.shape == (128, 32) and padded.lm_head.weight is padded.tok_emb.weight
    state = padded.state_dict()
    for name, value in plain.state_dict().items():
        state[name][: value.size(0)] = value  # the padding rows keep their random values
    padded.load_state_dict(state)
    ids = torch.randint(0, 100, (2, 9))
    logits = padded(ids)
    assert logits.shape == (2, 9, 100)
    torch.testing.assert_close(logits, plain(ids))


def test_zero_init_starts_each_block_as_the_identity_and_predicts_uniformly():
    """zero_init: attention outputs, FFN down projections and an untied output layer start at zero (so the
    logits are all zero: a uniform prediction, loss log V), everything else as usual; tied, the output layer
    is the embedding. It learns: 40 steps on a repeated sequence take the loss far below log V."""
    model = small(zero_init=True, tie_embeddings=False, activation="relu2", qk_norm=True).train()
    zeros = [m for name, m in model.named_modules() if name.endswith(("out_proj", "down", "lm_head"))]
    assert len(zeros) == 5 and all(not m.weight.any() for m in zeros)
    assert model.decoder.layers[0].self_attn.q_proj.weight.std() > 0.01
    ids = torch.arange(40).remainder(7)[None]
    assert not model(ids).any()
    assert small(zero_init=True).lm_head.weight.std() > 0.01  # tied: the embedding's values
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(40):
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[0, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.2 * torch.log(torch.tensor(50.0)).item()

