"""Checkpoints: a directory of safetensors weights, a JSON config, the tokenizers and (for resuming) the
trainer's state.

    run/best/                    run/last/            (the same files, plus)
      config.json                  trainer_state.pt     optimizer, step, RNG: torch.load(weights_only=True)
      model.safetensors
      tokenizer.src.json
      tokenizer.tgt.json

Nothing is unpickled as code: weights are safetensors and the trainer state loads with ``weights_only=True``.
A checkpoint directory is written beside its final place and swapped in with a rename, so a crash while
saving leaves the previous checkpoint intact (what a kill leaves behind is cleaned up by
:func:`qkv.rundir.claim`). Loading refuses what cannot be used: a config whose model would not fit in memory,
unreadable or corrupted weights, and weights that are not finite.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import (
    BERTClassifierConfig,
    BERTConfig,
    CLIPConfig,
    GPTConfig,
    RNNConfig,
    SwinConfig,
    TransformerConfig,
    ViTConfig,
)
from .files import read_json
from .memory import build_model
from .models import (
    BERT,
    CLIP,
    GPT,
    BERTClassifier,
    BERTForMaskedLM,
    LSTMSeq2Seq,
    Swin,
    SwinClassifier,
    Transformer,
    ViT,
    ViTClassifier,
)
from .models.common import skip_init
from .tokenizers import Tokenizer, load_tokenizer, save_tokenizer

ARCHITECTURES: dict[str, tuple[type[nn.Module], type]] = {
    "transformer": (Transformer, TransformerConfig),
    "lstm": (LSTMSeq2Seq, RNNConfig),  # all three variants: the config's `attention` says which
    "gpt": (GPT, GPTConfig),
    "bert": (BERT, BERTConfig),
    "bert-mlm": (BERTForMaskedLM, BERTConfig),
    "bert-classifier": (BERTClassifier, BERTClassifierConfig),
    "vit": (ViT, ViTConfig),
    "vit-classifier": (ViTClassifier, ViTConfig),
    "swin": (Swin, SwinConfig),
    "swin-classifier": (SwinClassifier, SwinConfig),
    "clip": (CLIP, CLIPConfig),
}

CONFIG, WEIGHTS, TRAINER_STATE = "config.json", "model.safetensors", "trainer_state.pt"

log = logging.getLogger(__name__)


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

    @property
    def name(self) -> str:
        """What to call the model: its run directory's name for a run's best/ or last/, else its folder's."""
        return self.path.parent.name if self.path.name in ("best", "last") else self.path.name


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
    """Write a checkpoint atomically: into a temporary sibling directory, then renamed into place.

    Raises:
        OSError: if the files cannot be written (a full disk, say); the temporary directory is removed and the
            previous checkpoint, if any, is left as it was.
    """
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f".{directory.name}.tmp-{os.getpid()}"
    old = directory.parent / f".{directory.name}.old"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write(tmp, model, tokenizers, meta, trainer_state)
    except Exception as err:  # safetensors and torch.save report a full disk as their own error types
        shutil.rmtree(tmp, ignore_errors=True)
        kept = "; the previous checkpoint is kept" if directory.exists() else ""
        raise OSError(f"cannot write the checkpoint {directory}: {_first_line(err)}{kept}") from None
    if directory.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(directory, old)
    os.replace(tmp, directory)
    shutil.rmtree(old, ignore_errors=True)
    return directory


def _write(tmp: Path, model: nn.Module, tokenizers: dict[str, Tokenizer], meta: dict[str, Any] | None,
           trainer_state: dict[str, Any] | None) -> None:
    from safetensors.torch import save_model

    tmp.mkdir()
    config = {"arch": architecture_of(model), "model": model.config.to_dict(), **(meta or {})}
    (tmp / CONFIG).write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    save_model(model, str(tmp / WEIGHTS))  # shared (tied) tensors are stored once
    # safetensors creates its file private (0600); give it the mode the umask gave its siblings
    os.chmod(tmp / WEIGHTS, (tmp / CONFIG).stat().st_mode & 0o777)
    for side, tokenizer in tokenizers.items():
        save_tokenizer(tokenizer, tmp / f"tokenizer.{side}.json")
    if trainer_state is not None:
        torch.save(trainer_state, tmp / TRAINER_STATE)
    _fsync_dir(tmp)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


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
        found = candidate if (candidate / CONFIG).is_file() else None
        interrupted = candidate.parent / f".{candidate.name}.old"
        if found is None and not candidate.exists() and (interrupted / CONFIG).is_file():
            found = interrupted
        if found is not None:
            if candidate.name == "last" and candidate.parent == path:
                log.info("%s has no best/ checkpoint; using last/", path)
            return found
    if not path.exists():
        raise CheckpointError(f"{path}: no such model directory")
    raise CheckpointError(f"{path}: no qkv checkpoint here (expected {CONFIG} and {WEIGHTS}, or best/ or last/)")


def load_checkpoint(path: str | Path, *, with_trainer_state: bool = False) -> Checkpoint:
    """Rebuild the model from its config and load its weights; no code is executed from the files.

    Raises:
        CheckpointError: for a missing, unreadable or foreign config, a config whose model does not fit in
            memory, missing, unreadable or corrupted weights, weights that are not finite, or (with
            ``with_trainer_state``) a missing or unsafe trainer state.
    """
    directory = resolve(path)
    arch, model_cls, config, meta = _read_config(directory / CONFIG)
    try:
        with skip_init():  # every weight is overwritten by the strict load below
            model = build_model(model_cls, config, what=f"the model of {directory / CONFIG}")
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    _load_weights(model, directory / WEIGHTS)
    model.eval()
    tokenizers = {
        f.name.split(".")[1]: load_tokenizer(f) for f in sorted(directory.glob("tokenizer.*.json"))
    }
    trainer_state = _load_trainer_state(directory) if with_trainer_state else None
    return Checkpoint(model, arch, meta, tokenizers, directory, trainer_state)


def read_meta(path: str | Path) -> dict[str, Any]:
    """What a checkpoint's ``config.json`` holds besides the model (task, options, step, ...), without loading
    the weights.

    Raises:
        CheckpointError: as :func:`load_checkpoint` does for its config.
    """
    return _read_config(resolve(path) / CONFIG)[3]


def _read_config(path: Path) -> tuple[str, type[nn.Module], Any, dict[str, Any]]:
    """(architecture, model class, model config, the rest of config.json) of a checkpoint."""
    try:
        config = read_json(path)
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    try:
        arch = config["arch"]
        model_cls, config_cls = ARCHITECTURES[arch]
        fields = config["model"]
    except (KeyError, TypeError) as err:
        raise CheckpointError(f"{path} is not a qkv model config ({type(err).__name__}: {err})") from None
    if not isinstance(fields, dict):
        raise CheckpointError(f"{path}: \"model\" must be an object of config fields, got {type(fields).__name__}")
    try:
        model_config = config_cls.from_dict(fields)
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"{path}: {err}") from None
    return arch, model_cls, model_config, {k: v for k, v in config.items() if k not in ("arch", "model")}


def _load_weights(model: nn.Module, path: Path) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import load_model

    if not path.exists():
        raise CheckpointError(f"{path}: missing")
    try:
        with open(path, "rb"):
            pass
    except OSError as err:  # a directory, no permission, ...
        raise CheckpointError(f"{path} cannot be read: {err.strerror or err}") from None
    try:
        load_model(model, str(path), strict=True)
    except (SafetensorError, RuntimeError, OSError) as err:
        raise CheckpointError(f"{path} is corrupted or does not fit the config: {_first_line(err)}") from None
    bad = [name for name, tensor in model.state_dict().items()
           if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())]
    if bad:
        raise CheckpointError(f"{path} holds weights that are not finite (NaN or Inf) in {len(bad)} tensor(s), e.g. "
                              f"{bad[0]}: the model is unusable; resume from or use an earlier checkpoint")


def _load_trainer_state(directory: Path) -> dict[str, Any]:
    state_path = directory / TRAINER_STATE
    if not state_path.is_file():
        raise CheckpointError(f"{directory} has no {TRAINER_STATE}; resume from a run's last/ checkpoint")
    try:
        return torch.load(state_path, weights_only=True)
    except Exception as err:  # a truncated or foreign pickle: refuse it rather than guess
        raise CheckpointError(f"{state_path} cannot be loaded safely: {_first_line(err)}") from None
