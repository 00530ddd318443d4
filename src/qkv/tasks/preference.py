"""Preference pairs as training data, and the task that learns from them (:mod:`qkv.preference`'s objectives).

The data are trl's preference formats, one JSON object a line:

* text: ``{"prompt": "...", "chosen": "...", "rejected": "..."}``: the prompt read as the model reads any text
  (after its begin-of-text token), each answer after it and then the end-of-sequence token;
* conversational: ``{"prompt": [messages], "chosen": [messages], "rejected": [messages]}``, the answers assistant
  turns: the model's chat template lays out the prompt and each answer (the prompt may hold earlier turns).

The file is read as :mod:`qkv.tasks.finetune` reads its data (bounded, gzip or not, JSONL by its name or its first
line, every text checked, progress in the log), one line naming the file and the line for an error.

Each answer's tokens, its end of turn (or of sequence) included, are the ones whose log-probabilities the
objective compares; the prompt's are not. A pair is two examples, prompt + chosen and prompt + rejected, that
begin alike: laid side by side in one row, the prompt's tokens are computed once for both
(:func:`qkv.nn.unpadded.shared_tokens`, as :mod:`qkv.tasks.finetune` shares the beginnings of any examples), and
each answer attends to the prompt and itself only. Rows hold whole pairs, up to twice the context; a pair whose
prompt and answer do not fit the context is dropped and counted, a prompt alone longer than it is an error.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data import DataError
from ..device import device_of, to_device
from ..distributed import SINGLE, Group
from ..preference import REFERENCE_FREE, Answers, pair_losses
from ..tokenizers import encode_prompt, utf8_checked
from .finetune import (
    Example,
    PackedBatch,
    collate,
    from_lines,
    in_batches,
    is_jsonl,
    learnt_logits,
    pack,
    read_data,
    shuffled,
)

log = logging.getLogger(__name__)

FIELDS = ("prompt", "chosen", "rejected")
ANSWER_FIELDS = ("chosen", "rejected", "chosen_tokens", "rejected_tokens")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")  # what trl logs of a batch of pairs, and the log carries (val_... on held-out pairs)


@dataclass
class Pair:
    """A preference pair: the prompt followed by the chosen answer, and by the rejected one (each learnt on its
    answer's tokens); ``prompt`` counts the prompt's tokens."""

    chosen: Example
    rejected: Example
    prompt: int

    @property
    def tokens(self) -> int:
        return len(self.chosen.ids) + len(self.rejected.ids)


def read_pairs(path: str | Path, tokenizer, template: str | None, *, context: int) -> list[Pair]:
    """The preference pairs of a JSONL file (see the module's text).

    Raises:
        DataError: one line naming the file and the line: not JSON, not an object with the three fields, fields of
            mixed or wrong types, an empty answer, the same chosen and rejected answers, a conversation without a
            chat template, a prompt longer than ``context`` tokens; or a file with no pair.
    """
    path = Path(path)
    text = read_data(path)
    if not is_jsonl(path, text):
        raise DataError(f"{path}: preference pairs are JSONL lines {{\"prompt\", \"chosen\", \"rejected\"}}; "
                        "give a .jsonl file")
    pairs = from_lines(path, text.split("\n"), lambda record: _pair(record, tokenizer, template, context))
    if not pairs:
        raise DataError(f"{path}: no preference pairs (expected JSONL lines {{\"prompt\", \"chosen\", \"rejected\"}})")
    return pairs


def _pair(record: Any, tokenizer, template: str | None, context: int) -> Pair:
    if not isinstance(record, dict) or any(k not in record for k in FIELDS):
        missing = [k for k in FIELDS if not isinstance(record, dict) or k not in record]
        raise ValueError(f"missing {', '.join(repr(k) for k in missing)}: each line needs \"prompt\", \"chosen\" and "
                         "\"rejected\" (texts, or lists of chat messages)")
    prompt, chosen, rejected = (record[k] for k in FIELDS)
    if all(isinstance(v, str) for v in (prompt, chosen, rejected)):
        make = _text_example
        for name in FIELDS:
            utf8_checked(record[name], f'"{name}"')
    elif all(isinstance(v, list) for v in (prompt, chosen, rejected)):
        make = _chat_example
    else:
        raise ValueError("\"prompt\", \"chosen\" and \"rejected\" must all be texts or all be lists of chat messages")
    for name, answer in (("chosen", chosen), ("rejected", rejected)):
        if not answer or (isinstance(answer, str) and not answer.strip()):
            raise ValueError(f"the {name} answer is empty")
    if chosen == rejected:
        raise ValueError("the chosen and rejected answers are the same: a pair must prefer one of two answers")
    (chosen_example, start), (rejected_example, _) = (make(prompt, a, tokenizer, template) for a in (chosen, rejected))
    if start >= context:
        raise ValueError(f"the prompt is {start} tokens, as long as the context of {context} or longer; raise "
                         "--context or shorten the prompt")
    return Pair(chosen_example, rejected_example, start)


def _text_example(prompt: str, answer: str, tokenizer, template: str | None) -> tuple[Example, int]:
    ids = encode_prompt(tokenizer, prompt)
    answer_ids = tokenizer.encode(answer) + ([] if tokenizer.eos_id is None else [tokenizer.eos_id])
    return Example(ids + answer_ids, [False] * len(ids) + [True] * len(answer_ids)), len(ids)


def _chat_example(prompt: list, answer: list, tokenizer, template: str | None) -> tuple[Example, int]:
    if template is None:
        raise ValueError("a conversational pair, but the model has no chat template; use text pairs")
    from ..chat import chat_training_ids

    ids, learn = chat_training_ids(template, [*prompt, *answer], tokenizer, learnt_from=len(prompt))
    return Example(ids, learn), learn.index(True)


def fitting_pairs(pairs: Sequence[Pair], context: int, what: str) -> list[Pair]:
    """The pairs whose prompt and answer, each way, fit ``context`` tokens; the rest dropped with a count in the log.

    Raises:
        DataError: when none is left.
    """
    kept = [p for p in pairs if max(len(p.chosen.ids), len(p.rejected.ids)) <= context]
    if len(kept) < len(pairs):
        log.warning("%s: %d of %d pairs dropped (a prompt and answer longer than the context of %d tokens)", what,
                    len(pairs) - len(kept), len(pairs), context)
    if not kept:
        raise DataError(f"{what}: every pair's prompt and answer are longer than the context of {context} tokens; "
                        "raise --context or shorten them")
    return kept


@dataclass
class PairBatch:
    """Pairs laid out in rows (:class:`~qkv.tasks.finetune.PackedBatch`, each pair's chosen example then its
    rejected one); ``examples`` ``(B, T)`` each position's example in the batch (pair p's chosen is 2p, its
    rejected 2p + 1; −1 at padding), ``pairs`` ``(P,)`` the pairs' indices in their data."""

    packed: PackedBatch
    examples: Tensor
    pairs: Tensor

    @property
    def n_tokens(self) -> int:
        """The items the loss is summed over: pairs."""
        return len(self.pairs)


def collate_pairs(rows: Sequence[Sequence[tuple[int, Pair]]], pad_id: int, *, share: bool = True) -> PairBatch:
    """Rows of ``(index, pair)`` as a batch (the prompts of a pair computed once unless ``share=False``)."""
    packed = collate([[e for _, p in row for e in (p.chosen, p.rejected)] for row in rows], pad_id, share=share)
    examples = torch.full_like(packed.segments, -1)
    first = 0
    for r, row in enumerate(rows):
        n = 2 * len(row)
        own = packed.segments[r] < n  # padding tokens are segments of their own, past the row's examples
        examples[r, own] = packed.segments[r, own] + first
        first += n
    return PairBatch(packed, examples, torch.tensor([i for row in rows for i, _ in row], dtype=torch.long))


def answer_logps(model: nn.Module, batch: PairBatch) -> tuple[Answers, Tensor]:
    """The log-probabilities of each pair's answers under ``model`` (summed over their tokens, with their counts),
    and the chosen answers' tokens' summed cross-entropy."""
    logits, targets, learnt = learnt_logits(model, batch.packed)
    token = -F.cross_entropy(logits.float(), targets, reduction="none")
    owner = to_device(batch.examples.flatten()[learnt], token.device)
    n = 2 * len(batch.pairs)
    sums = token.new_zeros(n, dtype=torch.float64).index_add(0, owner, token.double())
    counts = torch.bincount(owner, minlength=n).to(sums.dtype)
    answers = Answers(sums[0::2], sums[1::2], counts[0::2], counts[1::2])
    return answers, -answers.chosen.sum()


class PreferenceTask:
    """A preference objective (:mod:`qkv.preference`) on pairs; validated by the mean loss of a pair, the rewards
    and the chosen answers' cross-entropy per token.

    Args:
        model: the model trained (its adapters, or all of it).
        tokenizer: the model's tokenizer.
        train, valid: the pairs, already fitted to the context (:func:`fitting_pairs`).
        objective: one of :data:`qkv.preference.OBJECTIVES`.
        beta, gamma: the objective's β, and SimPO's margin γ.
        reference: where the reference's log-probabilities come from, unless the objective is reference-free:
            ``"adapters"`` (the model with its adapters off), a frozen copy of the model (a module), or
            ``"precomputed"`` (computed once, before the first step, and kept with the run: see ``store``).
        store: the file the precomputed log-probabilities are written to and read back from (``--resume``).
        context: the context a pair's prompt and answer fit in; rows hold up to twice it.
        batch_size, seed, packed, share, meta: as :class:`~qkv.tasks.finetune.FineTuneTask`'s.
    """

    selection_metric = "val_loss"
    higher_is_better = False
    unit = "pairs"

    def __init__(self, model: nn.Module, tokenizer, train: Sequence[Pair], valid: Sequence[Pair], *, objective: str,
                 beta: float, gamma: float = 0.5, reference: str | nn.Module | None = None, store: Path | None = None,
                 context: int, batch_size: int, seed: int = 0, packed: bool = True, share: bool = True,
                 meta: dict[str, Any] | None = None) -> None:
        if not valid:
            raise DataError("no validation pairs; give --valid-data or more pairs")
        if (reference is None) != (objective in REFERENCE_FREE):
            raise ValueError(f"{objective}: {'no' if objective in REFERENCE_FREE else 'a'} reference expected")
        if reference == "adapters":
            from ..lora import lora_layers

            if not lora_layers(model):
                raise ValueError("the reference is the model with its adapters off, but it has none: give a frozen "
                                 "copy, or precompute the reference's log-probabilities")
        self.model, self.tokenizers = model, {"text": tokenizer}
        pad = getattr(tokenizer, "pad_id", None)
        self.pad_id = 0 if pad is None else pad
        self.objective, self.beta, self.gamma, self.reference, self.store = objective, beta, gamma, reference, store
        self.pairs = {"train": list(train), "valid": list(valid)}
        self.rows = self._rows(train, 2 * context, packed)
        self.valid_rows = self._rows(valid, 2 * context, packed)
        self.batch_size, self.seed, self.share = batch_size, seed, share
        self.meta = {"task": "preference", **(meta or {})}
        self._epoch: tuple[int, list[PairBatch]] | None = None
        self._precomputed: dict[str, Answers] | None = None
        self._sums: dict[str, Tensor] = {}

    @staticmethod
    def _rows(pairs: Sequence[Pair], width: int, packed: bool) -> list[list[tuple[int, Pair]]]:
        return pack(list(enumerate(pairs)), width, packed=packed, size=lambda item: item[1].tokens)

    def _collate(self, rows: Sequence[Sequence[tuple[int, Pair]]]) -> PairBatch:
        return collate_pairs(rows, self.pad_id, share=self.share)

    def batches(self, epoch: int) -> list[PairBatch]:
        if self._epoch is None or self._epoch[0] != epoch:
            self._epoch = (epoch, in_batches(shuffled(self.rows, self.seed, epoch), self.batch_size, self._collate))
        return self._epoch[1]

    def valid_batches(self) -> list[PairBatch]:
        return in_batches(self.valid_rows, self.batch_size, self._collate)

    def losses(self, model: nn.Module, batch: PairBatch, split: str = "train"):
        """The objective's :class:`~qkv.preference.PairLosses` of ``batch`` under ``model``; the numbers trl logs,
        summed over the pairs (the rewards, and the policy's log-probabilities of the answers); the chosen answers'
        summed cross-entropy and their tokens."""
        # the reference first: its forward pass's memory is given back before the policy's activations are held
        reference = None if self.objective in REFERENCE_FREE else self._reference(batch, split)
        policy, chosen_nll = answer_logps(model, batch)
        mean_nll = chosen_nll / policy.chosen_tokens.sum().clamp(min=1)
        out = pair_losses(self.objective, policy, reference, beta=self.beta, gamma=self.gamma,
                          chosen_nll=mean_nll if self.objective == "orpo" else None)
        metrics = {**out.metrics(), "logps/chosen": policy.chosen.detach().sum(),
                   "logps/rejected": policy.rejected.detach().sum()}
        return out, metrics, chosen_nll, policy.chosen_tokens.sum()

    def loss(self, model: nn.Module, batch: PairBatch) -> tuple[Tensor, int]:
        out, metrics, _, _ = self.losses(model, batch)
        total = out.losses.sum() + (0 if out.nll is None else len(batch.pairs) * out.nll)
        for key, value in metrics.items():
            self._sums[key] = self._sums.get(key, 0) + value
        return total.float(), batch.n_tokens

    def step_metrics(self) -> dict[str, Tensor]:
        """The rewards of the pairs of the batches since the last call, summed (the trainer divides them by the
        step's pairs)."""
        sums, self._sums = self._sums, {}
        return sums

    def evaluate(self, model: nn.Module, group: Group = SINGLE) -> dict[str, float]:
        totals = dict.fromkeys(["loss", "pairs", "chosen_nll", "chosen_tokens", *METRICS], 0.0)  # a rank may get none
        for batch in group.shard(self.valid_batches()):
            out, metrics, nll, tokens = self.losses(model, batch, "valid")
            loss = out.losses.sum() + (0 if out.nll is None else len(batch.pairs) * out.nll)
            for key, value in {"loss": loss, "pairs": len(batch.pairs), "chosen_nll": nll, "chosen_tokens": tokens,
                               **metrics}.items():
                totals[key] += float(value)
        sums = group.sum(totals)
        pairs = max(sums.pop("pairs", 0.0), 1.0)
        chosen = sums.pop("chosen_nll", 0.0) / max(sums.pop("chosen_tokens", 0.0), 1.0)
        return {f"val_{key}": value / pairs for key, value in sums.items()} | {"val_chosen_loss": chosen}

    # --- the reference ---------------------------------------------------------------------------------------
    def _reference(self, batch: PairBatch, split: str) -> Answers:
        if self.reference == "precomputed":
            table = self._table()[split]
            return Answers(*(to_device(getattr(table, f)[batch.pairs], device_of(self.model)) for f in ANSWER_FIELDS))
        with torch.no_grad():
            return self._reference_logps(batch)

    def _reference_logps(self, batch: PairBatch) -> Answers:
        """The reference's log-probabilities: a frozen copy's, or the model's with its adapters off (a model
        without adapters: as it is, which only :meth:`_table` asks for, before the first step)."""
        if isinstance(self.reference, nn.Module):  # a frozen copy of the model as it was
            self.reference.to(device_of(self.model)).eval()
            return answer_logps(self.reference, batch)[0]
        from ..lora import adapters_off

        with adapters_off(self.model):
            return answer_logps(self.model, batch)[0]

    def _table(self) -> dict[str, Answers]:
        """The reference's log-probabilities of every pair, made before the first step (the model with its adapters
        off, or as it is for full fine-tuning) and kept in :attr:`store`; read back from there on resume."""
        if self._precomputed is None:
            if self.store is not None and self.store.exists():
                self._precomputed = _read_table(self.store, {k: len(v) for k, v in self.pairs.items()})
            else:
                self._precomputed = self._compute_table()
                if self.store is not None:
                    _write_table(self.store, self._precomputed)
        return self._precomputed

    def _compute_table(self) -> dict[str, Answers]:
        log.info("the reference's log-probabilities of %d pairs, once, before training",
                 sum(len(v) for v in self.pairs.values()))
        was_training = self.model.training
        self.model.eval()
        table = {}
        with torch.no_grad():  # every process computes all of them: the same numbers, nothing exchanged
            for split, pairs in self.pairs.items():
                rows = [[(i, p)] for i, p in enumerate(pairs)]
                parts = [self._reference_logps(collate_pairs(rows[i : i + self.batch_size], self.pad_id))
                         for i in range(0, len(rows), self.batch_size)]
                table[split] = Answers(*(torch.cat([getattr(a, f) for a in parts]).cpu() for f in ANSWER_FIELDS))
        self.model.train(was_training)
        return table


def _write_table(path: Path, table: dict[str, Answers]) -> None:
    from safetensors.torch import save_file

    from ..files import write_atomically

    tensors = {f"{split}.{field}": getattr(a, field).contiguous() for split, a in table.items()
               for field in ANSWER_FIELDS}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda tmp: save_file(tensors, str(tmp)))


def _read_table(path: Path, sizes: dict[str, int]) -> dict[str, Answers]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
        table = {split: Answers(*(tensors[f"{split}.{field}"] for field in ANSWER_FIELDS)) for split in sizes}
    except (OSError, SafetensorError, KeyError) as err:
        raise DataError(f"{path}: the reference's log-probabilities cannot be read ({err}); start the run again "
                        "without --resume") from None
    for split, n in sizes.items():
        if len(table[split].chosen) != n:
            raise DataError(f"{path} holds the reference's log-probabilities of {len(table[split].chosen)} {split} "
                            f"pairs, the data {n}: the data changed; start the run again without --resume")
    return table


__all__ = ["Pair", "PairBatch", "PreferenceTask", "answer_logps", "collate_pairs", "fitting_pairs",
           "read_pairs"]
