"""Which Hugging Face family (``model_type``) a decoder's config is, told apart by the blocks it uses.

A model read from a family's files records the family (``GPTConfig.family``); one qkv built itself is the family
whose blocks it has: Gemma's norm offset, OLMo 2's norms after each branch, Phi-3's partial rotary or LongRoPE,
SmolLM3's layers without rotary positions, Granite's scales, Qwen3's QK-norm, Qwen2's Q/K/V bias, Mistral's
window, else LLaMA. :mod:`qkv.interop.families` holds each family's names and layouts under this key;
:mod:`qkv.lora` places adapters by them. Nothing here imports the readers.
"""

from __future__ import annotations

from .config import GPTConfig


def model_type_of(cfg: GPTConfig) -> str:
    """The Hugging Face ``model_type`` whose blocks ``cfg`` has (see the module's text), whatever ``cfg.family``
    records: the callers take that first where a config read from a family's files holds it."""
    if cfg.n_experts is not None:  # Qwen's MoE configs state every variant of the block; Mixtral's the plainest
        plain = cfg.expert_normalize and cfg.shared_expert_d_ff is None and cfg.layers is None
        return ("mixtral" if plain and not (cfg.qk_norm or cfg.qkv_bias) else
                "qwen3_moe" if cfg.shared_expert_d_ff is None and not cfg.qkv_bias else "qwen2_moe")
    if cfg.norm_offset:
        return "gemma3_text" if cfg.qk_norm else "gemma2"
    if cfg.branch_norm:
        return "olmo2"
    if cfg.rotary_dim is not None or cfg.rope_long_factors is not None:
        return "phi3"
    if not all(cfg.layer(i).rotary for i in range(cfg.n_layers)):
        return "smollm3"
    if (cfg.embedding_scale, cfg.residual_scale, cfg.logit_scale, cfg.attention_scale) != (1.0, 1.0, 1.0, None):
        return "granite"
    if cfg.qk_norm:
        return "qwen3"
    if cfg.qkv_bias:
        return "qwen2"
    return "mistral" if cfg.window else "llama"


__all__ = ["model_type_of"]
