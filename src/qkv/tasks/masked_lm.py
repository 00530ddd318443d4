"""Masked-language modelling, BERT's pretraining: hide some tokens and predict them from both sides.

A language model reads left to right; an encoder sees the whole sentence, so it cannot be asked for "the next
token" (it would see it). Instead 15% of the tokens are chosen and the model predicts the originals. Of the
chosen tokens

* 80% become ``[MASK]``,
* 10% become a random token,
* 10% stay as they are,

because ``[MASK]`` never occurs once the model is fine-tuned: with a random or unchanged token in its place
some of the time, the model cannot rely on seeing ``[MASK]`` and must keep a good representation of every
token (Devlin et al. 2019, section 3.1). Special tokens ([CLS], [SEP], padding) are never chosen. The loss is
the cross-entropy over the chosen positions only.

The text is tokenized line by line, the lines concatenated and cut into sequences of ``max_length - 2``
tokens, each framed ``[CLS] ... [SEP]``: RoBERTa's "full sentences" packing, which wastes no positions on
padding.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data import pad
from ..device import device_of, move
from ..distributed import SINGLE, Group
from ..models import BERTForMaskedLM
from ..tokenizers import WordPieceTokenizer, encode_all

IGNORE = -100  # label of the positions that are not predicted (F.cross_entropy's ignore_index)


def mask_tokens(
    ids: Tensor,
    *,
    maskable: Tensor,
    mask_id: int,
    replacements: Tensor,
    generator: torch.Generator | None = None,
    probability: float = 0.15,
) -> tuple[Tensor, Tensor]:
    """BERT's corruption of a batch.

    Args:
        ids: token ids ``(B, T)``.
        maskable: ``(B, T)`` bool, False at special tokens and padding: those are never chosen.
        mask_id: the ``[MASK]`` id.
        replacements: the ids a random replacement is drawn from (uniformly), e.g. every non-special id.
        generator: the random source, for reproducible masks.
        probability: the chance of each maskable token being chosen (0.15).

    Returns:
        ``(inputs, labels)``, both ``(B, T)``: the corrupted ids, and the original id at each chosen position
        (``IGNORE`` elsewhere).
    """
    if not 0 < probability < 1:
        raise ValueError(f"the masking probability must be in (0, 1), got {probability}")
    if maskable.shape != ids.shape:
        raise ValueError(f"maskable must have the shape of ids {tuple(ids.shape)}, got {tuple(maskable.shape)}")
    chosen = (torch.rand(ids.shape, generator=generator) < probability) & maskable  # (B, T)
    labels = ids.masked_fill(~chosen, IGNORE)
    fate = torch.rand(ids.shape, generator=generator)  # one draw decides: < 0.8 mask, < 0.9 random, else keep
    to_mask = chosen & (fate < 0.8)
    to_random = chosen & (fate >= 0.8) & (fate < 0.9)
    inputs = ids.masked_fill(to_mask, mask_id)
    picks = torch.randint(len(replacements), (int(to_random.sum()),), generator=generator)
    inputs[to_random] = replacements[picks]
    return inputs, labels


def pack(token_lists: Iterable[Sequence[int]], length: int) -> list[list[int]]:
    """Concatenate the token lists and cut the stream into pieces of ``length`` (the last may be shorter)."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    stream = [i for ids in token_lists for i in ids]
    return [stream[i : i + length] for i in range(0, len(stream), length)]


def encode_for_mlm(tokenizer: WordPieceTokenizer, lines: Sequence[str], max_length: int) -> list[list[int]]:
    """Lines -> packed, framed sequences of at most ``max_length`` tokens."""
    pieces = pack(encode_all(tokenizer, [line for line in lines if line.strip()]), max_length - 2)
    return [tokenizer.wrap(piece, max_length) for piece in pieces]


@dataclass
class MaskedBatch:
    inputs: Tensor  # (B, T) corrupted ids
    labels: Tensor  # (B, T) original ids at the chosen positions, IGNORE elsewhere
    attention_mask: Tensor  # (B, T) True at real tokens
    n_tokens: int  # chosen positions: what the loss is summed over


class MaskedLMTask:
    """Masked-token prediction on packed sequences, validated by loss, perplexity and accuracy on a fixed
    masking of the held-out sequences."""

    selection_metric = "val_loss"
    higher_is_better = False
    unit = "masked_tokens"  # what a batch's n_tokens counts

    def __init__(
        self,
        model: BERTForMaskedLM,
        tokenizer: WordPieceTokenizer,
        train: Sequence[Sequence[int]],
        valid: Sequence[Sequence[int]],
        *,
        batch_size: int,
        probability: float = 0.15,
        seed: int = 0,
        meta: dict[str, Any] | None = None,
    ) -> None:
        if tokenizer.mask_id is None:
            raise ValueError("masked-language modelling needs a [MASK] token, and this tokenizer has none")
        if not train:
            raise ValueError("no training sequences: give more text")
        if not valid:
            raise ValueError("no validation sequences: give more text or a larger --valid-fraction")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model, self.tokenizer, self.tokenizers = model, tokenizer, {"text": tokenizer}
        self.train, self.valid = [list(s) for s in train], [list(s) for s in valid]
        self.batch_size, self.probability, self.seed = batch_size, probability, seed
        self.meta = {"task": "masked_lm", **(meta or {})}
        specials = torch.tensor(sorted(tokenizer.special_ids))
        vocab = torch.arange(tokenizer.vocab_size)
        self.specials = specials
        self.replacements = vocab[~torch.isin(vocab, specials)]
        self._epoch: tuple[int, list[MaskedBatch]] | None = None
        # Validation is masked once, with its own seed: every evaluation scores the same hidden tokens.
        g = torch.Generator().manual_seed(seed * 100_003 - 1)
        self._valid = [self._batch(self.valid[i : i + batch_size], g) for i in range(0, len(self.valid), batch_size)]
        if not sum(b.n_tokens for b in self._valid):  # else validation would report a loss of 0 on nothing
            tokens = sum(len(s) - 2 for s in self.valid)  # [CLS] and [SEP] are never hidden
            raise ValueError(f"the validation text is {tokens} token(s), too little to hide any at {probability:.0%}: "
                             f"give at least {math.ceil(20 / probability)} tokens of validation (a few lines), with "
                             "more text, a larger --valid-fraction or --valid-text FILE")

    def _batch(self, sequences: Sequence[Sequence[int]], generator: torch.Generator) -> MaskedBatch:
        ids = pad(sequences, self.tokenizer.pad_id)  # (B, T)
        real = torch.arange(ids.size(1))[None, :] < torch.tensor([len(s) for s in sequences])[:, None]  # (B, T)
        maskable = real & ~torch.isin(ids, self.specials)
        inputs, labels = mask_tokens(ids, maskable=maskable, mask_id=self.tokenizer.mask_id,
                                     replacements=self.replacements, generator=generator,
                                     probability=self.probability)
        return MaskedBatch(inputs, labels, real, int((labels != IGNORE).sum()))

    def batches(self, epoch: int) -> list[MaskedBatch]:
        """The sequences in a random order, and a fresh masking, both a function of (seed, epoch): every epoch
        hides different tokens (RoBERTa's dynamic masking)."""
        if self._epoch is None or self._epoch[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            order = torch.randperm(len(self.train), generator=g).tolist()
            batches = [self._batch([self.train[i] for i in order[k : k + self.batch_size]], g)
                       for k in range(0, len(order), self.batch_size)]
            self._epoch = (epoch, batches)
        return self._epoch[1]

    @staticmethod
    def _logits_and_targets(model: nn.Module, batch: MaskedBatch) -> tuple[Tensor, Tensor]:
        batch = move(batch, device_of(model))
        chosen = batch.labels != IGNORE  # (B, T)
        logits = model(batch.inputs, attention_mask=batch.attention_mask, select=chosen)  # (N, V)
        return logits.float(), batch.labels[chosen]  # (N, V), (N,)

    def loss(self, model: nn.Module, batch: MaskedBatch) -> tuple[Tensor, int]:
        logits, targets = self._logits_and_targets(model, batch)
        return F.cross_entropy(logits, targets, reduction="sum"), batch.n_tokens

    def evaluate(self, model: nn.Module, group: Group = SINGLE) -> dict[str, float]:
        """Loss, perplexity and accuracy on the fixed masking of the validation sequences (shared out across the
        ranks of a distributed run, the sums added up)."""
        total, correct, count = 0.0, 0, 0
        for batch in group.shard(self._valid):
            logits, targets = self._logits_and_targets(model, batch)
            total += F.cross_entropy(logits, targets, reduction="sum").item()
            correct += int((logits.argmax(-1) == targets).sum())
            count += len(targets)
        sums = group.sum({"loss": total, "correct": correct, "count": count})
        loss = sums["loss"] / max(sums["count"], 1)
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)),
                "val_accuracy": sums["correct"] / max(sums["count"], 1)}


@torch.no_grad()
def fill_mask(model: BERTForMaskedLM, tokenizer: WordPieceTokenizer, text: str, *, k: int = 5
              ) -> list[list[tuple[str, float]]]:
    """The ``k`` likeliest tokens, with probabilities, for every ``[MASK]`` written in ``text``.

    Raises:
        ValueError: if ``text`` has no ``[MASK]``.
    """
    model.eval()
    ids = tokenizer.wrap(tokenizer.encode(text), model.config.max_seq_len)
    batch = torch.tensor([ids], device=device_of(model))  # (1, T)
    where = batch == tokenizer.mask_id
    if not where.any():
        raise ValueError(f"no {tokenizer.specials['mask']} in {text!r}; write it where a word is to be guessed")
    probs = model(batch, select=where).softmax(-1)  # (N, V)
    top = probs.topk(k, dim=-1)
    return [[(tokenizer.id_to_token(int(i)), float(p)) for p, i in zip(ps, ids_, strict=True)]
            for ps, ids_ in zip(top.values, top.indices, strict=True)]
