"""The one training loop, shared by every task.

A task (see :mod:`qkv.tasks`) says only what differs: its model, how an epoch's batches are made, what a
batch's loss is, and how to evaluate. The loop does the rest, the same way for all:

* AdamW; learning rate warmup then inverse square root (the paper's schedule) or cosine decay;
* gradient accumulation, gradient clipping, optional bf16 autocast;
* evaluation every N steps, ``best/`` and ``last/`` checkpoints written atomically, never from a model whose
  loss or validation numbers are not finite;
* exact resume: the data order is a function of (seed, epoch) and the trainer state stores the step, the
  position in the epoch, the optimizer and the RNG, so an interrupted run continues as if never stopped;
* a progress bar with throughput and ETA, a CSV log and a loss-curve PNG;
* stopping on a step, epoch or wall-clock budget (the final evaluation and save included in it), or on
  Ctrl-C / SIGTERM (after saving; the result says which signal, so the command can exit 130 / 143).

The run directory is claimed for the whole run (:func:`qkv.rundir.claim`): one process at a time.
"""

from __future__ import annotations

import contextlib
import csv
import logging
import math
import signal
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from .checkpoint import load_checkpoint, save_checkpoint
from .rundir import claim
from .tokenizers import Tokenizer

log = logging.getLogger(__name__)

SCHEDULES = ("inverse_sqrt", "cosine", "constant")
FIRST_EVAL_SHARE = 0.25  # with a time budget, the first evaluation comes by this share of it (see _evaluation_due)


class Task(Protocol):
    """What the loop needs from a task."""

    model: nn.Module
    tokenizers: dict[str, Tokenizer]
    meta: dict[str, Any]  # saved in the checkpoint's config.json (task name, data description, ...)
    selection_metric: str  # key of evaluate()'s result that picks the best checkpoint
    higher_is_better: bool
    unit: str  # what a batch's n_tokens counts, for the progress bar and the log: "tokens", "examples", ...

    def batches(self, epoch: int) -> Sequence[Any]:
        """The training batches of an epoch, in order; must depend only on (seed, epoch). Each batch has an
        ``n_tokens`` attribute: the number of items (tokens, examples) its loss is summed over."""
        ...

    def loss(self, batch: Any) -> tuple[Tensor, int]:
        """(summed loss over the batch's items, number of those items)."""
        ...

    def evaluate(self) -> dict[str, float]:
        """Validation numbers, e.g. {"val_loss": ..., "val_bleu": ...}."""
        ...


def _positive(name: str, value: float | None, *, optional: bool = True) -> None:
    if value is None and optional:
        return
    if value is None or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value}")


@dataclass
class TrainOptions:
    """Everything about *how* to train (the task says *what*)."""

    out: str
    max_steps: int | None = None
    epochs: float | None = None
    max_minutes: float | None = None
    lr: float = 5e-4
    schedule: str = "inverse_sqrt"
    warmup: int = 1000
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.98)
    clip: float = 1.0
    accum: int = 1
    bf16: bool = False
    eval_every: int = 500
    eval_at_minutes: tuple[float, ...] = ()  # also evaluate when the run's wall-clock passes these marks
    stop_at: float | None = None  # stop once the task's selection metric reaches this value
    log_every: int = 50
    seed: int = 0
    resume: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if self.max_steps is None and self.epochs is None and self.max_minutes is None:
            raise ValueError("give a budget: max_steps, epochs or max_minutes")
        for name in ("max_steps", "epochs", "max_minutes", "lr"):
            _positive(name, getattr(self, name), optional=name != "lr")
        for minutes in self.eval_at_minutes:
            _positive("eval_at_minutes", minutes, optional=False)
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {self.schedule!r}")
        if self.accum < 1 or self.eval_every < 1 or self.log_every < 1 or self.warmup < 0:
            raise ValueError("accum, eval_every and log_every must be >= 1 and warmup >= 0")
        for name in ("clip", "weight_decay", "min_lr_ratio"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")


def learning_rate(step: int, opts: TrainOptions, total_steps: int | None,
                  time_fraction: float | None = None) -> float:
    """Linear warmup to ``opts.lr``, then

    * inverse_sqrt: lr · sqrt(warmup / step), the paper's d^-0.5 · min(step^-0.5, step · warmup^-1.5) with
      its peak set to ``lr``;
    * cosine: down to ``lr · min_lr_ratio`` at ``total_steps`` (half a cosine period); a run bounded only by
      time (``max_minutes``) passes ``time_fraction``, the share of its budget used, and decays over that;
    * constant.
    """
    step = max(step, 1)
    if opts.warmup and step <= opts.warmup:
        return opts.lr * step / opts.warmup
    if opts.schedule == "inverse_sqrt":
        return opts.lr * math.sqrt(max(opts.warmup, 1) / step)
    if opts.schedule == "cosine" and (total_steps or time_fraction is not None):
        if total_steps:
            progress = min(1.0, (step - opts.warmup) / max(1, total_steps - opts.warmup))
        else:
            progress = min(1.0, max(0.0, time_fraction))
        floor = opts.lr * opts.min_lr_ratio
        return floor + (opts.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return opts.lr


def _optimizer(model: nn.Module, opts: TrainOptions) -> torch.optim.Optimizer:
    """AdamW; no weight decay on biases, norms and embeddings' 1-D parameters (decay pulls gains to 0)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": opts.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # The fused kernel updates all parameters in one pass: ~15% of a small model's step time on a CPU.
    return torch.optim.AdamW(groups, lr=opts.lr, betas=opts.betas, eps=1e-9, fused=True)


class _StopFlag:
    """Ctrl-C (or SIGTERM) asks the loop to stop after the current step and save; a second one aborts."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopFlag:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclass
class TrainResult:
    """How a run (this invocation of it) ended.

    Attributes:
        elapsed_s: the whole run's wall-clock seconds, earlier invocations (before ``--resume``) included: the
            figure that ``log.csv`` and the time budget count.
        rate: items (``unit``) per second of training, evaluations left out, in this invocation.
        signal: the signal that stopped the run (SIGINT, SIGTERM), None if it ended on its own.
    """

    step: int
    epoch: int
    stopped_because: str
    best: dict[str, float] | None
    last_eval: dict[str, float] | None
    elapsed_s: float
    rate: float
    unit: str = "tokens"
    signal: int | None = None


def format_metrics(metrics: dict[str, float]) -> str:
    """``val_loss 1.0004  val_bleu 36.35``: four decimals below 100, so 1.00044 does not print as 1."""
    return "  ".join(f"{k} {v:.4f}" if abs(v) < 100 else f"{k} {v:.1f}" for k, v in metrics.items())


@dataclass
class _Log:
    """``log.csv``, kept in memory and rewritten whole (atomically) at every row: the run owns the file."""

    path: Path
    rows: list[dict[str, str]] = field(default_factory=list)
    fields: list[str] = field(default_factory=list)

    def read(self, *, up_to_step: int) -> None:
        """Load an existing log, dropping rows after ``up_to_step`` (logged after the checkpoint resumed from)."""
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

    def add(self, row: dict[str, Any], first: Sequence[str]) -> None:
        for key in [*first, *row]:
            if key not in self.fields:
                self.fields.append(key)
        self.rows.append({k: "" if v is None else (f"{v:.6g}" if isinstance(v, float) else str(v))
                          for k, v in row.items()})
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=self.fields, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(self.rows)
        tmp.replace(self.path)


class _Progress:
    """The progress bar and the training rows of the log. Throughput counts training time only, so an
    evaluation does not make the next figures drop."""

    def __init__(self, trainer: Trainer, total: int | None) -> None:
        from tqdm import tqdm

        self.trainer, self.label = trainer, trainer.unit.replace("_", " ")
        self.bar = tqdm(total=total, initial=trainer.step, unit="step", disable=not trainer.opts.progress,
                        dynamic_ncols=True, desc=trainer.task.meta.get("title", "train"), leave=True)
        self.items = 0  # this invocation's, and its seconds of training
        self.seconds = 0.0
        self._reset_window()

    def _reset_window(self) -> None:
        self.window_loss, self.window_items, self.window_steps, self.window_s = 0.0, 0, 0, 0.0

    def rate(self) -> float:
        return self.items / max(self.seconds, 1e-9)

    def step(self, loss: float, items: int, seconds: float, lr: float, run_s: float) -> None:
        t, opts = self.trainer, self.trainer.opts
        self.items, self.seconds = self.items + items, self.seconds + seconds
        self.window_loss, self.window_items = self.window_loss + loss, self.window_items + items
        self.window_steps, self.window_s = self.window_steps + 1, self.window_s + seconds
        rate = self.window_items / max(self.window_s, 1e-9)
        self.bar.update(1)
        postfix = {"loss": f"{loss:.3f}", "lr": f"{lr:.2e}", f"{self.label}/s": f"{rate:,.0f}"}
        if opts.max_minutes:
            postfix["left"] = f"{max(0.0, opts.max_minutes - run_s / 60):.1f}m"
        self.bar.set_postfix(postfix, refresh=False)
        if t.step % opts.log_every == 0:
            t._log_row({"step": t.step, "epoch": t.epoch, "lr": lr, "train_loss": self.window_loss / self.window_steps,
                        f"{t.unit}_per_s": round(rate), "elapsed_s": round(run_s, 1)})
            self._reset_window()

    def evaluate(self) -> dict[str, float]:
        self.bar.set_postfix_str("evaluating and saving", refresh=True)
        metrics = self.trainer._evaluate_and_save()
        self.bar.write(f"step {self.trainer.step}: {format_metrics(metrics)}")
        return metrics

    def close(self) -> None:
        self.bar.close()


class Trainer:
    """Runs a task under a set of options. ``Trainer(task, opts).run()``."""

    def __init__(self, task: Task, opts: TrainOptions) -> None:
        self.task, self.opts = task, opts
        self.out = Path(opts.out)
        self.model = task.model
        self.unit = getattr(task, "unit", "tokens")
        self.optimizer = _optimizer(self.model, opts)
        self.step = self.epoch = self.batch_index = 0
        self.best: dict[str, float] | None = None
        self.tokens_seen = 0
        self.elapsed_before, self.started = 0.0, time.monotonic()  # wall-clock of earlier runs, start of this one
        self.eval_s: float | None = None  # how long the last evaluation and save took: reserved at the end
        self.log = _Log(self.out / "log.csv")

    # --- state ----------------------------------------------------------------------------------------
    def _run_s(self) -> float:
        """The whole run's seconds so far: earlier invocations count."""
        return self.elapsed_before + time.monotonic() - self.started

    def _trainer_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "epoch": self.epoch,
            "batch_index": self.batch_index,
            "tokens_seen": self.tokens_seen,
            "elapsed_s": self._run_s(),
            "eval_s": self.eval_s,
            "best": self.best or {},
            "optimizer": self.optimizer.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "options": asdict(self.opts),
        }

    def _restore(self) -> None:
        ckpt = load_checkpoint(self.out / "last", with_trainer_state=True)
        state = ckpt.trainer_state
        try:
            self.model.load_state_dict(ckpt.model.state_dict())
            self.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as err:
            raise ValueError(f"{ckpt.path} does not fit the model being resumed ({str(err).splitlines()[0]}); "
                             "resume a run with the command that started it") from None
        self.step, self.epoch, self.batch_index = state["step"], state["epoch"], state["batch_index"]
        self.tokens_seen = state["tokens_seen"]
        self.elapsed_before = state.get("elapsed_s", 0.0)
        self.eval_s = state.get("eval_s")
        self.best = state["best"] or None
        torch.set_rng_state(state["torch_rng"])
        self.log.read(up_to_step=self.step)
        log.info("resumed from %s at step %d (epoch %d, batch %d)", ckpt.path, self.step, self.epoch,
                 self.batch_index)

    def _save(self, name: str, *, with_state: bool) -> None:
        meta = {**self.task.meta, "step": self.step, "best": self.best}
        save_checkpoint(self.out / name, self.model, tokenizers=self.task.tokenizers, meta=meta,
                        trainer_state=self._trainer_state() if with_state else None)

    def _log_row(self, row: dict[str, Any]) -> None:
        self.log.add(row, first=("step", "epoch", "lr", "train_loss", f"{self.unit}_per_s", "elapsed_s"))
        if "val_loss" in row:
            from .viz import loss_curves

            loss_curves(self.log.rows, self.out / "loss.png", title=self.task.meta.get("title", ""))

    # --- evaluation and checkpoints ---------------------------------------------------------------------
    def _is_better(self, metrics: dict[str, float]) -> bool:
        key = self.task.selection_metric
        if key not in metrics:
            return False
        if self.best is None or key not in self.best:
            return True
        return metrics[key] > self.best[key] if self.task.higher_is_better else metrics[key] < self.best[key]

    def _check_finite(self, metrics: dict[str, float]) -> None:
        """A model gone to NaN or Inf must never become a checkpoint: stop, keeping the last good one."""
        bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
        if not bad and all(bool(torch.isfinite(p).all()) for p in self.model.parameters()):
            return
        what = ", ".join(f"{k} {v}" for k, v in bad.items()) or "weights that are not finite"
        kept = f"{self.out / 'last'} is kept" if (self.out / "last").exists() else "nothing was saved"
        raise FloatingPointError(f"training diverged at step {self.step} ({what}); {kept}. Lower --lr or raise "
                                 "--warmup, then --resume")

    def _evaluate_and_save(self) -> dict[str, float]:
        start = time.monotonic()
        self.model.eval()
        with torch.no_grad():
            metrics = self.task.evaluate()
        self.model.train()
        self._check_finite(metrics)
        if self._is_better(metrics):
            self.best = {**metrics, "step": self.step}
            self._save("best", with_state=False)
        self._save("last", with_state=True)
        self._log_row({"step": self.step, "epoch": self.epoch, "elapsed_s": round(self._run_s(), 1), **metrics})
        self.eval_s = time.monotonic() - start
        return metrics

    # --- one step -------------------------------------------------------------------------------------
    def _train_step(self, batches: Sequence[Any], lr: float) -> tuple[float, int]:
        """One optimizer step over ``batches`` (gradient accumulation): the loss is the mean over every item
        of all of them, so accumulating k batches equals one batch k times as large. A loss or gradient that
        is not finite is never applied to the weights."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        n_tokens = sum(batch.n_tokens for batch in batches)
        total = 0.0
        for batch in batches:  # backward per batch: only one batch's activations are alive at a time
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.opts.bf16):
                loss_sum, _ = self.task.loss(batch)
            (loss_sum.float() / max(n_tokens, 1)).backward()
            total += loss_sum.item()
        norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.opts.clip if self.opts.clip > 0 else math.inf)
        if not (math.isfinite(total) and bool(torch.isfinite(norm))):
            self.optimizer.zero_grad(set_to_none=True)
            what = f"loss {total / max(n_tokens, 1)}" if not math.isfinite(total) else f"gradient norm {float(norm)}"
            kept = f"{self.out / 'last'} is kept" if (self.out / "last").exists() else "nothing was saved"
            raise FloatingPointError(f"training diverged at step {self.step + 1} ({what}); {kept}. Lower --lr or "
                                     "raise --warmup, then --resume")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total / max(n_tokens, 1), n_tokens

    # --- the loop -------------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        with claim(self.out, resume=self.opts.resume):
            return self._run()

    def _total_steps(self) -> int | None:
        total = self.opts.max_steps
        if self.opts.epochs is not None:
            steps_per_epoch = math.ceil(len(self.task.batches(self.epoch)) / self.opts.accum)
            by_epochs = math.ceil(self.opts.epochs * steps_per_epoch)
            total = by_epochs if total is None else min(total, by_epochs)
        return total

    def _run(self) -> TrainResult:
        opts = self.opts
        if opts.resume:
            self._restore()
            self._check_budget_left()
        else:
            torch.manual_seed(opts.seed)
            self.log.path.unlink(missing_ok=True)  # what an earlier start left before its first checkpoint
        total = self._total_steps()
        progress = _Progress(self, total)
        self.started = time.monotonic()
        last_eval: dict[str, float] | None = None
        previous_s, stopped = self.elapsed_before, ""
        self.model.train()
        with _StopFlag() as stop:
            log.info("training from step %d; Ctrl-C stops after the current step and saves", self.step)
            while not stopped:
                batches = self.task.batches(self.epoch)
                while self.batch_index < len(batches) and not stopped:
                    chunk = batches[self.batch_index : self.batch_index + opts.accum]
                    fraction = None
                    if total is None and opts.max_minutes:  # the whole run's share of its time budget
                        fraction = self._run_s() / (60 * opts.max_minutes)
                    lr = learning_rate(self.step + 1, opts, total, fraction)
                    start = time.monotonic()
                    loss, n_tokens = self._train_step(chunk, lr)
                    self.batch_index += len(chunk)
                    self.step += 1
                    self.tokens_seen += n_tokens
                    run_s = self._run_s()
                    progress.step(loss, n_tokens, time.monotonic() - start, lr, run_s)
                    reason = self._should_stop(total, run_s, stop.signal)
                    if self.step % opts.eval_every == 0 or reason or self._evaluation_due(previous_s, run_s):
                        last_eval = progress.evaluate()
                        if not reason and self._reached_target(last_eval):
                            reason = f"{self.task.selection_metric} reached {opts.stop_at}"
                        reason = reason or self._should_stop(total, self._run_s(), stop.signal)
                    previous_s, stopped = run_s, reason
                if not stopped:
                    self.epoch += 1
                    self.batch_index = 0
        progress.close()
        return TrainResult(self.step, self.epoch, stopped, self.best, last_eval, self._run_s(), progress.rate(),
                           self.unit, stop.signal)

    def _evaluation_due(self, previous_s: float, run_s: float) -> bool:
        """A wall-clock mark was passed; or, under a time budget, no evaluation has been timed yet and a
        quarter of the budget is used: its duration is what the end of the run reserves for the last one."""
        if any(previous_s < 60 * m <= run_s for m in self.opts.eval_at_minutes):
            return True
        return self.opts.max_minutes is not None and self.eval_s is None and \
            run_s >= FIRST_EVAL_SHARE * 60 * self.opts.max_minutes

    def _check_budget_left(self) -> None:
        """A resumed run's budgets count the whole run, so one already spent would stop at once: say so."""
        opts, done = self.opts, self.elapsed_before / 60
        if opts.max_steps is not None and self.step >= opts.max_steps:
            raise ValueError(f"{self.out} already ran {self.step} steps, its whole max_steps={opts.max_steps}; "
                             "raise --max-steps to train on")
        if opts.max_minutes is not None and done >= opts.max_minutes:
            raise ValueError(f"{self.out} already ran {done:.1f} minutes, its whole max_minutes={opts.max_minutes:g}; "
                             "raise --max-minutes to train on (the budget counts the run, not this invocation)")

    def _reached_target(self, metrics: dict[str, float]) -> bool:
        value = metrics.get(self.task.selection_metric)
        if self.opts.stop_at is None or value is None:
            return False
        return value >= self.opts.stop_at if self.task.higher_is_better else value <= self.opts.stop_at

    def _should_stop(self, total: int | None, run_s: float, interrupted_by: int | None) -> str:
        """Why to stop now, or "". A time budget stops early enough for the final evaluation and save to fit
        in it: as long as the last one took."""
        if interrupted_by is not None:
            return f"interrupted ({signal.Signals(interrupted_by).name})"
        if total is not None and self.step >= total:
            return "step budget reached"
        if self.opts.max_minutes is not None and run_s + (self.eval_s or 0.0) >= 60 * self.opts.max_minutes:
            return "time budget reached"
        return ""
