"""Parity with Hugging Face transformers: the same random weights in both models give the same outputs.

The reference models are built from configs (nothing is downloaded), run in float32, eval mode and eager
attention. Their weights are moved away from the initial values (LayerNorm γ = 1, β = 0, zero biases) so a
swapped gain and bias, a missing transpose or a mis-split fused projection cannot go unnoticed.
"""

import pytest
import torch
from hf_greedy import greedy_hf, greedy_qkv

from qkv.interop import (
    bert_config_from_hf,
    bert_state_dict_from_hf,
    gpt_config_from_hf,
    gpt_state_dict_from_hf,
    load_bert_from_hf,
    load_gpt_from_hf,
)

transformers = pytest.importorskip("transformers")

VOCAB = 96


def _randomize(model, scale=0.1):
    """Add noise to every parameter (tied ones once) and switch to eval mode."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model.eval()


def _gpt2():
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_head=4, n_layer=2, n_positions=16, bos_token_id=1, eos_token_id=2,
        attn_implementation="eager",
    )
    return _randomize(transformers.GPT2LMHeadModel(config))


def _llama(*, tie):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        intermediate_size=48, max_position_embeddings=64, rope_theta=500.0, rms_norm_eps=1e-5,
        tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, attn_implementation="eager",
    )
    # Larger noise than the others: with small weights a tied model just repeats its last token, and the
    # greedy test would check nothing.
    return _randomize(transformers.LlamaForCausalLM(config), scale=0.3)


def _bert(model_class=None, **model_kwargs):
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64,
        max_position_embeddings=24, type_vocab_size=2, pad_token_id=0, attn_implementation="eager",
    )
    return _randomize((model_class or transformers.BertModel)(config, **model_kwargs))


def _right_padded_mask(lengths, t):
    return torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]  # (B, T), True = real token


# ------------------------------------------------------------------------------------------------ GPT-2


def test_gpt2_logits_match():
    hf = _gpt2()
    model = load_gpt_from_hf(hf.state_dict(), hf.config.to_dict())
    assert model.config.activation == "gelu_tanh" and model.config.tie_embeddings
    assert model.lm_head.weight is model.tok_emb.weight
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-5, rtol=1e-5)


def test_gpt2_right_padded_batch_matches_on_real_positions():
    hf = _gpt2()
    model = load_gpt_from_hf(hf.state_dict(), hf.config.to_dict())
    mask = _right_padded_mask([12, 7], 12)
    ids = torch.randint(1, VOCAB, (2, 12)).masked_fill(~mask, 0)
    with torch.no_grad():
        ours = model(ids, attention_mask=mask)
        theirs = hf(ids, attention_mask=mask.long()).logits
    torch.testing.assert_close(ours[mask], theirs[mask], atol=1e-5, rtol=1e-5)


def test_gpt2_bare_checkpoint_without_prefix_head_or_with_old_buffers_converts_the_same():
    """Hub files of GPT-2 hold GPT2Model's tensors: no ``transformer.`` prefix, no lm_head, mask buffers."""
    hf = _gpt2()
    cfg = gpt_config_from_hf(hf.config.to_dict())
    full = gpt_state_dict_from_hf(hf.state_dict(), cfg, "gpt2")
    bare = dict(hf.transformer.state_dict())
    bare["h.0.attn.bias"] = torch.ones(1, 1, 16, 16, dtype=torch.bool)
    bare["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    converted = gpt_state_dict_from_hf(bare, cfg, "gpt2")
    assert converted.keys() == full.keys()
    for name in full:
        torch.testing.assert_close(converted[name], full[name], atol=0, rtol=0)


# ------------------------------------------------------------------------------------------------ LLaMA


@pytest.mark.parametrize("tie", [False, True])
def test_llama_logits_and_greedy_tokens_match(tie):
    hf = _llama(tie=tie)
    model = load_gpt_from_hf(hf.state_dict(), hf.config.to_dict())
    cfg = model.config
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.rope_base, cfg.tie_embeddings) == (4, 2, 500.0, tie)
    assert (model.lm_head.weight is model.tok_emb.weight) == tie
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-5, rtol=1e-5)
        prompt = ids[:, :5]
        ours, theirs = greedy_qkv(model, prompt, 10), greedy_hf(hf, prompt, 10)
    assert torch.equal(ours, theirs), f"qkv {ours.tolist()} != transformers {theirs.tolist()}"
    assert all(len(set(row)) > 3 for row in ours.tolist()), f"a degenerate continuation {ours.tolist()}"


def test_llama_right_padded_batch_matches_on_real_positions():
    hf = _llama(tie=False)
    model = load_gpt_from_hf(hf.state_dict(), hf.config.to_dict())
    mask = _right_padded_mask([10, 6], 10)
    ids = torch.randint(1, VOCAB, (2, 10)).masked_fill(~mask, 0)
    with torch.no_grad():
        ours = model(ids, attention_mask=mask)
        theirs = hf(ids, attention_mask=mask.long()).logits
    torch.testing.assert_close(ours[mask], theirs[mask], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------- BERT


def test_bert_hidden_states_and_pooled_output_match():
    hf = _bert()
    model = load_bert_from_hf(hf.state_dict(), hf.config.to_dict())
    mask = _right_padded_mask([10, 7, 4], 10)
    ids = torch.randint(1, VOCAB, (3, 10)).masked_fill(~mask, 0)
    token_types = (torch.arange(10) >= 3).long().expand(3, 10) * mask  # segment B from position 3
    with torch.no_grad():
        hidden = model(ids, attention_mask=mask, token_type_ids=token_types)
        out = hf(input_ids=ids, attention_mask=mask.long(), token_type_ids=token_types)
        pooled = model.pool(hidden)
    torch.testing.assert_close(hidden[mask], out.last_hidden_state[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pooled, out.pooler_output, atol=1e-5, rtol=1e-5)


def test_bert_pretraining_checkpoint_and_tensorflow_names_convert_the_same():
    """``bert.`` prefix, ``cls.*`` heads, LayerNorm ``gamma``/``beta``: all give the bare model's tensors."""
    hf = _bert(transformers.BertForPreTraining)
    cfg = bert_config_from_hf(hf.config.to_dict())
    bare = bert_state_dict_from_hf(hf.bert.state_dict(), cfg)
    tf_names = {
        name.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): tensor
        for name, tensor in hf.state_dict().items()
    }
    for state_dict in (hf.state_dict(), tf_names):
        converted = bert_state_dict_from_hf(state_dict, cfg)
        assert converted.keys() == bare.keys()
        assert all(torch.equal(converted[name], bare[name]) for name in bare)


def test_bert_without_pooler_loads_without_pooler():
    hf = _bert(add_pooling_layer=False)
    model = load_bert_from_hf(hf.state_dict(), hf.config.to_dict())
    assert model.pooler is None
    ids = torch.randint(1, VOCAB, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).last_hidden_state, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------- errors


@pytest.fixture(scope="module")
def gpt2_checkpoint():
    torch.manual_seed(1)
    hf = _gpt2()
    return hf.state_dict(), gpt_config_from_hf(hf.config.to_dict())


def test_missing_tensor_is_named(gpt2_checkpoint):
    state_dict, cfg = gpt2_checkpoint
    state_dict = {k: v for k, v in state_dict.items() if k != "transformer.h.1.ln_2.bias"}
    with pytest.raises(ValueError, match=r"missing \['h\.1\.ln_2\.bias'\]"):
        gpt_state_dict_from_hf(state_dict, cfg, "gpt2")


def test_wrong_shape_is_named(gpt2_checkpoint):
    state_dict, cfg = gpt2_checkpoint
    name = "transformer.h.0.mlp.c_fc.weight"
    state_dict = {**state_dict, name: state_dict[name].t()}  # an nn.Linear layout where Conv1D's is expected
    message = r"transformer\.h\.0\.mlp\.c_fc\.weight has shape \(128, 32\), expected \(32, 128\)"
    with pytest.raises(ValueError, match=message):
        gpt_state_dict_from_hf(state_dict, cfg, "gpt2")


def test_unexpected_tensor_is_named(gpt2_checkpoint):
    state_dict, cfg = gpt2_checkpoint
    state_dict = {**state_dict, "transformer.h.0.attn.rel_pos.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match=r"unexpected \['transformer\.h\.0\.attn\.rel_pos\.weight'\]"):
        gpt_state_dict_from_hf(state_dict, cfg, "gpt2")


def test_tied_output_head_that_differs_is_an_error(gpt2_checkpoint):
    state_dict, cfg = gpt2_checkpoint
    state_dict = {**state_dict, "lm_head.weight": state_dict["lm_head.weight"] + 1}
    with pytest.raises(ValueError, match=r"lm_head\.weight differs from the token embedding"):
        gpt_state_dict_from_hf(state_dict, cfg, "gpt2")


def test_llama_key_value_heads_of_the_wrong_width_are_named():
    hf = _llama(tie=False)
    cfg = gpt_config_from_hf(hf.config.to_dict())
    state_dict = {**hf.state_dict(), "model.layers.1.self_attn.k_proj.weight": torch.zeros(32, 32)}
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight has shape \(32, 32\)"):
        gpt_state_dict_from_hf(state_dict, cfg, "llama")


def test_unsupported_model_types():
    with pytest.raises(ValueError, match="unsupported model_type 't5'"):
        gpt_config_from_hf({"model_type": "t5"})
    with pytest.raises(ValueError, match="unsupported model_type 'roberta'"):
        bert_config_from_hf({"model_type": "roberta"})
    with pytest.raises(ValueError, match="unsupported model_type 'gemma'"):
        gpt_state_dict_from_hf({}, gpt_config_from_hf(_LLAMA_DICT), "gemma")


def test_config_built_for_another_family_is_refused(gpt2_checkpoint):
    state_dict, _ = gpt2_checkpoint
    with pytest.raises(ValueError, match="cannot hold a GPT-2 checkpoint: norm='rms'"):
        gpt_state_dict_from_hf(state_dict, gpt_config_from_hf(_LLAMA_DICT), "gpt2")


_LLAMA_DICT = {
    "model_type": "llama", "vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1,
    "intermediate_size": 48,
}


def test_llama_rope_theta_in_every_format():
    assert gpt_config_from_hf(_LLAMA_DICT).rope_base == 10000.0
    assert gpt_config_from_hf({**_LLAMA_DICT, "rope_theta": 5e5}).rope_base == 5e5  # transformers 4
    v5 = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    assert gpt_config_from_hf({**_LLAMA_DICT, **v5}).rope_base == 1e6


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 5e5, "factor": 8.0}}, "rope_type='dynamic'"),
        ({"rope_theta": 5e5, "rope_scaling": {"type": "proportional", "factor": 2.0}}, "rope_type='proportional'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5}}, "'yarn' needs a positive factor"),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"mlp_bias": True}, "mlp_bias=true"),
        ({"hidden_act": "gelu"}, "hidden_act must be 'silu'"),
    ],
)
def test_llama_features_qkv_lacks_are_refused(extra, message):
    with pytest.raises(ValueError, match=message):
        gpt_config_from_hf({**_LLAMA_DICT, **extra})
