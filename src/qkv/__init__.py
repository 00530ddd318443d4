"""qkv: a Transformer toolkit written from the building blocks up."""

from .config import BERTConfig, GPTConfig, TransformerConfig
from .models import BERT, GPT, Transformer

__version__ = "0.1.0"
__all__ = ["BERT", "GPT", "BERTConfig", "GPTConfig", "Transformer", "TransformerConfig"]
