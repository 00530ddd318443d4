"""What the commands share: merging typed options with a stored run's, for ``--resume``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path


def settings(args: argparse.Namespace, defaults: dict, *, paths: Sequence[str] = ()) -> dict:
    """Defaults, then (with --resume) what the run stored, then what was typed now.

    Every option of a train command defaults to None in its parser, so typed options can be told from the
    rest. File options named in ``paths`` are stored absolute, so ``--resume`` works from any directory.
    """
    typed = {k: v for k, v in vars(args).items() if k in defaults and v is not None}
    for key in paths:
        if typed.get(key) is not None:
            value = typed[key]
            typed[key] = [str(Path(v).resolve()) for v in value] if isinstance(value, list) else str(
                Path(value).resolve())
    stored = {}
    if args.resume:
        from ..checkpoint import CheckpointError, resolve

        try:
            last = resolve(Path(args.out) / "last")
        except CheckpointError:
            raise ValueError(f"{args.out} has no checkpoint to resume; drop --resume to start a new run") from None
        stored = json.loads((last / "config.json").read_text(encoding="utf-8")).get("args", {})
    return {**defaults, **stored, **typed}


def refuse_to_overwrite(out: Path, resume: bool) -> None:
    """A new run never replaces a trained model."""
    if not resume and ((out / "last").exists() or (out / "best").exists()):
        raise ValueError(f"{out} already holds a trained model; pass --resume to continue it, or choose another --out")


def read_inputs(texts: list[str], input_file: str | None, what: str, *, keep_blank: bool = False) -> list[str]:
    """Sentences from the arguments, else ``--input FILE``, else stdin, one per line.

    ``keep_blank`` keeps every line as it is, so outputs stay line-aligned with the input (translation);
    otherwise lines are stripped and blank ones skipped.
    """
    from ..data import read_lines

    if texts and input_file:
        raise ValueError("give sentences as arguments or with --input, not both")
    if input_file:
        lines = read_lines(input_file)
    elif texts:
        lines = texts
    elif not sys.stdin.isatty():
        lines = sys.stdin.read().splitlines()
    else:
        lines = []
    if not any(line.strip() for line in lines):
        raise ValueError(f"nothing to {what}: give sentences as arguments, with --input FILE, or on stdin")
    return lines if keep_blank else [line.strip() for line in lines if line.strip()]


def add_training_arguments(p: argparse.ArgumentParser, defaults: dict, *, batch: tuple[str, str],
                           lr_help: str | None = None, warmup_help: str | None = None) -> argparse._ArgumentGroup:
    """The options every ``qkv train`` command shares: budget, batch, optimizer, schedule, checkpoints.

    ``batch`` is the batch option's flag and what it counts (``("--batch-size", "windows per batch")``); help
    texts show the command's own ``defaults``. Returns the group, for the command's own training options.
    """
    train = p.add_argument_group("training")
    train.add_argument("--out", required=True, help="run directory: checkpoints, log.csv, loss.png")
    train.add_argument("--resume", action="store_true", help="continue the run in --out exactly where it stopped")
    train.add_argument("--max-steps", type=int)
    train.add_argument("--epochs", type=float)
    train.add_argument("--max-minutes", type=float,
                       help="wall-clock budget of the whole run (--resume counts the minutes already trained)")
    flag, counts = batch
    train.add_argument(flag, type=int, help=f"{counts} ({defaults[flag[2:].replace('-', '_')]})")
    train.add_argument("--accum", type=int, help="batches per optimizer step (gradient accumulation)")
    train.add_argument("--lr", type=float, help=lr_help or f"peak learning rate ({defaults['lr']:g})")
    train.add_argument("--warmup", type=int, help=warmup_help or f"warmup steps ({defaults['warmup']})")
    train.add_argument("--schedule", choices=["cosine", "inverse_sqrt", "constant"],
                       help=f"after warmup ({defaults['schedule']}); cosine decays to --min-lr-ratio × --lr by the "
                            "end of --max-steps/--epochs or, without them, of --max-minutes")
    train.add_argument("--min-lr-ratio", type=float,
                       help=f"cosine floor as a fraction of --lr ({defaults['min_lr_ratio']:g})")
    train.add_argument("--clip", type=float, help=f"gradient-norm clipping ({defaults['clip']}; 0 disables)")
    train.add_argument("--weight-decay", type=float, help=f"AdamW weight decay ({defaults['weight_decay']:g})")
    train.add_argument("--bf16", action="store_true", default=None, help="bf16 autocast (slower without AMX)")
    train.add_argument("--eval-every", type=int,
                       help=f"steps between validations and checkpoints ({defaults['eval_every']})")
    train.add_argument("--eval-at-minutes", type=float, nargs="+", metavar="M",
                       help="also validate (and checkpoint) when the run has trained this many minutes")
    train.add_argument("--seed", type=int)
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    return train


def train_options(s: dict, args: argparse.Namespace, **fixed):
    """``TrainOptions`` from merged settings ``s`` (see :func:`settings`); ``fixed`` sets what a command decides
    itself (``betas``, a learning rate that depends on the starting point)."""
    from ..training import TrainOptions

    chosen = {k: s[k] for k in ("max_steps", "epochs", "max_minutes", "lr", "schedule", "warmup", "weight_decay",
                                "clip", "accum", "bf16", "eval_every", "seed")}
    if s.get("min_lr_ratio") is not None:
        chosen["min_lr_ratio"] = s["min_lr_ratio"]
    chosen["eval_at_minutes"] = tuple(s.get("eval_at_minutes") or ())
    return TrainOptions(**{**chosen, **fixed}, out=str(args.out), resume=args.resume, progress=not args.no_progress)
