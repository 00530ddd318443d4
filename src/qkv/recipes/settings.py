"""A training run's settings: the typed defaults of its recipe, then (with ``--resume``) what the run stored,
then what was typed now; and the record of the run's data files that ``--resume`` checks.

Every option of a ``qkv train`` recipe defaults to None in its parser, so typed options can be told from the
rest; the defaults are the recipe's settings dataclass (:class:`TrainingSettings` and its subclasses), written
once and shown by ``--help`` from there.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

# The command that made a run, by the task its checkpoints record (runs made before "command" was recorded).
TASK_COMMANDS = {"translation": "train", "language_model": "train lm", "masked_lm": "train mlm",
                 "classify": "train classify"}
# What a resumed run may change: its budget, the optimizer's settings and when it evaluates. Everything else
# (data, tokenizer, model, batching, seed, what validation measures) is the run's and stays as it was.
RESUMABLE = frozenset({"max_steps", "epochs", "max_minutes", "eval_every", "eval_at_minutes", "lr", "muon_lr", "warmup",
                       "schedule", "min_lr_ratio", "clip", "weight_decay", "accum", "label_smoothing",
                       "teacher_forcing"})  # and --device, --precision: how this invocation runs, never stored
BEFORE_RECIPES = "classic"  # the recipe of the runs made before recipes had names
# Where a run's checkpoints record its data files as they were when it started, for --resume to check:
# {absolute path: {"size": bytes, "sha256": hex}}.
DATA_FILES = "data_files"


@dataclass
class TrainingSettings:
    """What every recipe has: the budget, the optimizer and its schedule, evaluation times, the seed. A recipe's
    own dataclass adds its data, tokenizer and model fields and may give these other defaults."""

    max_steps: int | None = None
    epochs: float | None = None
    max_minutes: float | None = None
    accum: int = 1
    optimizer: str = "adamw"
    lr: float | None = 1e-3
    muon_lr: float = 0.02
    warmup: int = 200
    schedule: str = "cosine"
    min_lr_ratio: float = 0.0
    clip: float = 1.0
    weight_decay: float = 0.01
    eval_every: int = 500
    eval_at_minutes: list[float] | None = None
    seed: int = 0
    recipe: str | None = None  # the named defaults the run started from (Recipe.RECIPES); None: classic


@dataclass
class ModelIngredients:
    """The Transformer trainers' switches of the modern recipe (see :mod:`qkv.optimizers` for Muon): the
    feed-forward activation (relu2: ReLU squared), norms on each head's queries and keys, and residual
    projections (and an untied output layer) starting at zero. None: the preset's."""

    activation: str | None = None
    qk_norm: bool | None = None
    zero_init: bool | None = None


INGREDIENTS = tuple(f.name for f in fields(ModelIngredients))


def merged_settings(args: argparse.Namespace, defaults: dict, *, command: str, paths: Sequence[str] = (),
                    recipes: dict[str, dict] | None = None) -> dict:
    """Defaults, then (with --resume) what the run stored, then what was typed now.

    ``recipes`` names sets of defaults over ``defaults`` (the first is a new run's unless ``--recipe`` names
    another); a resumed run starts from its own, and one stored before recipes existed from ``classic``.

    File options named in ``paths`` are stored absolute, so ``--resume`` works from any directory. On
    ``--resume`` a typed option outside :data:`RESUMABLE` must equal the stored one, and the data files must
    be those the run started with (same size and sha256, where the run recorded them). The result's
    :data:`DATA_FILES` is that record, for the run's meta.

    Raises:
        ValueError: for a run of another command, a typed option that would change what the run is, or (on
            ``--resume``) a data file that changed since the run started.
    """
    typed = {k: v for k, v in vars(args).items() if k in defaults and v is not None}
    for key in paths:
        if typed.get(key) is not None:
            value = typed[key]
            typed[key] = [_absolute(v) for v in value] if isinstance(value, list) else _absolute(value)
    stored = _stored_args(Path(args.out), command) if args.resume else {}
    recorded = stored.pop(DATA_FILES, None)
    if recipes:
        name = stored.get("recipe") or (BEFORE_RECIPES if args.resume else typed.get("recipe") or next(iter(recipes)))
        defaults = {**defaults, **recipes[name], "recipe": name}
    if args.resume:
        for key, value in typed.items():
            before = stored.get(key, defaults[key])
            if key not in RESUMABLE and value != before:
                raise ValueError(f"{_flag(key)} {_shown(value)} differs from this run's {_shown(before)}: a resumed "
                                 "run keeps its data, tokenizer and model (only the budget, the optimizer's settings "
                                 f"and evaluation times can change); drop {_flag(key)}, or start a new run with "
                                 "another --out")
    merged = {**defaults, **stored, **typed}
    files = [f for key in paths for f in (merged[key] if isinstance(merged[key], list) else [merged[key]]) if f]
    return {**merged, DATA_FILES: _data_files(files, recorded if isinstance(recorded, dict) else {})}


def _stored_args(out: Path, command: str) -> dict:
    """The options a run was started with, checked to belong to ``qkv {command}``."""
    from ..checkpoint import read_meta

    meta = read_meta(out / "last")
    made_by = meta.get("command") or TASK_COMMANDS.get(meta.get("task"))
    if "args" not in meta or made_by is None:
        raise ValueError(f"{out} was not made by a qkv train command (it records no options), so it cannot be "
                         "resumed; start a new run with another --out")
    if made_by != command:
        raise ValueError(f"{out} is a `qkv {made_by}` run, not a `qkv {command}` one; resume it with "
                         f"`qkv {made_by} --out {out} --resume`")
    return {**meta["args"], DATA_FILES: meta.get(DATA_FILES)}


def _data_files(files: Sequence[str], recorded: dict) -> dict:
    """Size and sha256 of each regular file of the run's data (a pipe is read once, so never hashed), checked
    against the record of the run's start where there is one (a run from before records none)."""
    from ..files import file_sha256

    now = {}
    for name in files:
        path = Path(name)
        if not path.is_file():
            continue  # a pipe, or missing: reading the data says what is wrong
        now[name] = {"size": path.stat().st_size, "sha256": file_sha256(path)}
        before = recorded.get(name)
        if isinstance(before, dict) and before != now[name]:
            change = (f"size {before.get('size')} -> {now[name]['size']} bytes" if before.get("size") !=
                      now[name]["size"] else "same size, another sha256")
            raise ValueError(f"{name} changed since the run started ({change}); resume with the original data, or "
                             "start a new run with another --out")
    return now


def _absolute(path: str) -> str:
    """A file option's path from the root. A pipe (``--src <(zcat train.de.gz)``, /dev/fd/63) keeps its name:
    resolved, it would become /proc/PID/fd/pipe:[N], which names nothing that can be opened."""
    p = Path(path)
    return str(p.resolve() if p.is_file() else p.absolute())


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _shown(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)
