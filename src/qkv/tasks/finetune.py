"""Fine-tuning a pretrained language model on a user's own examples: what an example is, and how they are packed.

Three kinds of data, each turned into token ids and, for each token, whether the model must learn to produce it
(a *loss mask*):

* **chat**, JSONL lines ``{"messages": [{"role": "system" | "user" | "assistant", "content": ...}, ...]}``, laid
  out by the model's own chat template; the loss is on the assistant turns only, each turn's end-of-turn token
  included, so the model learns to stop (:func:`qkv.chat.chat_training_ids`);
* **prompt and completion**, JSONL lines ``{"prompt": ..., "completion": ...}``: the prompt as the model reads
  any text (after its begin-of-text token where it has one), the completion after it and then the
  end-of-sequence token; the loss on the completion and that token;
* **plain text** (any other file): continued pretraining, every token learnt, the text cut into pieces of the
  context's length.

A file is JSONL when its name ends in ``.jsonl`` (or ``.jsonl.gz``) or its first line that is not blank is a JSON
object; it may be gzip-compressed (told by its first bytes, whatever its name), and the decision is taken on the
text after decompression, as for a file that is not compressed. What is read is bounded, and checked as it is read
(:func:`qkv.files.read_bounded`): a file of at most :data:`MAX_DATA_BYTES` (256 MiB) once decompressed, lines of at
most :data:`MAX_LINE_BYTES` (4 MiB), a regular file (never a FIFO or a device, refused before they are opened); a
chat of at most :data:`qkv.chat.MAX_TRAINING_MESSAGES` messages. Every text is checked before it reaches
the tokenizer (:func:`qkv.tokenizers.utf8_checked`: a JSON ``"\\ud800"`` is half a character). Each error is one
line naming the file and the line. Preparing a large file writes its progress to the log every
:data:`PROGRESS_EVERY_S` seconds (lines done, their rate, the time left).

Token *t* is learnt from the tokens before it: the target of position *t − 1* is ``ids[t]`` where the mask is
True, and ``IGNORE`` elsewhere (the loss skips it).

**Packing.** Short examples are laid end to end into rows of the context's length, so no compute goes to
padding. Each example keeps to itself: its tokens attend to its own earlier tokens only and its positions
start at 0 (``segments``, see :func:`qkv.nn.segment_mask`), so a packed example's loss and gradients are those
it has alone (tested). An example longer than the context is dropped, with a count in the log (cutting a chat
would cut the turn's end, which the model must learn).
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data import DataError, decode_text
from ..device import device_of, to_device
from ..distributed import SINGLE, Group
from ..files import quoted, read_bounded
from ..nn.unpadded import shared_tokens
from ..tokenizers import encode_prompt, utf8_checked

log = logging.getLogger(__name__)

T = TypeVar("T")
IGNORE = -100  # the target of a position that carries no loss (F.cross_entropy's ignore_index)
# A data file's bytes once decompressed: some 64 million tokens, held as Python lists while they are prepared.
MAX_DATA_BYTES = 256 << 20
MAX_LINE_BYTES = 4 << 20  # one example's line: a thousand times the longest context fine-tuned here
PROGRESS_EVERY_S = 10.0  # a line in the log this often while a file is prepared


@dataclass
class Example:
    """One example: its token ids and, for each, whether the model learns to produce it."""

    ids: list[int]
    learn: list[bool]


def read_examples(path: str | Path, tokenizer, template: str | None) -> list[Example]:
    """The examples of a file: JSONL (chat or prompt/completion lines) or plain text (:data:`qkv.tasks.finetune`).
    A plain text's one example is cut into pieces by :func:`pack` later.

    Raises:
        DataError: naming the file and the line: a line that is not JSON or not an object of one of the two
            kinds, a chat without a template, or a file with no example.
    """
    path = Path(path)
    text = read_data(path)
    if not is_jsonl(path, text):
        if not text.strip():
            raise DataError(f"{path}: no text to train on")
        ids = encode_prompt(tokenizer, text)
        return [Example(ids, [True] * len(ids))]
    examples = from_lines(path, text.split("\n"), lambda record: _example(record, tokenizer, template))
    if not examples:
        raise DataError(f"{path}: no examples (expected JSONL lines with \"messages\", or \"prompt\" and "
                        "\"completion\")")
    return examples


def read_data(path: Path) -> str:
    """The text of a data file, within the bounds of :data:`qkv.tasks.finetune` (decompressed where it is gzip).

    Raises:
        ValueError: one line naming the file (and the line where one is at fault).
    """
    return decode_text(read_bounded(path, max_bytes=MAX_DATA_BYTES, max_line=MAX_LINE_BYTES), str(path))


def is_jsonl(path: Path, text: str) -> bool:
    """Whether a data file is JSONL: its name says so (``.jsonl``, ``.jsonl.gz``), or its first line that is not
    blank is a JSON object (a compressed file or one named otherwise, read as JSONL all the same)."""
    if path.name.endswith((".jsonl", ".jsonl.gz")):
        return True
    start = re.search(r"\S", text)
    if start is None:
        return False
    end = text.find("\n", start.start())
    try:
        first = json.loads(text[start.start() : None if end < 0 else end])
    except (ValueError, RecursionError):
        return False
    if isinstance(first, dict):
        log.info("%s: read as JSONL (its first line is a JSON object)", path)
    return isinstance(first, dict)


def from_lines(path: Path, lines: Sequence[str], make: Callable[[Any], T]) -> list[T]:
    """``make(record)`` of each line that is not blank (its JSON value), progress in the log.

    Raises:
        DataError: naming the file and the line: a line that is not JSON, or one that ``make`` refuses (its
            ValueError's message follows).
    """
    out = []
    lines = lines[:-1] if lines and not lines[-1] else lines  # the file's last line end ends no line after it
    for number, line in reported(lines, str(path)):
        if not line.strip():
            continue
        try:
            out.append(make(json.loads(line)))
        except (json.JSONDecodeError, RecursionError):
            raise DataError(f"{path}: line {number} is not valid JSON; each line must be one JSON object") from None
        except ValueError as err:
            raise DataError(f"{path}: line {number}: {err}") from None
    return out


def reported(lines: Sequence[T], what: str) -> Iterator[tuple[int, T]]:
    """``(number, line)`` of ``lines`` from 1, with a line in the log every :data:`PROGRESS_EVERY_S` seconds: how
    many are done, at what rate, and about how long the rest take."""
    start = last = time.monotonic()
    for number, line in enumerate(lines, 1):
        now = time.monotonic()
        if now - last >= PROGRESS_EVERY_S:
            rate = (number - 1) / max(now - start, 1e-9)
            left = (len(lines) - number + 1) / max(rate, 1e-9)
            log.info("%s: %s of %s lines prepared (%s lines/s, about %s left)", what, f"{number - 1:,}",
                     f"{len(lines):,}", f"{rate:,.0f}", f"{left / 60:.1f} minutes" if left >= 60 else f"{left:.0f} s")
            last = now
        yield number, line


def _example(record: Any, tokenizer, template: str | None) -> Example:
    if isinstance(record, dict) and isinstance(record.get("messages"), list):
        if template is None:
            raise ValueError("a chat example, but the model has no chat template; use {\"prompt\", \"completion\"} "
                             "lines or plain text")
        from ..chat import chat_training_ids

        ids, learn = chat_training_ids(template, record["messages"], tokenizer)
        return Example(ids, learn)
    if isinstance(record, dict) and all(isinstance(record.get(k), str) for k in ("prompt", "completion")):
        prompt = encode_prompt(tokenizer, utf8_checked(record["prompt"], '"prompt"'))
        completion = tokenizer.encode(utf8_checked(record["completion"], '"completion"'))
        eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
        return Example(prompt + completion + eos, [False] * len(prompt) + [True] * (len(completion) + len(eos)))
    raise ValueError("expected an object with \"messages\" (a list of {\"role\", \"content\"}) or with string "
                     f"\"prompt\" and \"completion\", got {quoted(record)}")


@dataclass
class PackedBatch:
    """Rows of packed examples: ``ids``, ``segments`` (each token's example, numbered within its row) and
    ``targets`` (the next token where it is learnt, else :data:`IGNORE`), all ``(B, T)``; ``real`` the flat
    positions ``(N,)`` of the tokens the model computes (the model's products run on those alone) and ``copies``
    ``(B, T)`` the token each position holds, −1 at padding: examples that begin alike share those tokens
    (:func:`qkv.nn.unpadded.shared_tokens`). ``n_tokens`` counts the targets that carry loss, from the targets
    themselves."""

    ids: Tensor
    segments: Tensor
    targets: Tensor
    real: Tensor
    copies: Tensor

    @property
    def n_tokens(self) -> int:
        return int((self.targets != IGNORE).sum())

    @property
    def packed_segments(self) -> Tensor | None:
        """``segments`` where a row holds several examples; None where each holds one (the causal mask then keeps
        them apart, and attention runs without a mask)."""
        return self.segments if bool(self.segments[self.copies >= 0].any()) else None


def fitting(examples: Sequence[Example], context: int, what: str) -> list[Example]:
    """The examples of at most ``context`` tokens with at least one token to learn after the first; the rest are
    dropped, with a count in the log (``what`` names the data).

    Raises:
        DataError: when none is left.
    """
    kept = [e for e in examples if len(e.ids) <= context and any(e.learn[1:])]
    if len(kept) < len(examples):
        longer = sum(len(e.ids) > context for e in examples)
        log.warning("%s: %d of %d examples dropped (%d longer than the context of %d tokens, %d with nothing to "
                    "learn)", what, len(examples) - len(kept), len(examples), longer, context,
                    len(examples) - len(kept) - longer)
    if not kept:
        raise DataError(f"{what}: every example is longer than the context of {context} tokens or has nothing to "
                        "learn; raise --context or shorten the examples")
    return kept


def split_text(examples: list[Example], context: int) -> list[Example]:
    """Plain text (one long example) cut into pieces of ``context`` tokens; other examples as they are."""
    out = []
    for e in examples:
        if all(e.learn) and len(e.ids) > context:
            out += [Example(e.ids[i : i + context], e.learn[i : i + context]) for i in range(0, len(e.ids), context)]
        else:
            out.append(e)
    return [e for e in out if len(e.ids) > 1]


def pack(examples: Sequence[T], context: int, *, packed: bool = True,
         size: Callable[[T], int] = lambda e: len(e.ids)) -> list[list[T]]:
    """Rows of at most ``context`` tokens: examples in order (or other items of ``size`` tokens: a preference
    pair's two answers), each row filled until the next does not fit (``packed=False``: one a row)."""
    rows: list[list[T]] = []
    used = context
    for e in examples:
        if not packed or used + size(e) > context:
            rows.append([])
            used = 0
        rows[-1].append(e)
        used += size(e)
    return rows


def collate(rows: Sequence[Sequence[Example]], pad_id: int, *, share: bool = True) -> PackedBatch:
    """Rows of examples as tensors, padded to the longest row (a padding token is a segment of its own that
    learns nothing); examples that begin alike share those tokens (``share=False``: none shared)."""
    width = max(sum(len(e.ids) for e in row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    segments = torch.full((len(rows), width), -1, dtype=torch.long)
    targets = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for s, e in enumerate(row):
            n = len(e.ids)
            ids[r, at : at + n] = torch.tensor(e.ids)
            segments[r, at : at + n] = s
            learnt = torch.tensor(e.ids[1:])
            targets[r, at : at + n - 1] = torch.where(torch.tensor(e.learn[1:]), learnt, IGNORE)
            at += n
        segments[r, at:] = torch.arange(len(row), len(row) + width - at)  # each padding token alone
    real, copies = shared_tokens([[e.ids for e in row] for row in rows], width, share=share)
    return PackedBatch(ids, segments, targets, real, copies)


def learnt_logits(model: nn.Module, batch: PackedBatch) -> tuple[Tensor, Tensor, Tensor]:
    """``model``'s logits ``(N, vocab)`` at the batch's learnt tokens alone, their targets ``(N,)`` (both where the
    model is), and where they lie: flat indices into the ``(B, T)`` positions, on the host."""
    device = device_of(model)
    flat = batch.targets.flatten()
    learnt = (flat != IGNORE).nonzero().squeeze(1)  # found on the host, before the forward
    packed = batch.packed_segments  # read on the host once
    segments = None if packed is None else to_device(packed, device)
    logits = model(to_device(batch.ids, device), segments=segments, logits_at=to_device(learnt, device),
                   real=to_device(batch.real, device), copies=to_device(batch.copies, device))
    return logits, to_device(flat[learnt], device), learnt


def shuffled(rows: Sequence[T], seed: int, epoch: int) -> list[T]:
    """``rows`` in the order of epoch ``epoch`` of a run seeded ``seed`` (the same order on every resume)."""
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return [rows[i] for i in order.tolist()]


def in_batches(rows: Sequence[T], batch_size: int, make: Callable[[Sequence[T]], Any]) -> list:
    """``rows`` ``batch_size`` at a time, each made a batch by ``make``."""
    return [make(rows[i : i + batch_size]) for i in range(0, len(rows), batch_size)]


class FineTuneTask:
    """Next-token loss on the learnt tokens of packed examples; validated by the mean loss per learnt token.

    Args:
        model: the model trained (its adapters, or all of it).
        tokenizer: the model's tokenizer (saved with full fine-tuning's checkpoints).
        train, valid: the examples, already fitted to the context (:func:`fitting`).
        context: the rows' length.
        batch_size: rows a batch.
        seed: the order of the rows, epoch by epoch, follows (seed, epoch).
        packed: pack several examples a row (False: one a row).
        share: examples that begin alike do the work of those tokens once (False: each its own).
        meta: what the checkpoints record besides the model.
    """

    selection_metric = "val_loss"
    higher_is_better = False
    unit = "tokens"

    def __init__(self, model: nn.Module, tokenizer, train: Sequence[Example], valid: Sequence[Example], *,
                 context: int, batch_size: int, seed: int = 0, packed: bool = True, share: bool = True,
                 meta: dict[str, Any] | None = None) -> None:
        if not valid:
            raise DataError("no validation examples; give --valid-data or more examples")
        self.model, self.tokenizers = model, {"text": tokenizer}
        pad = getattr(tokenizer, "pad_id", None)  # qkv's own tokenizers have none
        self.pad_id = 0 if pad is None else pad  # never learnt, never attended to
        self.rows = pack(train, context, packed=packed)
        self.valid_rows = pack(valid, context, packed=packed)
        self.batch_size, self.seed, self.share = batch_size, seed, share
        self.meta = {"task": "finetune", **(meta or {})}
        self._epoch: tuple[int, list[PackedBatch]] | None = None

    def _collate(self, rows: Sequence[Sequence[Example]]) -> PackedBatch:
        return collate(rows, self.pad_id, share=self.share)

    def batches(self, epoch: int) -> list[PackedBatch]:
        if self._epoch is None or self._epoch[0] != epoch:
            self._epoch = (epoch, in_batches(shuffled(self.rows, self.seed, epoch), self.batch_size, self._collate))
        return self._epoch[1]

    def loss(self, model: nn.Module, batch: PackedBatch) -> tuple[Tensor, int]:
        logits, targets, _ = learnt_logits(model, batch)
        return F.cross_entropy(logits.float(), targets, reduction="sum"), batch.n_tokens

    def valid_batches(self) -> list[PackedBatch]:
        """The held-out examples' batches, in order."""
        return in_batches(self.valid_rows, self.batch_size, self._collate)

    def evaluate(self, model: nn.Module, group: Group = SINGLE) -> dict[str, float]:
        total, tokens = 0.0, 0
        for batch in group.shard(self.valid_batches()):
            summed, n = self.loss(model, batch)
            total, tokens = total + summed.item(), tokens + n
        sums = group.sum({"loss": total, "tokens": tokens})
        loss = sums["loss"] / max(sums["tokens"], 1)
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}


def held_out(examples: list[Example], fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """(training, validation): a ``fraction`` of the examples picked by ``seed`` held out (at least one, and at
    least one left to train on)."""
    if len(examples) < 2:
        raise DataError(f"only {len(examples)} example: too few to hold some out for validation; give --valid-data")
    n = min(len(examples) - 1, max(1, round(len(examples) * fraction)))
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    chosen = set(order[:n])
    return [e for i, e in enumerate(examples) if i not in chosen], [examples[i] for i in sorted(chosen)]
