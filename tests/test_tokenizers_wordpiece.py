"""WordPieceTokenizer: BERT's special tokens, the [CLS] ... [SEP] frame and its truncation, saving and loading, a
vocabulary size that cannot be honoured."""

import pytest
from tokenizers import Tokenizer, models

from qkv.tokenizers import WordPieceTokenizer, encode_all, load_tokenizer, save_tokenizer, tokenizer_from_dict

TEXTS = ["The cat sat on the mat.", "Cats and dogs are playing together.", "Playing, played, plays!", "Café 東京"] * 5


@pytest.fixture(scope="module")
def tok():
    return WordPieceTokenizer.train(TEXTS, vocab_size=120, min_frequency=1)


def test_specials_come_first_and_are_named(tok):
    assert [tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id] == [0, 1, 2, 3, 4]
    assert tok.special_ids == {0, 1, 2, 3, 4}
    assert [tok.id_to_token(i) for i in range(5)] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def test_words_split_into_pieces_lowercased_and_cjk_one_character_each(tok):
    pieces = tok.tokens("Playing TOGETHER 東京")
    assert pieces[-2:] == ["東", "京"]
    assert all(p == p.lower() for p in pieces)
    assert tok.tokens("dogsat") == ["dogs", "##at"]  # the longest known piece first, then a continuation
    assert tok.decode(tok.encode("cats and dogs")) == "cats and dogs"


def test_wrap_frames_and_cuts_the_end(tok):
    ids = tok.encode("the cat sat on the mat")
    assert tok.wrap(ids, 100) == [tok.cls_id, *ids, tok.sep_id]
    assert tok.wrap(ids, 4) == [tok.cls_id, *ids[:2], tok.sep_id]
    assert tok.wrap([], 3) == [tok.cls_id, tok.sep_id]
    with pytest.raises(ValueError, match=r"max_length .* >= 3, got 2"):
        tok.wrap(ids, 2)


def test_stored_padding_and_truncation_are_switched_off():
    hf = WordPieceTokenizer.train(TEXTS, vocab_size=120, min_frequency=1).hf
    hf.enable_padding(length=16, pad_id=0, pad_token="[PAD]")
    hf.enable_truncation(max_length=3)
    tok = WordPieceTokenizer(hf)
    assert len(tok.encode("the cat sat on the mat")) == 6


def test_save_and_load_give_the_same_tokenizer(tok, tmp_path):
    save_tokenizer(tok, tmp_path / "t.json")
    again = load_tokenizer(tmp_path / "t.json")
    assert isinstance(again, WordPieceTokenizer) and again.special_ids == tok.special_ids
    assert encode_all(again, TEXTS) == encode_all(tok, TEXTS)
    assert tokenizer_from_dict(tok.to_dict()).encode("cats") == tok.encode("cats")


@pytest.mark.parametrize("vocab_size", [0, -5])
def test_a_vocab_size_below_one_is_refused(vocab_size):
    with pytest.raises(ValueError, match=f"vocab_size must be >= 1, got {vocab_size}"):
        WordPieceTokenizer.train(TEXTS, vocab_size=vocab_size)


def test_a_vocab_size_too_small_for_the_alphabet_is_refused():
    """The 5 specials, "a" and "b" starting a word, "##a" and "##b" continuing one: once silently 9 tokens."""
    with pytest.raises(ValueError, match=r"vocab_size=3 is smaller than the 9 tokens this text needs \(5 special "
                                         r"tokens and 4 characters, word-initial or ##-continued\); choose "
                                         r"vocab_size >= 9"):
        WordPieceTokenizer.train(["ab ba"], vocab_size=3, min_frequency=1)
    assert WordPieceTokenizer.train(["ab ba"], vocab_size=9, min_frequency=1).vocab_size == 9


def test_a_vocabulary_without_bert_specials_is_refused():
    hf = Tokenizer(models.WordPiece({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    with pytest.raises(ValueError, match=r"needs the tokens \['\[PAD\]', '\[CLS\]', '\[SEP\]'\]"):
        WordPieceTokenizer(hf)
