"""The one training loop, shared by every task.

A task (see :mod:`qkv.tasks`) says only what differs: its model, how an epoch's batches are made, what a
batch's loss is, and how to evaluate. The loop does the rest, the same way for all:

* AdamW; learning rate warmup then inverse square root (the paper's schedule) or cosine decay;
* gradient accumulation, gradient clipping, optional bf16 autocast;
* evaluation every N steps, ``best/`` and ``last/`` checkpoints written atomically;
* exact resume: the data order is a function of (seed, epoch) and the trainer state stores the step, the
  position in the epoch, the optimizer and the RNG, so an interrupted run continues as if never stopped;
* a progress bar with tokens/s and ETA, a CSV log and a loss-curve PNG;
* stopping on a step, epoch or wall-clock budget, or on Ctrl-C (after saving).
"""

from __future__ import annotations

import contextlib
import csv
import logging
import math
import signal
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from .checkpoint import load_checkpoint, save_checkpoint
from .tokenizers import Tokenizer

log = logging.getLogger(__name__)

SCHEDULES = ("inverse_sqrt", "cosine", "constant")
LOG_FIELDS = ("step", "epoch", "lr", "train_loss", "tokens_per_s", "elapsed_s")


class Task(Protocol):
    """What the loop needs from a task."""

    model: nn.Module
    tokenizers: dict[str, Tokenizer]
    meta: dict[str, Any]  # saved in the checkpoint's config.json (task name, data description, ...)
    selection_metric: str  # key of evaluate()'s result that picks the best checkpoint
    higher_is_better: bool

    def batches(self, epoch: int) -> Sequence[Any]:
        """The training batches of an epoch, in order; must depend only on (seed, epoch). Each batch has an
        ``n_tokens`` attribute: the number of tokens its loss is summed over."""
        ...

    def loss(self, batch: Any) -> tuple[Tensor, int]:
        """(summed loss over the batch's target tokens, number of those tokens)."""
        ...

    def evaluate(self) -> dict[str, float]:
        """Validation numbers, e.g. {"val_loss": ..., "val_bleu": ...}."""
        ...


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
        for name in ("max_steps", "epochs", "max_minutes"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {self.schedule!r}")
        if self.accum < 1 or self.eval_every < 1 or self.log_every < 1 or self.warmup < 0:
            raise ValueError("accum, eval_every and log_every must be >= 1 and warmup >= 0")
        if self.clip < 0:
            raise ValueError(f"clip must be >= 0 (0 disables it), got {self.clip}")


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
        self.requested = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopFlag:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclass
class TrainResult:
    step: int
    epoch: int
    stopped_because: str
    best: dict[str, float] | None
    last_eval: dict[str, float] | None
    elapsed_s: float
    tokens_per_s: float


class Trainer:
    """Runs a task under a set of options. ``Trainer(task, opts).run()``."""

    def __init__(self, task: Task, opts: TrainOptions) -> None:
        self.task, self.opts = task, opts
        self.out = Path(opts.out)
        self.model = task.model
        self.optimizer = _optimizer(self.model, opts)
        self.step = self.epoch = self.batch_index = 0
        self.best: dict[str, float] | None = None
        self.tokens_seen = 0
        self.elapsed_before, self.started = 0.0, time.monotonic()  # wall-clock of earlier runs, start of this one

    # --- state ----------------------------------------------------------------------------------------
    def _trainer_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "epoch": self.epoch,
            "batch_index": self.batch_index,
            "tokens_seen": self.tokens_seen,
            "elapsed_s": self.elapsed_before + time.monotonic() - self.started,
            "best": self.best or {},
            "optimizer": self.optimizer.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "options": asdict(self.opts),
        }

    def _restore(self) -> None:
        ckpt = load_checkpoint(self.out / "last", with_trainer_state=True)
        state = ckpt.trainer_state
        self.model.load_state_dict(ckpt.model.state_dict())
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.epoch, self.batch_index = state["step"], state["epoch"], state["batch_index"]
        self.tokens_seen = state["tokens_seen"]
        self.elapsed_before = state.get("elapsed_s", 0.0)
        self.best = state["best"] or None
        torch.set_rng_state(state["torch_rng"])
        log.info("resumed from %s at step %d (epoch %d, batch %d)", ckpt.path, self.step, self.epoch,
                 self.batch_index)

    def _save(self, name: str, *, with_state: bool) -> None:
        meta = {**self.task.meta, "step": self.step, "best": self.best}
        save_checkpoint(self.out / name, self.model, tokenizers=self.task.tokenizers, meta=meta,
                        trainer_state=self._trainer_state() if with_state else None)

    # --- logging --------------------------------------------------------------------------------------
    def _log_row(self, row: dict[str, Any]) -> None:
        path = self.out / "log.csv"
        fields = list(LOG_FIELDS) + sorted(k for k in row if k not in LOG_FIELDS)
        rows = []
        if path.exists():
            with open(path, newline="") as f:
                rows = list(csv.DictReader(f))
            for r in rows:
                fields += [k for k in r if k not in fields]
        rows.append({k: ("" if v is None else (f"{v:.6g}" if isinstance(v, float) else v)) for k, v in row.items()})
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        tmp.replace(path)
        if "val_loss" in row:
            from .viz import loss_curves

            loss_curves(rows, self.out / "loss.png", title=self.task.meta.get("title", ""))

    # --- the loop -------------------------------------------------------------------------------------
    def _is_better(self, metrics: dict[str, float]) -> bool:
        key = self.task.selection_metric
        if key not in metrics:
            return False
        if self.best is None or key not in self.best:
            return True
        return metrics[key] > self.best[key] if self.task.higher_is_better else metrics[key] < self.best[key]

    def _evaluate_and_save(self, elapsed: float) -> dict[str, float]:
        self.model.eval()
        with torch.no_grad():
            metrics = self.task.evaluate()
        self.model.train()
        if self._is_better(metrics):
            self.best = {**metrics, "step": self.step}
            self._save("best", with_state=False)
        self._save("last", with_state=True)
        self._log_row({"step": self.step, "epoch": self.epoch, "elapsed_s": round(self.elapsed_before + elapsed, 1),
                       **metrics})
        return metrics

    def _train_step(self, batches: Sequence[Any], lr: float) -> tuple[float, int]:
        """One optimizer step over ``batches`` (gradient accumulation): the loss is the mean over every target
        token of all of them, so accumulating k batches equals one batch k times as large."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        n_tokens = sum(batch.n_tokens for batch in batches)
        total = 0.0
        for batch in batches:  # backward per batch: only one batch's activations are alive at a time
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.opts.bf16):
                loss_sum, _ = self.task.loss(batch)
            (loss_sum.float() / max(n_tokens, 1)).backward()
            total += loss_sum.item()
        if self.opts.clip > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.opts.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total / max(n_tokens, 1), n_tokens

    def run(self) -> TrainResult:
        opts = self.opts
        self.out.mkdir(parents=True, exist_ok=True)
        if opts.resume:
            self._restore()
            self._check_budget_left()
        else:
            torch.manual_seed(opts.seed)
            if (self.out / "log.csv").exists():
                (self.out / "log.csv").unlink()  # a fresh run starts a fresh log
        steps_per_epoch = math.ceil(len(self.task.batches(self.epoch)) / opts.accum)
        total = opts.max_steps
        if opts.epochs is not None:
            by_epochs = math.ceil(opts.epochs * steps_per_epoch)
            total = by_epochs if total is None else min(total, by_epochs)

        from tqdm import tqdm

        bar = tqdm(total=total, initial=self.step, unit="step", disable=not opts.progress, dynamic_ncols=True,
                   desc=self.task.meta.get("title", "train"), leave=True)
        start, tokens_before = time.monotonic(), self.tokens_seen
        self.started = start
        window_loss, window_tokens, window_steps, window_start = 0.0, 0, 0, start
        last_eval: dict[str, float] | None = None
        previous_s = self.elapsed_before
        stopped = "finished"
        self.model.train()
        with _StopFlag() as stop:
            while True:
                batches = self.task.batches(self.epoch)
                while self.batch_index < len(batches):
                    chunk = batches[self.batch_index : self.batch_index + opts.accum]
                    fraction = None
                    if total is None and opts.max_minutes:  # the whole run's share of its time budget
                        fraction = (self.elapsed_before + time.monotonic() - start) / (60 * opts.max_minutes)
                    lr = learning_rate(self.step + 1, opts, total, fraction)
                    loss, n_tokens = self._train_step(chunk, lr)
                    if not math.isfinite(loss):
                        raise FloatingPointError(f"loss became {loss} at step {self.step + 1}; lower --lr or "
                                                 "raise --warmup (the last good checkpoint is kept)")
                    self.batch_index += len(chunk)
                    self.step += 1
                    self.tokens_seen += n_tokens
                    window_loss += loss
                    window_tokens += n_tokens
                    window_steps += 1
                    now = time.monotonic()
                    run_s = self.elapsed_before + now - start  # the whole run's seconds: earlier invocations count
                    rate = window_tokens / max(now - window_start, 1e-9)
                    bar.update(1)
                    postfix = {"loss": f"{loss:.3f}", "lr": f"{lr:.2e}", "tok/s": f"{rate:,.0f}"}
                    if opts.max_minutes:
                        postfix["left"] = f"{max(0.0, opts.max_minutes - run_s / 60):.1f}m"
                    bar.set_postfix(postfix, refresh=False)
                    if self.step % opts.log_every == 0:
                        self._log_row({"step": self.step, "epoch": self.epoch, "lr": lr,
                                       "train_loss": window_loss / window_steps, "tokens_per_s": round(rate),
                                       "elapsed_s": round(run_s, 1)})
                        window_loss, window_tokens, window_steps, window_start = 0.0, 0, 0, now
                    reason = self._should_stop(total, run_s, stop.requested)
                    mark = any(previous_s < 60 * m <= run_s for m in opts.eval_at_minutes)
                    previous_s = run_s
                    if self.step % opts.eval_every == 0 or reason or mark:
                        last_eval = self._evaluate_and_save(time.monotonic() - start)
                        bar.write(f"step {self.step}: " + "  ".join(f"{k} {v:.4g}" for k, v in last_eval.items()))
                        if not reason and self._reached_target(last_eval):
                            reason = f"{self.task.selection_metric} reached {opts.stop_at}"
                    if reason:
                        stopped = reason
                        break
                else:
                    self.epoch += 1
                    self.batch_index = 0
                    continue
                break
        bar.close()
        elapsed = time.monotonic() - start
        return TrainResult(self.step, self.epoch, stopped, self.best, last_eval, elapsed,
                           (self.tokens_seen - tokens_before) / max(elapsed, 1e-9))

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

    def _should_stop(self, total: int | None, run_s: float, interrupted: bool) -> str:
        if interrupted:
            return "interrupted"
        if total is not None and self.step >= total:
            return "step budget reached"
        if self.opts.max_minutes is not None and run_s >= 60 * self.opts.max_minutes:
            return "time budget reached"
        return ""
