"""What a training run shows and records as it goes: the progress bar, ``log.csv`` and the loss curve.

    log.csv     one row per ``log_every`` steps (lr, train_loss, throughput, elapsed_s) and one per evaluation
                (the validation numbers), rewritten whole at every row; a resumed run drops the rows logged
                after the checkpoint it resumes from
    loss.png    drawn from the log after every evaluation (:func:`qkv.viz.loss_curves`)

Throughput counts training time only, so an evaluation does not make the figures after it drop, and it is named
by what the task counts (``target_tokens/s``, ``examples/s``).
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .files import write_atomically


def format_metrics(metrics: dict[str, float]) -> str:
    """``step 30  val_loss 1.0004  val_bleu 36.35``: counts as counts; four decimals below 100, so 1.00044 does
    not print as 1."""
    return "  ".join(f"{k} {_number(v)}" for k, v in metrics.items())


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return f"{value:.4f}" if abs(value) < 100 else f"{value:.1f}"


@dataclass
class RunLog:
    """``log.csv``, kept in memory and rewritten whole (atomically) at every row: the run owns the file."""

    path: Path
    rows: list[dict[str, str]] = field(default_factory=list)
    fields: list[str] = field(default_factory=list)

    def read(self, *, up_to_step: int) -> None:
        """Load an existing log, dropping rows after ``up_to_step`` (logged after the checkpoint resumed from).

        Raises:
            ValueError: for a file that is not a readable training log (naming it).
        """
        if not self.path.exists():
            return
        try:
            with open(self.path, newline="", encoding="utf-8") as f:
                reader = csv.DictReader(f)
                rows, fields = list(reader), list(reader.fieldnames or [])
            steps = [int(r["step"]) for r in rows]
        except (OSError, UnicodeDecodeError, csv.Error, KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{self.path} is not a readable qkv training log ({type(err).__name__}: {err}); move "
                             "it away (a new log is started) and resume again") from None
        self.fields = fields
        self.rows = [r for r, step in zip(rows, steps, strict=True) if step <= up_to_step]

    def add(self, row: dict[str, Any], first: Sequence[str] = ()) -> None:
        """Append ``row`` (columns ``first`` lead a new file) and rewrite the file."""
        for key in [*first, *row]:
            if key not in self.fields:
                self.fields.append(key)
        self.rows.append({k: "" if v is None else (f"{v:.6g}" if isinstance(v, float) else str(v))
                          for k, v in row.items()})
        write_atomically(self.path, self._write)

    def _write(self, path: Path) -> None:
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=self.fields, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(self.rows)


class Progress:
    """The progress bar and the training rows of the log.

    Args:
        log: where the rows go (None: nowhere, as on every process but the first of a distributed run).
        unit: what a batch's ``n_tokens`` counts (``"target_tokens"``, ``"examples"``).
        total: the step budget, if there is one; ``initial`` the step the run starts from.
        show: draw the bar.
        log_every: write a training row at the first step and every ``log_every`` steps.
        main: print the validation lines (only rank 0 of a distributed run does).
    """

    def __init__(self, log: RunLog | None, *, unit: str, title: str, total: int | None, initial: int, show: bool,
                 log_every: int, max_minutes: float | None, plot_title: str = "", main: bool = True) -> None:
        from tqdm import tqdm

        self.log, self.unit, self.label, self.log_every = log, unit, unit.replace("_", " "), log_every
        self.main = main
        self.max_minutes, self.plot_title = max_minutes, plot_title
        self.bar = tqdm(total=total, initial=initial, unit="step", disable=not show, dynamic_ncols=True, desc=title,
                        leave=True)
        self.items, self.seconds = 0, 0.0  # this invocation's items and seconds of training
        self._reset_window()

    def _reset_window(self) -> None:
        self.window_loss, self.window_items, self.window_steps, self.window_s = 0.0, 0, 0, 0.0
        self.window_extra: dict[str, float] = {}

    def rate(self) -> float:
        """Items per second of training in this invocation."""
        return self.items / max(self.seconds, 1e-9)

    def step(self, *, step: int, epoch: int, loss: float, items: int, seconds: float, lr: float, run_s: float,
             extra: dict[str, float] | None = None) -> None:
        """One optimizer step done: advance the bar, and at the first step and every ``log_every`` steps write a
        row (``extra``: the task's other numbers of the step, e.g. a preference objective's rewards, averaged over
        the row's steps as the loss is)."""
        self.items, self.seconds = self.items + items, self.seconds + seconds
        self.window_loss, self.window_items = self.window_loss + loss, self.window_items + items
        for key, value in (extra or {}).items():
            self.window_extra[key] = self.window_extra.get(key, 0.0) + value
        self.window_steps, self.window_s = self.window_steps + 1, self.window_s + seconds
        rate = self.window_items / max(self.window_s, 1e-9)
        self.bar.update(1)
        postfix = {"loss": f"{loss:.3f}", "lr": f"{lr:.2e}", f"{self.label}/s": f"{rate:,.0f}"}
        if self.max_minutes:
            postfix["left"] = f"{max(0.0, self.max_minutes - run_s / 60):.1f}m"
        self.bar.set_postfix(postfix, refresh=False)
        if step % self.log_every == 0 or step == 1:
            extra = {key: value / self.window_steps for key, value in self.window_extra.items()}
            self.row({"step": step, "epoch": epoch, "lr": lr, "train_loss": self.window_loss / self.window_steps,
                      f"{self.unit}_per_s": round(rate), "elapsed_s": round(run_s, 1), **extra})
            self._reset_window()

    def row(self, row: dict[str, Any]) -> None:
        """A row of the log (training or evaluation; after an evaluation's saves, the trainer redraws the loss curve
        with :meth:`curve`)."""
        if self.log is None:
            return
        self.log.add(row, first=("step", "epoch", "lr", "train_loss", f"{self.unit}_per_s", "elapsed_s"))

    def curve(self) -> None:
        """Redraw ``loss.png`` from the log."""
        if self.log is None:
            return
        from .viz import loss_curves

        loss_curves(self.log.rows, self.log.path.with_name("loss.png"), title=self.plot_title, unit=self.unit)

    def evaluating(self) -> None:
        self.bar.set_postfix_str("evaluating and saving", refresh=True)

    def evaluated(self, step: int, metrics: dict[str, float]) -> None:
        if self.main:  # tqdm.write prints even from a disabled bar: once per run, not once per process
            self.bar.write(f"step {step}: {format_metrics(metrics)}")

    def close(self) -> None:
        self.bar.close()
