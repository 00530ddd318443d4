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


def _gemma3(transformers, **changes):
    config = transformers.Gemma3TextConfig(**{
        **BASE, "head_dim": 16, "query_pre_attn_scalar": 12, "sliding_window": 4, "tie_word_embeddings": True,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0}},
        **changes})
    return transformers.Gemma3ForCausalLM(config)


def _gemma2(transformers, **changes):
    config = transformers.Gemma2Config(**{**BASE, "head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 5,
                                          "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0, **changes})
    return transformers.Gemma2ForCausalLM(config)


def _phi3(transformers, **changes):
    # partial_rotary_factor 0.75 of 8 features: 6 turn, in 3 pairs
    config = transformers.Phi3Config(**{
        **BASE, "original_max_position_embeddings": 8, "tie_word_embeddings": False, "pad_token_id": 0,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 100.0, "partial_rotary_factor": 0.75,
                            "short_factor": [1.0, 1.5, 2.0], "long_factor": [2.0, 4.0, 9.0]},
        **changes})
    return transformers.Phi3ForCausalLM(config)


def _smollm3(transformers, **changes):
    config = transformers.SmolLM3Config(**{**BASE, "no_rope_layers": [1, 0, 1], "tie_word_embeddings": True,
                                           "rope_parameters": {"rope_theta": 50.0, "rope_type": "default"},
                                           "pad_token_id": 0, **changes})
    return transformers.SmolLM3ForCausalLM(config)


def _olmo2(transformers, **changes):
    config = transformers.Olmo2Config(**{**BASE, "tie_word_embeddings": False, "pad_token_id": 0, **changes})
    return transformers.Olmo2ForCausalLM(config)


def _granite(transformers, **changes):
    config = transformers.GraniteConfig(**{**BASE, "embedding_multiplier": 3.0, "residual_multiplier": 0.4,
                                           "attention_multiplier": 0.2, "logits_scaling": 4.0,
                                           "tie_word_embeddings": True, **changes})
    return transformers.GraniteForCausalLM(config)


# Mixtures of experts: 4 experts, 2 a token, in each family's variant (Qwen3-MoE renormalising its top-k, Qwen2-MoE's
# shared expert, a dense layer among Qwen's); routing that matters, as random routers send tokens everywhere
EXPERTS = dict(num_experts_per_tok=2, intermediate_size=48)


def _mixtral(transformers, **changes):
    config = transformers.MixtralConfig(**{**BASE, **EXPERTS, "num_local_experts": 4, "tie_word_embeddings": False,
                                           "rope_parameters": {"rope_theta": 1000.0, "rope_type": "default"},
                                           **changes})
    return transformers.MixtralForCausalLM(config)


def _qwen2_moe(transformers, **changes):
    config = transformers.Qwen2MoeConfig(**{**BASE, **EXPERTS, "num_experts": 4, "moe_intermediate_size": 24,
                                            "shared_expert_intermediate_size": 40, "tie_word_embeddings": False,
                                            **changes})
    return transformers.Qwen2MoeForCausalLM(config)


def _qwen3_moe(transformers, **changes):
    config = transformers.Qwen3MoeConfig(**{**BASE, **EXPERTS, "num_experts": 4, "moe_intermediate_size": 32,
                                            "intermediate_size": 64,
                                            "norm_topk_prob": True, "head_dim": 16, "tie_word_embeddings": False,
                                            "mlp_only_layers": [1],
                                            **changes})
    return transformers.Qwen3MoeForCausalLM(config)


def _olmoe(transformers, **changes):
    config = transformers.OlmoeConfig(**{**BASE, **EXPERTS, "num_experts": 4, "tie_word_embeddings": False,
                                         "pad_token_id": 0, "eos_token_id": 1, **changes})
    return transformers.OlmoeForCausalLM(config)


def _granitemoe(transformers, **changes):
    config = transformers.GraniteMoeConfig(**{**BASE, **EXPERTS, "num_local_experts": 4, "embedding_multiplier": 3.0,
                                              "residual_multiplier": 0.4, "attention_multiplier": 0.2,
                                              "logits_scaling": 4.0, "tie_word_embeddings": True, **changes})
    return transformers.GraniteMoeForCausalLM(config)


MAKERS = {"gemma3_text": _gemma3, "gemma2": _gemma2, "phi3": _phi3, "smollm3": _smollm3, "olmo2": _olmo2,
          "granite": _granite, "mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe, "olmoe": _olmoe,
          "granitemoe": _granitemoe}
MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe")
FAMILIES = tuple(MAKERS)


# What llama.cpp's GGUF files leave unsaid and its loader assumes (docs/families.md): one global layer in six for
# Gemma 3, with an attention scale of 1/√head_dim and a local θ of 10,000; SmolLM3's NoPE layer in every four;
# experts in every layer of a Qwen3-MoE, OLMoE's keys in as many heads as its queries.
# These variants fit them.
AS_LLAMA_CPP_ASSUMES = {
    "gemma3_text": dict(num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=16, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0}}),
    "smollm3": dict(num_hidden_layers=4, no_rope_layers=None),
    "qwen3_moe": dict(mlp_only_layers=[]),  # experts in every layer
    "olmoe": dict(num_key_value_heads=4),  # llama.cpp's K norm is as wide as the model
}


def family_model(transformers, kind: str, seed: int = 0, vocab: int = VOCAB, **changes):
    """The tiny transformers model of family ``kind``, its weights random (seeded), in eval mode; ``vocab`` tokens,
    and any config ``changes`` (``AS_LLAMA_CPP_ASSUMES[kind]``)."""
    torch.manual_seed(seed)
    return randomized(MAKERS[kind](transformers, **{"vocab_size": vocab, **changes}))


# ---------------------------------------------------------------------------------------------- tokenizers

TEXT = ["The cat sat on the mat, and the dog sat by the door.", "猫坐在垫子上。狗在门边。",
        "def f(x):\n    return x  # 😀", "Hello   world\t\tagain 12345 café ¿qué?",
        "<start_of_turn>user\nhi<end_of_turn>"]
# what the tokenizers are held to: Chinese, emoji, code, runs of spaces and tabs, digits, accents, a control token
SAMPLES = ["Hello   world 猫 😀 12\n  x", "The cat sat. 垫子上 café ¿qué? 🙂🙂 999", "  leading\tand trailing  ",
           "def g(y):\n\treturn [y, 'ok']  # 注释", "<start_of_turn>user\nhello<end_of_turn>\n"]


def train_sentencepiece(path, *, dummy_prefix: bool):
    """A SentencePiece BPE model with byte fallback, as Gemma's (no space put in front of the text: ``dummy_prefix``
    False) or LLaMA 2's and Phi-3's (one put in front), trained on :data:`TEXT`: 360 pieces."""
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT * 40), model_writer=model, vocab_size=360, model_type="bpe", byte_fallback=True,
        add_dummy_prefix=dummy_prefix, remove_extra_whitespaces=False, split_digits=True, character_coverage=1.0,
        normalization_rule_name="identity", user_defined_symbols=["<start_of_turn>", "<end_of_turn>"],
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, bos_piece="<bos>", eos_piece="<eos>",
        allow_whitespace_only_pieces=True, minloglevel=2)
    path.write_bytes(model.getvalue())
    return path
