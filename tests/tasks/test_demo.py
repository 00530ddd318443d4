"""`qkv demo` end to end with a tiny budget: it trains, scores held-out pairs overall and per kind, draws, and
leaves a usable model; a budget that is no number of minutes is refused before anything is written."""

import math

import pytest

from qkv.checkpoint import load_checkpoint
from qkv.tasks.dates_numbers import DATE_STYLES, KINDS, kind_of
from qkv.tasks.demo import EXAMPLES, exact_match_per_kind, run_demo
from qkv.tasks.translation import translate


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path, capsys):
    result = run_demo(out=tmp_path / "demo", minutes=0.15, progress=False)
    assert set(result) >= {"exact_match", "bleu", "train_minutes", "steps", "per_kind"} and result["steps"] > 0
    for name in ("attention.png", "loss.png", "log.csv", "best/model.safetensors", "last/trainer_state.pt"):
        assert (tmp_path / "demo" / name).stat().st_size > 0, name
    # The held-out test set holds every kind, so the report names them all, in the order of KINDS.
    assert list(result["per_kind"]) == list(KINDS)
    assert all(0.0 <= accuracy <= 1.0 for accuracy in result["per_kind"].values())
    printed = capsys.readouterr().out
    assert "exact match" in printed and "March 3, 2021" in printed
    table = printed[printed.index("kind") : printed.index("samples:")]
    for kind, accuracy in result["per_kind"].items():
        assert f"{kind} " in table and f"{accuracy:.1%}" in table, kind
    for example in EXAMPLES:
        assert example in printed, example
    model = load_checkpoint(tmp_path / "demo")
    assert len(translate(model.model, model.tokenizers, ["May 17, 1990"])) == 1


@pytest.mark.parametrize("minutes", [math.nan, math.inf, 0.0, -1.0])
def test_demo_refuses_a_budget_that_is_no_positive_number_of_minutes(tmp_path, minutes):
    with pytest.raises(ValueError, match="minutes"):
        run_demo(out=tmp_path / "demo", minutes=minutes, progress=False)
    assert not (tmp_path / "demo").exists()


def test_exact_match_per_kind_counts_each_kind_in_the_order_of_kinds():
    sources = ["March 3, 2021", "eleven", "twelve", "five thousand", "Mar 3, 2021"]
    references = ["2021年3月3日", "十一", "十二", "五千", "2021年3月3日"]
    hyps = ["2021年3月3日", "十一", "一二", "五千", "2021年3月4日"]
    assert exact_match_per_kind(sources, hyps, references) == {
        "small": (2, 0.5), "round": (1, 1.0), "month_day_year": (1, 1.0), "short_month": (1, 0.0),
    }  # fmt: skip
    assert list(exact_match_per_kind(sources, hyps, references)) == ["small", "round", "month_day_year", "short_month"]


def test_examples_show_what_a_new_user_types_first():
    kinds = {kind_of(example) for example in EXAMPLES}
    assert {"eleven", "twelve", "twenty", "one"} <= set(EXAMPLES)
    assert "round" in kinds and len(kinds & set(DATE_STYLES)) >= 3  # a round number and several date styles
    assert EXAMPLES[0] == "March 3, 2021"  # the attention map's sentence: its year moves to the front
