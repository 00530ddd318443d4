"""qkv's language models as GGUF files that llama.cpp runs.

    qkv export --model RUN --format gguf --out FILE.gguf [--type f32|f16|q8_0|q4_0]

The way in, backwards: the model's Hugging Face tensors (:func:`~qkv.interop.hf_gpt.gpt_state_dict_to_hf`, the
export's own), renamed to llama.cpp's names (the inverse of :data:`qkv.interop.gguf.LAYER_NAMES`), the query and
key rows of a ``llama`` file reordered into ggml's interleaved rotary pairs (the inverse of
:func:`~qkv.interop.gguf.unpermute_rope_rows`), written by the ``gguf`` package with the metadata llama.cpp reads.

=============  ==========================================================================================
architecture   the qkv GPT it holds
=============  ==========================================================================================
``llama``      RMSNorm, rotary positions, SwiGLU, no biases (grouped key/value heads allowed)
``qwen2``      the same with biases on Q, K and V
``qwen3``      the same with RMSNorm on each head's queries and keys
``gpt2``       LayerNorm, learned positions, biases, GELU (tanh)
=============  ==========================================================================================

A sliding window has no key in llama.cpp's ``llama`` files and is refused, as is any other model.

``--type`` sets how the matrices are stored: ``f32`` exactly; ``f16`` rounded to half precision; ``q8_0`` (8 bits
and a scale per 32 weights, about 0.1% of error) and ``q4_0`` (4 bits, about 10%) by the ``gguf`` package's
quantizers, which are llama.cpp's. Norms, biases and Qwen3's head norms stay ``f32``; a matrix whose rows are not
whole blocks of 32 stays ``f16``.

The tokenizer: byte-level BPE (``tokenizer.ggml.model = "gpt2"``), the vocabulary, the merges, the special ids,
and ``tokenizer.ggml.pre``, the name llama.cpp knows the pre-tokenizer by (found by comparing the tokenizer's
own with those qkv rebuilds from each name, :data:`~qkv.interop.gguf_tokenizer.GGUF_PRE_TOKENIZERS`); qkv's
trained byte-level BPE is SmolLM2's ``smollm``. Character vocabularies and qkv's SentencePiece-style BPE have no
GGUF form here.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor, nn

from ..files import write_atomically
from ..models import GPT
from .export import check_float, check_out, check_size, hf_tokenizer
from .gguf import (
    GLOBAL_NAMES,
    GPT2_CONV1D,
    GPT2_GLOBAL_NAMES,
    GPT2_LAYER_NAMES,
    LAYER_NAMES,
    PERMUTED_ARCHITECTURES,
    _import_gguf,
)

log = logging.getLogger(__name__)

TYPES = ("f32", "f16", "q8_0", "q4_0")


def export_gguf(model: nn.Module, tokenizer, out: str | Path, *, storage: str = "f16",
                chat_template: str | None = None) -> Path:
    """Write ``model`` and its byte-level BPE ``tokenizer`` as the GGUF file ``out`` (see the module's text).

    Raises:
        ValueError: a model or tokenizer with no GGUF form here (said why), an unknown ``storage`` (one of
            :data:`TYPES`: how the matrices are stored), or an ``out`` that exists.
    """
    gguf = _import_gguf()
    out = Path(out)
    check_out(out, "file")
    if storage not in TYPES:
        raise ValueError(f"--type must be one of {list(TYPES)}, got {storage!r}")
    from .hf_gpt import gpt_config_to_hf, gpt_state_dict_to_hf

    if not isinstance(model, GPT):
        raise ValueError(f"qkv writes its GPT language models as GGUF files; a {type(model).__name__} has none")
    check_float(model)
    cfg = model.config
    hf_config = gpt_config_to_hf(cfg)
    arch = {"mistral": None}.get(hf_config["model_type"], hf_config["model_type"])
    if arch is None:
        raise ValueError(f"llama.cpp's GGUF files have no sliding window (window={cfg.window}); export this model "
                         "with --format hf")
    vocab = _vocabulary(tokenizer, hf_config["vocab_size"])
    tensors = _gguf_tensors(gpt_state_dict_to_hf(model.state_dict(), cfg), hf_config)
    kinds = {}

    def write(tmp: Path) -> None:
        writer = gguf.GGUFWriter(str(tmp), arch)
        _write_metadata(writer, gguf, hf_config, cfg, storage)
        _write_tokenizer(writer, gguf, vocab, chat_template)
        for name, tensor in tensors.items():
            array, kinds[name] = _stored(gguf, tensor, storage)
            writer.add_tensor(name, array, raw_dtype=kinds[name])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    write_atomically(out, write)
    stored = sorted({k.name for k in kinds.values()})
    log.info("wrote %s: a %s model of %d tensors (%s) that llama.cpp runs", out, arch, len(tensors), ", ".join(stored))
    return out


def _gguf_tensors(hf: dict[str, Tensor], hf_config: dict[str, Any]) -> dict[str, Tensor]:
    """Hugging Face names -> llama.cpp's (the reader's tables inverted): q and k reordered for the architectures
    ggml rotates in pairs, GPT-2's Conv1D weights turned to ``(out, in)``."""
    gpt2 = hf_config["model_type"] == "gpt2"
    names = {theirs: ours for ours, theirs in (GPT2_GLOBAL_NAMES if gpt2 else GLOBAL_NAMES).items()}
    layer_names = {theirs: ours for ours, theirs in (GPT2_LAYER_NAMES if gpt2 else LAYER_NAMES).items()}
    heads = {} if hf_config["model_type"] not in PERMUTED_ARCHITECTURES else {
        "attn_q": hf_config["num_attention_heads"], "attn_k": hf_config["num_key_value_heads"]}
    out = {}
    for name, tensor in hf.items():
        base, _, part = name.rpartition(".")
        if base in names:
            out[f"{names[base]}.{part}"] = tensor
            continue
        layer, module = base.split(".")[2], base.split(".", 3)[-1]  # {transformer.h|model.layers}.{i}.{module}
        kind = layer_names[module]
        if part == "weight" and kind in heads:
            tensor = permute_rope_rows(tensor, heads[kind])
        elif part == "weight" and gpt2 and kind in GPT2_CONV1D:
            tensor = tensor.T
        out[f"blk.{layer}.{kind}.{part}"] = tensor
    return out


def permute_rope_rows(weight: Tensor, n_heads: int) -> Tensor:
    """Rotate-half query/key rows -> ggml's interleaved pairs: row ``i`` of each head's first half and row ``i``
    of its second half become neighbours ``2i`` and ``2i + 1`` (the inverse of
    :func:`qkv.interop.gguf.unpermute_rope_rows`)."""
    rows, d_in = weight.shape
    return weight.reshape(n_heads, 2, rows // n_heads // 2, d_in).transpose(1, 2).reshape(rows, d_in)


def _stored(gguf, tensor: Tensor, storage: str):
    """(array, GGMLQuantizationType) of one tensor stored as ``storage`` (vectors always F32)."""
    kinds = gguf.GGMLQuantizationType
    array = tensor.detach().float().contiguous().numpy()
    if array.ndim == 1 or storage == "f32":
        return array, kinds.F32
    if storage == "f16" or array.shape[-1] % 32:
        return array.astype(np.float16), kinds.F16
    kind = kinds.Q8_0 if storage == "q8_0" else kinds.Q4_0
    return gguf.quants.quantize(array, kind), kind


def _write_metadata(writer, gguf, hf: dict[str, Any], cfg, storage: str) -> None:
    writer.add_name("qkv")
    writer.add_block_count(cfg.n_layers)
    writer.add_context_length(cfg.max_seq_len)
    writer.add_embedding_length(cfg.d_model)
    writer.add_feed_forward_length(cfg.d_ff)
    writer.add_head_count(cfg.n_heads)
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[storage])
    if hf["model_type"] == "gpt2":
        writer.add_layer_norm_eps(cfg.norm_eps)
        return
    writer.add_head_count_kv(cfg.n_kv_heads or cfg.n_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_base)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_vocab_size(cfg.vocab_size)


def _vocabulary(tokenizer, vocab_size: int) -> dict[str, Any]:
    """The byte-level BPE of ``tokenizer`` as GGUF holds it: tokens in id order, which are special (control
    tokens), merges, the pre-tokenizer's name and the special ids."""
    from .gguf_tokenizer import pre_tokenizer_name

    hf, specials = hf_tokenizer(tokenizer)
    data = json.loads(hf.to_str())
    if data["model"]["type"] != "BPE" or (data.get("decoder") or {}).get("type") != "ByteLevel":
        raise ValueError(f"GGUF files here hold byte-level BPE vocabularies; this one is {_kind(tokenizer, data)}: "
                         "train the model with --tokenizer bpe (byte-level, as qkv train lm does)")
    pre = pre_tokenizer_name(hf)
    if pre is None:
        raise ValueError("the tokenizer splits text in a way llama.cpp has no name for; it cannot be a GGUF file")
    size = hf.get_vocab_size(with_added_tokens=True)
    check_size(size, vocab_size)
    tokens = [hf.id_to_token(i) for i in range(size)]
    special = {t.content for t in hf.get_added_tokens_decoder().values() if t.special}
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    ids = {role: hf.token_to_id(token) for role, token in specials.items() if role != "unk"}
    add_bos = bool(getattr(tokenizer, "add_bos", False))
    return {"tokens": tokens, "special": [t in special for t in tokens], "merges": merges, "pre": pre, "ids": ids,
            "add_bos": add_bos}


def _kind(tokenizer, data: dict[str, Any]) -> str:
    if tokenizer.kind == "char":
        return "a character vocabulary"
    return f"{data['model']['type']} with a {(data.get('decoder') or {}).get('type', 'plain')} decoder"


def _write_tokenizer(writer, gguf, vocab: dict[str, Any], chat_template: str | None) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab["pre"])
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types([gguf.TokenType.CONTROL if s else gguf.TokenType.NORMAL for s in vocab["special"]])
    writer.add_token_merges(vocab["merges"])
    adders = {"bos": writer.add_bos_token_id, "eos": writer.add_eos_token_id, "pad": writer.add_pad_token_id}
    for role, token_id in vocab["ids"].items():
        adders[role](token_id)
    writer.add_add_bos_token(vocab["add_bos"])
    if chat_template is not None:
        writer.add_chat_template(chat_template)


__all__ = ["TYPES", "export_gguf", "permute_rope_rows"]
