"""Models assembled from :mod:`qkv.nn`: encoder-decoder, decoder-only and encoder-only, and the LSTM
encoder-decoder that came before them."""

from .bert import BERT, BERTClassifier, BERTForMaskedLM, mean_pool
from .gpt import GPT
from .rnn import LSTMSeq2Seq
from .transformer import Transformer

__all__ = ["BERT", "GPT", "BERTClassifier", "BERTForMaskedLM", "LSTMSeq2Seq", "Transformer", "mean_pool"]
