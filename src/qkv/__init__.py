"""qkv: a Transformer toolkit written from the building blocks up."""

from .config import BERTConfig, GPTConfig, RNNConfig, TransformerConfig, ViTConfig
from .models import BERT, GPT, LSTMSeq2Seq, Transformer, ViT

__version__ = "0.1.0"
__all__ = ["BERT", "GPT", "BERTConfig", "GPTConfig", "LSTMSeq2Seq", "RNNConfig", "Transformer", "TransformerConfig", "ViT", "ViTConfig"]
