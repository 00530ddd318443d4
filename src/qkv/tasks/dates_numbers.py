"""A synthetic English → Chinese corpus of dates and numbers, for the encoder-decoder demo.

Two kinds of pair, in roughly equal shares:

* dates, ``"the 3rd of March, 2021" -> "2021年3月3日"``: the year moves from the end to the front, so the
  model must reorder, not just substitute word by word;
* numbers written in words, ``"one thousand and five" -> "一千零五"``: English groups digits by thousands,
  Chinese by ten thousands (万), and Chinese marks a gap of missing units with a single 零.

The mapping is a deterministic function of the English side, so a small Transformer trained from scratch
can reach exact-match accuracy near 100%, and held-out pairs measure whether it learnt the rules rather than
the examples. Everything here is the Python standard library; no corpus is downloaded.

Example:
    >>> number_to_chinese(10010)
    '一万零一十'
    >>> date_to_english(2021, 3, 3, "ordinal"), date_to_chinese(2021, 3, 3)
    ('the 3rd of March, 2021', '2021年3月3日')
"""

from __future__ import annotations

import datetime
import random
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

DATE_FRACTION = 0.5
"""Share of dates among generated pairs; the rest are numbers."""

SMALL_NUMBER_LIMIT = 10_000
"""Numbers below this are the common case: one Chinese section, no 万."""

LARGE_NUMBER_FRACTION = 0.1
"""Share of numbers drawn from ``SMALL_NUMBER_LIMIT..NUMBER_MAX``. Kept small because regrouping thousands
into 万 (``"forty-five thousand" -> "四万五千"``) is the hardest rule in the corpus and a tiny model on a
CPU budget sees few such examples; a tenth of the numbers is enough to show it without dominating the score."""

MAX_PAIRS = 200_000
"""Most pairs one call may produce. The pool holds about 1.37 million distinct English sides (365,245 dated
phrases, 1,000,000 numbers); staying well below it keeps rejection of duplicates cheap."""

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

_FIRST_DAY = datetime.date(YEAR_MIN, 1, 1).toordinal()
_LAST_DAY = datetime.date(YEAR_MAX, 12, 31).toordinal()


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


def _draw(n: int, rng: random.Random, taken: set[str]) -> list[Pair]:
    """Draw ``n`` pairs whose English sides are not in ``taken``, adding each new one to ``taken``."""
    # Small numbers are a pool of 10,000 that a large corpus nearly exhausts, where rejection sampling would
    # stall; dealing from a shuffled deck never repeats. Dates and large numbers are pools of hundreds of
    # thousands, where rejecting the rare repeat is cheaper than building a deck.
    small = list(range(SMALL_NUMBER_LIMIT))
    rng.shuffle(small)
    large_share = (1 - DATE_FRACTION) * LARGE_NUMBER_FRACTION
    pairs: list[Pair] = []
    while len(pairs) < n:
        u = rng.random()
        if u < DATE_FRACTION:
            date = datetime.date.fromordinal(rng.randint(_FIRST_DAY, _LAST_DAY))  # uniform over real days
            style = rng.choice(DATE_STYLES)
            pair = (
                date_to_english(date.year, date.month, date.day, style),
                date_to_chinese(date.year, date.month, date.day),
            )
        else:
            if u < DATE_FRACTION + large_share or not small:
                number = rng.randint(SMALL_NUMBER_LIMIT, NUMBER_MAX)
            else:
                number = small.pop()
            pair = (number_to_english(number), number_to_chinese(number))
        if pair[0] not in taken:
            taken.add(pair[0])
            pairs.append(pair)
    return pairs


def _check_count(name: str, value: int) -> None:
    if not 0 <= value <= MAX_PAIRS:
        raise ValueError(f"{name} must be in [0, {MAX_PAIRS}], got {value}")


def generate_pairs(n: int, *, seed: int = 0, exclude: Iterable[str] | None = None) -> list[Pair]:
    """Generate ``n`` distinct English → Chinese pairs, about half dates and half numbers.

    Dates are uniform over the days of 1900–2099 (so 29 February appears in leap years only), each in a
    random style of ``DATE_STYLES``. Numbers are uniform over 0–9999, except ``LARGE_NUMBER_FRACTION`` of
    them drawn from 10,000–999,999.

    Args:
        n: how many pairs, in ``[0, MAX_PAIRS]``.
        seed: the same seed gives the same list, in the same order.
        exclude: English sides never to produce, e.g. a held-out test split. The caller's collection is
            not modified.

    Returns:
        ``n`` ``(english, chinese)`` pairs, no two with the same English side.

    Raises:
        ValueError: if ``n`` is outside ``[0, MAX_PAIRS]``.
    """
    _check_count("n", n)
    return _draw(n, random.Random(seed), set(exclude) if exclude is not None else set())


def train_test_split(n_train: int, n_test: int, *, seed: int = 0) -> tuple[list[Pair], list[Pair]]:
    """Generate a training and a test set that share no English side.

    The test set is drawn first, so it equals ``generate_pairs(n_test, seed=seed)`` and stays the same when
    only ``n_train`` changes; the training set continues the same random stream, excluding the test set.

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
    taken: set[str] = set()
    test = _draw(n_test, rng, taken)
    train = _draw(n_train, rng, taken)
    return train, test
