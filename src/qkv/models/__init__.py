"""Models assembled from :mod:`qkv.nn`: encoder-decoder, decoder-only and encoder-only, and the LSTM
encoder-decoder that came before them; the vision half (ViT, Swin, CLIP)."""

from .bert import BERT, BERTClassifier, BERTForMaskedLM, mean_pool
from .clip import CLIP
from .gpt import GPT
from .rnn import LSTMSeq2Seq
from .swin import Swin, SwinClassifier
from .transformer import Transformer
from .vit import ViT, ViTClassifier

__all__ = ["BERT", "CLIP", "GPT", "BERTClassifier", "BERTForMaskedLM", "LSTMSeq2Seq", "Swin", "SwinClassifier",
           "Transformer", "ViT", "ViTClassifier", "mean_pool"]
