"""The date/number corpus: hand-picked spellings, round trips through independent parsers, and the
properties a train/test split relies on (determinism, distinct English sides, exclusion, valid dates)."""

import datetime
import re

import pytest

from qkv.tasks.dates_numbers import (
    DATE_STYLES,
    MAX_PAIRS,
    date_to_chinese,
    date_to_english,
    generate_pairs,
    number_to_chinese,
    number_to_english,
    train_test_split,
)

ENGLISH_CASES = {
    0: "zero",
    1: "one",
    10: "ten",
    11: "eleven",
    19: "nineteen",
    20: "twenty",
    21: "twenty-one",
    99: "ninety-nine",
    100: "one hundred",
    101: "one hundred and one",
    110: "one hundred and ten",
    200: "two hundred",
    412: "four hundred and twelve",
    999: "nine hundred and ninety-nine",
    1000: "one thousand",
    1001: "one thousand and one",
    1005: "one thousand and five",
    1010: "one thousand and ten",
    1100: "one thousand one hundred",
    1234: "one thousand two hundred and thirty-four",
    9999: "nine thousand nine hundred and ninety-nine",
    10000: "ten thousand",
    10500: "ten thousand five hundred",
    21000: "twenty-one thousand",
    100005: "one hundred thousand and five",
    120000: "one hundred and twenty thousand",
    999999: "nine hundred and ninety-nine thousand nine hundred and ninety-nine",
}

CHINESE_CASES = {
    0: "零",
    1: "一",
    2: "二",
    10: "十",
    11: "十一",
    12: "十二",
    19: "十九",
    20: "二十",
    99: "九十九",
    100: "一百",
    101: "一百零一",
    110: "一百一十",
    112: "一百一十二",
    200: "二百",
    999: "九百九十九",
    1000: "一千",
    1001: "一千零一",
    1005: "一千零五",
    1010: "一千零一十",
    1100: "一千一百",
    1200: "一千二百",
    2002: "二千零二",
    9999: "九千九百九十九",
    10000: "一万",
    10001: "一万零一",
    10010: "一万零一十",
    10500: "一万零五百",
    11000: "一万一千",
    20000: "二万",
    100000: "十万",
    100005: "十万零五",
    100100: "十万零一百",
    101000: "十万一千",
    110000: "十一万",
    110010: "十一万零一十",
    120000: "十二万",
    200000: "二十万",
    999999: "九十九万九千九百九十九",
}

_DIGITS = {ch: i for i, ch in enumerate("零一二三四五六七八九")}
_UNITS = {"十": 10, "百": 100, "千": 1000}
_ONES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
         "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen")  # fmt: skip
_TENS = ("twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
_WORDS = {word: i for i, word in enumerate(_ONES)} | {word: 10 * i for i, word in enumerate(_TENS, 2)}


def parse_chinese(text: str) -> int:
    """Sum of digit * unit per section, the part before 万 times 10,000; a bare unit counts once (十 = 10)."""

    def section(s: str) -> int:
        total, digit = 0, None
        for ch in s:
            if ch in _DIGITS:
                digit = _DIGITS[ch]
            else:
                total += (1 if digit is None else digit) * _UNITS[ch]
                digit = None
        return total + (digit or 0)

    high, _, low = text.rpartition("万")
    return section(high) * 10_000 + section(low) if "万" in text else section(text)


def parse_english(text: str) -> int:
    """Words add up; "hundred" multiplies the current group, "thousand" closes it; "and" is ignored."""
    total = group = 0
    for word in text.replace("-", " ").split():
        if word == "and":
            continue
        if word == "hundred":
            group *= 100
        elif word == "thousand":
            total, group = total + group * 1000, 0
        else:
            group += _WORDS[word]
    return total + group


@pytest.mark.parametrize(("n", "expected"), ENGLISH_CASES.items())
def test_number_to_english_known_cases(n, expected):
    assert number_to_english(n) == expected


@pytest.mark.parametrize(("n", "expected"), CHINESE_CASES.items())
def test_number_to_chinese_known_cases(n, expected):
    assert number_to_chinese(n) == expected


def test_numbers_round_trip_through_independent_parsers():
    for n in range(0, 1_000_000, 7):
        chinese = number_to_chinese(n)
        assert parse_chinese(chinese) == n, (n, chinese)
        # The zero rules: never two 零 in a row, none at the end, 一十 never first, 二 not 两.
        assert "零零" not in chinese and "两" not in chinese, (n, chinese)
        assert n == 0 or not chinese.endswith("零"), (n, chinese)
        assert not chinese.startswith("一十"), (n, chinese)
        english = number_to_english(n)
        assert parse_english(english) == n, (n, english)


@pytest.mark.parametrize("convert", [number_to_english, number_to_chinese])
@pytest.mark.parametrize("n", [-1, 1_000_000, 10**9])
def test_numbers_out_of_range_raise(convert, n):
    with pytest.raises(ValueError, match=str(n)):
        convert(n)


@pytest.mark.parametrize("convert", [number_to_english, number_to_chinese])
@pytest.mark.parametrize("n", [1.0, "1", True])
def test_numbers_reject_non_int(convert, n):
    with pytest.raises(TypeError):
        convert(n)


@pytest.mark.parametrize(
    ("style", "expected"),
    [
        ("month_day_year", "March 3, 2021"),
        ("day_month_year", "3 March 2021"),
        ("short_month", "Mar 3, 2021"),
        ("ordinal", "the 3rd of March, 2021"),
        ("month_ordinal", "March 3rd, 2021"),
    ],
)
def test_date_styles(style, expected):
    assert date_to_english(2021, 3, 3, style) == expected
    assert date_to_chinese(2021, 3, 3) == "2021年3月3日"


def test_every_style_is_tested_and_september_abbreviates_to_sep():
    assert set(DATE_STYLES) == {"month_day_year", "day_month_year", "short_month", "ordinal", "month_ordinal"}
    assert date_to_english(1999, 9, 30, "short_month") == "Sep 30, 1999"
    assert date_to_chinese(1999, 12, 31) == "1999年12月31日"


@pytest.mark.parametrize(
    ("day", "suffix"),
    [(1, "st"), (2, "nd"), (3, "rd"), (4, "th"), (11, "th"), (12, "th"), (13, "th"), (21, "st"), (22, "nd"),
     (23, "rd"), (30, "th"), (31, "st")],
)  # fmt: skip
def test_ordinal_suffixes(day, suffix):
    assert date_to_english(2020, 1, day, "ordinal") == f"the {day}{suffix} of January, 2020"


@pytest.mark.parametrize(("year", "month", "day"), [(2021, 2, 29), (1900, 2, 29), (2021, 13, 1), (2021, 4, 31),
                                                    (2021, 1, 0)])  # fmt: skip
def test_invalid_dates_raise(year, month, day):
    with pytest.raises(ValueError, match="invalid date"):
        date_to_english(year, month, day, "ordinal")
    with pytest.raises(ValueError, match="invalid date"):
        date_to_chinese(year, month, day)


def test_leap_days_are_accepted_in_leap_years():
    assert date_to_english(2000, 2, 29) == "February 29, 2000"
    assert date_to_chinese(2024, 2, 29) == "2024年2月29日"


def test_unknown_style_raises():
    with pytest.raises(ValueError, match="iso"):
        date_to_english(2021, 3, 3, "iso")


_CHINESE_DATE = re.compile(r"(\d{4})年(\d{1,2})月(\d{1,2})日")


def test_generated_pairs_are_consistent_valid_and_mixed():
    pairs = generate_pairs(20_000, seed=3)
    assert len(pairs) == 20_000
    assert len({english for english, _ in pairs}) == len(pairs)
    dates = large = leap_days = 0
    for english, chinese in pairs:
        match = _CHINESE_DATE.fullmatch(chinese)
        if match:
            year, month, day = map(int, match.groups())
            date = datetime.date(year, month, day)  # raises if the generator made an invalid date
            assert 1900 <= year <= 2099
            assert english in {date_to_english(year, month, day, style) for style in DATE_STYLES}
            dates += 1
            leap_days += (month, day) == (2, 29)
            assert (month, day) != (2, 29) or date.year % 4 == 0  # 1900 and 2100 are outside the range
        else:
            n = parse_english(english)
            assert (english, chinese) == (number_to_english(n), number_to_chinese(n))
            large += n >= 10_000
    assert 0.45 < dates / len(pairs) < 0.55
    assert 0 < large < 0.2 * (len(pairs) - dates)
    assert leap_days > 0  # the check above saw some 29 Februaries


def test_generate_pairs_is_deterministic():
    assert generate_pairs(500, seed=7) == generate_pairs(500, seed=7)
    assert generate_pairs(500, seed=7) != generate_pairs(500, seed=8)
    assert generate_pairs(0) == []


def test_generate_pairs_exhausts_small_numbers_without_repeating():
    pairs = generate_pairs(30_000, seed=1)  # more numbers than the 10,000 below 10,000
    assert len({english for english, _ in pairs}) == 30_000


def test_generate_pairs_respects_exclude():
    held_out = {english for english, _ in generate_pairs(2_000, seed=0)}
    frozen = set(held_out)
    pairs = generate_pairs(5_000, seed=0, exclude=held_out)
    assert len(pairs) == 5_000
    assert not held_out & {english for english, _ in pairs}
    assert held_out == frozen  # the caller's set is left alone


def test_train_test_split_is_disjoint_and_deterministic():
    train, test = train_test_split(5_000, 1_000, seed=2)
    assert (len(train), len(test)) == (5_000, 1_000)
    train_english = {english for english, _ in train}
    test_english = {english for english, _ in test}
    assert len(train_english) == 5_000 and len(test_english) == 1_000
    assert not train_english & test_english
    assert train_test_split(5_000, 1_000, seed=2) == (train, test)
    assert test == generate_pairs(1_000, seed=2)  # the test split does not depend on n_train
    assert train_test_split(100, 1_000, seed=2)[1] == test


@pytest.mark.parametrize("n", [-1, MAX_PAIRS + 1])
def test_generate_pairs_rejects_bad_sizes(n):
    with pytest.raises(ValueError, match=str(n)):
        generate_pairs(n)
    with pytest.raises(ValueError):
        train_test_split(n, 10)
    with pytest.raises(ValueError):
        train_test_split(10, n)


def test_train_test_split_rejects_a_total_over_the_limit():
    with pytest.raises(ValueError, match="n_train \\+ n_test"):
        train_test_split(MAX_PAIRS, 1)
