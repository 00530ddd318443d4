"""Text classification: fine-tune a BERT to put each sentence in one of a few classes.

The data is a TSV file, ``text<TAB>label`` per line. Each text is framed ``[CLS] tokens [SEP]``; the encoder's
sentence vector (BERT's pooled output, tanh(W h_[CLS] + b), or the mean of the token states) goes through
one linear layer to a score per label, trained with cross-entropy. All the encoder's weights are fine-tuned
with the new layer, usually at a small learning rate, so that pretraining is adjusted rather than forgotten.
Validation reports the loss and the accuracy on held-out examples; the best accuracy picks the checkpoint.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data import DataError, pad, read_lines
from ..device import device_of, move, to_device
from ..distributed import SINGLE, Group
from ..models import BERTClassifier
from ..tokenizers import WordPieceTokenizer
from .embeddings import frame


def read_labelled(path: str | Path) -> list[tuple[str, str]]:
    """``(text, label)`` pairs from a ``text<TAB>label`` file (the label is after the last tab); blank lines are
    skipped.

    Raises:
        DataError: for a missing file, a line without a tab or with an empty text or label, or no examples.
    """
    examples = []
    for number, line in enumerate(read_lines(path), 1):
        if not line.strip():
            continue
        text, tab, label = line.rpartition("\t")
        if not tab:
            raise DataError(f"{path}: line {number} has no tab; expected text<TAB>label, got {line[:60]!r}")
        if not text.strip() or not label.strip():
            raise DataError(f"{path}: line {number} has an empty {'text' if not text.strip() else 'label'}")
        examples.append((text.strip(), label.strip()))
    if not examples:
        raise DataError(f"{path}: no examples; expected lines of text<TAB>label")
    return examples


def split_examples(examples: Sequence[tuple[str, str]], valid_fraction: float, seed: int = 0
                   ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """A random ``valid_fraction`` of the examples (at least one) held out, the rest for training."""
    if not 0 < valid_fraction < 1:
        raise ValueError(f"the validation fraction must be in (0, 1), got {valid_fraction}")
    shuffled = list(examples)
    random.Random(seed).shuffle(shuffled)
    n_valid = max(1, round(len(shuffled) * valid_fraction))
    if n_valid >= len(shuffled):
        raise ValueError(f"{len(shuffled)} examples are too few to hold {valid_fraction:.0%} out and still train")
    return shuffled[n_valid:], shuffled[:n_valid]


def label_set(examples: Sequence[tuple[str, str]]) -> list[str]:
    """The labels, sorted, so that their ids do not depend on the order of the file."""
    labels = sorted({label for _, label in examples})
    if len(labels) < 2:
        raise ValueError(f"a classifier needs at least 2 labels, the training data has {labels}")
    return labels


@dataclass
class ClassifyBatch:
    ids: Tensor  # (B, T)
    attention_mask: Tensor  # (B, T) True at real tokens
    labels: Tensor  # (B,)
    n_tokens: int  # examples in the batch: what the loss is summed over


class ClassifyTask:
    """Sentence classification, validated by loss and accuracy."""

    selection_metric = "val_accuracy"
    higher_is_better = True
    unit = "examples"  # what a batch's n_tokens counts

    def __init__(
        self,
        model: BERTClassifier,
        tokenizer: WordPieceTokenizer,
        labels: Sequence[str],
        train: Sequence[tuple[str, str]],
        valid: Sequence[tuple[str, str]],
        *,
        batch_size: int,
        max_length: int,
        seed: int = 0,
        meta: dict[str, Any] | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(labels) != model.config.n_labels:
            raise ValueError(f"the model has {model.config.n_labels} outputs for {len(labels)} labels")
        if not train or not valid:
            raise ValueError(f"need training and validation examples, got {len(train)} and {len(valid)}")
        self.model, self.tokenizer, self.tokenizers = model, tokenizer, {"text": tokenizer}
        self.labels = list(labels)
        self.batch_size, self.seed = batch_size, seed
        self.meta = {"task": "classify", "labels": self.labels, "max_length": max_length, **(meta or {})}
        self.train_ids, self.train_labels = self._encode(train, max_length)
        self.valid_ids, self.valid_labels = self._encode(valid, max_length)
        self._epoch: tuple[int, list[ClassifyBatch]] | None = None

    def _encode(self, examples: Sequence[tuple[str, str]], max_length: int) -> tuple[list[list[int]], list[int]]:
        index = {label: i for i, label in enumerate(self.labels)}
        unknown = sorted({label for _, label in examples} - set(index))
        if unknown:
            raise ValueError(f"labels {unknown} are not among the training labels {self.labels}")
        ids = frame(self.tokenizer, [text for text, _ in examples], max_length)
        return ids, [index[label] for _, label in examples]

    def _batch(self, rows: Sequence[int], ids: list[list[int]], labels: list[int]) -> ClassifyBatch:
        sequences = [ids[i] for i in rows]
        batch = pad(sequences, self.tokenizer.pad_id)  # (B, T)
        mask = torch.arange(batch.size(1))[None, :] < torch.tensor([len(s) for s in sequences])[:, None]
        return ClassifyBatch(batch, mask, torch.tensor([labels[i] for i in rows]), len(rows))

    def batches(self, epoch: int) -> list[ClassifyBatch]:
        if self._epoch is None or self._epoch[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            order = torch.randperm(len(self.train_ids), generator=g).tolist()
            self._epoch = (epoch, [self._batch(order[k : k + self.batch_size], self.train_ids, self.train_labels)
                                   for k in range(0, len(order), self.batch_size)])
        return self._epoch[1]

    def loss(self, model: nn.Module, batch: ClassifyBatch) -> tuple[Tensor, int]:
        batch = move(batch, device_of(model))
        logits = model(batch.ids, attention_mask=batch.attention_mask)  # (B, L)
        return F.cross_entropy(logits.float(), batch.labels, reduction="sum"), batch.n_tokens

    def evaluate(self, model: nn.Module, group: Group = SINGLE) -> dict[str, float]:
        """Loss and accuracy on the held-out examples (shared out across the ranks of a distributed run)."""
        total, correct = 0.0, 0
        for k in group.shard(range(0, len(self.valid_ids), self.batch_size)):
            batch = move(self._batch(range(k, min(k + self.batch_size, len(self.valid_ids))), self.valid_ids,
                                     self.valid_labels), device_of(model))
            logits = model(batch.ids, attention_mask=batch.attention_mask).float()
            total += F.cross_entropy(logits, batch.labels, reduction="sum").item()
            correct += int((logits.argmax(-1) == batch.labels).sum())
        sums, n = group.sum({"loss": total, "correct": correct}), len(self.valid_ids)
        return {"val_loss": sums["loss"] / n, "val_accuracy": sums["correct"] / n}


@torch.no_grad()
def predict(model: BERTClassifier, tokenizer: WordPieceTokenizer, texts: Sequence[str], *, max_length: int,
            batch_size: int = 32) -> Tensor:
    """Class probabilities ``(len(texts), n_labels)``."""
    model.eval()
    ids = frame(tokenizer, texts, max_length)
    out = []
    for k in range(0, len(ids), batch_size):
        sequences = ids[k : k + batch_size]
        batch = pad(sequences, tokenizer.pad_id)  # (B, T)
        mask = torch.arange(batch.size(1))[None, :] < torch.tensor([len(s) for s in sequences])[:, None]
        device = device_of(model)
        out.append(model(to_device(batch, device), attention_mask=to_device(mask, device)).float().softmax(-1).cpu())
    return torch.cat(out)
