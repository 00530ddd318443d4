"""When a training run evaluates and when it stops: its budgets and its stopping rules, apart from the loop.

A run stops at the first of

* its step budget: ``max_steps``, or ``epochs`` worth of steps (the fewer of the two when both are given);
* its time budget, ``max_minutes`` of wall-clock for the whole run (earlier invocations, before ``--resume``,
  and the command's setup included), stopping early enough for what must still follow to fit in it: the next
  step, the final evaluation and save, and the caller's scoring after the run (:meth:`Budget.reserve_s`);
* the task's selection metric reaching ``stop_at``;
* a signal (Ctrl-C, SIGTERM), after the current step.

It evaluates every ``eval_every`` steps, when its clock passes one of ``eval_at_minutes``, when it stops, and,
under a time budget, once by a quarter of it (:data:`FIRST_EVAL_SHARE`): how long that evaluation took is what
the end of the budget keeps free for the last one.

The rules are pure: the trainer measures (the clock, how long a step and an evaluation took) and asks.
"""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FIRST_EVAL_SHARE = 0.25  # with a time budget, the first evaluation comes by this share of it


@dataclass(frozen=True)
class Budget:
    """A run's budgets and stopping rules (see the module's docstring); ``metric`` is the task's selection
    metric, which ``stop_at`` is compared with (``higher_is_better`` says in which direction)."""

    max_steps: int | None = None
    epochs: float | None = None
    max_minutes: float | None = None
    eval_every: int = 500
    eval_at_minutes: tuple[float, ...] = ()
    final_scoring: float = 0.0  # the caller's work after the run, in evaluations
    stop_at: float | None = None
    metric: str = "val_loss"
    higher_is_better: bool = False

    @classmethod
    def of(cls, opts: Any, task: Any) -> Budget:
        """The budget of ``TrainOptions`` ``opts`` for ``task`` (its selection metric and direction)."""
        return cls(max_steps=opts.max_steps, epochs=opts.epochs, max_minutes=opts.max_minutes,
                   eval_every=opts.eval_every, eval_at_minutes=tuple(opts.eval_at_minutes),
                   final_scoring=opts.final_scoring, stop_at=opts.stop_at, metric=task.selection_metric,
                   higher_is_better=task.higher_is_better)

    def total_steps(self, steps_per_epoch: int) -> int | None:
        """The step budget, or None when only time bounds the run."""
        total = self.max_steps
        if self.epochs is not None:
            by_epochs = math.ceil(self.epochs * steps_per_epoch)
            total = by_epochs if total is None else min(total, by_epochs)
        return total

    def time_fraction(self, run_s: float) -> float | None:
        """The share of the time budget used after ``run_s`` seconds; None without a time budget."""
        return None if self.max_minutes is None else run_s / (60 * self.max_minutes)

    def reserve_s(self, *, step_s: float, eval_s: float | None) -> float:
        """The end of a time budget kept free, as long as each part last took: the next step (the decision to stop
        comes after a step, so stopping one step later must fit too), the final evaluation and save, and the
        caller's scoring after the run (``final_scoring`` evaluations)."""
        return step_s + (eval_s or 0.0) * (1 + self.final_scoring)

    def stop_reason(self, *, step: int, total: int | None, run_s: float, step_s: float, eval_s: float | None,
                    interrupted_by: int | None = None) -> str:
        """Why to stop after ``step`` (of ``total``), ``run_s`` seconds into the run, or "" to go on."""
        if interrupted_by is not None:
            return f"interrupted ({signal.Signals(interrupted_by).name})"
        if total is not None and step >= total:
            return "step budget reached"
        if self.max_minutes is not None and run_s + self.reserve_s(step_s=step_s, eval_s=eval_s) >= \
                60 * self.max_minutes:
            return "time budget reached"
        return ""

    def evaluation_due(self, *, step: int, previous_s: float, run_s: float, eval_s: float | None) -> bool:
        """Evaluate after ``step``, which took the run's clock from ``previous_s`` to ``run_s``: every
        ``eval_every`` steps; when a wall-clock mark was passed; or, under a time budget, when no evaluation has
        been timed yet (``eval_s`` None) and :data:`FIRST_EVAL_SHARE` of the budget is used."""
        if step % self.eval_every == 0 or any(previous_s < 60 * m <= run_s for m in self.eval_at_minutes):
            return True
        return self.max_minutes is not None and eval_s is None and run_s >= FIRST_EVAL_SHARE * 60 * self.max_minutes

    def target_reached(self, metrics: dict[str, float]) -> str:
        """The reason to stop when an evaluation reached ``stop_at``, else ""."""
        value = metrics.get(self.metric)
        if self.stop_at is None or value is None:
            return ""
        reached = value >= self.stop_at if self.higher_is_better else value <= self.stop_at
        return f"{self.metric} reached {self.stop_at}" if reached else ""

    def check_left(self, out: str | Path, *, step: int, run_s: float, eval_s: float | None) -> None:
        """A resumed run's budgets count the whole run, so one already spent (``step`` steps and ``run_s`` seconds
        so far) would stop at once: say so.

        Raises:
            ValueError: if the step budget is spent, or the time left would not hold the final evaluation (as
                long as the last one took).
        """
        if self.max_steps is not None and step >= self.max_steps:
            raise ValueError(f"{out} already ran {step} steps, its whole max_steps={self.max_steps}; raise "
                             "--max-steps to train on")
        if self.max_minutes is not None and run_s + (eval_s or 0.0) >= 60 * self.max_minutes:
            raise ValueError(f"{out} already ran {run_s / 60:.1f} minutes of its max_minutes={self.max_minutes:g}, "
                             f"too few left for a step and an evaluation ({eval_s or 0:.0f} s); raise "
                             "--max-minutes to train on (the budget counts the run, not this invocation)")
