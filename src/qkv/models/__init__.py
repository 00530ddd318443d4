"""Models assembled from :mod:`qkv.nn`: encoder-decoder, decoder-only and encoder-only, and the LSTM
encoder-decoder that came before them; the vision half (ViT)."""

from .bert import BERT, BERTClassifier, BERTForMaskedLM, mean_pool
from .gpt import GPT
from .rnn import LSTMSeq2Seq
from .transformer import Transformer
from .vit import ViT, ViTClassifier

__all__ = ["BERT", "GPT", "BERTClassifier", "BERTForMaskedLM", "LSTMSeq2Seq", "Transformer", "ViT", "ViTClassifier", "mean_pool"]
