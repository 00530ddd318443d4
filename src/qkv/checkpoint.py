"""Checkpoints: a directory of safetensors weights, a JSON config, the tokenizers and (for resuming) the
trainer's state.

    run/best/                    run/last/            (the same files, plus)
      config.json                  trainer_state.pt     optimizer, step, RNG: torch.load(weights_only=True)
      model.safetensors
      tokenizer.src.json
      tokenizer.tgt.json

Nothing is unpickled as code: weights are safetensors and the trainer state loads with ``weights_only=True``.
A checkpoint directory is written beside its final place and swapped in with a rename, so a crash while
saving leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import BERTClassifierConfig, BERTConfig, GPTConfig, RNNConfig, TransformerConfig
from .models import BERT, GPT, BERTClassifier, BERTForMaskedLM, Seq2Seq, Transformer
from .tokenizers import Tokenizer, load_tokenizer, save_tokenizer

ARCHITECTURES: dict[str, tuple[type[nn.Module], type]] = {
    "transformer": (Transformer, TransformerConfig),
    "lstm": (Seq2Seq, RNNConfig),  # all three variants: the config's `attention` says which
    "gpt": (GPT, GPTConfig),
    "bert": (BERT, BERTConfig),
    "bert-mlm": (BERTForMaskedLM, BERTConfig),
    "bert-classifier": (BERTClassifier, BERTClassifierConfig),
}

CONFIG, WEIGHTS, TRAINER_STATE = "config.json", "model.safetensors", "trainer_state.pt"


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or not qkv's."""


@dataclass
class Checkpoint:
    model: nn.Module
    arch: str
    meta: dict[str, Any]
    tokenizers: dict[str, Tokenizer]
    path: Path
    trainer_state: dict[str, Any] | None = field(default=None, repr=False)


def architecture_of(model: nn.Module) -> str:
    for name, (cls, _) in ARCHITECTURES.items():
        if type(model) is cls:
            return name
    raise TypeError(f"cannot save a {type(model).__name__}; known architectures: {sorted(ARCHITECTURES)}")


def save_checkpoint(
    directory: str | Path,
    model: nn.Module,
    *,
    tokenizers: dict[str, Tokenizer],
    meta: dict[str, Any] | None = None,
    trainer_state: dict[str, Any] | None = None,
) -> Path:
    """Write a checkpoint atomically: into a temporary sibling directory, then renamed into place."""
    from safetensors.torch import save_model

    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f".{directory.name}.tmp-{os.getpid()}"
    old = directory.parent / f".{directory.name}.old"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    config = {"arch": architecture_of(model), "model": model.config.to_dict(), **(meta or {})}
    (tmp / CONFIG).write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    save_model(model, str(tmp / WEIGHTS))  # shared (tied) tensors are stored once
    for side, tokenizer in tokenizers.items():
        save_tokenizer(tokenizer, tmp / f"tokenizer.{side}.json")
    if trainer_state is not None:
        torch.save(trainer_state, tmp / TRAINER_STATE)
    _fsync_dir(tmp)
    if directory.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(directory, old)
    os.replace(tmp, directory)
    shutil.rmtree(old, ignore_errors=True)
    return directory


def _fsync_dir(path: Path) -> None:
    for f in path.iterdir():
        with open(f, "rb") as handle:
            os.fsync(handle.fileno())


def resolve(path: str | Path) -> Path:
    """A checkpoint directory itself, or a run directory holding ``best/`` (preferred) or ``last/``.

    A save interrupted between its two renames leaves ``.NAME.old``; it is used if ``NAME`` is missing.
    """
    path = Path(path)
    for candidate in (path, path / "best", path / "last"):
        if (candidate / CONFIG).is_file():
            return candidate
        interrupted = candidate.parent / f".{candidate.name}.old"
        if not candidate.exists() and (interrupted / CONFIG).is_file():
            return interrupted
    if not path.exists():
        raise CheckpointError(f"{path}: no such model directory")
    raise CheckpointError(f"{path}: no qkv checkpoint here (expected {CONFIG} and {WEIGHTS}, or best/ or last/)")


def load_checkpoint(path: str | Path, *, with_trainer_state: bool = False) -> Checkpoint:
    """Rebuild the model from its config and load its weights; no code is executed from the files."""
    from safetensors import SafetensorError
    from safetensors.torch import load_model

    directory = resolve(path)
    try:
        config = json.loads((directory / CONFIG).read_text(encoding="utf-8"))
        arch = config["arch"]
        model_cls, config_cls = ARCHITECTURES[arch]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{directory / CONFIG} is not a qkv model config ({err})") from None
    model = model_cls(config_cls.from_dict(config["model"]))
    try:
        load_model(model, str(directory / WEIGHTS), strict=True)
    except FileNotFoundError:
        raise CheckpointError(f"{directory / WEIGHTS}: missing") from None
    except (SafetensorError, RuntimeError, OSError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{directory / WEIGHTS} is corrupted or does not fit the config: {first_line}") from None
    model.eval()
    tokenizers = {
        f.name.split(".")[1]: load_tokenizer(f) for f in sorted(directory.glob("tokenizer.*.json"))
    }
    trainer_state = None
    if with_trainer_state:
        state_path = directory / TRAINER_STATE
        if not state_path.is_file():
            raise CheckpointError(f"{directory} has no {TRAINER_STATE}; resume from a run's last/ checkpoint")
        try:
            trainer_state = torch.load(state_path, weights_only=True)
        except Exception as err:  # a truncated or foreign pickle: refuse it rather than guess
            raise CheckpointError(f"{state_path} cannot be loaded safely: {err}") from None
    meta = {k: v for k, v in config.items() if k not in ("arch", "model")}
    return Checkpoint(model, arch, meta, tokenizers, directory, trainer_state)
