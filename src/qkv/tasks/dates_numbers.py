"""A synthetic English → Chinese corpus of dates and numbers, for the encoder-decoder demo.

Two families of pair:

* dates, ``"the 3rd of March, 2021" -> "2021年3月3日"``: the year moves from the end to the front, so the
  model must reorder, not just substitute word by word;
* numbers written in words, ``"one thousand and five" -> "一千零五"``: English groups digits by thousands,
  Chinese by ten thousands (万), and Chinese marks a gap of missing units with a single 零.

Each family is cut into *kinds* (``KINDS``), each with its share of the training loss and an equal share of
the held-out pairs, so that what a person types first ("eleven", "twenty", "five thousand", "Mar 3, 2021") is
learnt and scored as well as what is merely numerous (there are ten thousand times more six-digit numbers than
two-digit ones). The
mapping is a deterministic function of the English side, so a small Transformer trained from scratch can
reach exact-match accuracy near 100%, and held-out pairs measure whether it learnt the rules rather than the
examples. Everything here is the Python standard library; no corpus is downloaded.

Example:
    >>> number_to_chinese(10010)
    '一万零一十'
    >>> date_to_english(2021, 3, 3, "ordinal"), date_to_chinese(2021, 3, 3)
    ('the 3rd of March, 2021', '2021年3月3日')
    >>> kind_of("eleven"), kind_of("five thousand"), kind_of("Mar 3, 2021")
    ('small', 'round', 'short_month')
"""

from __future__ import annotations

import datetime
import random
import re
from collections import Counter
from collections.abc import Iterable

Pair = tuple[str, str]
"""One ``(english, chinese)`` example."""

NUMBER_MAX = 999_999
"""Largest number the converters accept (both languages stay below a million / 一百万)."""

YEAR_MIN, YEAR_MAX = 1900, 2099
"""Years of the generated dates (the converters themselves accept any year ``datetime.date`` accepts)."""

DATE_STYLES: tuple[str, ...] = ("month_day_year", "day_month_year", "short_month", "ordinal", "month_ordinal")
"""English date styles: ``"March 3, 2021"``, ``"3 March 2021"``, ``"Mar 3, 2021"``,
``"the 3rd of March, 2021"``, ``"March 3rd, 2021"``. There is no ISO style on purpose: ``"2021-03-03"``
becomes ``"2021年3月3日"`` by dropping zeros, with nothing to read and nothing to reorder."""

NUMBER_KINDS: tuple[str, ...] = ("small", "hundreds", "thousands", "large", "round")
"""The kinds of number, which split 0–999,999 between them (each number has exactly one kind):

* ``"small"``: 0–99, ``"eleven"``, ``"twenty-one"``; what a person types first, and 0.01% of all numbers;
* ``"hundreds"``: 100–999 that are not round, ``"four hundred and twelve"``;
* ``"thousands"``: 1,000–9,999 that are not round, ``"one thousand and five"``;
* ``"large"``: 10,000–999,999 that are not round, ``"forty-five thousand and six"``: the 万 regrouping;
* ``"round"``: 100 or more with one or two significant digits, ``"three hundred"``, ``"five thousand"``,
  ``"one thousand five hundred"``, ``"twelve thousand"``, ``"six hundred thousand"``: the trailing zeros that
  Chinese leaves unwritten (十二万, 一千五百). The round tens (20, 30, ...) are small numbers.
"""

KINDS: tuple[str, ...] = (*NUMBER_KINDS, *DATE_STYLES)
"""Every kind of pair: the ``NUMBER_KINDS``, then one kind per date style of ``DATE_STYLES`` (a day of
1900–2099 written in that style). ``"May 3, 2021"`` is written alike in the ``"month_day_year"`` and
``"short_month"`` styles; it belongs to the first, so ``"short_month"`` dates are the ones not in May."""

KIND_WEIGHTS: dict[str, float] = {"small": 3, "hundreds": 1.5, "thousands": 1.5, "large": 2, "round": 2,
                                  **dict.fromkeys(DATE_STYLES, 1)}  # fmt: skip
"""Relative share of each kind among training pairs (of 30,000: 6,000 small, 4,000 round, 4,000 large, 3,000
hundreds, 3,000 thousands, 2,000 per date style), chosen by training the demo's model for 600 to 900 steps:

* short pairs get more of them, because the loss averages over target tokens: a small number is 3.6 tokens
  (characters and ``</s>``), a date 11, so equal shares of pairs gave the small numbers 4% of the loss and left
  10 to 14 of the 100 wrong, most of them training ones (these weights: 1 wrong after 900 steps);
* large numbers (the 万 regrouping, the hardest rule) keep more than an equal share: with 2,000 pairs, 5 to 7
  of 123 held-out ones were wrong;
* dates get less: with 2,000 pairs every style was at 99–100%, except in the loss spikes that the demo's
  training has whatever the weights (a few points off some kind for a hundred steps).

The small pools (100 small numbers, 360 round ones, 810 hundreds) are oversampled: their pairs repeat in a large
training set, each kind keeping its share."""

HELD_OUT_SHARE = 0.2
"""Most of a kind's English sides a held-out set may take (``train_test_split``): 20 of the 100 small numbers,
72 of the 360 round ones, so training still sees most of the small pools; the big pools never reach it. A
held-out set also takes no one-word side (``"four"``, ``"twelve"``, ``"forty"``): each is a word that no rule
spells out from the others, and what a person types first, so training must see it alone."""

MAX_PAIRS = 200_000
"""Most pairs one call may produce. It is below the ``HELD_OUT_SHARE`` of the whole corpus (about
1.36 million distinct English sides: 359,045 dated phrases, 1,000,000 numbers), so a held-out set of any
allowed size fits in its caps, and drawing distinct sides by rejection stays cheap."""

_ONES = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
    "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen",
)  # fmt: skip
_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
_MONTHS = (
    "January", "February", "March", "April", "May", "June",
    "July", "August", "September", "October", "November", "December",
)  # fmt: skip
_CHINESE_DIGITS = "零一二三四五六七八九"
_CHINESE_UNITS = ("", "十", "百", "千")  # 10**0 .. 10**3 within one four-digit section

_MONTH_NUMBERS = {name: i for i, name in enumerate(_MONTHS, 1)} | {name[:3]: i for i, name in enumerate(_MONTHS, 1)}
_WORD_VALUES = {word: i for i, word in enumerate(_ONES)} | {word: 10 * i for i, word in enumerate(_TENS) if word}

_FIRST_DAY = datetime.date(YEAR_MIN, 1, 1).toordinal()
_LAST_DAY = datetime.date(YEAR_MAX, 12, 31).toordinal()

_NUMBER_SPANS = {"small": (0, 99), "hundreds": (100, 999), "thousands": (1_000, 9_999), "large": (10_000, NUMBER_MAX)}
"""Inclusive bounds of the number kinds other than ``"round"``, which cuts across them."""

_ROUND_NUMBERS = tuple(head * 10**zeros for zeros in range(1, 5) for head in range(10, 100))
"""The round numbers, 100 to 990,000: two leading digits (10–99) then one to four zeros; 300 is 30 · 10."""


def _check_number(n: int) -> None:
    # bool is an int subclass; True -> "one" would hide a caller's bug.
    if not isinstance(n, int) or isinstance(n, bool):
        raise TypeError(f"n must be an int, got {type(n).__name__} ({n!r})")
    if not 0 <= n <= NUMBER_MAX:
        raise ValueError(f"n must be in [0, {NUMBER_MAX}], got {n}")


def _english_below_100(n: int) -> str:
    if n < 20:
        return _ONES[n]
    tens, ones = divmod(n, 10)
    return _TENS[tens] + (f"-{_ONES[ones]}" if ones else "")


def _english_below_1000(n: int) -> str:
    hundreds, rest = divmod(n, 100)
    if not hundreds:
        return _english_below_100(rest)
    words = f"{_ONES[hundreds]} hundred"
    return f"{words} and {_english_below_100(rest)}" if rest else words


def number_to_english(n: int) -> str:
    """Write ``n`` in British English words, with "and" before the tens and units.

    ``412 -> "four hundred and twelve"``, ``1005 -> "one thousand and five"``, ``21 -> "twenty-one"``,
    ``120000 -> "one hundred and twenty thousand"``. No commas, so the only punctuation is the hyphen.

    Args:
        n: an integer in ``[0, 999_999]``.

    Returns:
        The number in lower-case words.

    Raises:
        TypeError: if ``n`` is not an ``int``.
        ValueError: if ``n`` is outside ``[0, 999_999]``.
    """
    _check_number(n)
    if n == 0:
        return "zero"
    thousands, rest = divmod(n, 1000)
    parts = []
    if thousands:
        parts.append(f"{_english_below_1000(thousands)} thousand")
        # British usage: "and" joins a thousand to a remainder with no hundreds ("one thousand and five").
        if 0 < rest < 100:
            parts.append("and")
    if rest:
        parts.append(_english_below_1000(rest))
    return " ".join(parts)


def _chinese_section(n: int, *, leading: bool) -> str:
    """Write ``1 <= n <= 9999`` with 千百十; ``leading`` says nothing precedes it in the whole number."""
    out: list[str] = []
    gap = False  # a zero digit seen after the first non-zero one; becomes one 零 if a non-zero digit follows
    for power in (3, 2, 1, 0):
        digit = n // 10**power % 10
        if digit == 0:
            gap = gap or bool(out)
            continue
        if gap:
            out.append("零")
            gap = False
        # 十二 at the start of a number, but 一百一十二 / 一万零一十 inside one.
        if not (leading and not out and power == 1 and digit == 1):
            out.append(_CHINESE_DIGITS[digit])
        out.append(_CHINESE_UNITS[power])
    return "".join(out)


def number_to_chinese(n: int) -> str:
    """Write ``n`` in Chinese numerals.

    Digits are grouped by four around 万. Inside the number a run of missing units is written as one 零 and
    trailing zeros are not written (``1005 -> "一千零五"``, ``10500 -> "一万零五百"``, ``1200 -> "一千二百"``).
    A leading ten drops its 一 (``12 -> "十二"``, ``120000 -> "十二万"``), an inner one keeps it
    (``110 -> "一百一十"``, ``10010 -> "一万零一十"``). Two is always 二, never 两, so each number has one
    spelling.

    Args:
        n: an integer in ``[0, 999_999]``.

    Returns:
        The number in Chinese numerals.

    Raises:
        TypeError: if ``n`` is not an ``int``.
        ValueError: if ``n`` is outside ``[0, 999_999]``.
    """
    _check_number(n)
    if n == 0:
        return "零"
    high, low = divmod(n, 10_000)
    if not high:
        return _chinese_section(n, leading=True)
    text = _chinese_section(high, leading=True) + "万"
    if low:
        # The low section lacks its 千 digit, so the gap across 万 needs its 零 (一万零五百, 十万零五).
        text += ("零" if low < 1000 else "") + _chinese_section(low, leading=False)
    return text


def _check_date(year: int, month: int, day: int) -> datetime.date:
    try:
        return datetime.date(year, month, day)
    except ValueError as err:
        raise ValueError(f"invalid date year={year}, month={month}, day={day}: {err}") from None


def _ordinal(day: int) -> str:
    # 11th-13th are the exceptions to 1st/2nd/3rd.
    suffix = "th" if 11 <= day % 100 <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(day % 10, "th")
    return f"{day}{suffix}"


def date_to_english(year: int, month: int, day: int, style: str = "month_day_year") -> str:
    """Write a date in English, the year in digits and the month as a word.

    Args:
        year: the year, as ``datetime.date`` accepts it.
        month: 1 to 12.
        day: a valid day of that month (29 February only in leap years).
        style: one of ``DATE_STYLES``:

            * ``"month_day_year"``: ``"March 3, 2021"``
            * ``"day_month_year"``: ``"3 March 2021"``
            * ``"short_month"``: ``"Mar 3, 2021"``
            * ``"ordinal"``: ``"the 3rd of March, 2021"``
            * ``"month_ordinal"``: ``"March 3rd, 2021"``

    Returns:
        The date in the chosen style.

    Raises:
        ValueError: if the date does not exist or ``style`` is unknown.
    """
    _check_date(year, month, day)
    name = _MONTHS[month - 1]
    if style == "month_day_year":
        return f"{name} {day}, {year}"
    if style == "day_month_year":
        return f"{day} {name} {year}"
    if style == "short_month":
        return f"{name[:3]} {day}, {year}"  # the first three letters abbreviate every month (Sep, not Sept)
    if style == "ordinal":
        return f"the {_ordinal(day)} of {name}, {year}"
    if style == "month_ordinal":
        return f"{name} {_ordinal(day)}, {year}"
    raise ValueError(f"style must be one of {DATE_STYLES}, got {style!r}")


def date_to_chinese(year: int, month: int, day: int) -> str:
    """Write a date the Chinese way: year first, Arabic digits, no leading zeros (``"2021年3月3日"``).

    Args:
        year: the year, as ``datetime.date`` accepts it.
        month: 1 to 12.
        day: a valid day of that month.

    Returns:
        ``f"{year}年{month}月{day}日"``.

    Raises:
        ValueError: if the date does not exist.
    """
    _check_date(year, month, day)
    return f"{year}年{month}月{day}日"


def _is_round(n: int) -> bool:
    """At least 100, with one or two significant digits (``"round"``; the round tens are small numbers)."""
    if n < 100:
        return False
    while n % 10 == 0:
        n //= 10
    return n < 100


def _number_kind(n: int) -> str:
    if n < 100:
        return "small"
    if _is_round(n):
        return "round"
    return next(kind for kind, (low, high) in _NUMBER_SPANS.items() if low <= n <= high)


def _english_to_number(text: str) -> int | None:
    """The number that :func:`number_to_english` writes as ``text``, or None if it writes none that way."""
    total = group = 0
    for word in text.replace("-", " ").split():
        if word == "hundred":
            group *= 100
        elif word == "thousand":
            total, group = total + group * 1000, 0
        elif word in _WORD_VALUES:
            group += _WORD_VALUES[word]
        elif word != "and":
            return None
    n = total + group
    # The sum accepts spellings the converter never writes ("two and two"); only its own one is a corpus side.
    return n if n <= NUMBER_MAX and number_to_english(n) == text else None


def _date_style(text: str) -> str | None:
    """The first style of ``DATE_STYLES`` that writes ``text`` as a day of the corpus's years, or None."""
    months = [_MONTH_NUMBERS[word] for word in re.findall(r"[A-Z][a-z]+", text) if word in _MONTH_NUMBERS]
    numbers = re.findall(r"\d+", text)  # every style writes the day before the year
    if len(months) != 1 or len(numbers) != 2:
        return None
    (month,), (day, year) = months, map(int, numbers)
    try:
        date = datetime.date(year, month, day)
    except ValueError:
        return None
    if not YEAR_MIN <= date.year <= YEAR_MAX:
        return None
    return next((style for style in DATE_STYLES if date_to_english(year, month, day, style) == text), None)


def kind_of(english: str) -> str:
    """The kind (one of ``KINDS``) of an English side of the corpus.

    ``"eleven" -> "small"``, ``"five thousand" -> "round"``, ``"Mar 3, 2021" -> "short_month"``,
    ``"May 3, 2021" -> "month_day_year"`` (the first style that writes it).

    Args:
        english: a number as :func:`number_to_english` writes it, or a day of ``YEAR_MIN``–``YEAR_MAX`` as
            :func:`date_to_english` writes it.

    Returns:
        The kind's name.

    Raises:
        ValueError: if ``english`` is no English side this corpus can produce.
    """
    style = _date_style(english)
    if style is not None:
        return style
    n = _english_to_number(english)
    if n is None:
        raise ValueError(f"{english!r} is no number or date ({YEAR_MIN}–{YEAR_MAX}) as this corpus writes them")
    return _number_kind(n)


def to_chinese(english: str) -> str:
    """The Chinese side of an English side of the corpus: ``"Mar 3, 2021" -> "2021年3月3日"``,
    ``"five thousand" -> "五千"``; the reference a translation is checked against.

    Raises:
        ValueError: if ``english`` is no English side this corpus can produce (see :func:`kind_of`).
    """
    if kind_of(english) in DATE_STYLES:  # kind_of has checked it: one month name, then the day and the year
        month = next(_MONTH_NUMBERS[word] for word in re.findall(r"[A-Z][a-z]+", english) if word in _MONTH_NUMBERS)
        day, year = map(int, re.findall(r"\d+", english))
        return date_to_chinese(year, month, day)
    return number_to_chinese(_english_to_number(english))


def _kind_size(kind: str) -> int:
    if kind == "round":
        return len(_ROUND_NUMBERS)
    if kind in _NUMBER_SPANS:
        low, high = _NUMBER_SPANS[kind]
        return high - low + 1 - sum(low <= n <= high for n in _ROUND_NUMBERS)
    days = _LAST_DAY - _FIRST_DAY + 1
    mays = 31 * (YEAR_MAX - YEAR_MIN + 1)
    return days - mays if kind == "short_month" else days


KIND_SIZES: dict[str, int] = {kind: _kind_size(kind) for kind in KINDS}
"""How many distinct English sides each kind has: 100 small numbers, 360 round ones, 810 hundreds, 8,910
thousands, 989,820 large; 73,049 days per date style (66,849 for ``"short_month"``, which leaves May out)."""


def _sample(kind: str, rng: random.Random) -> Pair:
    """One pair of ``kind``, uniform over its English sides."""
    if kind in DATE_STYLES:
        date = datetime.date.fromordinal(rng.randint(_FIRST_DAY, _LAST_DAY))
        while kind == "short_month" and date.month == 5:  # "May 3, 2021" belongs to "month_day_year"
            date = datetime.date.fromordinal(rng.randint(_FIRST_DAY, _LAST_DAY))
        return date_to_english(date.year, date.month, date.day, kind), date_to_chinese(date.year, date.month, date.day)
    if kind == "round":
        n = rng.choice(_ROUND_NUMBERS)
    else:
        low, high = _NUMBER_SPANS[kind]
        n = rng.randint(low, high)
        while _is_round(n):  # round numbers are a kind of their own
            n = rng.randint(low, high)
    return number_to_english(n), number_to_chinese(n)


def _quotas(n: int, rng: random.Random, weights: dict[str, float], caps: dict[str, int] | None = None
            ) -> dict[str, int]:
    """Split ``n`` pairs over ``KINDS`` in proportion to ``weights``, rounded down, the rest one each to kinds
    chosen at random.

    A kind capped below its share gives what it cannot take to the others, split the same way again.
    ``MAX_PAIRS`` is below the sum of the held-out caps, so the quotas always add up to ``n``.
    """
    quotas = dict.fromkeys(KINDS, 0)
    room = caps if caps is not None else dict.fromkeys(KINDS, n)
    left = n
    while left:
        open_kinds = [kind for kind in KINDS if quotas[kind] < room[kind]]
        total = sum(weights[kind] for kind in open_kinds)
        shares = {kind: int(left * weights[kind] / total) for kind in open_kinds}
        lucky = set(rng.sample(open_kinds, left - sum(shares.values())))
        for kind in open_kinds:
            take = min(shares[kind] + (kind in lucky), room[kind] - quotas[kind])
            quotas[kind] += take
            left -= take
    return quotas


def _kind_order(quotas: dict[str, int], rng: random.Random) -> list[str]:
    """The kinds of the pairs to draw, in random order, so every prefix of a set (the demo's validation slice of
    the held-out pairs) holds each kind in about its share."""
    kinds = [kind for kind, count in quotas.items() for _ in range(count)]
    rng.shuffle(kinds)
    return kinds


def _draw_held_out(kinds: list[str], rng: random.Random) -> list[Pair]:
    """One pair per entry of ``kinds``, no English side twice and none of one word (the caps keep rejection
    cheap: 20 small numbers of the 72 written with two words)."""
    taken: set[str] = set()
    pairs: list[Pair] = []
    for kind in kinds:
        pair = _sample(kind, rng)
        while pair[0] in taken or not re.search("[ -]", pair[0]):
            pair = _sample(kind, rng)
        taken.add(pair[0])
        pairs.append(pair)
    return pairs


def _draw_dealt(kinds: list[str], rng: random.Random, exclude: frozenset[str]) -> list[Pair]:
    """One pair per entry of ``kinds``, none in ``exclude``; each kind deals its English sides like a deck.

    A kind repeats a side only once it has dealt every side it has outside ``exclude``, then deals them all
    again: the small pools are oversampled evenly (each small number about as often as any other), and the
    big pools, which no set exhausts, never repeat.
    """
    excluded = Counter(kind for kind in map(_kind_or_none, exclude) if kind is not None)
    left = {kind: KIND_SIZES[kind] - excluded[kind] for kind in KINDS}
    for kind in set(kinds):
        if not left[kind]:
            raise ValueError(f"exclude holds every English side of kind {kind!r}; none is left to draw")
    dealt: dict[str, set[str]] = {kind: set() for kind in KINDS}
    pairs: list[Pair] = []
    for kind in kinds:
        if len(dealt[kind]) == left[kind]:
            dealt[kind].clear()  # the deck is spent: a new pass over the same sides
        pair = _sample(kind, rng)
        while pair[0] in exclude or pair[0] in dealt[kind]:
            pair = _sample(kind, rng)
        dealt[kind].add(pair[0])
        pairs.append(pair)
    return pairs


def _kind_or_none(english: str) -> str | None:
    try:
        return kind_of(english)
    except ValueError:
        return None  # an excluded string the corpus never produces excludes nothing


def _check_count(name: str, value: int) -> None:
    if not 0 <= value <= MAX_PAIRS:
        raise ValueError(f"{name} must be in [0, {MAX_PAIRS}], got {value}")


def generate_pairs(n: int, *, seed: int = 0, exclude: Iterable[str] | None = None) -> list[Pair]:
    """Generate ``n`` English → Chinese training pairs, the kinds of ``KINDS`` in the shares of ``KIND_WEIGHTS``.

    The kinds come in shuffled order, each kind's count within one pair of its share (the remainder goes to
    kinds chosen at random). Within a kind the pair is uniform over its English sides: dates over the days of
    1900–2099 (so 29 February appears in leap years only), numbers over the kind's span. A kind repeats an
    English side only after it has produced every one it has: the small pools (``"small"``, ``"round"``,
    ``"hundreds"``) are oversampled evenly so that each keeps its share of a large set, while the big pools
    never repeat within ``MAX_PAIRS``.

    Args:
        n: how many pairs, in ``[0, MAX_PAIRS]``.
        seed: the same seed gives the same list, in the same order.
        exclude: English sides never to produce, e.g. a held-out test split. The caller's collection is
            not modified; strings that are no side of this corpus are ignored.

    Returns:
        ``n`` ``(english, chinese)`` pairs.

    Raises:
        ValueError: if ``n`` is outside ``[0, MAX_PAIRS]``, or ``exclude`` holds every side of a kind.
    """
    _check_count("n", n)
    rng = random.Random(seed)
    return _draw_dealt(_kind_order(_quotas(n, rng, KIND_WEIGHTS), rng), rng, frozenset(exclude or ()))


def train_test_split(n_train: int, n_test: int, *, seed: int = 0) -> tuple[list[Pair], list[Pair]]:
    """Generate a training set and a held-out test set that share no English side.

    The test set has distinct English sides, every kind of ``KINDS`` in an equal share (so each kind's score
    rests on as many pairs as any other's), except that it takes at most ``HELD_OUT_SHARE`` of any kind's
    sides (20 small numbers, 72 round ones) so that training still sees most of a small pool, and no one-word
    side (``"four"``, ``"twelve"``), which training must see alone; what a capped kind cannot take goes to the
    other kinds in equal shares. Its order is shuffled, so any prefix of it (a validation slice) holds every
    kind in about its share. The training set is drawn as by :func:`generate_pairs` (shares of
    ``KIND_WEIGHTS``), excluding the test set: it repeats the pairs of the small pools, never a test pair.

    The test set is drawn first, so it stays the same when only ``n_train`` changes; the training set
    continues the same random stream.

    Args:
        n_train: size of the training set.
        n_test: size of the test set.
        seed: the same seed gives the same split.

    Returns:
        ``(train, test)`` lists of ``(english, chinese)`` pairs.

    Raises:
        ValueError: if a size is negative or ``n_train + n_test`` exceeds ``MAX_PAIRS``.
    """
    _check_count("n_train", n_train)
    _check_count("n_test", n_test)
    _check_count("n_train + n_test", n_train + n_test)
    rng = random.Random(seed)
    caps = {kind: int(HELD_OUT_SHARE * KIND_SIZES[kind]) for kind in KINDS}
    test = _draw_held_out(_kind_order(_quotas(n_test, rng, dict.fromkeys(KINDS, 1), caps), rng), rng)
    train_kinds = _kind_order(_quotas(n_train, rng, KIND_WEIGHTS), rng)
    train = _draw_dealt(train_kinds, rng, frozenset(english for english, _ in test))
    return train, test
