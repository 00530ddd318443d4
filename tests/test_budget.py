"""The budgets and stopping rules of a training run, apart from any model: plain numbers in, decisions out."""

import signal
from types import SimpleNamespace

import pytest

from qkv.budget import FIRST_EVAL_SHARE, Budget
from qkv.training import TrainOptions


def test_the_step_budget_is_the_fewer_of_max_steps_and_epochs():
    assert Budget(max_steps=100).total_steps(steps_per_epoch=7) == 100
    assert Budget(epochs=2.5).total_steps(steps_per_epoch=7) == 18  # ceil(17.5)
    assert Budget(max_steps=10, epochs=2).total_steps(steps_per_epoch=7) == 10
    assert Budget(max_steps=20, epochs=2).total_steps(steps_per_epoch=7) == 14
    assert Budget(max_minutes=5).total_steps(steps_per_epoch=7) is None  # only time bounds it


def test_the_time_fraction_is_the_share_of_the_minutes_used():
    assert Budget(max_minutes=2).time_fraction(30) == pytest.approx(0.25)
    assert Budget(max_steps=5).time_fraction(30) is None


def test_the_end_of_a_time_budget_keeps_room_for_a_step_an_evaluation_and_the_scoring():
    budget = Budget(max_minutes=2, final_scoring=1.0)
    assert budget.reserve_s(step_s=7, eval_s=30) == 7 + 30 * 2
    assert budget.reserve_s(step_s=7, eval_s=None) == 7  # no evaluation timed yet
    stop = {"step": 3, "total": None, "step_s": 7, "eval_s": 30}
    assert budget.stop_reason(run_s=120 - 67 - 0.5, **stop) == ""
    assert budget.stop_reason(run_s=120 - 67, **stop) == "time budget reached"


def test_why_a_run_stops():
    budget = Budget(max_steps=10, max_minutes=1)
    times = {"run_s": 1.0, "step_s": 0.1, "eval_s": None}
    assert budget.stop_reason(step=9, total=10, **times) == ""
    assert budget.stop_reason(step=10, total=10, **times) == "step budget reached"
    assert budget.stop_reason(step=3, total=10, interrupted_by=signal.SIGTERM, **times) == "interrupted (SIGTERM)"
    assert budget.stop_reason(step=10, total=10, interrupted_by=signal.SIGINT, **times) == "interrupted (SIGINT)"
    assert Budget(max_steps=10).stop_reason(step=3, total=10, run_s=1e9, step_s=1e9, eval_s=1e9) == ""


def test_when_a_run_evaluates():
    budget = Budget(max_steps=100, eval_every=4, eval_at_minutes=(1.0, 2.0))
    due = [step for step in range(1, 13) if budget.evaluation_due(step=step, previous_s=0, run_s=1, eval_s=None)]
    assert due == [4, 8, 12]
    assert budget.evaluation_due(step=5, previous_s=59, run_s=61, eval_s=1)  # a mark passed during the step
    assert not budget.evaluation_due(step=6, previous_s=61, run_s=63, eval_s=1)  # and only once
    assert budget.evaluation_due(step=7, previous_s=119, run_s=120, eval_s=1)


def test_a_time_budget_times_its_first_evaluation_by_a_quarter_of_it():
    budget = Budget(max_minutes=4, eval_every=1000)
    quarter = FIRST_EVAL_SHARE * 240
    assert not budget.evaluation_due(step=1, previous_s=0, run_s=quarter - 1, eval_s=None)
    assert budget.evaluation_due(step=2, previous_s=quarter - 1, run_s=quarter, eval_s=None)
    assert not budget.evaluation_due(step=3, previous_s=quarter, run_s=quarter + 1, eval_s=12.0)  # timed already


@pytest.mark.parametrize("higher, value, reached", [(True, 0.9, True), (True, 0.8, False), (False, 1.5, True),
                                                    (False, 1.6, False)])
def test_the_target_of_the_selection_metric(higher, value, reached):
    target = 0.9 if higher else 1.5
    budget = Budget(max_steps=5, stop_at=target, metric="val_x", higher_is_better=higher)
    assert budget.target_reached({"val_x": value}) == (f"val_x reached {target}" if reached else "")
    assert budget.target_reached({"val_loss": value}) == ""  # the metric was not measured
    assert Budget(max_steps=5, metric="val_x").target_reached({"val_x": value}) == ""  # no target


def test_a_resumed_run_whose_budget_is_spent_says_so():
    with pytest.raises(ValueError, match=r"runs/a already ran 10 steps, its whole max_steps=10; raise --max-steps"):
        Budget(max_steps=10).check_left("runs/a", step=10, run_s=0, eval_s=None)
    with pytest.raises(ValueError, match=r"already ran 1.9 minutes of its max_minutes=2, too few left for a step and "
                                         r"an evaluation \(10 s\); raise --max-minutes"):
        Budget(max_minutes=2).check_left("runs/a", step=3, run_s=115, eval_s=10)
    Budget(max_steps=11, max_minutes=2).check_left("runs/a", step=10, run_s=100, eval_s=10)  # room left: no error


def test_a_budget_of_the_options_and_the_task():
    opts = TrainOptions(out="x", max_steps=7, epochs=2.0, max_minutes=3.0, eval_every=5, eval_at_minutes=(1.0,),
                        final_scoring=2.0, stop_at=0.5)
    task = SimpleNamespace(selection_metric="val_exact", higher_is_better=True)
    assert Budget.of(opts, task) == Budget(max_steps=7, epochs=2.0, max_minutes=3.0, eval_every=5,
                                           eval_at_minutes=(1.0,), final_scoring=2.0, stop_at=0.5, metric="val_exact",
                                           higher_is_better=True)
