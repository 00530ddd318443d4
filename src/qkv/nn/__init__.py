"""The building blocks of the Transformer. Nothing here knows about data, training or files."""

from .attention import KVCache, MultiHeadAttention, StackedSelfAttention, scaled_dot_product_attention
from .feedforward import FeedForward, StackedFeedForward
from .layers import Decoder, DecoderCache, DecoderLayer, Encoder, EncoderLayer, LayerCache
from .lora import LoRALinear
from .masks import (
    causal_mask,
    key_padding_to_attention,
    padding_mask,
    segment_mask,
    segment_positions,
    sliding_window_mask,
)
from .moe import MoEFeedForward, Router
from .norm import LayerNorm, RMSNorm, build_norm
from .position import LearnedPositionalEmbedding, RotaryEmbedding, SinusoidalPositionalEncoding

__all__ = [
    "Decoder",
    "DecoderCache",
    "DecoderLayer",
    "Encoder",
    "EncoderLayer",
    "FeedForward",
    "KVCache",
    "LayerCache",
    "LayerNorm",
    "LearnedPositionalEmbedding",
    "LoRALinear",
    "MoEFeedForward",
    "MultiHeadAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "Router",
    "SinusoidalPositionalEncoding",
    "StackedFeedForward",
    "StackedSelfAttention",
    "build_norm",
    "causal_mask",
    "key_padding_to_attention",
    "padding_mask",
    "scaled_dot_product_attention",
    "segment_mask",
    "segment_positions",
    "sliding_window_mask",
]
