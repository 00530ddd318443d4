"""Checkpoints: a directory of safetensors weights, a JSON config, the tokenizers and (for resuming) the
trainer's state.

    run/best/                    run/last/            (the same files, plus)
      config.json                  trainer_state.pt     optimizer, step, RNG: torch.load(weights_only=True)
      model.safetensors            (its sha256 and the tokenizers' kinds and sizes are in config.json)
      tokenizer.src.json
      tokenizer.tgt.json

Nothing is unpickled as code: weights are safetensors and the trainer state loads with ``weights_only=True``.
A checkpoint directory is written beside its final place and swapped in with a rename, so a crash while
saving leaves the previous checkpoint intact (what a kill leaves behind is cleaned up by
:func:`qkv.rundir.claim`). Loading trusts no file beyond what it can check, and refuses what cannot be used: a
config that is not valid (its task's fields included: labels, image statistics, templates), a config whose model
would not fit in memory, weights whose bytes differ from the checksum recorded when they were saved, tensors
whose dtype or shape is not the model's, weights that are not finite, and tokenizers whose kind or size does not
fit the model.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .adapters import load_peft_adapter, peft_base_name, save_peft_adapter
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
from .files import check_finite, file_sha256, read_json, write_atomically
from .footprint import build_model
from .lora import lora_config_of, lora_layers
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
# A LoRA run's checkpoints hold its adapters alone, as PEFT writes them, in this folder; the base model is named
# by the run's meta ("base": its source, how its weights are held, and a fingerprint of its files).
ADAPTER, ADAPTER_WEIGHTS = "adapter", "adapter_model.safetensors"
# What config.json records about the other files, to check them when loading; not part of the meta.
CHECKSUM, TOKENIZERS = "weights_sha256", "tokenizers"
# The tokenizer kinds each family's code can run with (an encoder frames its input with WordPiece's [CLS] and
# [SEP]); a checkpoint saved since kinds were recorded must have the very kind it was saved with.
TOKENIZER_KINDS = {"transformer": ("char", "bpe"), "lstm": ("char", "bpe"), "gpt": ("char", "bpe", "pretrained"),
                   "bert": ("wordpiece",), "bert-mlm": ("wordpiece",), "bert-classifier": ("wordpiece",),
                   "clip": ("char", "bpe")}
# qkv trains these to the size the config then records; wordpiece and pretrained ones may come with a pretrained
# model whose embedding table has spare rows.
EXACT_SIZE_KINDS = ("char", "bpe")

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
    from .sharding import unsharded_class

    for name, (cls, _) in ARCHITECTURES.items():
        if unsharded_class(model) is cls:
            return name
    raise TypeError(f"cannot save a {type(model).__name__}; known architectures: {sorted(ARCHITECTURES)}")


def save_checkpoint(
    directory: str | Path,
    model: nn.Module,
    *,
    tokenizers: dict[str, Tokenizer],
    meta: dict[str, Any] | None = None,
    trainer_state: dict[str, Any] | None = None,
    weights: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write a checkpoint atomically: into a temporary sibling directory, then renamed into place. ``weights``:
    the model's tensors when the module does not hold them whole (a sharded model's, gathered by
    :func:`qkv.sharding.gathered_weights`).

    Raises:
        OSError: if the files cannot be written (a full disk, say); the temporary directory is removed and the
            previous checkpoint, if any, is left as it was.
    """
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        write_atomically(directory, lambda tmp: _write(tmp, model, tokenizers, meta, trainer_state, weights),
                         folder=True)
    except OSError as err:
        kept = "; the previous checkpoint is kept" if directory.exists() else ""
        raise OSError(f"{str(err).replace('cannot write', 'cannot write the checkpoint', 1)}{kept}") from None
    return directory


def _write(tmp: Path, model: nn.Module, tokenizers: dict[str, Tokenizer], meta: dict[str, Any] | None,
           trainer_state: dict[str, Any] | None, whole: dict[str, torch.Tensor] | None) -> None:
    from safetensors.torch import save_file, save_model

    if lora_layers(model):  # a LoRA run: the adapters alone, in PEFT's format; the base is named in the meta
        save_peft_adapter(model, lora_config_of(model), tmp / ADAPTER,
                          base_name=peft_base_name(str((meta or {})["base"]["source"])))
        weights = tmp / ADAPTER / ADAPTER_WEIGHTS
    else:
        weights = tmp / WEIGHTS
        if whole is not None:
            save_file(whole, str(weights))
        else:
            save_model(model, str(weights))  # shared (tied) tensors are stored once
    config = {"arch": architecture_of(model), "model": model.config.to_dict(), **(meta or {}),
              CHECKSUM: file_sha256(weights),
              TOKENIZERS: {side: {"kind": t.kind, "vocab_size": t.vocab_size} for side, t in tokenizers.items()}}
    (tmp / CONFIG).write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    # safetensors creates its file private (0600); give it the mode the umask gave its siblings
    os.chmod(weights, (tmp / CONFIG).stat().st_mode & 0o777)
    for side, tokenizer in tokenizers.items():
        save_tokenizer(tokenizer, tmp / f"tokenizer.{side}.json")
    if trainer_state is not None:
        torch.save(trainer_state, tmp / TRAINER_STATE)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


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
        CheckpointError: for a missing, unreadable, foreign or invalid config, a config whose model does not
            fit in memory, missing, unreadable, corrupted or changed weights, tensors of another dtype or shape
            than the model's, weights that are not finite, tokenizers that do not fit the model, or (with
            ``with_trainer_state``) a missing or unsafe trainer state; a LoRA run's checkpoint, whose model is its
            base with its adapters: :func:`qkv.trained.load_trained` loads it (and every checkpoint).
    """
    directory = resolve(path)
    arch, model_cls, config, meta, recorded = read_config(directory / CONFIG)
    if is_lora_run(directory, meta):
        raise CheckpointError(f"{directory} holds a LoRA run's adapters, not a whole model: load it with its base "
                              "model (qkv.trained.load_trained)")
    try:
        with skip_init():  # every weight is overwritten by the strict load below
            model = build_model(model_cls, config, what=f"the model of {directory / CONFIG}")
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    _load_weights(model, directory / WEIGHTS)  # first: a wrong dtype or a NaN is a more precise message
    check_digest(directory / WEIGHTS, recorded.get(CHECKSUM))
    model.eval()
    tokenizers = _load_tokenizers(directory, arch, config, recorded.get(TOKENIZERS))
    trainer_state = load_trainer_state(directory) if with_trainer_state else None
    return Checkpoint(model, arch, meta, tokenizers, directory, trainer_state)


def is_lora_run(directory: Path, meta: dict[str, Any]) -> bool:
    """Whether the checkpoint ``directory`` holds a LoRA run's adapters (and names their base in ``meta``)."""
    return (directory / ADAPTER).is_dir() and isinstance(meta.get("base"), dict)


def load_adapter_weights(model: nn.Module, directory: Path, recorded: Any) -> None:
    """Copy a LoRA run's adapters (``directory/adapter``) into ``model`` (adapted there if not yet), after checking
    the file's bytes against the checksum recorded when it was saved."""
    check_digest(directory / ADAPTER / ADAPTER_WEIGHTS, recorded)
    load_peft_adapter(model, directory / ADAPTER)


def resume_adapters(model: nn.Module, path: str | Path) -> dict[str, Any]:
    """A LoRA run's checkpoint read back into ``model`` (its base already loaded and adapted): the adapters copied
    in place, and the trainer state returned."""
    directory = resolve(path)
    recorded = read_config(directory / CONFIG)[4]
    load_adapter_weights(model, directory, recorded.get(CHECKSUM))
    return load_trainer_state(directory)


def read_meta(path: str | Path) -> dict[str, Any]:
    """What a checkpoint's ``config.json`` holds besides the model (task, options, step, ...), without loading
    the weights.

    Raises:
        CheckpointError: as :func:`load_checkpoint` does for its config.
    """
    return read_config(resolve(path) / CONFIG)[3]


def read_config(path: Path) -> tuple[str, type[nn.Module], Any, dict[str, Any], dict[str, Any]]:
    """(architecture, model class, model config, the task's meta, what was recorded of the other files) of a
    checkpoint."""
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
    meta = {k: v for k, v in config.items() if k not in ("arch", "model", CHECKSUM, TOKENIZERS)}
    _check_meta(meta, arch, model_config, path)
    return arch, model_cls, model_config, meta, {k: config[k] for k in (CHECKSUM, TOKENIZERS) if k in config}


# The tasks whose commands read fields of the meta, and the architectures they train.
_TASK_ARCHITECTURES = {"classify": ("bert-classifier",), "classify-image": ("vit-classifier", "swin-classifier"),
                       "contrastive": ("clip",)}


def _check_meta(meta: dict[str, Any], arch: str, config: Any, path: Path) -> None:
    """The fields a task's commands read from its checkpoints (labels, image statistics, templates), checked
    once here so that a damaged config.json is one clear error, not a KeyError or a label printed letter by
    letter."""
    task = meta.get("task")
    if task in _TASK_ARCHITECTURES and arch not in _TASK_ARCHITECTURES[task]:
        raise CheckpointError(f"{path}: task {task!r} trains {' or '.join(_TASK_ARCHITECTURES[task])} models, not "
                              f"{arch!r}; the checkpoint's config was changed or damaged")
    image = {"classify-image": config, "contrastive": getattr(config, "vision", None)}.get(task)
    if task == "classify":
        _meta_list(meta, "labels", str, path, length=config.n_labels)
        _meta_number(meta, "max_length", path, integer=True, minimum=3)
    if image is not None:
        classes = image.n_classes if task == "classify-image" else None
        _meta_list(meta, "labels", str, path, length=classes)
        shape = _meta_list(meta, "image_shape", int, path, length=3)
        if shape[0] != image.channels or min(shape) < 1:
            raise CheckpointError(f"{path}: \"image_shape\" must be [channels, height, width] with "
                                  f"{image.channels} channels (the model's), got {shape}")
        for name in ("mean", "std"):
            values = _meta_list(meta, name, float, path, length=image.channels)
            if name == "std" and min(values) <= 0:
                raise CheckpointError(f"{path}: \"std\" must be positive for each channel, got {values}")
    if task == "contrastive":
        _meta_list(meta, "class_names", str, path, length=len(meta["labels"]))
        _meta_list(meta, "templates", str, path)


_META_TYPES = {str: "strings", int: "integers", float: "numbers"}


def _meta_list(meta: dict[str, Any], name: str, kind: type, path: Path, *, length: int | None = None) -> list:
    """``meta[name]``, checked to be a non-empty list of ``kind`` (of ``length`` items when given)."""
    value = meta.get(name)
    is_kind = (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < float("inf")
               ) if kind is float else (lambda v: isinstance(v, kind) and not isinstance(v, bool))
    expected = f"a list of {length or 'one or more'} {_META_TYPES[kind]}"
    ok = isinstance(value, list) and len(value) == (length or len(value) or 1) and all(map(is_kind, value))
    if not ok:
        shown = "nothing" if name not in meta else f"{type(value).__name__} {_short(value)}"
        raise CheckpointError(f"{path}: \"{name}\" must be {expected}, got {shown}; the checkpoint's config "
                              "was changed or damaged: use the run's other checkpoint (best/ or last/) or retrain")
    return value


def _meta_number(meta: dict[str, Any], name: str, path: Path, *, integer: bool, minimum: float) -> None:
    value = meta.get(name)
    ok = isinstance(value, int if integer else (int, float)) and not isinstance(value, bool) and value >= minimum
    if not ok:
        shown = "nothing" if name not in meta else f"{type(value).__name__} {_short(value)}"
        raise CheckpointError(f"{path}: \"{name}\" must be {'an integer' if integer else 'a number'} >= "
                              f"{minimum}, got {shown}")


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_digest(path: Path, recorded: Any) -> None:
    """The weights' bytes are those saved: a flipped bit or an edited file would otherwise load silently."""
    if recorded is None:  # saved before checksums were recorded
        log.debug("%s: no checksum recorded (an older checkpoint); its bytes are not checked", path)
        return
    if file_sha256(path) != recorded:
        raise CheckpointError(f"{path} is corrupted or was changed since it was saved (its sha256 differs from the "
                              f"one recorded in {CONFIG}); use the run's other checkpoint (best/ or last/), or "
                              "retrain")


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
        _check_header(model, path)
        load_model(model, str(path), strict=True)
    except (SafetensorError, RuntimeError, OSError) as err:
        raise CheckpointError(f"{path} is corrupted or does not fit the config: {_first_line(err)}") from None
    try:
        check_finite(model.state_dict().items(), f"{path} holds",
                     "the model is unusable; resume from or use an earlier checkpoint")
    except ValueError as err:
        raise CheckpointError(str(err)) from None


def _check_header(model: nn.Module, path: Path) -> None:
    """Each stored tensor's dtype and shape, as its header says, against the model's, before anything is copied:
    a copy would turn integers into floats without a word."""
    from safetensors import safe_open

    expected = model.state_dict()
    with safe_open(str(path), "pt") as f:
        stored_names = f.keys()  # a safe_open handle is not iterable
        rename = getattr(model, "current_name", lambda name: name)  # weights saved under an older name
        for name in (n for n in stored_names if rename(n) in expected):  # load_model's strict check names the rest
            stored, want = f.get_slice(name), expected[rename(name)]
            dtype, shape = stored.get_dtype(), list(stored.get_shape())
            if shape != list(want.shape) or not _same_kind(dtype, want.dtype):
                kind = "a floating-point tensor" if want.is_floating_point() else f"a {want.dtype} tensor"
                raise CheckpointError(f"{path} does not fit the config: tensor {name} is stored as {dtype} of shape "
                                      f"{shape}, expected {kind} of shape {list(want.shape)}; the file is damaged "
                                      "or not this model's: use the run's other checkpoint (best/ or last/), or "
                                      "retrain")


def _same_kind(stored: str, wanted: torch.dtype) -> bool:
    """A floating-point parameter takes any floating-point dtype (widened or narrowed as it is copied); any
    other tensor, its own dtype only."""
    if wanted.is_floating_point:
        return stored in _FLOAT_DTYPES
    return _SAFETENSORS_DTYPES.get(stored) == wanted


_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
_SAFETENSORS_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
                       "I32": torch.int32, "I64": torch.int64}


def _load_tokenizers(directory: Path, arch: str, config: Any, recorded: Any) -> dict[str, Tokenizer]:
    """The checkpoint's tokenizers, each checked to fit the model: its kind, and a vocabulary the size the
    config (and the record made when saving) says; a swapped file would otherwise encode text the model was
    never trained on."""
    tokenizers = {f.name.split(".")[1]: load_tokenizer(f) for f in sorted(directory.glob("tokenizer.*.json"))}
    recorded = recorded if isinstance(recorded, dict) else {}
    for side in recorded:
        if side not in tokenizers:
            raise CheckpointError(f"{directory} lacks tokenizer.{side}.json, which was saved with the model; use "
                                  "the run's other checkpoint (best/ or last/), or retrain")
    for side, tokenizer in tokenizers.items():
        _check_tokenizer(directory / f"tokenizer.{side}.json", tokenizer, arch, _vocab_size(config, side),
                         recorded.get(side))
    return tokenizers


def _vocab_size(config: Any, side: str) -> int | None:
    """The model's vocabulary for the tokenizer of ``side``: ``src_vocab_size`` for "src", the text tower's for
    CLIP, ``vocab_size`` for the rest."""
    for holder in (config, getattr(config, "text", None)):
        for name in (f"{side}_vocab_size", "vocab_size"):
            if isinstance(getattr(holder, name, None), int):
                return getattr(holder, name)
    return None


def _check_tokenizer(path: Path, tokenizer: Tokenizer, arch: str, model_vocab: int | None, recorded: Any) -> None:
    kinds = TOKENIZER_KINDS.get(arch, ())
    if isinstance(recorded, dict) and isinstance(recorded.get("kind"), str):
        kinds = (recorded["kind"],)
    size = tokenizer.vocab_size
    # qkv sizes a new model's vocabulary to its tokenizer; a pretrained model's table may have spare rows
    fits = model_vocab is None or (size == model_vocab if tokenizer.kind in EXACT_SIZE_KINDS else size <= model_vocab)
    if kinds and tokenizer.kind not in kinds:
        problem = f"is a {tokenizer.kind} tokenizer, but this {arch} model's is {' or '.join(kinds)}"
    elif not fits:
        problem = f"has {size} tokens, but the model's vocabulary has {model_vocab}"
    elif isinstance(recorded, dict) and recorded.get("vocab_size") not in (None, size):
        problem = f"has {size} tokens, but the one saved with the model had {recorded['vocab_size']}"
    else:
        return
    raise CheckpointError(f"{path} {problem}: it does not fit the model (was it replaced?); use the tokenizer "
                          "saved with the model")


def load_trainer_state(directory: Path) -> dict[str, Any]:
    state_path = directory / TRAINER_STATE
    if not state_path.is_file():
        raise CheckpointError(f"{directory} has no {TRAINER_STATE}; resume from a run's last/ checkpoint")
    try:
        return torch.load(state_path, weights_only=True)
    except Exception as err:  # a truncated or foreign pickle: refuse it rather than guess
        raise CheckpointError(f"{state_path} cannot be loaded safely: {_first_line(err)}") from None
