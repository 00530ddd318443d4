"""The text of a continuation as its tokens come (qkv.detokenize), which qkv generate, qkv chat and qkv serve share:
the incremental decoding is the whole sequence's decoding at every step, characters split over byte-level tokens
included; stop strings are found across tokens, earliest first, and nothing of one or after it is ever final."""

import random

import pytest

from qkv.detokenize import MAX_STOP_CHARS, MAX_STOPS, Detokenizer, TextStream, check_stops, cut, held
from qkv.tokenizers import BPETokenizer, CharTokenizer

TEXT = "Grüße aus Köln: 日本語のテキスト, emoji 🙂🎉 and € signs. The end is near, the end.\n"


@pytest.fixture(scope="module")
def byte_level():
    """A byte-level BPE too small to hold the rarer characters whole: they are split over several tokens."""
    return BPETokenizer.train([TEXT.split(":")[0] * 20, "the end is near " * 20], vocab_size=300, byte_level=True)


def test_the_fixture_splits_characters_over_tokens(byte_level):
    ids = byte_level.encode(TEXT)
    assert byte_level.decode(ids) == TEXT
    assert any(byte_level.decode(ids[:k]).endswith("\ufffd") for k in range(1, len(ids)))


@pytest.mark.parametrize("kind", ["byte_level", "char"])
def test_the_text_so_far_is_the_whole_decoding_at_every_step(byte_level, kind):
    tokenizer = byte_level if kind == "byte_level" else CharTokenizer.train([TEXT])
    ids = tokenizer.encode(TEXT)
    stream, pieces = Detokenizer(tokenizer), ""
    for k, token in enumerate(ids, 1):
        pieces += stream.add(token)
        whole = tokenizer.decode(ids[:k])
        assert pieces == whole if not whole.endswith("\ufffd") else whole.startswith(pieces) and pieces == \
            whole[: len(pieces)]
        assert "\ufffd" not in pieces  # a character appears once whole, never as its halves
    assert pieces + stream.flush() == TEXT


def test_a_character_never_completed_comes_out_as_the_decoding_says(byte_level):
    """Bytes that never make a character wait for a few tokens at most, and the end gives what decode gives."""
    euro = byte_level.encode("€")
    assert len(euro) > 1
    ids = [*byte_level.encode("ab"), euro[0], *byte_level.encode("cdefg")]
    stream = TextStream(byte_level)
    for token in ids:
        stream.add(token)
    assert stream.finish() == byte_level.decode(ids)
    cut_short = TextStream(byte_level)
    for token in [*byte_level.encode("ab"), euro[0]]:
        cut_short.add(token)
    assert cut_short.text == "ab" and cut_short.finish() == byte_level.decode([*byte_level.encode("ab"), euro[0]])


def fed(tokenizer, text: str, stops: tuple[str, ...]) -> tuple[TextStream, int, list[str]]:
    """``text``'s tokens fed until a stop string is reached: the stream, the tokens it took, and the final text
    after each token."""
    stream, finals = TextStream(tokenizer, stops), []
    ids = tokenizer.encode(text)
    for k, token in enumerate(ids, 1):
        stopped = stream.add(token)
        finals.append(stream.text[: stream.final])
        if stopped:
            return stream, k, finals
    stream.finish()
    return stream, len(ids), finals


@pytest.mark.parametrize("stop", ["end is", "日本語の", "🙂🎉", "€", "\n"])
def test_a_stop_string_across_tokens_ends_the_text_where_it_begins(byte_level, stop):
    stream, took, finals = fed(byte_level, TEXT, (stop, "never there"))
    before = TEXT[: TEXT.find(stop)]
    assert stream.stopped and stream.text == before and stream.finish() == before
    ids = byte_level.encode(TEXT)
    assert stop in byte_level.decode(ids[:took]) and stop not in byte_level.decode(ids[: took - 1])
    assert all(before.startswith(f) for f in finals)  # nothing of the stop string, or after it, was final


def test_the_earliest_stop_string_wins_and_text_that_may_begin_one_is_held(byte_level):
    stream, _, finals = fed(byte_level, TEXT, ("the end.", "end is near"))
    assert stream.text == TEXT[: TEXT.find("end is near")]
    held_back = [f for f in finals if f.endswith("The ")]
    assert not any(f.endswith("The e") for f in finals) and held_back  # "e" might have begun "end is near"
    assert cut("a stop and a stop", ("stop", "a s")) == 0 and cut("abc", ("x",)) is None


def naive_held(text: str, markers) -> int:
    return max((k for s in markers for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def test_held_is_the_longest_beginning_of_a_marker_at_the_end():
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 12)))
        markers = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 8))) for _ in range(rng.randint(0, 3))]
        assert held(text, markers) == naive_held(text, markers), (text, markers)


def test_stop_strings_are_bounded_in_number_and_length():
    assert check_stops(["a" * MAX_STOP_CHARS] * MAX_STOPS) == ("a" * MAX_STOP_CHARS,) * MAX_STOPS
    with pytest.raises(ValueError, match=f"at most {MAX_STOPS} stop strings"):
        check_stops(["a"] * (MAX_STOPS + 1))
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_CHARS} characters, got one of 240,000"):
        check_stops(["x" * 240_000], "stop")
    with pytest.raises(ValueError, match="--stop must be a non-empty string"):
        check_stops(["ok", ""], "--stop")
