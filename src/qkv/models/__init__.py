"""Models assembled from :mod:`qkv.nn`: encoder-decoder, decoder-only and encoder-only."""

from .bert import BERT, BERTClassifier, BERTForMaskedLM, mean_pool
from .gpt import GPT
from .transformer import Transformer

__all__ = ["BERT", "GPT", "BERTClassifier", "BERTForMaskedLM", "Transformer", "mean_pool"]
