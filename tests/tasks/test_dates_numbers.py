"""The date/number corpus: hand-picked spellings, round trips through independent parsers, the kinds of pair
(told apart here by rules of the test's own), and the properties a train/test split relies on (determinism,
every kind in its share, held-out English sides never trained on, small pools not used up by the test set,
valid dates)."""

import datetime
import re
from collections import Counter

import pytest

from qkv.tasks.dates_numbers import (
    DATE_STYLES,
    HELD_OUT_SHARE,
    KIND_SIZES,
    KIND_WEIGHTS,
    KINDS,
    MAX_PAIRS,
    date_to_chinese,
    date_to_english,
    generate_pairs,
    kind_of,
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


def number_kind(n: int) -> str:
    """The kinds as NUMBER_KINDS defines them: 0-99, then round (one or two significant digits), then by size."""
    if n < 100:
        return "small"
    if len(str(n).rstrip("0")) <= 2:
        return "round"
    return "hundreds" if n < 1_000 else "thousands" if n < 10_000 else "large"


def date_kind(english: str) -> str:
    """The date style read off the English words; "May 3, 2021" counts as the full month name it is."""
    if english.startswith("the "):
        return "ordinal"
    if english[0].isdigit():
        return "day_month_year"
    if re.fullmatch(r"[A-Z][a-z]+ \d+(st|nd|rd|th), \d{4}", english):
        return "month_ordinal"
    return "short_month" if re.match(r"[A-Z][a-z]{2} ", english) and not english.startswith("May") else "month_day_year"


def check_pair(english: str, chinese: str) -> str:
    """Assert that a generated pair is a correct translation of a valid date or number; return its kind."""
    match = _CHINESE_DATE.fullmatch(chinese)
    if match:
        year, month, day = map(int, match.groups())
        datetime.date(year, month, day)  # raises if the generator made an invalid date
        assert 1900 <= year <= 2099
        assert english == date_to_english(year, month, day, date_kind(english))
        return date_kind(english)
    n = parse_english(english)
    assert (english, chinese) == (number_to_english(n), number_to_chinese(n))
    return number_kind(n)


@pytest.mark.parametrize(
    ("english", "kind"),
    [("zero", "small"), ("eleven", "small"), ("twenty", "small"), ("ninety-nine", "small"), ("one hundred", "round"),
     ("one hundred and ten", "round"), ("one hundred and eleven", "hundreds"), ("five thousand", "round"),
     ("one thousand five hundred", "round"), ("one thousand and five", "thousands"), ("twelve thousand", "round"),
     ("six hundred thousand", "round"), ("twelve thousand and one", "large"),
     ("nine hundred and ninety-nine thousand nine hundred and ninety-nine", "large"),
     ("March 3, 2021", "month_day_year"), ("May 3, 2021", "month_day_year"), ("3 March 2021", "day_month_year"),
     ("Mar 3, 2021", "short_month"), ("Sep 30, 1999", "short_month"), ("the 3rd of May, 2021", "ordinal"),
     ("March 3rd, 2021", "month_ordinal")],
)  # fmt: skip
def test_kind_of_known_cases(english, kind):
    assert kind_of(english) == kind
    assert kind in KINDS


@pytest.mark.parametrize(
    "english",
    ["", "hello", "eleven ", "Eleven", "two and two", "one thousand thousand", "March 3, 1776", "February 29, 2021",
     "Sept 30, 1999", "3rd March 2021", "2021-03-03"],
)  # fmt: skip
def test_kind_of_rejects_what_the_corpus_never_writes(english):
    with pytest.raises(ValueError, match="no number or date"):
        kind_of(english)


def test_kind_of_agrees_with_the_tests_rules_on_numbers():
    round_numbers = [n for n in range(100, 1_000_000, 10) if number_kind(n) == "round"]
    for n in [*range(0, 1_000_000, 31), *range(100), *round_numbers]:
        assert kind_of(number_to_english(n)) == number_kind(n), n


def test_kind_sizes_count_the_distinct_english_sides():
    numbers = Counter(number_kind(n) for n in range(1_000_000))
    days = (datetime.date(2099, 12, 31) - datetime.date(1900, 1, 1)).days + 1
    mays = 31 * 200
    expected = {**numbers, **dict.fromkeys(DATE_STYLES, days), "short_month": days - mays}
    assert expected == KIND_SIZES
    assert (KIND_SIZES["small"], KIND_SIZES["round"]) == (100, 360)
    # A held-out set of any allowed size fits below the caps, so train_test_split never runs out of kinds.
    assert sum(int(HELD_OUT_SHARE * size) for size in KIND_SIZES.values()) >= MAX_PAIRS


def shares(n: int) -> dict[str, float]:
    return {kind: n * weight / sum(KIND_WEIGHTS.values()) for kind, weight in KIND_WEIGHTS.items()}


def test_generated_pairs_are_consistent_valid_and_every_kind_in_its_share():
    pairs = generate_pairs(20_003, seed=3)
    assert len(pairs) == 20_003
    kinds = Counter(check_pair(english, chinese) for english, chinese in pairs)
    assert set(kinds) == set(KINDS) == set(KIND_WEIGHTS)
    for kind, share in shares(20_003).items():
        assert int(share) <= kinds[kind] <= int(share) + 1, (kind, kinds[kind], share)
    assert Counter(kind_of(english) for english, _ in pairs) == kinds
    assert any(chinese.endswith("2月29日") for _, chinese in pairs)  # check_pair saw some 29 Februaries
    # Shuffled, not in blocks: the first tenth already holds every kind in about its share.
    head = Counter(kind_of(english) for english, _ in pairs[:2_000])
    for kind, share in shares(2_000).items():
        assert 0.7 * share < head[kind] < 1.3 * share, (kind, head[kind], share)


def test_no_kind_is_starved_of_the_loss():
    # The loss averages over target tokens (characters and </s>): equal shares of pairs gave the small numbers
    # 0.4 of an equal share of it. The weights give every kind at least two thirds, the large numbers most.
    tokens = Counter()
    for english, chinese in generate_pairs(20_000, seed=4):
        tokens[kind_of(english)] += len(chinese) + 1
    mean = sum(tokens.values()) / len(KINDS)
    assert all(tokens[kind] > 2 / 3 * mean for kind in KINDS), tokens
    assert tokens["small"] > 0.9 * tokens["month_day_year"] and max(tokens, key=tokens.get) == "large", tokens


def test_generate_pairs_is_deterministic():
    assert generate_pairs(500, seed=7) == generate_pairs(500, seed=7)
    assert generate_pairs(500, seed=7) != generate_pairs(500, seed=8)
    assert generate_pairs(0) == []


def test_generate_pairs_oversamples_small_pools_evenly_and_never_repeats_big_ones():
    pairs = generate_pairs(30_000, seed=1)
    by_kind: dict[str, Counter] = {kind: Counter() for kind in KINDS}
    for english, _ in pairs:
        by_kind[kind_of(english)][english] += 1
    # Dealt like a deck: a side comes again only once its kind dealt them all, so counts differ by one at most.
    for kind in ("small", "round", "hundreds"):
        counts = by_kind[kind]
        assert len(counts) == KIND_SIZES[kind] and max(counts.values()) - min(counts.values()) <= 1, kind
        assert min(counts.values()) >= 3, kind  # oversampled: each side several times
    for kind in ("thousands", "large", *DATE_STYLES):
        assert set(by_kind[kind].values()) == {1}, kind


def test_generate_pairs_respects_exclude():
    held_out = {english for english, _ in train_test_split(0, 2_000, seed=0)[1]} | {"not a number", "March 3, 1776"}
    frozen = set(held_out)
    pairs = generate_pairs(5_000, seed=0, exclude=held_out)
    assert len(pairs) == 5_000
    assert not held_out & {english for english, _ in pairs}
    assert held_out == frozen  # the caller's set is left alone


def test_generate_pairs_deals_what_exclude_leaves_of_a_small_pool():
    exclude = [number_to_english(n) for n in range(1, 100)]  # all small numbers but zero
    pairs = generate_pairs(1_000, seed=0, exclude=iter(exclude))
    assert {english for english, _ in pairs if kind_of(english) == "small"} == {"zero"}


def test_generate_pairs_refuses_to_draw_a_kind_exclude_used_up():
    with pytest.raises(ValueError, match="small"):
        generate_pairs(100, exclude=[number_to_english(n) for n in range(100)])


def test_train_test_split_is_disjoint_and_deterministic():
    train, test = train_test_split(5_000, 1_000, seed=2)
    assert (len(train), len(test)) == (5_000, 1_000)
    train_english = {english for english, _ in train}
    test_english = {english for english, _ in test}
    assert len(test_english) == 1_000  # the test set never counts a pair twice
    assert not train_english & test_english
    for english, chinese in train + test:
        check_pair(english, chinese)
    assert train_test_split(5_000, 1_000, seed=2) == (train, test)
    assert train_test_split(5_000, 1_000, seed=3) != (train, test)
    assert train_test_split(100, 1_000, seed=2)[1] == test  # the test split does not depend on n_train


def test_train_test_split_gives_every_kind_its_share_and_leaves_small_pools_to_training():
    train, test = train_test_split(30_000, 1_500, seed=0)  # the demo's split
    test_kinds = Counter(kind_of(english) for english, _ in test)
    caps = {kind: int(HELD_OUT_SHARE * KIND_SIZES[kind]) for kind in KINDS}
    assert (caps["small"], caps["round"], caps["hundreds"]) == (20, 72, 162)
    # Equal shares of 150, except the capped small pools, whose 208 pairs go to the other 7 kinds.
    assert test_kinds == {**dict.fromkeys(KINDS, 178), "small": 20, "round": 72, "hundreds": 162}
    train_kinds = Counter(kind_of(english) for english, _ in train)
    for kind, share in shares(30_000).items():
        assert int(share) <= train_kinds[kind] <= int(share) + 1, (kind, train_kinds[kind], share)
    # Training sees every small and round number the test set left, so 80% of each small pool.
    train_english = {english for english, _ in train}
    assert {number_to_english(n) for n in range(100)} - train_english == {
        english for english, _ in test if kind_of(english) == "small"
    }
    assert len({english for english in train_english if kind_of(english) == "round"}) == 360 - 72
    # Every one-word number (zero to twenty, the tens) is a word no rule derives: training has them all.
    one_word = {english for english in map(number_to_english, range(100)) if "-" not in english}
    assert len(one_word) == 28 and one_word <= train_english
    # The demo validates on the first 500 held-out pairs: every kind is there too.
    assert set(Counter(kind_of(english) for english, _ in test[:500])) == set(KINDS)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_held_out_set_takes_no_one_word_side(seed):
    _, test = train_test_split(0, 1_500, seed=seed)
    small = [english for english, _ in test if kind_of(english) == "small"]
    assert len(small) == 20 and all("-" in english for english in small), small
    assert all(re.search("[ -]", english) for english, _ in test)


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
