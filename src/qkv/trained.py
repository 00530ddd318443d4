"""A trained model from its run or checkpoint: the one door, for a whole model and a LoRA run alike.

A LoRA run's checkpoint holds its adapters alone (:mod:`qkv.adapters`, PEFT's format) and names its base model in
its meta: the base's source (a pretrained name, a file, a folder, or another qkv run), how its weights were held,
and a fingerprint of its files. Loading it loads that base as the run did, checks that its files are the ones the
run adapted, then reads the adapters, whose bytes must match the checksum recorded when they were saved. Nothing
of a run's adapter folder is read through a symbolic link: a link there could point anywhere on the disk.

This module sits above :mod:`qkv.checkpoint` (whole models, and the adapters' files) and
:mod:`qkv.interop.pretrained` (the bases), neither of which imports it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from .checkpoint import (
    ADAPTER,
    ADAPTER_WEIGHTS,
    CHECKSUM,
    CONFIG,
    Checkpoint,
    CheckpointError,
    is_lora_run,
    load_adapter_weights,
    load_checkpoint,
    load_trainer_state,
    read_config,
    resolve,
)
from .files import file_sha256
from .interop.pretrained import Pretrained, load_pretrained, smollm2_path
from .quantize import quantize


def load_trained(path: str | Path, *, with_trainer_state: bool = False, weights: str | None = None) -> Checkpoint:
    """The model of a qkv run or checkpoint: :func:`~qkv.checkpoint.load_checkpoint`'s for a whole model; a LoRA
    run's base, loaded as the run loaded it (``weights``: another way to hold it, "none" for float32), with its
    adapters.

    Raises:
        CheckpointError: as :func:`~qkv.checkpoint.load_checkpoint` does; for a LoRA run, a base whose files changed
            or cannot be loaded, a link in its adapter folder, or adapters that are damaged or were changed.
    """
    directory = resolve(path)
    arch, _, _, meta, recorded = read_config(directory / CONFIG)
    if not is_lora_run(directory, meta):
        return load_checkpoint(directory, with_trainer_state=with_trainer_state)
    adapters = adapter_folder(directory)
    try:
        base = load_base(meta["base"]["source"], weights=weights or meta["base"]["weights"],
                         expected=meta["base"].get("fingerprint"))
    except KeyError as err:
        raise CheckpointError(f"{directory / CONFIG}: the base model's record lacks {err}") from None
    load_adapter_weights(base.model, adapters.parent, recorded.get(CHECKSUM))
    trainer_state = load_trainer_state(directory) if with_trainer_state else None
    meta = meta | {"chat_template": meta.get("chat_template") or base.chat_template}  # a run's record may lack it
    return Checkpoint(base.model.eval(), arch, meta, {"text": base.tokenizer}, directory, trainer_state)


def adapter_folder(path: str | Path) -> Path:
    """The adapter folder of the LoRA run or checkpoint ``path``, its files checked to be the run's own: no
    symbolic link among them (an export would otherwise copy whatever a link points to).

    Raises:
        CheckpointError: a checkpoint without adapters, or a link in its adapter folder.
    """
    folder = resolve(path) / ADAPTER
    if folder.is_symlink() or not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder of the run: the checkpoint holds no LoRA adapters of its own")
    links = sorted(p.name for p in folder.iterdir() if p.is_symlink())
    if links:
        raise CheckpointError(f"{folder} holds symbolic links ({', '.join(links[:3])}); a run's adapters are files of "
                              "its own: copy the files in place of the links, or retrain")
    if not (folder / ADAPTER_WEIGHTS).is_file():
        raise CheckpointError(f"{folder} has no {ADAPTER_WEIGHTS}; use the run's other checkpoint (best/ or last/)")
    return folder


# ------------------------------------------------------------------------------------------ fine-tuning's base


def _qkv_run(source: str) -> bool:
    """Whether ``source`` is a qkv run or checkpoint directory (a Hugging Face folder's config has no "arch")."""
    from .files import read_json

    path = Path(source)
    if (path / "best").is_dir() or (path / "last").is_dir():
        return True
    return (path / "config.json").is_file() and "arch" in read_json(path / "config.json")


def base_files(source: str) -> list[Path]:
    """The files that make a base model: a GGUF file; a Hugging Face folder's config, weights and tokenizer; a qkv
    run's checkpoint config (which holds its weights' sha256)."""
    if source == "smollm2":
        return [p for p in [smollm2_path()] if p is not None]
    path = Path(source)
    if not path.is_dir():
        return [path]
    if _qkv_run(source):
        return [resolve(path) / CONFIG]
    names = ["config.json", "tokenizer.json", "model.safetensors.index.json",
             *sorted(p.name for p in path.glob("*.safetensors"))]
    return [path / n for n in names if (path / n).is_file()]


def fingerprint(source: str) -> str:
    """The sha256 of a base model's files (:func:`base_files`), in order: what a LoRA run records of its base, to
    refuse another model's files under the same name."""
    digest = hashlib.sha256()
    for path in base_files(source):
        try:
            digest.update(file_sha256(path).encode())
        except OSError as err:  # a base deleted or moved since the run: named, with what to do
            raise ValueError(f"cannot read the base model {path}: {err.strerror or err}; the run needs the base "
                             "model it was trained on, at the same place") from None
    return digest.hexdigest()


def load_base(source: str, *, weights: str, expected: str | None = None) -> Pretrained:
    """A model to fine-tune: anything :func:`~qkv.interop.pretrained.load_pretrained` reads, or a qkv language-model
    run (its ``best/`` checkpoint, a LoRA run's base with its adapters included), its weights as ``weights`` says
    ("none": float32; "auto", "int8", "int4": quantized as :func:`~qkv.interop.pretrained.load_pretrained` holds
    them). With ``expected`` (a :func:`fingerprint`), the files must be those the fingerprint was taken of.

    Raises:
        ValueError: one line: what :func:`~qkv.interop.pretrained.load_pretrained` or :func:`load_trained` refuse, a
            qkv run that is not a language model, or files that differ from the fingerprint.
    """
    if expected is not None and fingerprint(source) != expected:
        raise ValueError(f"the base model {source} is not the one the adapters were trained on (its files have "
                         "changed); use the original base model")
    if not (Path(source).is_dir() and _qkv_run(source)):
        return load_pretrained(source, weights=weights)
    ckpt = load_trained(source)
    if ckpt.arch != "gpt" or "text" not in ckpt.tokenizers:
        raise ValueError(f"{ckpt.path} is a {ckpt.arch} checkpoint, not a language model to fine-tune")
    model = ckpt.model if weights in ("none", "auto") else quantize(ckpt.model, weights)
    return Pretrained(model, ckpt.tokenizers["text"], None, ckpt.name)


__all__ = ["adapter_folder", "base_files", "fingerprint", "load_base", "load_trained"]
