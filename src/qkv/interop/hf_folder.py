"""Hugging Face model folders, read without transformers: the files ``save_pretrained`` writes.

    config.json                         the architecture (model_type, sizes) and, for decoders, the special ids
    model.safetensors                   the weights, or shards listed in model.safetensors.index.json
    tokenizer.json                      the whole tokenizer pipeline ("fast" tokenizer), read by ``tokenizers``
    tokenizer_config.json               which tokens are bos/eos/pad/..., the chat template (transformers < 5)
    special_tokens_map.json             the same special tokens, in older folders
    chat_template.jinja                 the chat template (transformers 5)

Each reader checks what it reads and raises a one-line ``ValueError`` naming the folder or file; weights are
read from safetensors only, never unpickled. The loaders (:func:`qkv.interop.load_pretrained`,
:func:`qkv.interop.load_sentence_encoder`) put the pieces together.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..files import check_finite, read_json
from ..tokenizers import WORDPIECE_SPECIALS, PretrainedTokenizer, WordPieceTokenizer, default_stop_ids


def read_config(folder: str | Path, *, model_types: Collection[str] | None = None) -> dict[str, Any]:
    """The folder's ``config.json``.

    Args:
        folder: the model folder.
        model_types: the ``model_type`` values the caller can load (None: any).

    Raises:
        ValueError: if the file is missing or unreadable, or its model_type is not one of ``model_types``.
    """
    folder = Path(folder)
    path = folder / "config.json"
    if not folder.exists():
        raise not_found(str(folder), "expected a Hugging Face model folder")
    if not path.is_file():
        raise ValueError(f"{folder} has no config.json, so it is not a Hugging Face model folder")
    config = read_json(path)
    model_type = config.get("model_type")
    if model_types is not None and model_type not in model_types:
        raise ValueError(f"{path}: unsupported model_type {model_type!r}; expected one of {list(model_types)}")
    return config


def read_safetensors(folder: str | Path) -> dict[str, Tensor]:
    """All tensors of ``model.safetensors``, or of the shards listed in ``model.safetensors.index.json``.

    A large model is saved in shards of a few gigabytes each; the index's ``weight_map`` says which shard holds
    which tensor. Half-precision weights are widened to float32, qkv's working precision.

    Raises:
        ValueError: for a folder without safetensors weights (pickled ``pytorch_model.bin`` only, or nothing),
            an unreadable file or index, shards that are missing or do not hold what the index lists, a weight or
            bias stored as integers, or weights that are not finite (each error names the tensor).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    files, expected = _weight_files(folder)
    tensors: dict[str, Tensor] = {}
    for path in files:
        try:
            tensors.update(load_file(path))
        except (SafetensorError, OSError) as err:
            raise ValueError(f"cannot read {path}: {err}") from None
    _check_listed(folder, expected, set(tensors))
    _check_parameter_dtypes({name: t.dtype for name, t in tensors.items()}, folder)
    tensors = {name: t.float() if t.is_floating_point() else t for name, t in tensors.items()}
    check_finite(tensors.items(), f"{folder} holds", "the weights are damaged; use another copy of the model")
    return tensors


def open_safetensors(folder: str | Path) -> dict[str, tuple[Any, Path]]:
    """Every tensor of the folder's safetensors files, unread: name -> (the ``safe_open`` handle of its file,
    the file), for reading a slice at a time through the file's memory map.

    Raises:
        ValueError: as :func:`read_safetensors` does, but for weights that are not finite: those are found as
            they are read.
    """
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    files, expected = _weight_files(folder)
    handles: dict[str, tuple[Any, Path]] = {}
    dtypes = {}
    for path in files:
        try:
            handle = safe_open(path, framework="pt")
            for name in handle.keys():  # noqa: SIM118 - a safe_open handle is not a mapping
                handles[name] = (handle, path)
                dtypes[name] = _DTYPES.get(handle.get_slice(name).get_dtype(), torch.uint8)
        except (SafetensorError, OSError) as err:
            raise ValueError(f"cannot read {path}: {err}") from None
    _check_listed(folder, expected, set(handles))
    _check_parameter_dtypes(dtypes, folder)
    return handles


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}  # safetensors' dtype names


def _weight_files(folder: Path) -> tuple[list[Path], set[str] | None]:
    """The safetensors files of ``folder``, and the tensor names its shard index lists (None: one file)."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        files, expected = [single], None
    elif index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(shard, str) for shard in weight_map.values()):
            raise ValueError(f"cannot read the shard index {index}: no weight_map from tensor names to files")
        files, expected = [folder / shard for shard in sorted(set(weight_map.values()))], set(weight_map)
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{folder} lacks the shards {missing} listed in {index.name}")
    elif (folder / "pytorch_model.bin").is_file():
        raise ValueError(
            f"{folder} has pickle weights (pytorch_model.bin) only; qkv reads safetensors: re-save the model with "
            "save_pretrained(..., safe_serialization=True)"
        )
    else:
        raise ValueError(f"{folder} has no model.safetensors or model.safetensors.index.json")
    return files, expected


def _check_listed(folder: Path, expected: set[str] | None, found: set[str]) -> None:
    if expected is not None and expected != found:
        raise ValueError(
            f"the shards in {folder} do not match model.safetensors.index.json: missing {sorted(expected - found)}, "
            f"unlisted {sorted(found - expected)}"
        )


# The last part of a parameter's name (LayerNorm's were gamma and beta in older checkpoints); other tensors,
# such as BERT's position_ids, are integer buffers.
_PARAMETER_NAMES = ("weight", "bias", "gamma", "beta")


def _check_parameter_dtypes(dtypes: Mapping[str, torch.dtype], folder: Path) -> None:
    """A parameter stored as integers would be copied into the model as garbage floats: a quantized folder
    (int8 weights with their scales beside them), or a damaged header."""
    for name, dtype in dtypes.items():
        if name.rpartition(".")[2] in _PARAMETER_NAMES and not dtype.is_floating_point:
            raise ValueError(f"{folder}: tensor {name} is stored as {dtype}, expected floating-point weights "
                             "(float32, float16 or bfloat16); qkv reads unquantized models only")


def read_chat_template(folder: str | Path) -> str | None:
    """The Jinja chat template, or None: transformers 5 saves it as ``chat_template.jinja``, earlier versions
    inside ``tokenizer_config.json``.

    Raises:
        ValueError: if ``tokenizer_config.json`` is there but unreadable.
    """
    folder = Path(folder)
    path = folder / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = read_json(folder / "tokenizer_config.json", required=False).get("chat_template")
    return template if isinstance(template, str) else None


def tokenizer_from_hf_folder(folder: str | Path) -> PretrainedTokenizer:
    """A decoder's tokenizer: ``tokenizer.json`` and the ids of its special tokens.

    ``tokenizer.json`` holds the whole pipeline but not which token is bos, eos or padding: those come from
    ``tokenizer_config.json`` (as token strings), else from ``config.json`` (as ids). A list of eos ids
    (LLaMA 3) gives eos and further stop ids.

    Raises:
        ValueError: if ``tokenizer.json`` is missing or unreadable, a side file is unreadable, or a special id
            is outside the vocabulary.
    """
    folder = Path(folder)
    hf = _read_tokenizer_json(folder)
    config = read_json(folder / "config.json", required=False)
    ids: dict[str, Any] = {name: config.get(f"{name}_token_id") for name in ("bos", "eos", "pad")}
    extra_stops: set[int] = set()
    if isinstance(ids["eos"], list):  # LLaMA 3: end of text, end of turn, ... all end generation
        extra_stops, ids["eos"] = set(ids["eos"]), (ids["eos"][0] if ids["eos"] else None)
    tokenizer_config = read_json(folder / "tokenizer_config.json", required=False)
    for name in ("bos", "eos", "pad"):
        text = _special_token_text(tokenizer_config.get(f"{name}_token"))
        if text is not None and hf.token_to_id(text) is not None:
            ids[name] = hf.token_to_id(text)
    stop_ids = default_stop_ids(hf, ids["eos"]) | extra_stops
    # whether the model reads texts after bos: what tokenizer.json's post-processor puts in front of one
    add_bos = ids["bos"] is not None and hf.encode("a", add_special_tokens=True).ids[:1] == [ids["bos"]]
    try:
        return PretrainedTokenizer(hf, bos_id=ids["bos"], eos_id=ids["eos"], pad_id=ids["pad"], stop_ids=stop_ids,
                                   add_bos=add_bos)
    except ValueError as err:
        raise ValueError(f"{folder}: {err}") from None


def wordpiece_tokenizer_from_hf_folder(folder: str | Path) -> WordPieceTokenizer:
    """A BERT folder's ``tokenizer.json``, with the special tokens named in ``tokenizer_config.json`` (or
    ``special_tokens_map.json``) where they differ from BERT's.

    Raises:
        ValueError: if ``tokenizer.json`` is missing, unreadable, or lacks ``[PAD]``/``[CLS]``/``[SEP]``, or a
            side file is unreadable.
    """
    folder = Path(folder)
    hf = _read_tokenizer_json(folder, missing_hint=" (qkv reads the fast-tokenizer file, not vocab.txt)")
    specials = {}
    for file in ("special_tokens_map.json", "tokenizer_config.json"):  # the later wins
        config = read_json(folder / file, required=False)
        for name in WORDPIECE_SPECIALS:
            text = _special_token_text(config.get(f"{name}_token"))
            if text is not None:
                specials[name] = text
    try:
        return WordPieceTokenizer(hf, specials=specials)
    except ValueError as err:
        raise ValueError(f"{folder / 'tokenizer.json'}: {err}") from None


def _read_tokenizer_json(folder: Path, *, missing_hint: str = ""):
    """The ``tokenizers.Tokenizer`` saved in ``folder/tokenizer.json``."""
    from tokenizers import Tokenizer as HFTokenizer

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{folder} has no tokenizer.json{missing_hint}")
    try:
        return HFTokenizer.from_file(str(path))
    except Exception as err:  # the tokenizers library raises its own exception type for any bad file
        # Its messages can span lines (a serde error and the offending text); the CLI prints one line.
        raise ValueError(f"cannot read {path}: {' '.join(str(err).split())}") from None


def _special_token_text(value: Any) -> str | None:
    """A token in ``tokenizer_config.json``: a string, or an AddedToken written as a dict with ``content``."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def not_found(name: str, expected: str) -> ValueError:
    """The error for a model ``name`` that is neither one qkv knows nor a file or folder that exists: it may be a
    hub id (``opus-mt-en-zh``, ``org/model``), and qkv reads local files only."""
    hub_id = name if name.count("/") == 1 and not name.startswith((".", "/", "~")) else "ORG/NAME"
    return ValueError(f"cannot load {name!r}: no such file or folder here ({expected}); qkv reads local files only, "
                      f"never a model hub: download the folder elsewhere (huggingface-cli download {hub_id} "
                      f"--local-dir {Path(name).name}), copy it here and give its path")


__all__ = [
    "not_found",
    "read_chat_template",
    "read_config",
    "read_safetensors",
    "tokenizer_from_hf_folder",
    "wordpiece_tokenizer_from_hf_folder",
]
