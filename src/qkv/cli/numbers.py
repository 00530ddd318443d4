"""The one validation layer for numbers typed on the command line.

Every numeric option of every command is parsed by one of these two argparse types, which refuse what Python's
``int``/``float`` accept but no option means: ``nan``, ``inf``, and values out of the option's range. The
refusal is argparse's one-line error, before any file is read or model loaded:

    qkv train: error: argument --batch-tokens: must be an integer >= 1, got '0' (see qkv train --help)
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def integer(minimum: int | None = None, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in ``[minimum, maximum]`` (either bound may be open-ended)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be an integer{_range(minimum, maximum)}, got {text!r}")
        return value

    return parse


def real(minimum: float | None = None, maximum: float | None = None, *, above: float | None = None,
         below: float | None = None) -> Callable[[str], float]:
    """An argparse type: a finite number ``>= minimum``, ``<= maximum``, ``> above``, ``< below`` (as given)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        ok = math.isfinite(value) and all((
            minimum is None or value >= minimum, maximum is None or value <= maximum,
            above is None or value > above, below is None or value < below,
        ))
        if not ok:
            raise argparse.ArgumentTypeError(f"must be a finite number{_range(minimum, maximum, above, below)}, "
                                             f"got {text!r}")
        return value

    return parse


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"  # 4294967295, not 4.29497e+09


def _range(minimum=None, maximum=None, above=None, below=None) -> str:
    low = _number(minimum) if minimum is not None else _number(above) if above is not None else None
    high = _number(maximum) if maximum is not None else _number(below) if below is not None else None
    if low is not None and high is not None:
        return f" in {'[' if minimum is not None else '('}{low}, {high}{']' if maximum is not None else ')'}"
    if low is not None:
        return f" {'>=' if minimum is not None else '>'} {low}"
    if high is not None:
        return f" {'<=' if maximum is not None else '<'} {high}"
    return ""


COUNT = integer(1)  # sizes, steps, beams: at least one
# What every seeded generator takes (torch to 2**64 - 1, NumPy's legacy seeds to 2**32 - 1), with room for the
# seeds qkv derives from it (seed × 100,003 + epoch, and so on).
SEED = integer(0, 2**32 - 1)
POSITIVE = real(above=0)  # minutes, epochs, learning rates
NON_NEGATIVE = real(minimum=0)  # clipping (0 disables), weight decay, length penalty
PROBABILITY = real(minimum=0, below=1)  # dropout, label smoothing: [0, 1)
FRACTION = real(above=0, below=1)  # a share held out: (0, 1)
