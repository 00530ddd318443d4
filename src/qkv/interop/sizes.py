"""The sizes a decoder's config.json or GGUF header states, each with the largest qkv takes: a damaged number fails
where it is read, before it sizes a loop or an allocation."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Every size a decoder's config states, with the largest qkv takes: far above any published model's (Llama 3.1
# 405B: 126 layers 16,384 wide, 128 heads of 128, 53,248 in the feed-forward layer, 131,072 positions), so that
# a damaged number fails here, before it sizes a loop or an allocation. What the tensors show (layers, widths,
# heads times their width, the vocabulary) is then checked against them by the strict converter.
#   config.json key (LLaMA family)  GPT-2's                GGUF key after "{arch}."             at most
SIZES = (
    ("num_hidden_layers",         "n_layer",            "block_count",                        2**10),
    ("hidden_size",               "n_embd",             "embedding_length",                   2**16),
    ("num_attention_heads",       "n_head",             "attention.head_count",               2**10),
    ("num_key_value_heads",       None,                 "attention.head_count_kv",            2**10),
    ("head_dim",                  None,                 "attention.key_length",               2**12),
    (None,                        None,                 "rope.dimension_count",               2**12),
    ("intermediate_size",         "n_inner",            "feed_forward_length",                2**20),
    ("vocab_size",                "vocab_size",         "vocab_size",                         2**22),
    ("max_position_embeddings",   "n_positions",        "context_length",                     2**24),
    ("num_local_experts",         None,                 "expert_count",                       2**12),
    ("num_experts",               None,                 None,                                 2**12),
    ("num_experts_per_tok",       None,                 "expert_used_count",                  2**12),
    ("moe_intermediate_size",     None,                 "expert_feed_forward_length",         2**20),
    ("shared_expert_intermediate_size", None,           "expert_shared_feed_forward_length",  2**20),
    ("rope_theta",                None,                 "rope.freq_base",                     10**12),
    ("rms_norm_eps",              None,                 "attention.layer_norm_rms_epsilon",   1),
    (None,                        "layer_norm_epsilon", "attention.layer_norm_epsilon",       1),
)


def check_size(name: str, value: Any, bound: float) -> None:
    """A number a file states (``name``, as the file names it), at most ``bound``."""
    if isinstance(value, int | float) and not isinstance(value, bool) and value > bound:
        raise ValueError(f"{name}={value} is beyond what qkv takes (at most {bound:,}); the file is damaged, or "
                         "not a model qkv reads")


BOUNDS = {key: bound for *keys, _, bound in SIZES for key in keys if key}  # config.json key -> its bound


def check_sizes(hf_config: Mapping[str, Any]) -> None:
    """Each number of :data:`SIZES` a config.json holds, at most its bound."""
    for key, bound in BOUNDS.items():
        check_size(key, hf_config.get(key), bound)


__all__ = ["BOUNDS", "SIZES", "check_size", "check_sizes"]
