"""The one training loop, shared by every task.

A task (see :mod:`qkv.tasks`) says only what differs: its model, how an epoch's batches are made, what a
batch's loss is, and how to evaluate. The loop does the rest, the same way for all:

* AdamW, or Muon for the hidden matrices and AdamW for the rest (:mod:`qkv.optimizers`); learning rate warmup
  then inverse square root (the paper's schedule), cosine decay or warmup-stable-decay;
* on any device (``--device``), in fp32, bf16 or fp16 autocast (fp16 with a gradient scaler); gradient
  accumulation, gradient clipping;
* evaluation every N steps, ``best/`` and ``last/`` checkpoints written atomically, never from a model whose
  loss or validation numbers are not finite;
* exact resume: the data order is a function of (seed, epoch) and the trainer state stores the step, the
  position in the epoch, the optimizer and the RNG, so an interrupted run continues as if never stopped;
* a progress bar with throughput and ETA, a CSV log and a loss-curve PNG;
* stopping on a step, epoch or wall-clock budget (from the command's start when it gives it; the final
  evaluation and save, and the caller's scoring after the run, included in it), or on Ctrl-C / SIGTERM (after
  saving; the result says which signal, so the command can exit 130 / 143): the rules are :mod:`qkv.budget`'s.

The task never sees the loop's machinery: its loss and its evaluation take the model they run (the DDP wrapper
of a distributed run, or the model itself), and the device, precision and process group come resolved, once,
as a :class:`qkv.runtime.Runtime`.

The run directory is claimed for the whole run (:func:`qkv.rundir.claim`), once per process: a command claims
it before it reads data, and the trainer claims it only when nothing in this process holds it (a library
caller's run).
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from .budget import Budget
from .checkpoint import CheckpointError, load_checkpoint, resume_adapters, save_checkpoint
from .device import NO_NATIVE_BF16, native_bf16
from .distributed import SINGLE, Group
from .files import read_json
from .footprint import reuse_freed_memory
from .lora import lora_layers
from .optimizers import OPTIMIZERS, build_optimizer
from .progress import Progress, RunLog
from .rundir import claim, holds, resumable
from .runtime import Runtime
from .sharding import gathered, gathered_weights, local, scattered, shard
from .tokenizers import Tokenizer

log = logging.getLogger(__name__)

SCHEDULES = ("inverse_sqrt", "cosine", "wsd", "constant")
WSD_COOLDOWN = 0.2  # wsd: the share of the run (after warmup) over which the rate falls (MiniCPM 0.1, speedruns 0.4)
TIE_BREAKER = "val_loss"  # picks the best checkpoint when the selection metric ties (lower is better)


class Task(Protocol):
    """What the loop needs from a task.

    ``model`` is the task's model, the one trained and saved. Its loss and evaluation run the model they are
    given: the trainer passes the DDP wrapper of ``model`` to :meth:`loss` in a distributed run (``model`` itself
    otherwise), and ``model`` itself, in eval mode, to :meth:`evaluate`. A task may also have a ``cool_down()``
    method: the trainer calls it before every step of wsd's cool-down (:func:`cooling_down`); the image classifier's
    stops leaving patches out there.
    """

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

    def loss(self, model: nn.Module, batch: Any) -> tuple[Tensor, int]:
        """(summed loss over the batch's items, number of those items), computed by ``model``. A task may also have
        a ``step_metrics()`` method: what its losses since the last call add up to besides (``{name: tensor}``,
        summed over the items); the trainer divides them by the step's items and logs them with the loss."""
        ...

    def evaluate(self, model: nn.Module, group: Group = SINGLE) -> dict[str, float]:
        """Validation numbers of ``model``, e.g. {"val_loss": ..., "val_bleu": ...}; in a distributed run each rank
        takes its ``group.shard`` of the work and the numbers are combined with ``group.sum`` / ``group.gather``."""
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
    optimizer: str = "adamw"  # or "muon": see qkv.optimizers
    muon_lr: float = 0.02  # Muon's peak learning rate (--lr is AdamW's)
    schedule: str = "inverse_sqrt"
    warmup: int = 1000
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.98)
    clip: float = 1.0
    accum: int = 1
    device: str = "cpu"  # see qkv.device: auto, cpu, cuda, cuda:N (unless the Trainer is given a Runtime)
    precision: str = "fp32"  # auto, fp32, bf16, fp16 (fp16 on CUDA only, with a gradient scaler; idem)
    compile: bool = False  # torch.compile the model's forward (and backward) before training
    fsdp: bool = False  # in several processes, shard the model (qkv.sharding) instead of replicating it (DDP)
    eval_every: int = 500
    eval_at_minutes: tuple[float, ...] = ()  # also evaluate when the run's wall-clock passes these marks
    stop_at: float | None = None  # stop once the task's selection metric reaches this value
    final_scoring: float = 0.0  # the caller's work after the run (a test set), in evaluations: reserved by max_minutes
    started: float | None = None  # time.monotonic() when the command began: its setup counts in max_minutes too
    log_every: int = 50  # at most: a run of N steps logs its first step and every min(log_every, N // 10)
    seed: int = 0
    resume: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if self.max_steps is None and self.epochs is None and self.max_minutes is None:
            raise ValueError("give a budget: max_steps, epochs or max_minutes (on the command line: --max-steps, "
                             "--epochs or --max-minutes)")
        for name in ("max_steps", "epochs", "max_minutes", "lr", "muon_lr"):
            _positive(name, getattr(self, name), optional=name not in ("lr", "muon_lr"))
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {list(OPTIMIZERS)}, got {self.optimizer!r}")
        for minutes in self.eval_at_minutes:
            _positive("eval_at_minutes", minutes, optional=False)
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {self.schedule!r}")
        if self.accum < 1 or self.eval_every < 1 or self.log_every < 1 or self.warmup < 0:
            raise ValueError("accum, eval_every and log_every must be >= 1 and warmup >= 0")
        for name in ("clip", "weight_decay", "min_lr_ratio", "final_scoring"):
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
    * wsd (warmup-stable-decay): ``lr`` held flat, then down in a straight line to ``lr · min_lr_ratio`` over the
      last :data:`WSD_COOLDOWN` of the run (steps or time, as cosine): most of the run at the full rate, and the
      loss drops in the cool-down, where cosine spends half the run below half the rate;
    * constant.
    """
    step = max(step, 1)
    if opts.warmup and step <= opts.warmup:
        return opts.lr * step / opts.warmup
    if opts.schedule == "inverse_sqrt":
        return opts.lr * math.sqrt(max(opts.warmup, 1) / step)
    progress = _progress(step, opts, total_steps, time_fraction)
    if opts.schedule in ("cosine", "wsd") and progress is not None:
        floor = opts.lr * opts.min_lr_ratio
        if opts.schedule == "wsd":
            return opts.lr - (opts.lr - floor) * max(0.0, (progress - 1 + WSD_COOLDOWN) / WSD_COOLDOWN)
        return floor + (opts.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return opts.lr


def _progress(step: int, opts: TrainOptions, total_steps: int | None, time_fraction: float | None) -> float | None:
    """The share of the run after warmup that ``step`` has reached, by steps or by time; None when the run has
    neither budget."""
    if total_steps:
        return min(1.0, (step - opts.warmup) / max(1, total_steps - opts.warmup))
    return None if time_fraction is None else min(1.0, max(0.0, time_fraction))


def cooling_down(step: int, opts: TrainOptions, total_steps: int | None, time_fraction: float | None = None) -> bool:
    """Whether ``step`` is in wsd's cool-down, the last :data:`WSD_COOLDOWN` of the run, where the rate falls.
    A task may train differently there (its ``cool_down()``, see :class:`Task`)."""
    if opts.schedule != "wsd" or step <= opts.warmup:
        return False
    progress = _progress(step, opts, total_steps, time_fraction)
    return progress is not None and progress > 1 - WSD_COOLDOWN


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


class _Counted(Sequence):
    """A task's validation batches that move a progress bar as they are gone through: slices (a process's share,
    :meth:`qkv.distributed.Group.shard`) count too, each pass adding its batches to the bar's total."""

    def __init__(self, items: Sequence, bar) -> None:
        self.items, self.bar = items, bar

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index):
        return _Counted(self.items[index], self.bar) if isinstance(index, slice) else self.items[index]

    def __iter__(self) -> Iterator[Any]:
        self.bar.total = (self.bar.total or 0) + len(self.items)
        self.bar.refresh()
        for item in self.items:
            yield item
            self.bar.update(1)


@contextlib.contextmanager
def _validation_bar(task: Task, show: bool) -> Iterator[None]:
    """A progress bar under the training bar while ``task`` validates (``show``), for a task whose evaluation goes
    through ``task.valid_batches()``: a validation of hundreds of examples takes minutes on a CPU."""
    batches = getattr(task, "valid_batches", None)
    if not show or batches is None:
        yield
        return
    from tqdm import tqdm

    bar = tqdm(total=0, desc="validating", unit="batch", position=1, leave=False, dynamic_ncols=True)
    task.valid_batches = lambda: _Counted(batches(), bar)
    try:
        yield
    finally:
        del task.valid_batches  # the task's own method again
        bar.close()


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


@dataclass
class TrainState:
    """Where a run stands: saved whole in ``last/trainer_state.pt`` (beside the optimizer's and the RNGs' states)
    and restored whole by ``--resume``.

    Attributes:
        batch_index: the next batch of epoch ``epoch`` to train on.
        tokens_seen: the items (the task's ``unit``) trained on so far.
        elapsed_s: the wall-clock seconds of the run's earlier invocations; saved as those up to the save, which is
            where a resumed invocation's clock goes on from.
        eval_s: how long the last evaluation and save took (None before the first): reserved at the end of a time
            budget for the final one.
        best: the best evaluation so far, with its ``step`` (None before the first).
    """

    step: int = 0
    epoch: int = 0
    batch_index: int = 0
    tokens_seen: int = 0
    elapsed_s: float = 0.0
    eval_s: float | None = None
    best: dict[str, float] | None = None

    @classmethod
    def saved(cls, state: dict[str, Any]) -> TrainState:
        """From a saved trainer state: today's, or an earlier qkv's (no ``elapsed_s`` or ``eval_s``; ``{}`` for no
        best)."""
        names = {f.name for f in fields(cls)}
        return cls(**{**{k: v for k, v in state.items() if k in names}, "best": state.get("best") or None})


class Trainer:
    """Runs a task under a set of options: ``Trainer(task, opts).run()``.

    The loop of the notes, at a glance (:meth:`_run`)::

        for chunk in batches, epoch after epoch:       # _chunks: accumulation groups, from where a run stopped
            step: forward, loss, backward, clip, update  # _step
            after the step: log, evaluate and save, or stop  # _after_step

    Everything else is a small piece of its own: the device, precision and process group (a
    :class:`~qkv.runtime.Runtime`, given by the command or resolved here from ``opts.device`` and
    ``opts.precision``), when to evaluate and stop (:class:`~qkv.budget.Budget`), where the run stands
    (:class:`TrainState`), what the run shows and records (:mod:`qkv.progress`), its directory
    (:mod:`qkv.rundir`), its checkpoints.
    """

    def __init__(self, task: Task, opts: TrainOptions, *, runtime: Runtime | None = None) -> None:
        self.task, self.opts = task, opts
        self.out = Path(opts.out)
        self.runtime = Runtime.resolve(opts.device, opts.precision, training=True) if runtime is None else runtime
        self.device, self.group = self.runtime.device, self.runtime.group
        self.model = task.model.to(self.device)  # in place: the task's model is the one trained and saved
        if opts.compile:
            self.model.compile()  # in place: the module, its type and its state dict stay as they are
        # What the training forward passes run: in several processes the DDP wrapper, which averages the
        # gradients in the backward pass (see _synchronising); evaluation and checkpoints use the model itself.
        # Sharded (FSDP), the model is its own training model, changed in place.
        self.ddp, self.sharded = None, opts.fsdp and self.group.world > 1
        if self.sharded:
            shard(self.model, self.device.type)
        elif self.group.world > 1:  # qkv's buffers are constants (position tables, quantized codes): not resent
            self.ddp = DistributedDataParallel(self.model, device_ids=[self.device.index] if
                                               self.device.type == "cuda" else None, broadcast_buffers=False)
        self.training_model = self.model if self.ddp is None else self.ddp
        self.unit = getattr(task, "unit", "tokens")
        self.budget = Budget.of(opts, task)
        self.optimizer = build_optimizer(self.model, kind=opts.optimizer, lr=opts.lr, muon_lr=opts.muon_lr,
                                         betas=opts.betas, weight_decay=opts.weight_decay)
        self.peak_lrs = [group["lr"] for group in self.optimizer.param_groups]  # each scaled by the schedule
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.runtime.precision.needs_scaler)
        self.state = TrainState()
        self.started = time.monotonic()  # when this invocation's clock starts (see _run)
        self.step_s = 0.0  # how long the last step took: the next one must fit in a time budget too
        self.step_metrics: dict[str, float] = {}  # the task's other numbers of the last step (step_metrics())
        self.log = RunLog(self.out / "log.csv")

    def run(self) -> TrainResult:
        """Train until a budget, the target or a signal stops the run. The run directory is claimed here unless
        this process holds it already (a command claims it for its whole run, see :func:`qkv.rundir.claim`);
        rank 0 alone claims it."""
        mine = self.group.main and not holds(self.out)
        with claim(self.out, resume=self.opts.resume) if mine else contextlib.nullcontext():
            return self._run()

    # --- the loop -------------------------------------------------------------------------------------
    def _run(self) -> TrainResult:
        self._start()
        total = self._total_steps()
        title, main = self.task.meta.get("title", ""), self.group.main
        # A short run still gets about ten training rows, not none.
        log_every = self.opts.log_every if total is None else min(self.opts.log_every, max(1, total // 10))
        progress = Progress(self.log if main else None, unit=self.unit, title=title or "train", total=total,
                            initial=self.state.step, show=self.opts.progress and main, log_every=log_every,
                            max_minutes=self.opts.max_minutes, plot_title=title, main=main)
        # The clock runs from the command's start when the caller gives it: reading data and training a tokenizer
        # are part of the minutes a user asked for.
        self.started = time.monotonic() if self.opts.started is None else self.opts.started
        self.last_eval: dict[str, float] | None = None
        self.model.train()
        reason = ""
        first = self.state.step + 1
        with _StopFlag() as stop:
            if main:
                self._say_precision()
            log.info("training from step %d; Ctrl-C stops after the current step and saves", self.state.step)
            for chunk in self._chunks():
                previous_s = self._run_s()
                start = time.monotonic()
                loss, items, lr = self._step(chunk, total)
                seconds = time.monotonic() - start
                if self.state.step > first:  # the first step warms up (allocations, --compile): no measure of the next
                    self.step_s = seconds
                progress.step(step=self.state.step, epoch=self.state.epoch, loss=loss, items=items, lr=lr,
                              seconds=seconds, run_s=self._run_s(), extra=self.step_metrics)
                reason = self._after_step(total, previous_s, stop.signal, progress)
                if reason:
                    break
        progress.close()
        return TrainResult(self.state.step, self.state.epoch, reason, self.state.best, self.last_eval, self._run_s(),
                           progress.rate(), self.unit, stop.signal)

    def _say_precision(self) -> None:
        """How ``auto`` chose the precision; and bf16 asked for on a CPU without native bf16, where it is several
        times slower than fp32 (the note ``auto`` gives when it chooses fp32 for that reason)."""
        precision = self.runtime.precision
        if precision.why:
            log.info("precision: %s (%s)", precision.name, precision.why)
        elif precision.name == "bf16" and self.device.type == "cpu" and native_bf16() is None:
            log.warning("precision: bf16, as --precision asks, but %s: --precision auto (fp32 here) trains faster",
                        NO_NATIVE_BF16)

    def _chunks(self) -> Iterator[Sequence[Any]]:
        """The batches of each step (``accum`` per process), epoch after epoch, from the position a resumed run
        stopped at. The position moves past a step's batches when they are handed out, so a checkpoint after
        the step resumes after them. In a distributed run an epoch's last few batches, too few to give every
        process one, are left out, and a shorter last step's batches are as many for each (a sharded model's
        processes run their forward passes together)."""
        size, state, world = self.opts.accum * self.group.world, self.state, self.group.world
        while True:
            batches = self.task.batches(state.epoch)
            while len(batches) - state.batch_index >= world:
                chunk = batches[state.batch_index : state.batch_index + size]
                chunk = chunk[: len(chunk) - len(chunk) % world]
                state.batch_index += len(chunk)
                yield chunk
            state.epoch, state.batch_index = state.epoch + 1, 0

    def _step(self, batches: Sequence[Any], total: int | None) -> tuple[float, int, float]:
        """One optimizer step over ``batches`` (gradient accumulation): the loss is the mean over every item
        of all of them, so accumulating k batches equals one batch k times as large. A loss or gradient that
        is not finite is never applied to the weights. Returns (mean loss, items, learning rate)."""
        fraction = self.budget.time_fraction(self._run_s()) if total is None else None
        lr = learning_rate(self.state.step + 1, self.opts, total, fraction)
        if cooling_down(self.state.step + 1, self.opts, total, fraction) and hasattr(self.task, "cool_down"):
            self.task.cool_down()
        for group, peak in zip(self.optimizer.param_groups, self.peak_lrs, strict=True):
            group["lr"] = lr * (peak / self.opts.lr)  # AdamW's exactly lr; Muon's in proportion
        n_items = sum(batch.n_tokens for batch in batches)  # all processes' items, counted on the host
        mine = self.group.shard(batches)
        total_loss = torch.zeros((), device=self.device)
        for i, batch in enumerate(mine):  # backward per batch: only one batch's activations are alive at a time
            with self._synchronising(i == len(mine) - 1), self.runtime.autocast():
                loss_sum, _ = self.task.loss(self.training_model, batch)
            # DDP averages the processes' gradients: scaled by their number, the sum is over all their items
            self.scaler.scale(loss_sum.float() * self.group.world / max(n_items, 1)).backward()
            total_loss += loss_sum.detach().float()
        self.scaler.unscale_(self.optimizer)
        norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.opts.clip if self.opts.clip > 0 else math.inf)
        norm = gathered(norm) if self.sharded else norm
        extra = self.task.step_metrics() if hasattr(self.task, "step_metrics") else {}
        values = torch.stack([total_loss.double(), *(v.double().to(total_loss.device) for v in extra.values())])
        sums = self.group.sum(dict(zip(["loss", *extra], values.tolist(), strict=True)))  # the step's one wait
        loss = sums.pop("loss") / max(n_items, 1)
        self.step_metrics = {key: value / max(n_items, 1) for key, value in sums.items()}
        # With fp16 an infinite gradient is routine: the scaler skips that step and lowers its scale.
        if not math.isfinite(loss) or not (self.scaler.is_enabled() or bool(torch.isfinite(norm))):
            self.optimizer.zero_grad(set_to_none=True)
            what = f"loss {loss}" if not math.isfinite(loss) else f"gradient norm {float(norm)}"
            raise self._diverged(self.state.step + 1, what)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1
        self.state.tokens_seen += n_items
        return loss, n_items, lr

    def _synchronising(self, last: bool) -> contextlib.AbstractContextManager:
        """DDP averages the gradients in the backward pass of a step's last batch only (``last``): the others'
        accumulate locally. A sharded model reduces each batch's into its shards (no whole gradient is kept)."""
        return self.ddp.no_sync() if self.ddp is not None and not last else contextlib.nullcontext()

    def _after_step(self, total: int | None, previous_s: float, interrupted_by: int | None,
                    progress: Progress) -> str:
        """Evaluate and save when it is time; the reason to stop, or "". Rank 0's clock and signals decide, for
        every process of a distributed run."""
        run_s = self._run_s()
        reason = self._stop_reason(total, run_s, interrupted_by)
        due = bool(reason) or self.budget.evaluation_due(step=self.state.step, previous_s=previous_s, run_s=run_s,
                                                         eval_s=self.state.eval_s)
        reason, due = self.group.decide((reason, due))
        if due:
            progress.evaluating()
            self.last_eval = self._evaluate_and_save(progress)
            progress.evaluated(self.state.step, self.last_eval)
            reason = reason or self.budget.target_reached(self.last_eval)
            reason = self.group.decide(reason or self._stop_reason(total, self._run_s(), interrupted_by))
        return reason

    def _stop_reason(self, total: int | None, run_s: float, interrupted_by: int | None) -> str:
        return self.budget.stop_reason(step=self.state.step, total=total, run_s=run_s, step_s=self.step_s,
                                       eval_s=self.state.eval_s, interrupted_by=interrupted_by)

    def _total_steps(self) -> int | None:
        epochs = self.opts.epochs is not None  # an epoch's batches are made only when the budget counts them
        per_epoch = math.ceil(len(self.task.batches(self.state.epoch)) / self.opts.accum) if epochs else 0
        return self.budget.total_steps(per_epoch)

    # --- evaluation and checkpoints ---------------------------------------------------------------------
    def _evaluate_and_save(self, progress: Progress) -> dict[str, float]:
        start = time.monotonic()
        self.model.eval()
        with torch.no_grad(), self.runtime.autocast(), _validation_bar(self.task, self.opts.progress and
                                                                        self.group.main):
            # a sharded model's processes run every forward pass together: each evaluates all the batches
            metrics = self.task.evaluate(self.model, SINGLE if self.sharded else self.group)
        self.model.train()
        self._check_finite(metrics)
        rng = self.group.gather([torch.get_rng_state()])  # every process's, for an exact resume
        better = self._is_better(metrics)
        if better:
            self.state.best = {**metrics, "step": self.state.step}
        # One recoverable unit, in this order: the log's row (a resume drops rows past the step it resumes from),
        # last/ (what --resume needs, recording the best so far), then best/ (rewritten from last/ on resume when
        # a kill or a full disk stopped it, see _restore_best); the curve, drawn from the log, last.
        progress.row({"step": self.state.step, "epoch": self.state.epoch, "elapsed_s": round(self._run_s(), 1),
                      **metrics})
        self._save("last", with_state=True, rng=rng)
        if better:
            self._save("best", with_state=False)
        progress.curve()
        self.state.eval_s = time.monotonic() - start
        return metrics

    def _is_better(self, metrics: dict[str, float]) -> bool:
        """Better by the task's selection metric; a tie (no exact match in two early validations) falls to the
        validation loss, lower is better, so the more trained of two equally scored models is kept."""
        key, best = self.task.selection_metric, self.state.best
        if key not in metrics:
            return False
        if best is None or key not in best:
            return True
        if metrics[key] != best[key]:
            return metrics[key] > best[key] if self.task.higher_is_better else metrics[key] < best[key]
        return metrics.get(TIE_BREAKER, math.inf) < best.get(TIE_BREAKER, math.inf)

    def _check_finite(self, metrics: dict[str, float]) -> None:
        """A model gone to NaN or Inf must never become a checkpoint: stop, keeping the last good one."""
        bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
        finite = bool(torch.stack([torch.isfinite(local(p)).all() for p in self.model.parameters()]).all())
        if self.sharded:  # each process sees its own shards
            finite = self.group.sum({"finite": float(finite)})["finite"] == self.group.world
        if not bad and finite:
            return
        what = ", ".join(f"{k} {v}" for k, v in bad.items()) or "weights that are not finite"
        raise self._diverged(self.state.step, what)

    def _diverged(self, step: int, what: str) -> FloatingPointError:
        """The error of a run gone to NaN or Inf, with the advice that works for what this run has on disk:
        ``--resume`` only where there is a checkpoint to resume (the test of :func:`qkv.rundir.resumable`)."""
        if resumable(self.out):
            advice = f"{self.out / 'last'} is kept. Lower --lr or raise --warmup, then --resume from it"
        else:
            advice = ("nothing was saved (it diverged before its first checkpoint), so there is nothing to resume. "
                      f"Lower --lr or raise --warmup, and rerun into {self.out} without --resume")
        return FloatingPointError(f"training diverged at step {step} ({what}); {advice}")

    def _save(self, name: str, *, with_state: bool, rng: list | None = None) -> None:
        """Rank 0 writes: every rank holds the same weights, or (sharded) gathers them whole first."""
        weights = gathered_weights(self.model) if self.sharded else None
        trainer_state = self._trainer_state(rng) if with_state else None
        if not self.group.main:
            return
        meta = {**self.task.meta, "step": self.state.step, "best": self.state.best}
        save_checkpoint(self.out / name, self.model, tokenizers=self.task.tokenizers, meta=meta,
                        trainer_state=trainer_state, weights=weights)

    # --- the state a resumed run continues from -----------------------------------------------------------
    def _run_s(self) -> float:
        """The whole run's seconds so far: earlier invocations count."""
        return self.state.elapsed_s + time.monotonic() - self.started

    def _start(self) -> None:
        reuse_freed_memory()  # every step frees what the next allocates again: keep it (qkv.footprint)
        if self.opts.resume:
            self._restore()
            self.budget.check_left(self.out, step=self.state.step, run_s=self.state.elapsed_s,
                                   eval_s=self.state.eval_s)
        else:
            torch.manual_seed(self.opts.seed + self.group.rank)  # each process its own dropout masks
            if self.group.main:
                self.log.path.unlink(missing_ok=True)  # what an earlier start left before its first checkpoint

    def _trainer_state(self, rng: list | None = None) -> dict[str, Any]:
        return {
            **asdict(replace(self.state, elapsed_s=self._run_s())),
            "optimizer": gathered(self.optimizer.state_dict()) if self.sharded else self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "rank_rngs": rng or [],  # a distributed run's processes, in rank order
            "cuda_rng": torch.cuda.get_rng_state_all() if self.device.type == "cuda" else [],
            "options": asdict(self.opts),
        }

    def _restore(self) -> None:
        path = self.out / "last"
        try:
            if lora_layers(self.model):  # a LoRA run saved its adapters alone: its base is the one loaded now
                state = resume_adapters(self.model, path)
                self.optimizer.load_state_dict(state["optimizer"])
            else:
                ckpt = load_checkpoint(path, with_trainer_state=True)
                state = ckpt.trainer_state
                if self.sharded:  # each process keeps its shards of the whole tensors read
                    scattered(self.model, self.optimizer, ckpt.model.state_dict(), state["optimizer"])
                else:
                    self.model.load_state_dict(ckpt.model.state_dict())  # copied onto this run's device
                    self.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as err:
            if isinstance(err, CheckpointError):
                raise
            raise ValueError(f"{path} does not fit the model being resumed ({str(err).splitlines()[0]}); "
                             "resume a run with the command that started it") from None
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.state = TrainState.saved(state)
        rngs = state.get("rank_rngs") or []
        torch.set_rng_state(rngs[self.group.rank] if len(rngs) == self.group.world > 1 else state["torch_rng"])
        if self.device.type == "cuda" and len(state.get("cuda_rng", [])) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state["cuda_rng"])  # dropout on the GPU continues as it would have
        self.log.read(up_to_step=self.state.step)
        log.info("resumed from %s at step %d (epoch %d, batch %d) on %s", path, self.state.step,
                 self.state.epoch, self.state.batch_index, self.device)
        self._restore_best()

    def _restore_best(self) -> None:
        """best/ as last/ records it: a run stopped between its two saves (killed, a full disk) left last/ naming a
        best step that best/ does not hold; when that step is the one resumed, the model in hand is that best
        model, and is saved as best/ again."""
        best = self.state.best
        if not best or best.get("step") != self.state.step:
            return
        try:
            saved_step = read_json(self.out / "best" / "config.json", required=False).get("step")
        except ValueError:  # damaged: replaced by the model in hand
            saved_step = None
        if saved_step != self.state.step:
            log.info("%s: best/ (step %s) was not saved after step %d's evaluation; saved now from last/",
                     self.out, saved_step, self.state.step)
            self._save("best", with_state=False)
