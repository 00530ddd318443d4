"""A continuation's text as its tokens come: decoded incrementally, cut at the first stop string, and given out in
pieces that are final. ``qkv generate``, ``qkv chat`` and ``qkv serve`` read their text through it alike.

Decoding every token alone would be wrong (a byte-level token may hold half a character; a SentencePiece token's
leading space depends on what precedes it) and decoding the whole sequence at every token is quadratic. So each new
token is decoded together with the few before it, and only what they add is taken (as Hugging Face's text-generation
servers do): the work per token does not grow with the text. A character split over tokens appears once whole.

Stop strings are looked for in the text, not in tokens (a stop string may span tokens, a token may hold more than
one), and only in the new tail: the characters just added and, before them, as many as the longest stop string could
reach back. Text that might be the beginning of a stop string is held back until the next token shows whether it is,
so nothing after a stop string, and nothing of one, is ever given out.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_STOPS = 16  # stop strings one continuation may have (OpenAI's limit is 4; evaluation harnesses send more)
MAX_STOP_CHARS = 256  # characters of one stop string: bounds the text each token is checked against
PENDING = 4  # tokens a character may be split over (UTF-8's longest is four bytes): later, "\ufffd" is the text


def check_stops(stops: Sequence[str], what: str = "stop") -> tuple[str, ...]:
    """``stops`` as a tuple, refused (ValueError naming ``what``) unless at most :data:`MAX_STOPS` non-empty strings
    of at most :data:`MAX_STOP_CHARS` characters each."""
    if not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"{what} must be a non-empty string, or a list of them")
    if len(stops) > MAX_STOPS:
        raise ValueError(f"{what}: at most {MAX_STOPS} stop strings are taken, got {len(stops):,}")
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise ValueError(f"{what}: a stop string may have at most {MAX_STOP_CHARS} characters, got one of "
                         f"{longest:,}")
    return tuple(stops)


def held(text: str, markers: Sequence[str]) -> int:
    """How many characters at the end of ``text`` might begin one of ``markers`` (the longest such beginning, the
    whole marker excluded): held back from a stream until the next piece shows whether they do. Only the places where
    a marker holds ``text``'s last character are tried, so the work is about the markers' length, not the text's."""
    if not text:
        return 0
    best, last = 0, text[-1]
    for marker in markers:
        end = marker.rfind(last, 0, min(len(marker) - 1, len(text)))  # marker[: end + 1] may be text's ending
        while end >= best:
            if text.endswith(marker[: end + 1]):
                best = end + 1
                break
            end = marker.rfind(last, 0, end)
    return best


def cut(text: str, stops: Sequence[str], start: int = 0) -> int | None:
    """Where the first stop string found in ``text[start:]`` begins (None: none there)."""
    found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(found) if found else None


class Detokenizer:
    """Token ids -> text, one token at a time: :meth:`add` returns what a new token adds to the text ("" while a
    character split over tokens is incomplete), :meth:`flush` whatever is still pending at the end. Their
    concatenation is ``tokenizer.decode`` of all the ids."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.start = self.read = 0  # ids[start:read] were decoded already: decoded again with the new ones, they give
        # the context those need (a leading space, the first bytes of a character)

    def add(self, token: int) -> str:
        self.ids.append(token)
        decode = self.tokenizer.decode
        before, now = decode(self.ids[self.start : self.read]), decode(self.ids[self.start :])
        if now.endswith("\ufffd") and len(self.ids) - self.read < PENDING:  # a character's first bytes: wait
            return ""
        self.start, self.read = self.read, len(self.ids)
        return now[len(before) :]

    def flush(self) -> str:
        """What the pending tokens add, incomplete or not (nothing more will come)."""
        if self.read == len(self.ids):
            return ""
        decode = self.tokenizer.decode
        text = decode(self.ids[self.start :])[len(decode(self.ids[self.start : self.read])) :]
        self.start = self.read = len(self.ids)
        return text


class TextStream:
    """A continuation's text, ``tokenizer``'s tokens decoded as they come and cut at the first of ``stops``.

    :meth:`add` takes a token and says whether a stop string has been reached; ``text`` is the text so far,
    ``text[:final]`` the part no later token can change (the rest might begin a stop string); :meth:`finish` ends it
    and makes everything final.
    """

    def __init__(self, tokenizer, stops: Sequence[str] = ()) -> None:
        self.detokenizer = Detokenizer(tokenizer)
        self.stops = tuple(stops)
        self.longest = max(map(len, self.stops), default=0)
        self.text, self.stopped, self.ended = "", False, False

    def add(self, token: int) -> bool:
        """Take one more token; True once a stop string has been reached (later tokens are not to be added)."""
        self._grow(self.detokenizer.add(token))
        return self.stopped

    def finish(self) -> str:
        """The whole text: what was pending decoded, nothing held back any more."""
        if not self.stopped:
            self._grow(self.detokenizer.flush())
        self.ended = True
        return self.text

    @property
    def final(self) -> int:
        """How many characters of ``text`` are final."""
        if self.stopped or self.ended:
            return len(self.text)
        return len(self.text) - held(self.text, self.stops)

    def _grow(self, piece: str) -> None:
        if not piece:
            return
        seen = len(self.text)
        self.text += piece
        at = cut(self.text, self.stops, max(0, seen - self.longest + 1))  # only where a stop string may now end
        if at is not None:
            self.text, self.stopped = self.text[:at], True


__all__ = ["MAX_STOPS", "MAX_STOP_CHARS", "Detokenizer", "TextStream", "check_stops", "cut", "held"]
