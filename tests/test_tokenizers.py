"""Tokenizers on real text: BPE round-trips Chinese (no spaces) and German/English exactly, keeps full-width
punctuation, splits punctuation off words; the character tokenizer maps unknowns to <unk>; both save and load
back to identical encodings; a broken tokenizer file is a ValueError naming it; a vocabulary size too small for
the special tokens and the alphabet is an error, not a larger vocabulary."""

import gzip
import json
import os
from pathlib import Path

import pytest
from shared_data import missing_corpora

from qkv.tokenizers import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SPECIALS,
    UNK_ID,
    BPETokenizer,
    CharTokenizer,
    load_tokenizer,
    save_tokenizer,
    train_tokenizer,
)

DATA = Path(os.environ.get("QKV_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


def _need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(missing_corpora(DATA))
    return path


def _gz_lines(path: Path, n: int | None = None) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read().splitlines()[:n]


@pytest.fixture(scope="module")
def chinese() -> list[str]:
    """About 2,000 Tatoeba Chinese sentences, every tenth line, so short and long ones alike."""
    lines = _need(DATA / "tatoeba-en-zh" / "cmn.txt").read_text(encoding="utf-8").splitlines()
    return [line.split("\t")[1] for line in lines[::10]][:2000]


@pytest.fixture(scope="module")
def bpe_zh(chinese) -> BPETokenizer:
    return BPETokenizer.train(chinese, vocab_size=4000)


@pytest.fixture(scope="module")
def multi30k() -> dict[str, list[str]]:
    folder = _need(DATA / "multi30k")
    return {
        "train": _gz_lines(folder / "train.de.gz", 2000) + _gz_lines(folder / "train.en.gz", 2000),
        "val": _gz_lines(folder / "val.de.gz") + _gz_lines(folder / "val.en.gz"),
    }


@pytest.fixture(scope="module")
def bpe_de_en(multi30k) -> BPETokenizer:
    return BPETokenizer.train(multi30k["train"], vocab_size=2000)


# --- BPE ------------------------------------------------------------------------------------------------------

def test_bpe_special_ids(bpe_zh, bpe_de_en):
    assert SPECIALS == ("<pad>", "<s>", "</s>", "<unk>")
    assert (PAD_ID, BOS_ID, EOS_ID, UNK_ID) == (0, 1, 2, 3)
    for tok in (bpe_zh, bpe_de_en):
        assert [tok.hf.id_to_token(i) for i in range(4)] == list(SPECIALS)


def test_bpe_round_trips_chinese(chinese, bpe_zh):
    assert sum(" " in s for s in chinese) < 0.05 * len(chinese)  # the test means something: no spaces to split on
    failures = [(s, bpe_zh.decode(bpe_zh.encode(s))) for s in chinese if bpe_zh.decode(bpe_zh.encode(s)) != s]
    assert failures == []
    assert UNK_ID not in {i for s in chinese for i in bpe_zh.encode(s)}
    # merges were learnt inside the space-free runs: fewer tokens than characters
    assert sum(len(bpe_zh.encode(s)) for s in chinese) < 0.8 * sum(len(s) for s in chinese)


@pytest.mark.parametrize("mark", ["，", "。", "？"])
def test_bpe_keeps_full_width_punctuation(chinese, bpe_zh, mark):
    sentence = next(s for s in chinese if mark in s)
    assert mark in bpe_zh.tokens(sentence)  # its own token, not folded to ASCII by normalization
    assert bpe_zh.decode(bpe_zh.encode(sentence)) == sentence
    assert bpe_zh.hf.token_to_id(mark) is not None


def test_bpe_round_trips_german_and_english(multi30k, bpe_de_en):
    train = multi30k["train"]
    assert [s for s in train if bpe_de_en.decode(bpe_de_en.encode(s)) != s] == []
    # unseen sentences too, as far as their characters were seen in training
    alphabet = set("".join(train))
    val = [s for s in multi30k["val"] if set(s) <= alphabet]
    assert len(val) > 0.99 * len(multi30k["val"])
    assert [s for s in val if bpe_de_en.decode(bpe_de_en.encode(s)) != s] == []


def test_bpe_splits_off_punctuation_and_digits(multi30k, bpe_de_en):
    sentence = next(s for s in multi30k["train"] if "bushes." in s)
    tokens = bpe_de_en.tokens(sentence)
    assert tokens[-1] == "."
    assert all("." not in t for t in tokens[:-1])
    assert bpe_de_en.tokens("1234")[-4:] == ["1", "2", "3", "4"]


# --- characters -----------------------------------------------------------------------------------------------

def test_char_round_trip_unknowns_and_specials():
    texts = ["Ein Hund läuft.", "你好。", "A dog runs."]
    tok = CharTokenizer.train(texts)
    assert tok.itos[:4] == list(SPECIALS)
    for text in texts:
        assert tok.decode(tok.encode(text)) == text
    ids = tok.encode("Hund?")
    assert ids[-1] == UNK_ID and UNK_ID not in ids[:-1]
    assert tok.tokens("Hund?")[-1] == "<unk>"
    hund = tok.encode("Hund")
    assert tok.decode([BOS_ID, *hund, EOS_ID, PAD_ID, PAD_ID]) == "Hund"


def test_train_tokenizer_rejects_unknown_kind():
    with pytest.raises(ValueError, match="'wordpiece'"):
        train_tokenizer("wordpiece", ["text"])


# --- vocabulary size ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("vocab_size", [0, -1])  # once: "no limit" to the tokenizers library, and an OverflowError
@pytest.mark.parametrize(("kind", "byte_level"), [("bpe", False), ("bpe", True), ("char", False)])
def test_a_vocab_size_below_one_is_refused_before_training(kind, byte_level, vocab_size):
    with pytest.raises(ValueError, match=f"vocab_size must be >= 1, got {vocab_size}"):
        train_tokenizer(kind, ["a dog runs"], vocab_size=vocab_size, byte_level=byte_level)
    if kind == "bpe":
        with pytest.raises(ValueError, match=f"vocab_size must be >= 1, got {vocab_size}"):
            BPETokenizer.train(["a dog runs"], vocab_size=vocab_size, byte_level=byte_level)


@pytest.mark.parametrize("vocab_size", [1, 100, 259])
def test_byte_level_bpe_needs_room_for_the_256_bytes(vocab_size):
    """Once silently a vocabulary of 260 tokens, whatever was asked for."""
    expected = (f"vocab_size={vocab_size} is smaller than the 260 tokens this text needs (4 special tokens and 256 "
                "bytes); choose vocab_size >= 260")
    with pytest.raises(ValueError) as err:
        train_tokenizer("bpe", ["a dog runs", "a cat sits"], vocab_size=vocab_size, byte_level=True)
    assert str(err.value) == expected
    assert train_tokenizer("bpe", ["a dog runs", "a cat sits"], vocab_size=260, byte_level=True).vocab_size == 260


def test_bpe_needs_room_for_the_alphabet():
    texts = ["abc", "cab"]  # a, b, c and the word marker ▁
    with pytest.raises(ValueError, match=r"vocab_size=7 is smaller than the 8 tokens this text needs \(4 special "
                                         r"tokens and 4 characters\); choose vocab_size >= 8"):
        BPETokenizer.train(texts, vocab_size=7, min_frequency=1)
    tok = BPETokenizer.train(texts, vocab_size=8, min_frequency=1)
    assert tok.vocab_size == 8 and tok.decode(tok.encode("cab")) == "cab"


# --- saving and loading ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["bpe_zh", "bpe_de_en", "char"])
def test_save_load_gives_identical_encodings(tmp_path, request, chinese, multi30k, kind):
    texts = chinese[:200] + multi30k["val"][:200]
    tok = CharTokenizer.train(texts[::2]) if kind == "char" else request.getfixturevalue(kind)
    path = tmp_path / "tokenizer.json"
    save_tokenizer(tok, path)
    loaded = load_tokenizer(path)
    assert type(loaded) is type(tok)
    assert loaded.vocab_size == tok.vocab_size
    assert [loaded.encode(t) for t in texts] == [tok.encode(t) for t in texts]
    assert [loaded.decode(tok.encode(t)) for t in texts] == [tok.decode(tok.encode(t)) for t in texts]


def test_load_tokenizer_garbage_file(tmp_path):
    path = tmp_path / "tokenizer.src.json"
    path.write_bytes(b"\x00\xff this is not JSON")
    with pytest.raises(ValueError) as err:
        load_tokenizer(path)
    assert str(path) in str(err.value)


def test_load_tokenizer_unknown_kind(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"kind": "sentencepiece"}))
    with pytest.raises(ValueError, match="sentencepiece"):
        load_tokenizer(path)


@pytest.mark.parametrize("content", ["[1, 2, 3]", '{"kind": "char"}', '{"kind": "bpe", "hf": {"model": 1}}',
                                     '{"kind": "wordpiece"}'])
def test_load_tokenizer_wrong_shape_names_the_file(tmp_path, content):
    path = tmp_path / "tokenizer.src.json"
    path.write_text(content)
    with pytest.raises(ValueError) as err:
        load_tokenizer(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("chars, message", [
    ("abc", r"\"chars\" must be a list of one-character strings, got str"),
    ([1, 2], r"\"chars\" must be a list of one-character strings, got list"),
    (["ab", "c"], r"\"chars\" must be a list of one-character strings"),
    (["a", "b", "a"], r"\"chars\" lists 1 character\(s\) twice"),
])
def test_a_character_tokenizer_file_with_a_bad_alphabet_is_refused(tmp_path, chars, message):
    """A string in place of the list used to load as one token per letter; a duplicate gave an id nothing encodes
    to, so the vocabulary no longer matched the model's."""
    path = tmp_path / "tokenizer.src.json"
    path.write_text(json.dumps({"kind": "char", "chars": chars}))
    with pytest.raises(ValueError, match=rf"tokenizer\.src\.json is not a qkv tokenizer file: {message}"):
        load_tokenizer(path)
