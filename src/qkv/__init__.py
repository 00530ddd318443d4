"""qkv: a Transformer toolkit written from the building blocks up."""

from .config import BERTConfig, GPTConfig, RNNConfig, TransformerConfig
from .models import BERT, GPT, Seq2Seq, Transformer

__version__ = "0.1.0"
__all__ = ["BERT", "GPT", "BERTConfig", "GPTConfig", "RNNConfig", "Seq2Seq", "Transformer", "TransformerConfig"]
