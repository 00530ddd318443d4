"""qkv: a Transformer toolkit written from the building blocks up."""

from .config import BERTConfig, CLIPConfig, GPTConfig, RNNConfig, SwinConfig, TransformerConfig, ViTConfig
from .models import BERT, CLIP, GPT, LSTMSeq2Seq, Swin, Transformer, ViT

__version__ = "0.1.0"
__all__ = ["BERT", "CLIP", "GPT", "BERTConfig", "CLIPConfig", "GPTConfig", "LSTMSeq2Seq", "RNNConfig", "Swin",
           "SwinConfig", "Transformer", "TransformerConfig", "ViT", "ViTConfig"]
