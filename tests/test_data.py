"""Reading corpora and making batches: every input problem is a DataError naming the file and the line; batches
cover every example once, stay within the token budget and are reproducible from their seed."""

import gzip
import itertools
import os
import random
from pathlib import Path

import pytest
import torch
from shared_data import missing_corpora

from qkv.data import (
    DataError,
    clean_pairs,
    pad,
    read_lines,
    read_parallel,
    token_budget_batches,
    translation_batch,
)

DATA = Path(os.environ.get("QKV_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


# --- read_lines -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["plain.txt", "packed.txt.gz"])
def test_read_lines_plain_and_gzip(tmp_path, name):
    path = write(tmp_path / name, "Ein Hund läuft.\r\nZwei Männer\n\n你好。".encode())
    assert read_lines(path) == ["Ein Hund läuft.", "Zwei Männer", "", "你好。"]


@pytest.mark.parametrize("name", ["bom.txt", "bom.txt.gz"])
def test_read_lines_strips_byte_order_mark(tmp_path, name):
    path = write(tmp_path / name, b"\xef\xbb\xbfHello\nworld\n")
    assert read_lines(path) == ["Hello", "world"]


def test_read_lines_breaks_only_at_newlines(tmp_path):
    path = write(tmp_path / "seps.txt", "one\u2028still one\ntwo\x85still two\nthree\x0cstill three\n".encode())
    assert read_lines(path) == ["one\u2028still one", "two\x85still two", "three\x0cstill three"]


# --- read_parallel --------------------------------------------------------------------------------------------

def test_read_parallel_two_files(tmp_path):
    src = write(tmp_path / "train.de.gz", b"Ein Hund.\nZwei Katzen.\n")
    tgt = write(tmp_path / "train.en", b"A dog.\nTwo cats.\n")
    assert read_parallel(src, tgt) == [("Ein Hund.", "A dog."), ("Zwei Katzen.", "Two cats.")]


def test_read_parallel_tsv_ignores_extra_columns(tmp_path):
    tsv = write(tmp_path / "cmn.txt", "Hi.\t嗨。\tCC-BY 2.0 (France) Attribution: tatoeba.org #538123\n"
                                      "Run.\t你用跑的。\n\n".encode())
    assert read_parallel(tsv) == [("Hi.", "嗨。"), ("Run.", "你用跑的。"), ("", "")]


def test_read_parallel_real_corpora():
    multi30k, tatoeba = DATA / "multi30k", DATA / "tatoeba-en-zh" / "cmn.txt"
    if not (multi30k / "val.de.gz").is_file() or not tatoeba.is_file():
        pytest.skip(missing_corpora(DATA))
    pairs = read_parallel(multi30k / "val.de.gz", multi30k / "val.en.gz")
    assert len(pairs) == 1014 and all(de and en for de, en in pairs)
    pairs = read_parallel(tatoeba)
    assert len(pairs) == 21116
    assert pairs[0] == ("Hi.", "嗨。")


# --- errors: DataError naming the file and the line -----------------------------------------------------------

def test_data_error_is_a_value_error():
    assert issubclass(DataError, ValueError)  # the CLI turns ValueErrors into one-line messages


def test_unequal_line_counts(tmp_path):
    src = write(tmp_path / "a.de", b"eins\nzwei\ndrei\n")
    tgt = write(tmp_path / "a.en", b"one\ntwo\n")
    with pytest.raises(DataError) as err:
        read_parallel(src, tgt)
    message = str(err.value)
    assert str(src) in message and str(tgt) in message
    assert "3 lines" in message and "has 2" in message


@pytest.mark.parametrize("name", ["bad.txt", "bad.txt.gz"])
def test_undecodable_bytes_name_the_line(tmp_path, name):
    path = write(tmp_path / name, b"fine\nalso fine\nbroken \xff here\nfine again\n")
    with pytest.raises(DataError) as err:
        read_lines(path)
    message = str(err.value)
    assert str(path) in message and "line 3" in message and "UTF-8" in message


def test_missing_file(tmp_path):
    path = tmp_path / "nowhere.de"
    with pytest.raises(DataError, match="no such file") as err:
        read_lines(path)
    assert str(path) in str(err.value)


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(DataError, match="is a directory") as err:
        read_lines(tmp_path)
    assert str(tmp_path) in str(err.value)


def _corrupt_body(data: bytes) -> bytes:
    packed = gzip.compress(data)
    return packed[:10] + b"\xff" * 20 + packed[30:]  # valid gzip header, then a deflate stream that is not one


@pytest.mark.parametrize(
    "packed",
    [
        pytest.param(b"this is not gzip at all", id="not-gzip"),
        pytest.param(gzip.compress(b"hello world\n" * 50)[:20], id="truncated"),
        pytest.param(_corrupt_body(b"hello world\n" * 50), id="corrupt-deflate"),
    ],
)
def test_corrupt_gzip(tmp_path, packed):
    path = tmp_path / "corpus.de.gz"
    path.write_bytes(packed)
    with pytest.raises(DataError) as err:
        read_lines(path)
    assert str(path) in str(err.value)


def test_tsv_line_without_tab(tmp_path):
    tsv = write(tmp_path / "pairs.tsv", b"Hi.\tHallo.\nno tab on this line\n")
    with pytest.raises(DataError) as err:
        read_parallel(tsv)
    message = str(err.value)
    assert str(tsv) in message and "line 2" in message and "no tab" in message


# --- cleaning, padding ----------------------------------------------------------------------------------------

def test_clean_pairs_counts_empty_and_over_long():
    src = [[4], [], [4, 5, 6], [4], [4], [4, 5, 6, 7]]
    tgt = [[5], [5], [5], [], [4, 5, 6, 7], [5]]
    keep, stats = clean_pairs(src, tgt, max_len=3)
    assert keep == [0, 2]
    assert (stats.kept, stats.empty, stats.too_long) == (2, 2, 2)
    assert str(stats) == "2 pairs kept, 2 empty and 2 over-long skipped"


def test_pad_right_and_left():
    sequences = [[5, 6, 7], [8], []]
    right = pad(sequences, pad_id=9)
    left = pad(sequences, pad_id=9, left=True)
    assert right.dtype == torch.long and left.dtype == torch.long
    assert right.tolist() == [[5, 6, 7], [8, 9, 9], [9, 9, 9]]
    assert left.tolist() == [[5, 6, 7], [9, 9, 8], [9, 9, 9]]
    assert pad([], pad_id=0).shape == (0, 0)


# --- token-budget batches -------------------------------------------------------------------------------------

_rng = random.Random(0)
LENGTHS = [_rng.randint(1, 40) for _ in range(300)]
BUDGET = 200


def _padded_size(batch, lengths):
    return len(batch) * max(lengths[i] for i in batch)


@pytest.mark.parametrize("seed", [None, 0, 7])
def test_batches_cover_every_index_once_within_budget(seed):
    batches = token_budget_batches(LENGTHS, BUDGET, seed=seed)
    assert sorted(itertools.chain.from_iterable(batches)) == list(range(len(LENGTHS)))
    assert all(batches)
    assert all(_padded_size(b, LENGTHS) <= BUDGET for b in batches)


def test_example_over_budget_gets_a_batch_of_its_own():
    lengths = [5, 300, 7, 250, 6]
    batches = token_budget_batches(lengths, 100)
    assert sorted(itertools.chain.from_iterable(batches)) == [0, 1, 2, 3, 4]
    for batch in batches:
        assert _padded_size(batch, lengths) <= 100 or len(batch) == 1
    assert [1] in batches and [3] in batches


def test_max_batch_limits_the_number_of_examples():
    batches = token_budget_batches([3] * 50, 10_000, max_batch=8)
    assert [len(b) for b in batches] == [8] * 6 + [2]


def test_same_seed_same_batches_different_seed_different_order():
    first = token_budget_batches(LENGTHS, BUDGET, seed=3)
    random.seed(12345)  # the global random state must not matter
    assert token_budget_batches(LENGTHS, BUDGET, seed=3) == first
    assert token_budget_batches(LENGTHS, BUDGET, seed=4) != first


def test_no_seed_sorts_by_length():
    batches = token_budget_batches(LENGTHS, BUDGET)
    order = list(itertools.chain.from_iterable(batches))
    assert [LENGTHS[i] for i in order] == sorted(LENGTHS)
    assert token_budget_batches(LENGTHS, BUDGET) == batches


def test_translation_batch_shifts_target_and_pads_with_zero():
    batch = translation_batch([[5, 6, 7], [8]], [[9, 10], [11, 12, 13]], pad_id=0, bos_id=1, eos_id=2)
    assert batch.src.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch.tgt_in.tolist() == [[1, 9, 10, 0], [1, 11, 12, 13]]
    assert batch.tgt_out.tolist() == [[9, 10, 2, 0], [11, 12, 13, 2]]
    assert batch.n_tokens == 7  # 2 + 3 target tokens, plus one </s> each
