"""Tiny random-weight transformers models of each family qkv reads beyond LLaMA's first members, in configs that
make every one of its blocks count: Gemma 3 with a window shorter than the prompts and a rotary scaling on its
global layers, Gemma 2 with caps that bite, Phi-3 with partial rotary and LongRoPE past its original context,
SmolLM3 with NoPE layers, OLMo 2, Granite with multipliers far from 1.

Imported by name (``from family_models import ...``): its name is unique across the test tree (see hf_greedy).
"""

from __future__ import annotations

import torch

VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
            intermediate_size=64, max_position_embeddings=64, rms_norm_eps=1e-5, attn_implementation="eager")


def randomized(model):
    with torch.no_grad():  # away from the initial values (zero biases, unit gains), so a swap shows
        for p in model.parameters():
            p.add_(torch.randn_like(p, generator=None) * 0.3)
    return model.eval()


def _gemma3(transformers):
    config = transformers.Gemma3TextConfig(
        **BASE, head_dim=16, query_pre_attn_scalar=12, sliding_window=4, tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0}})
    return transformers.Gemma3ForCausalLM(config)


def _gemma2(transformers):
    config = transformers.Gemma2Config(**BASE, head_dim=8, query_pre_attn_scalar=8, sliding_window=5,
                                       attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
    return transformers.Gemma2ForCausalLM(config)


def _phi3(transformers):
    rotary_pairs = 3  # partial_rotary_factor 0.75 of 8 features: 6 turn, in 3 pairs
    config = transformers.Phi3Config(
        **{**BASE, "max_position_embeddings": 64}, original_max_position_embeddings=8, tie_word_embeddings=False,
        rope_parameters={"rope_type": "longrope", "rope_theta": 100.0, "partial_rotary_factor": 0.75,
                         "short_factor": [1.0, 1.5, 2.0][:rotary_pairs], "long_factor": [2.0, 4.0, 9.0][:rotary_pairs]},
        pad_token_id=0)
    return transformers.Phi3ForCausalLM(config)


def _smollm3(transformers):
    config = transformers.SmolLM3Config(**BASE, no_rope_layers=[1, 0, 1], rope_parameters={"rope_theta": 50.0,
                                        "rope_type": "default"}, tie_word_embeddings=True, pad_token_id=0)
    return transformers.SmolLM3ForCausalLM(config)


def _olmo2(transformers):
    return transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**BASE, tie_word_embeddings=False, pad_token_id=0))


def _granite(transformers):
    config = transformers.GraniteConfig(**BASE, embedding_multiplier=3.0, residual_multiplier=0.4,
                                        attention_multiplier=0.2, logits_scaling=4.0, tie_word_embeddings=True)
    return transformers.GraniteForCausalLM(config)


MAKERS = {"gemma3_text": _gemma3, "gemma2": _gemma2, "phi3": _phi3, "smollm3": _smollm3, "olmo2": _olmo2,
          "granite": _granite}
FAMILIES = tuple(MAKERS)


def family_model(transformers, kind: str, seed: int = 0, vocab: int = VOCAB):
    """The tiny transformers model of family ``kind``, its weights random (seeded), in eval mode; ``vocab`` tokens."""
    torch.manual_seed(seed)
    BASE["vocab_size"] = vocab
    try:
        return randomized(MAKERS[kind](transformers))
    finally:
        BASE["vocab_size"] = VOCAB
