"""What the server runs for ``/v1/embeddings``: a sentence encoder (all-MiniLM-L6-v2, or a BERT trained with qkv)
turning texts into vectors, as ``qkv embed`` does (:func:`qkv.tasks.embeddings.embed` with the encoder's own
pooling, normalisation and length), one request at a time."""

from __future__ import annotations

import threading

import torch

from ..tasks.embeddings import embed
from .protocol import APIError

MAX_INPUTS = 256  # texts in one request
MAX_CHARS = 100_000  # characters in all of them


class Embedder:
    """A sentence ``encoder`` (:class:`~qkv.interop.sentence.SentenceEncoder`) served under ``name``."""

    def __init__(self, encoder, *, name: str) -> None:
        self.encoder, self.name = encoder, name
        self.lock = threading.Lock()

    @property
    def dimensions(self) -> int:
        return self.encoder.model.config.d_model

    def vectors(self, texts: list[str]) -> tuple[torch.Tensor, int]:
        """The texts' vectors ``(len(texts), dimensions)`` and the tokens read (each text cut to the encoder's
        length, as ``qkv embed`` cuts it)."""
        enc = self.encoder
        tokens = sum(min(len(enc.tokenizer.encode(t)) + 2, enc.max_length) for t in texts)  # [CLS] ... [SEP]
        with self.lock, torch.inference_mode():
            return embed(enc.model, enc.tokenizer, texts, pooling=enc.pooling, normalize=enc.normalize,
                         max_length=enc.max_length), tokens


def texts(body: dict) -> list[str]:
    """The ``input`` of an embeddings request: a string or a list of strings (token-id inputs are not read)."""
    value = body.get("input")
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(t, str) and t for t in items):
        raise APIError(400, "input must be a non-empty string or a list of them (token ids are not read)",
                       param="input")
    if len(items) > MAX_INPUTS or sum(map(len, items)) > MAX_CHARS:
        raise APIError(400, f"input holds {len(items):,} texts of {sum(map(len, items)):,} characters; at most "
                            f"{MAX_INPUTS} texts and {MAX_CHARS:,} characters a request", param="input")
    return items
