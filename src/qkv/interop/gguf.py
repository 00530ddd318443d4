"""GGUF files (llama.cpp's format) -> qkv's GPT, by way of a Hugging Face LLaMA (or GPT-2) checkpoint.

A GGUF file is one binary holding a key-value metadata table (the architecture's sizes, the tokenizer's
vocabulary and merges, a chat template) and the tensors, usually quantized in blocks: ``Q4_1`` stores 32
weights as 4-bit integers with one float16 scale ``d`` and one offset ``m`` (``w = d * q + m``), ``Q8_0`` as
8-bit integers with one scale. The ``gguf`` package reads the file and dequantizes; this module only
translates, so that the existing, strict Hugging Face converter does the loading:

    GGUF metadata ── hf_config_from_gguf ─────> LLaMA config.json (dict) ─┐
    GGUF tensors  ── dequantize, rename, ─────> LLaMA state dict ─────────┴─ load_gpt_from_hf ─> GPT
                     un-permute q/k (hf_state_dict_from_gguf)

The tokenizer is rebuilt from the metadata as well (:mod:`qkv.interop.gguf_tokenizer`): a GGUF file has no
``tokenizer.json``, but holds its vocabulary, merges or scores, and special ids.

Quantization is lossy, but once the weights are dequantized to float32 the model is an ordinary LLaMA model:
qkv's logits equal those of any other implementation that dequantizes the same file (transformers does).

The one layout change is in the query and key projections. Rotary embeddings rotate feature pairs; Hugging
Face LLaMA pairs feature ``i`` with ``i + head_dim/2`` ("rotate half"), while ggml pairs neighbours ``2i`` and
``2i + 1``. llama.cpp's converter therefore reorders the rows of ``q_proj`` and ``k_proj`` inside each head,
and :func:`unpermute_rope_rows` puts them back, so qkv's default (rotate-half) RoPE is right.
"""

from __future__ import annotations

import functools
import logging
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..files import check_finite
from ..models import GPT
from .families import FAMILIES, GGUF_FAMILIES, PERMUTED_ARCHITECTURES, norm_shift
from .hf_gpt import load_gpt_from_hf
from .sizes import SIZES, check_size

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = (*GGUF_FAMILIES, "gpt2")
_BOUNDS = {gguf_key: bound for *_, gguf_key, bound in SIZES}  # every size a header may state, bounded
ROPE_FREQS = "rope_freqs.weight"  # Llama 3's rotary scaling: one divisor per frequency (config rope_freq_factors)
# Rotary settings stored as tensors, read into the config: Llama 3's divisors, Phi-3's LongRoPE sets
ROPE_TENSORS = (ROPE_FREQS, "rope_factors_long.weight", "rope_factors_short.weight")

# GGUF tensor names -> Hugging Face LLaMA names. Per layer: blk.{i}.{gguf} -> model.layers.{i}.{hf}.
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# The same for GPT-2 (Hugging Face names under transformer.), whose Conv1D weights Hugging Face stores (in, out)
GPT2_GLOBAL_NAMES = {"token_embd": "transformer.wte", "position_embd": "transformer.wpe",
                     "output_norm": "transformer.ln_f", "output": "lm_head"}
GPT2_LAYER_NAMES = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
                    "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
GPT2_CONV1D = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass
class GGUFContents:
    """What a GGUF file holds, ready for Python: metadata values and float32 tensors.

    Attributes:
        path: the file read.
        metadata: key -> value (``int``, ``float``, ``bool``, ``str`` or a list of them), e.g.
            ``metadata["llama.block_count"] == 30``; the tokenizer's vocabulary is the list
            ``metadata["tokenizer.ggml.tokens"]``.
        tensors: GGUF tensor name -> dequantized float32 tensor, in PyTorch's ``(out, in)`` layout.
        tensor_types: GGUF tensor name -> the type it was stored as (``"Q4_1"``, ``"Q8_0"``, ``"F32"``, ...).
    """

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, Tensor] = field(repr=False)
    tensor_types: dict[str, str] = field(repr=False)

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")


def _import_gguf():
    try:
        import gguf
    except ImportError:
        raise ValueError("reading GGUF files needs the gguf package: pip install gguf") from None
    return gguf


def read_gguf(path: str | Path, *, check_metadata: Callable[[dict[str, Any]], None] | None = None) -> GGUFContents:
    """Read a GGUF file and dequantize every tensor to float32.

    Args:
        path: the ``.gguf`` file.
        check_metadata: called with the metadata before any tensor is dequantized, so that what depends on it
            alone (the tokenizer, options checked against it) fails before the slow part.

    Returns:
        Its metadata and tensors (see :class:`GGUFContents`).

    Raises:
        ValueError: the file is missing or not a readable GGUF file (its header counts more than the file
            holds, it ends early), the ``gguf`` package is not installed, a tensor is stored in a type the
            ``gguf`` package cannot dequantize, or a weight is not finite (NaN or Inf; the tensor is named).
    """
    gguf = _import_gguf()
    path = Path(path)
    reader, metadata = open_gguf(path)
    if check_metadata is not None:
        check_metadata(metadata)

    tensors: dict[str, Tensor] = {}
    tensor_types: dict[str, str] = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        try:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ValueError(
                f"{path}: tensor {t.name!r} is stored as {kind}, which the gguf package cannot dequantize"
            ) from None
        # ggml lists dimensions innermost first (ne0 = the input features of a weight matrix), so the
        # PyTorch shape is the reverse; that makes a weight (out, in), as nn.Linear wants it.
        shape = tuple(reversed([int(n) for n in t.shape]))
        # np.require copies only when needed: unquantized tensors come back as read-only views of the file.
        array = np.require(values, dtype=np.float32, requirements=["C", "W"]).reshape(shape)
        tensors[t.name] = torch.from_numpy(array)
        tensor_types[t.name] = kind
    check_finite(tensors.items(), f"{path} holds", "the file is damaged or was badly converted; use another copy")
    logger.info("read %d tensors (%s) from %s", len(tensors), ", ".join(sorted(set(tensor_types.values()))), path)
    return GGUFContents(path=path, metadata=metadata, tensors=tensors, tensor_types=tensor_types)


def open_gguf(path: str | Path):
    """``(header, metadata)`` of a GGUF file: its tensors are views of the file through a memory map, nothing
    read until used (see :mod:`qkv.interop.gguf_file`), and the metadata as Python values.

    Raises:
        ValueError: the file is missing or not a readable GGUF file, or the ``gguf`` package is not installed.
    """
    from .gguf_file import read_gguf_header

    _import_gguf()
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no GGUF file at {path}")
    _check_counts(path)
    try:
        header = read_gguf_header(path)
    except (ValueError, UnicodeDecodeError, struct.error) as err:  # a bad magic number, a truncated table, ...
        raise ValueError(f"{path} is not a readable GGUF file (damaged or truncated?): {' '.join(str(err).split())}"
                         ) from None
    return header, header.metadata


# The least a metadata entry takes (key length, value type, one byte of value) and a tensor's description
# (name length, dimension count, type, data offset), in bytes: counts beyond what the file can hold are damage.
_MIN_ENTRY, _MIN_TENSOR_INFO, _HEADER = 13, 24, 24


def _check_counts(path: Path) -> None:
    """The header's tensor and metadata counts against the file's size, before the reader trusts them."""
    with open(path, "rb") as f:
        head = f.read(_HEADER)
    if len(head) < _HEADER or head[:4] != b"GGUF":
        return  # the reader says what is wrong
    # a big-endian file's version (a small number) reads as a multiple of 2**16 in little-endian order
    order = ">" if struct.unpack("<I", head[4:8])[0] & 0xFFFF == 0 else "<"
    n_tensors, n_entries = struct.unpack(f"{order}QQ", head[8:24])
    size = path.stat().st_size
    if n_tensors * _MIN_TENSOR_INFO + n_entries * _MIN_ENTRY > size - _HEADER:
        raise ValueError(f"{path} is not a readable GGUF file: its header counts {n_tensors} tensors and {n_entries} "
                         f"metadata entries, more than its {size} bytes can hold (truncated or damaged)")


def _check_architecture(contents: GGUFContents) -> str:
    arch = contents.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{contents.path}: unsupported architecture {arch!r}; qkv loads {list(SUPPORTED_ARCHITECTURES)} GGUF files"
        )
    return arch


def hf_config_from_gguf(contents: GGUFContents) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of the model a GGUF file's metadata describes (with qkv's own
    ``rope_freq_factors`` when the file holds Llama 3's ``rope_freqs``): LLaMA's keys, then its family's own
    (:data:`qkv.interop.families.FAMILIES`).

    Keys are ``{architecture}.{name}`` in GGUF (``llama.block_count``); the result uses transformers' names,
    so :func:`~qkv.interop.hf_gpt.gpt_config_from_hf` applies its checks unchanged.

    Args:
        contents: from :func:`read_gguf`.

    Returns:
        A dict such as ``{"model_type": "llama", "hidden_size": 576, ...}``.

    Raises:
        ValueError: for another architecture, a missing size or one that is not a positive number (named), or a
            mixture of experts.
    """
    arch = _check_architecture(contents)
    meta = contents.metadata
    get = functools.partial(_size, contents, arch)
    if arch == "gpt2":
        return _gpt2_hf_config(contents, get)
    family = GGUF_FAMILIES[arch]
    if meta.get(f"{arch}.expert_count", 0) and family.experts is None:  # Mixtral's files are "llama" files
        family = FAMILIES["mixtral"] if arch == "llama" else None
    if family is None:
        raise ValueError(f"{contents.path}: a {arch} file with experts ({arch}.expert_count > 0) is not supported")
    d_model, n_heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", d_model // n_heads or 1)
    rotary_dim = get("rope.dimension_count", head_dim)
    if rotary_dim > head_dim:
        raise ValueError(f"{contents.path}: rope.dimension_count={rotary_dim} is more than the head size {head_dim}")
    config = {
        "model_type": family.model_type,
        "vocab_size": _vocab_size(contents, arch),
        "hidden_size": d_model,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": get("attention.head_count_kv", n_heads),
        "head_dim": head_dim,
        "max_position_embeddings": get("context_length", 2048),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5, real=True)),
        "rope_theta": float(get("rope.freq_base", 10000.0, real=True)),
        "partial_rotary_factor": rotary_dim / head_dim,
        "hidden_act": "silu",
        # llama.cpp leaves out the output matrix of a model that reuses its token embedding.
        "tie_word_embeddings": "output.weight" not in contents.tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if ROPE_FREQS in contents.tensors:
        config["rope_freq_factors"] = contents.tensors[ROPE_FREQS].flatten().tolist()
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":  # handed on, so that gpt_config_from_hf reads it or rejects it with its usual message
        config["rope_scaling"] = {"rope_type": scaling, "factor": meta.get(f"{arch}.rope.scaling.factor"),
                                  "original_max_position_embeddings":
                                      meta.get(f"{arch}.rope.scaling.original_context_length")}
    try:
        return config | family.from_gguf(get, meta, contents.tensors)
    except ValueError as err:  # named with the file, once
        raise ValueError(str(err) if str(err).startswith(f"{contents.path}: ") else f"{contents.path}: {err}") \
            from None


def _gpt2_hf_config(contents: GGUFContents, get: Callable[..., Any]) -> dict[str, Any]:
    """GPT-2's ``config.json`` of a ``gpt2`` GGUF file (GELU with tanh, as llama.cpp computes it)."""
    return {"model_type": "gpt2", "vocab_size": _vocab_size(contents, "gpt2"), "n_embd": get("embedding_length"),
            "n_head": get("attention.head_count"), "n_layer": get("block_count"),
            "n_inner": get("feed_forward_length"), "n_positions": get("context_length"),
            "layer_norm_epsilon": float(get("attention.layer_norm_epsilon", 1e-5, real=True)),
            "activation_function": "gelu_new", "tie_word_embeddings": "output.weight" not in contents.tensors,
            "bos_token_id": contents.metadata.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": contents.metadata.get("tokenizer.ggml.eos_token_id")}


def _vocab_size(contents: GGUFContents, arch: str) -> int:
    if "token_embd.weight" in contents.tensors:
        return int(contents.tensors["token_embd.weight"].shape[0])
    # the strict converter will report the missing embedding; a size is still needed to get there
    return int(contents.metadata.get(f"{arch}.vocab_size", len(contents.metadata.get("tokenizer.ggml.tokens", ()))))


def _size(contents: GGUFContents, arch: str, key: str, default: Any = None, *, real: bool = False,
          minimum: int = 1, optional: bool = False) -> Any:
    """Metadata ``{arch}.{key}``: a size (an int >= ``minimum``), or with ``real`` a positive number, checked here,
    where the key can be named; ``optional``: None when absent."""
    value = contents.metadata.get(f"{arch}.{key}", default)
    if value is None:
        if optional:
            return None
        raise ValueError(f"{contents.path}: the metadata has no {arch}.{key}")
    if isinstance(value, bool) or not isinstance(value, (int, float) if real else int) or \
            not (value > 0 if real else minimum <= value) or value == float("inf"):
        expected = "a positive number" if real else f"an integer >= {minimum}"
        raise ValueError(f"{contents.path}: {arch}.{key} must be {expected}, got {value!r}")
    try:
        check_size(f"{arch}.{key}", value, _BOUNDS.get(key, 2**24))
    except ValueError as err:
        raise ValueError(f"{contents.path}: {err}") from None
    return value


def unpermute_rope_rows(weight: Tensor, n_heads: int) -> Tensor:
    """Undo llama.cpp's reordering of a query/key projection: interleaved rotary pairs -> rotate-half.

    llama.cpp's converter (``LlamaModel.permute`` in ``convert_hf_to_gguf.py``) maps each head's rows with
    ``reshape(n_heads, 2, head_dim/2, d_in).swapaxes(1, 2)``: row ``i`` of the first half and row ``i`` of the
    second half, a rotate-half pair, become neighbours ``2i`` and ``2i + 1``, the pairs ggml rotates. The
    inverse splits the rows into those neighbour pairs and swaps the axes back.

    Args:
        weight: ``(n_heads * head_dim, d_in)`` rows as stored in the GGUF file.
        n_heads: heads in this projection (key/value heads for ``k_proj``).

    Returns:
        The same rows in Hugging Face order.
    """
    rows, d_in = weight.shape
    head_dim = rows // n_heads
    if head_dim * n_heads != rows or head_dim % 2:
        raise ValueError(f"cannot split {rows} rows into {n_heads} heads of an even size")
    w = weight.reshape(n_heads, head_dim // 2, 2, d_in)  # (H, Dh/2, 2, in): row pairs (2i, 2i+1)
    return w.transpose(1, 2).reshape(rows, d_in)  # (H, 2, Dh/2, in) -> first halves, then second halves


def hf_state_dict_from_gguf(contents: GGUFContents, hf_config: Mapping[str, Any]) -> dict[str, Tensor]:
    """Rename GGUF tensors to a Hugging Face ``LlamaForCausalLM`` state dict, un-permuting q and k.

    A tensor whose name is unknown keeps its GGUF name, so the strict converter reports it rather than
    the model silently running without it.

    Args:
        contents: from :func:`read_gguf`.
        hf_config: from :func:`hf_config_from_gguf` (for the head counts).

    Returns:
        Hugging Face name -> tensor.
    """
    if hf_config["model_type"] == "gpt2":
        return _gpt2_state_dict(contents)
    arch = contents.architecture
    heads = {"attn_q": hf_config["num_attention_heads"], "attn_k": hf_config["num_key_value_heads"]}
    if arch not in PERMUTED_ARCHITECTURES:
        heads = {}
    names, shift = FAMILIES[hf_config["model_type"]].gguf_names, norm_shift(arch)
    out: dict[str, Tensor] = {}
    for name, tensor in contents.tensors.items():
        if name in ROPE_TENSORS:  # in the config already
            continue
        if shift and name.endswith("norm.weight"):  # stored as the gains 1 + w
            tensor = tensor - shift
        base, _, part = name.rpartition(".")
        if base in GLOBAL_NAMES:
            out[f"{GLOBAL_NAMES[base]}.{part}"] = tensor
            continue
        match = _LAYER_TENSOR.fullmatch(name)
        if match is None or match[2] not in names:
            out[name] = tensor
            continue
        layer, kind, part = match.groups()
        if kind in heads and part == "weight":
            tensor = unpermute_rope_rows(tensor, heads[kind])
        if kind == "ffn_gate_inp_shexp":  # a vector in GGUF files, one row of a linear layer in Hugging Face's
            tensor = tensor.reshape(1, -1)
        out[f"model.layers.{layer}.{names[kind]}.{part}"] = tensor
    return out


def _gpt2_state_dict(contents: GGUFContents) -> dict[str, Tensor]:
    """GPT-2's Hugging Face names, its matrices turned back to Conv1D's ``(in, out)``."""
    out: dict[str, Tensor] = {}
    for name, tensor in contents.tensors.items():
        base, _, part = name.rpartition(".")
        match = _LAYER_TENSOR.fullmatch(name)
        if base in GPT2_GLOBAL_NAMES:
            out[f"{GPT2_GLOBAL_NAMES[base]}.{part}"] = tensor
        elif match is None or match[2] not in GPT2_LAYER_NAMES:
            out[name] = tensor  # reported by the strict converter
        else:
            layer, kind, part = match.groups()
            transposed = kind in GPT2_CONV1D and part == "weight"
            out[f"transformer.h.{layer}.{GPT2_LAYER_NAMES[kind]}.{part}"] = tensor.T if transposed else tensor
    return out


def load_gpt_from_gguf(source: str | Path | GGUFContents) -> GPT:
    """Build a :class:`GPT` from a GGUF file of the LLaMA family or GPT-2 (the reference path: every tensor in
    float32).

    Args:
        source: a ``.gguf`` path, or what :func:`read_gguf` returned (to read the file once for both the model
            and its tokenizer).

    Returns:
        The model in eval mode, float32.

    Raises:
        ValueError: as :func:`read_gguf` and :func:`hf_config_from_gguf` do, and for tensors that are missing,
            misshapen or left over (all of them named).
    """
    contents = source if isinstance(source, GGUFContents) else read_gguf(source)
    hf_config = hf_config_from_gguf(contents)
    try:
        return load_gpt_from_hf(hf_state_dict_from_gguf(contents, hf_config), hf_config)
    except ValueError as err:
        raise ValueError(f"{contents.path}: {err}") from None


__all__ = [
    "GGUFContents",
    "hf_config_from_gguf",
    "hf_state_dict_from_gguf",
    "load_gpt_from_gguf",
    "open_gguf",
    "read_gguf",
    "unpermute_rope_rows",
]
