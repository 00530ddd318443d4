"""Machine translation: what differs from other tasks is only here.

A batch is (source, target-in, target-out) with teacher forcing; the loss is label-smoothed cross-entropy over
the target tokens; validation is the plain cross-entropy and sacreBLEU of greedy translations. The model is a
:class:`~qkv.models.Transformer` or an LSTM :class:`~qkv.models.LSTMSeq2Seq`; both decode through the same
greedy and beam search.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..data import TranslationBatch, clean_pairs, pad, token_budget_batches, translation_batch
from ..device import device_of, move, to_device
from ..distributed import SINGLE, Group
from ..footprint import check_decoding
from ..generation import IncrementalDecoder, beam_search, greedy, pooled_beam_search
from ..metrics import bleu
from ..models import LSTMSeq2Seq
from ..tokenizers import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer, encode_all, token_label

log = logging.getLogger(__name__)

NOT_TEXT = (PAD_ID, BOS_ID, UNK_ID)  # never a word of a translation: decoding does not produce them


@dataclass(frozen=True)
class TranslationIds:
    """The ids a translation model was trained with: padding, the decoder's first input, the end of a sentence,
    whether a source ends with ``</s>``, and the ids a translation never contains; and the beam search it was
    published with. qkv's own models use :data:`QKV_IDS`; a pretrained model's tokenizer carries its own as
    ``ids`` (Marian: decoding starts at pad, sources end with ``</s>``, transformers' beam search)."""

    pad: int = PAD_ID
    start: int = BOS_ID
    eos: int = EOS_ID
    source_eos: bool = False
    never: tuple[int, ...] = NOT_TEXT
    # decoding as transformers runs it: generation.pooled_beam_search, and </s> forced as the last token a text
    # may have (so one real token fewer at the length limit)
    transformers_search: bool = False


QKV_IDS = TranslationIds()


def translation_ids(tokenizers: dict[str, Tokenizer]) -> TranslationIds:
    """The ids of the model these tokenizers belong to (the target side's ``ids``, else qkv's)."""
    return getattr(tokenizers["tgt"], "ids", QKV_IDS)


def position_limit(model: nn.Module) -> int | None:
    """The longest sequence the model can read: the size of its position table, or None when it has none
    (rotary positions, an LSTM)."""
    cfg = model.config
    return cfg.max_seq_len if getattr(cfg, "positional", None) in ("sinusoidal", "learned") else None


def max_new_tokens(model: nn.Module, src_len: int) -> int:
    """Room for a translation: twice the source plus 10, within the model's position table if it has one."""
    budget = 2 * src_len + 10
    limit = position_limit(model)
    if limit is not None:
        budget = min(budget, limit - 1)
    return max(budget, 1)


@torch.no_grad()
def translate_ids(
    model: nn.Module,
    sources: Sequence[list[int]],
    *,
    beam_size: int = 1,
    alpha: float = 0.6,
    batch_tokens: int = 4000,
    use_cache: bool = True,
    ids: TranslationIds = QKV_IDS,
    length_cap: int | None = None,
) -> list[list[int]]:
    """Translate token-id sequences (without specials) in length-sorted batches; output in input order.
    ``ids``: the model's special ids and beam search (see :class:`TranslationIds`); ``alpha`` the length
    penalty of that search; ``length_cap``: at most this many new tokens (a Marian folder's own limit) where
    :func:`max_new_tokens` would give more."""
    model.eval()
    outputs: list[list[int]] = [[] for _ in sources]
    budget = max(batch_tokens // max(beam_size, 1), 1)
    for indices in token_budget_batches([len(s) + 1 for s in sources], budget):
        src = pad([[*sources[i], ids.eos] if ids.source_eos else sources[i] for i in indices], ids.pad)
        limit = [min(max_new_tokens(model, len(sources[i])), length_cap or math.inf) for i in indices]
        check_decoding(model.config, sequences=len(indices), beams=beam_size, length=max(limit),
                       device=device_of(model))
        src = to_device(src, device_of(model))
        # the Transformer with its KV cache, the LSTM with its carried state (h, c)
        decoder: IncrementalDecoder = model.start_decoding(src, use_cache=use_cache)
        if beam_size > 1 and ids.transformers_search:
            hyps = pooled_beam_search(decoder, bos_id=ids.start, eos_id=ids.eos, max_new_tokens=limit,
                                      beam_size=beam_size, length_penalty=alpha, end_at_limit=True,
                                      suppress_ids=ids.never)
        elif beam_size > 1:
            hyps = beam_search(decoder, bos_id=ids.start, eos_id=ids.eos, max_new_tokens=limit, beam_size=beam_size,
                               alpha=alpha, suppress_ids=ids.never)
        else:  # transformers' search ends a text at its limit with a forced </s>: one real token fewer
            hyps = greedy(decoder, bos_id=ids.start, eos_id=ids.eos, suppress_ids=ids.never,
                          max_new_tokens=[n - ids.transformers_search for n in limit])
        for i, hyp in zip(indices, hyps, strict=True):
            outputs[i] = hyp
    return outputs


def translate(model: nn.Module, tokenizers: dict[str, Tokenizer], texts: Sequence[str], **kwargs: Any) -> list[str]:
    """Translate sentences; keyword arguments as for :func:`translate_ids`. An empty sentence (or one with no
    tokens) translates to an empty line: there is nothing to translate, so nothing is decoded."""
    limit = position_limit(model)
    sources = [ids[: limit - 2] if limit else ids for ids in encode_all(tokenizers["src"], texts)]
    outputs = [""] * len(texts)
    todo = [i for i, ids in enumerate(sources) if ids]
    translated = translate_ids(model, [sources[i] for i in todo], ids=translation_ids(tokenizers), **kwargs)
    for i, target in zip(todo, translated, strict=True):
        outputs[i] = tokenizers["tgt"].decode(target)
    return outputs


@torch.no_grad()
def cross_attention(model: nn.Module, tokenizers: dict[str, Tokenizer], source: str, target_ids: list[int],
                    *, layer: int = -1) -> tuple[torch.Tensor, list[str], list[str]]:
    """Cross-attention weights of one translated sentence, averaged over heads, with token labels. For an LSTM
    with attention: its one set of weights (one layer, one head).

    Returns:
        ``(weights (T_tgt + 1, S), target labels, source labels)``: one row per produced token (and ``</s>``),
        one column per source token.
    """
    model.eval()
    limit, ids = position_limit(model), translation_ids(tokenizers)
    src_ids = tokenizers["src"].encode(source)[: limit - ids.source_eos if limit else None]
    src_ids += [ids.eos] if ids.source_eos else []
    src = torch.tensor([src_ids], device=device_of(model))
    tgt_in = torch.tensor([[ids.start, *target_ids]], device=device_of(model))
    _, att = model(src, tgt_in, return_attention=True)
    layers = att["decoder_cross"]
    if not -len(layers) <= layer < len(layers):
        raise ValueError(f"layer {layer} does not exist: the decoder has {len(layers)} attention layer(s), "
                         f"0 to {len(layers) - 1} (or -1 for the last)")
    weights = layers[layer][0].mean(0)  # (T, S): average over heads
    tgt_tok = tokenizers["tgt"]
    target_labels = [token_label(tgt_tok, i) for i in target_ids] + ["</s>"]
    source_labels = [token_label(tokenizers["src"], i) for i in src_ids]
    return weights, target_labels, source_labels


@dataclass
class ParallelData:
    """Tokenized sentence pairs, already cleaned."""

    src: list[list[int]]
    tgt: list[list[int]]
    src_text: list[str]
    tgt_text: list[str]

    @classmethod
    def encode(cls, pairs: Sequence[tuple[str, str]], tokenizers: dict[str, Tokenizer], *, max_len: int,
               name: str) -> ParallelData:
        src_text, tgt_text = [p[0].strip() for p in pairs], [p[1].strip() for p in pairs]
        src, tgt = encode_all(tokenizers["src"], src_text), encode_all(tokenizers["tgt"], tgt_text)
        keep, stats = clean_pairs(src, tgt, max_len=max_len)
        log.info("%s: %s", name, stats)
        if not keep:
            raise ValueError(f"{name}: no usable sentence pairs ({stats})")
        return cls([src[i] for i in keep], [tgt[i] for i in keep], [src_text[i] for i in keep],
                   [tgt_text[i] for i in keep])

    def __len__(self) -> int:
        return len(self.src)


def split_off(pairs: list[tuple[str, str]], n: int, seed: int) -> tuple[list, list]:
    """Hold out ``n`` pairs chosen with a fixed seed: (rest, held out), both in their original order."""
    if not 0 < n < len(pairs):
        raise ValueError(f"cannot hold out {n} of {len(pairs)} pairs")
    held = set(random.Random(seed).sample(range(len(pairs)), n))
    return [p for i, p in enumerate(pairs) if i not in held], [p for i, p in enumerate(pairs) if i in held]


class TranslationTask:
    """Teacher-forced training of an encoder-decoder on parallel data, validated by loss and BLEU.

    With ``teacher_forcing`` < 1 (LSTM only) training feeds the model's own previous prediction instead of
    the true token with probability 1 - teacher_forcing (see :meth:`qkv.models.rnn.LSTMDecoder.forward`).
    """

    selection_metric = "val_bleu"
    higher_is_better = True
    unit = "target_tokens"  # what a batch's n_tokens counts

    def __init__(
        self,
        model: nn.Module,
        tokenizers: dict[str, Tokenizer],
        train: ParallelData,
        valid: ParallelData,
        *,
        batch_tokens: int = 4000,
        seed: int = 0,
        label_smoothing: float = 0.1,
        bleu_samples: int = 500,
        target_language: str | None = None,
        teacher_forcing: float = 1.0,
        meta: dict[str, Any] | None = None,
    ) -> None:
        if not 0.0 <= teacher_forcing <= 1.0:
            raise ValueError(f"teacher_forcing must be in [0, 1], got {teacher_forcing}")
        if teacher_forcing < 1.0 and not isinstance(model, LSTMSeq2Seq):
            raise ValueError(f"teacher_forcing={teacher_forcing} needs an LSTM Seq2Seq; the {type(model).__name__} "
                             "is trained with full teacher forcing (1.0)")
        self.model, self.tokenizers, self.train, self.valid = model, tokenizers, train, valid
        self.teacher_forcing = teacher_forcing
        self.batch_tokens, self.seed, self.label_smoothing = batch_tokens, seed, label_smoothing
        self.bleu_samples, self.target_language = bleu_samples, target_language
        if not bleu_samples:  # nothing is translated in validation: the loss picks the best checkpoint
            self.selection_metric, self.higher_is_better = "val_loss", False
        self.meta = {"task": "translation", **(meta or {})}
        self._lengths = [max(len(s), len(t)) + 1 for s, t in zip(train.src, train.tgt, strict=True)]
        self._epoch_batches: tuple[int, list[TranslationBatch]] | None = None

    def batches(self, epoch: int) -> list[TranslationBatch]:
        if self._epoch_batches is None or self._epoch_batches[0] != epoch:
            groups = token_budget_batches(self._lengths, self.batch_tokens, seed=self.seed * 100_003 + epoch)
            self._epoch_batches = (epoch, [self._batch(self.train, g) for g in groups])
        return self._epoch_batches[1]

    @staticmethod
    def _batch(data: ParallelData, indices: Sequence[int]) -> TranslationBatch:
        return translation_batch([data.src[i] for i in indices], [data.tgt[i] for i in indices], pad_id=PAD_ID,
                                 bos_id=BOS_ID, eos_id=EOS_ID)

    def loss(self, model: nn.Module, batch: TranslationBatch, *, label_smoothing: float | None = None
             ) -> tuple[torch.Tensor, int]:
        n_tokens = batch.n_tokens  # counted on the host, before the batch moves
        batch = move(batch, device_of(model))
        if self.teacher_forcing < 1.0 and model.training:  # validation always feeds the true tokens
            logits = model(batch.src, batch.tgt_in, teacher_forcing=self.teacher_forcing)  # (B, T, V)
        else:
            logits = model(batch.src, batch.tgt_in)  # (B, T, V)
        smoothing = self.label_smoothing if label_smoothing is None else label_smoothing
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch.tgt_out.flatten(), ignore_index=PAD_ID,
                               label_smoothing=smoothing, reduction="sum")
        return loss, n_tokens

    def evaluate(self, model: nn.Module, group: Group = SINGLE) -> dict[str, float]:
        """Validation loss (no label smoothing) and, on ``bleu_samples`` sentences, greedy BLEU and exact match;
        in a distributed run each rank takes a share and the sums and translations are gathered."""
        total, tokens = 0.0, 0
        lengths = [max(len(s), len(t)) + 1 for s, t in zip(self.valid.src, self.valid.tgt, strict=True)]
        for rows in group.shard(token_budget_batches(lengths, self.batch_tokens)):
            loss, n = self.loss(model, self._batch(self.valid, rows), label_smoothing=0.0)
            total, tokens = total + loss.item(), tokens + n
        sums = group.sum({"loss": total, "tokens": tokens})
        metrics = {"val_loss": sums["loss"] / max(sums["tokens"], 1)}
        if self.bleu_samples:
            n = min(self.bleu_samples, len(self.valid))
            ids = translate_ids(model, group.shard(self.valid.src[:n]))
            hyps = group.gather([self.tokenizers["tgt"].decode(h) for h in ids])
            refs = self.valid.tgt_text[:n]
            metrics["val_bleu"] = bleu(hyps, refs, language=self.target_language).score
            metrics["val_exact"] = sum(h == r for h, r in zip(hyps, refs, strict=True)) / n
        return metrics


def looks_chinese(texts: Sequence[str]) -> bool:
    """True when most characters are CJK ideographs (then BLEU uses sacreBLEU's ``zh`` tokenizer)."""
    sample = "".join(texts[:2000])
    cjk = sum("\u4e00" <= ch <= "\u9fff" for ch in sample)
    return cjk > 0.3 * max(1, sum(not ch.isspace() for ch in sample))


def build_tokenizers(pairs: Sequence[tuple[str, str]], *, kind: str, vocab_size: int, shared: bool,
                     target_kind: str | None = None) -> dict[str, Tokenizer]:
    """Train the source and target tokenizers on the training pairs (one shared, or one per side)."""
    from ..tokenizers import train_tokenizer

    src_text, tgt_text = [p[0] for p in pairs], [p[1] for p in pairs]
    if shared:
        tok = train_tokenizer(kind, src_text + tgt_text, vocab_size=vocab_size)
        return {"src": tok, "tgt": tok}
    return {"src": train_tokenizer(kind, src_text, vocab_size=vocab_size),
            "tgt": train_tokenizer(target_kind or kind, tgt_text, vocab_size=vocab_size)}
