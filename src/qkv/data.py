"""Reading corpora, and turning token sequences into padded, length-bucketed batches.

Every problem with the input files ends in a :class:`DataError` whose message names the file and the line,
so the command line can print it as one line.
"""

from __future__ import annotations

import gzip
import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor


class DataError(ValueError):
    """A corpus that cannot be used as it is."""


def read_text(path: str | Path) -> str:
    """A whole UTF-8 text file, plain or gzip (``.gz``), without a leading byte-order mark."""
    path = Path(path)
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise DataError(f"{path}: is a directory, expected a text file") from None
    except (OSError, EOFError, zlib.error) as err:  # permissions, truncated, corrupt or non-gzip .gz files
        raise DataError(f"{path}: cannot read: {getattr(err, 'strerror', None) or err}") from None
    return decode_text(raw, str(path))


def decode_text(raw: bytes, name: str) -> str:
    """UTF-8 bytes as text, without a leading byte-order mark; ``name`` (a file, "stdin") says where they came
    from in the error.

    Raises:
        DataError: naming the first line that is not valid UTF-8.
    """
    try:
        return raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise DataError(
            f"{name}: line {line} is not valid UTF-8 (byte 0x{raw[err.start]:02x}); convert it to UTF-8"
        ) from None


def read_lines(path: str | Path) -> list[str]:
    """All lines of a UTF-8 text file, plain or gzip (``.gz``), without their line endings."""
    # Split on "\n" only: str.splitlines() also breaks at U+2028, form feeds and the like, which would shift
    # every later line of one file against the other language's.
    lines = read_text(path).split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def read_parallel(source: str | Path, target: str | Path | None = None) -> list[tuple[str, str]]:
    """Sentence pairs from two aligned files (line i of one translates line i of the other) or from one
    TSV file of ``source<TAB>target`` lines (further columns, such as attributions, are ignored)."""
    if target is not None:
        src, tgt = read_lines(source), read_lines(target)
        if len(src) != len(tgt):
            raise DataError(
                f"{source} has {len(src)} lines but {target} has {len(tgt)}; parallel files must align line by line"
            )
        return list(zip(src, tgt, strict=True))
    pairs = []
    for number, line in enumerate(read_lines(source), 1):
        if not line.strip():
            pairs.append(("", ""))  # counted as empty by clean_pairs
            continue
        fields = line.split("\t")
        if len(fields) < 2:
            raise DataError(f"{source}: line {number} has no tab; expected source<TAB>target")
        pairs.append((fields[0], fields[1]))
    return pairs


@dataclass
class CleanStats:
    kept: int = 0
    empty: int = 0
    too_long: int = 0

    def __str__(self) -> str:
        return f"{self.kept} pairs kept, {self.empty} empty and {self.too_long} over-long skipped"


def clean_pairs(
    src_ids: Sequence[list[int]], tgt_ids: Sequence[list[int]], *, max_len: int
) -> tuple[list[int], CleanStats]:
    """Indices of the pairs to keep: both sides non-empty and at most ``max_len`` tokens."""
    stats, keep = CleanStats(), []
    for i, (s, t) in enumerate(zip(src_ids, tgt_ids, strict=True)):
        if not s or not t:
            stats.empty += 1
        elif len(s) > max_len or len(t) > max_len:
            stats.too_long += 1
        else:
            keep.append(i)
    stats.kept = len(keep)
    return keep, stats


def pad(sequences: Sequence[Sequence[int]], pad_id: int, *, left: bool = False) -> Tensor:
    """Stack sequences of different lengths into ``(B, T_max)``, padding on the right (or left)."""
    width = max((len(s) for s in sequences), default=0)
    out = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    for i, s in enumerate(sequences):
        if len(s):
            if left:
                out[i, width - len(s) :] = torch.as_tensor(s, dtype=torch.long)
            else:
                out[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
    return out


def pad_with_mask(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """:func:`pad` on the right, and the mask of the real tokens ``(B, T_max)`` (True where a token is)."""
    ids = pad(sequences, pad_id)
    lengths = torch.tensor([len(s) for s in sequences])
    return ids, torch.arange(ids.size(1)) < lengths[:, None]


def token_budget_batches(
    lengths: Sequence[int], max_tokens: int, *, seed: int | None = None, max_batch: int | None = None
) -> list[list[int]]:
    """Group example indices into batches of similar length, each at most ``max_tokens`` padded tokens.

    Sorting by length keeps padding small (a batch pads to its longest member); a fixed token budget rather
    than a fixed number of sentences keeps the work per step even. With a ``seed`` the order within equal
    lengths and the order of the batches are shuffled, deterministically: the same seed gives the same batches,
    which is what makes an interrupted run resumable exactly.
    """
    rng = random.Random(seed)
    order = list(range(len(lengths)))
    if seed is not None:
        rng.shuffle(order)
    order.sort(key=lambda i: lengths[i])  # stable: shuffled within equal lengths
    batches, current, longest = [], [], 0
    for i in order:
        longest_if_added = max(longest, lengths[i])
        too_many = max_batch is not None and len(current) >= max_batch
        if current and (longest_if_added * (len(current) + 1) > max_tokens or too_many):
            batches.append(current)
            current, longest_if_added = [], lengths[i]
        current.append(i)
        longest = longest_if_added
    if current:
        batches.append(current)
    if seed is not None:
        rng.shuffle(batches)
    return batches


@dataclass
class TranslationBatch:
    """``src (B, S)``; ``tgt_in = <s> y_1 .. y_n`` and ``tgt_out = y_1 .. y_n </s>``, both ``(B, T)``: teacher
    forcing feeds the true previous token at every position and asks for the next."""

    src: Tensor
    tgt_in: Tensor
    tgt_out: Tensor

    @property
    def n_tokens(self) -> int:
        return int((self.tgt_out != 0).sum())


def translation_batch(src: Sequence[list[int]], tgt: Sequence[list[int]], *, pad_id: int, bos_id: int,
                      eos_id: int) -> TranslationBatch:
    return TranslationBatch(
        src=pad(src, pad_id),
        tgt_in=pad([[bos_id, *t] for t in tgt], pad_id),
        tgt_out=pad([[*t, eos_id] for t in tgt], pad_id),
    )

