"""What every training recipe does, once: start the run, build or resume the model, train, report.

A recipe is a class with typed settings (a :class:`~qkv.recipes.settings.TrainingSettings` dataclass) and three
steps of its own, in the order :meth:`Recipe.run` calls them::

    setup()   the data, then the tokenizer and model config: new, or the resumed run's (resumed())
    task()    the model (built(...), its size logged) inside the recipe's Task, with the run's meta(...)
    finish()  after a run that ended well, on rank 0: a sample, a test score

Around them :meth:`Recipe.run` resolves the device, precision and process group once (a
:class:`qkv.runtime.Runtime`), owns ``--out`` for the whole run (:func:`qkv.rundir.claim`), merges the settings
(:func:`~qkv.recipes.settings.merged_settings`), seeds every random source before anything random happens, runs
the :class:`qkv.training.Trainer` and prints how the run ended.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import random
import signal
import sys
from pathlib import Path
from typing import ClassVar

from .settings import DATA_FILES, TrainingSettings, merged_settings

log = logging.getLogger("qkv")

VOCAB_MULTIPLE = 64  # embedding and output tables of new models padded to whole tiles (ModelConfig.table_rows)


class Recipe:
    """One way to train a model from the command line (``qkv train NAME``)."""

    name: ClassVar[str]  # qkv train NAME
    command: ClassVar[str]  # what the run's checkpoints record as the command that made them
    summary: ClassVar[str]  # its line in `qkv train --help`
    Settings: ClassVar[type[TrainingSettings]]
    paths: ClassVar[tuple[str, ...]] = ()  # the settings that name data files: stored absolute, hashed for --resume
    betas: ClassVar[tuple[float, float]] = (0.9, 0.999)  # AdamW's
    # Named sets of defaults over Settings() (``--recipe``); the first is a new run's.
    RECIPES: ClassVar[dict[str, dict]] = {"classic": {}}
    # The first recipe's depth by the time it is given: (from this --max-minutes, n_layers) in rising order, the
    # last one the budget reaches applies (None: the preset's depth; no --max-minutes: none applies).
    LAYERS_BY_MINUTES: ClassVar[tuple[tuple[float, int | None], ...]] = ()

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.out = args, Path(args.out)
        self.s: TrainingSettings = self.Settings()
        self.data_files: dict = {}
        self.runtime = None

    @classmethod
    def main(cls, args: argparse.Namespace) -> int:
        """The command's entry point; its exit status (see :func:`report`)."""
        return cls(args).run()

    # --- the steps of a recipe ------------------------------------------------------------------------------

    def defaults(self) -> dict:
        return dataclasses.asdict(self.Settings())

    def recipes(self) -> dict[str, dict]:
        """The named sets of defaults this run may start from (:attr:`RECIPES`), the first one's depth following
        ``--max-minutes`` (:attr:`LAYERS_BY_MINUTES`; a typed ``--n-layers`` wins, a resumed run keeps its model)."""
        minutes = getattr(self.args, "max_minutes", None)
        layers = [n for start, n in self.LAYERS_BY_MINUTES if minutes is not None and minutes >= start][-1:]
        if layers in ([], [None]):
            return self.RECIPES
        first = next(iter(self.RECIPES))
        return {**self.RECIPES, first: {**self.RECIPES[first], "n_layers": layers[-1]}}

    def prepare(self) -> None:
        """Before the settings are merged: checks of the typed options and paths made absolute."""

    def setup(self) -> None:
        raise NotImplementedError

    def task(self):
        raise NotImplementedError

    def finish(self) -> None:
        """After a run that ended well, on rank 0."""

    def learning_rate(self) -> float:
        return self.s.lr

    # --- the run --------------------------------------------------------------------------------------------

    def run(self) -> int:
        import time

        import torch._dynamo  # torch, and what any torch.optim optimizer imports: imports, outside the clock

        from ..distributed import current
        from ..rundir import claim
        from ..runtime import Runtime
        from ..training import Trainer

        self.args.started = time.monotonic()  # --max-minutes counts from here: reading data, tokenizers
        self.prepare()
        # A device this machine lacks fails first; --precision auto may measure bf16 against fp32 here.
        self.runtime = Runtime.resolve(self.args.device, self.args.precision, training=True)
        with claim(self.args.out, resume=self.args.resume) if self.runtime.group.main else contextlib.nullcontext():
            merged = merged_settings(self.args, self.defaults(), command=self.command, paths=self.paths,
                                     recipes=self.recipes())
            self.s = self.Settings(**{f.name: merged[f.name] for f in dataclasses.fields(self.Settings)})
            self.data_files = merged[DATA_FILES]
            torch.manual_seed(self.s.seed)
            random.seed(self.s.seed)
            opts = self.options()
            self.setup()
            status = report(Trainer(self.task(), opts, runtime=self.runtime).run(), self.out)
            if status == 0 and current().main:
                self.finish()
            return status

    def options(self):
        """The Trainer's options: the settings' budget and optimizer, this invocation's device and progress."""
        from ..training import TrainOptions

        s, args = self.s, self.args
        return TrainOptions(
            max_steps=s.max_steps, epochs=s.epochs, max_minutes=s.max_minutes, lr=self.learning_rate(),
            optimizer=s.optimizer, muon_lr=s.muon_lr,
            schedule=s.schedule, warmup=s.warmup, min_lr_ratio=s.min_lr_ratio, weight_decay=s.weight_decay,
            clip=s.clip, accum=s.accum, eval_every=s.eval_every, seed=s.seed, betas=self.betas,
            eval_at_minutes=tuple(s.eval_at_minutes or ()), out=str(self.out), resume=args.resume,
            progress=not args.no_progress, device=args.device, precision=args.precision, compile=args.compile,
            started=getattr(args, "started", None))

    # --- what the steps share -------------------------------------------------------------------------------

    def resumed(self):
        """The checkpoint the run goes on from (``--out``/last), or None for a new run."""
        from ..checkpoint import load_checkpoint

        return load_checkpoint(self.out / "last") if self.args.resume else None

    def built(self, model_cls, cfg, *, batch=None, inputs: int = 0, what: str = ""):
        """A new model for training, its size checked against the machine's memory first and then logged."""
        from ..footprint import build_model

        model = build_model(model_cls, cfg, training=True, batch=batch, inputs=inputs)
        log.info("model: %s, %.2fM parameters (%.2fM without embeddings)%s", model_cls.__name__,
                 model.num_parameters() / 1e6, model.num_parameters(exclude_embeddings=True) / 1e6, what)
        return model

    def meta(self, **extra) -> dict:
        """What every checkpoint of the run records: the command, its settings (for --resume), the run's name and
        data files."""
        return {"command": self.command, "args": dataclasses.asdict(self.s), "title": self.out.name,
                DATA_FILES: self.data_files, **extra}


def report(result, out: Path) -> int:
    """Print how the run ended (rank 0 of a distributed run); the exit status: 0, or 128 + the signal that
    stopped it (130 for Ctrl-C, 143 for SIGTERM), so that ``qkv train ... && qkv evaluate ...`` does not go on
    after an interrupted run."""
    from ..distributed import current
    from ..progress import format_metrics

    if not current().main:
        return 128 + result.signal if result.signal is not None else 0
    print(f"{result.stopped_because} after {result.step} steps ({result.epoch} epochs), {result.elapsed_s / 60:.1f} "
          f"min in all, {result.rate:,.0f} {result.unit.replace('_', ' ')}/s while training")
    if result.best:
        print(f"best: {format_metrics(result.best)}  -> {out / 'best'}")
    print(f"log: {out / 'log.csv'}, curve: {out / 'loss.png'}")
    if result.signal is not None:
        print(f"the run was stopped by {signal.Signals(result.signal).name}; {out / 'last'} holds it, to --resume",
              file=sys.stderr)
        return 128 + result.signal
    return 0
