"""qkv's language models as GGUF files that llama.cpp runs.

    qkv export --model RUN --format gguf --out FILE.gguf [--type f32|f16|q8_0|q4_0]

The way in, backwards: the model's Hugging Face tensors (:func:`~qkv.interop.hf_gpt.gpt_state_dict_to_hf`, the
export's own), renamed to llama.cpp's names (the inverse of its family's ``gguf_names``,
:mod:`qkv.interop.families`), the query and key rows of a ``llama`` file reordered into ggml's interleaved rotary
pairs (the inverse of :func:`~qkv.interop.gguf.unpermute_rope_rows`), written by the ``gguf`` package with the
metadata llama.cpp reads.

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
trained byte-level BPE is SmolLM2's ``smollm``. A character vocabulary is the same BPE with no merges (as in the
Hugging Face export): a character of one byte in UTF-8 is a normal token spelt in GPT-2's byte alphabet (``" "``
is ``"Ġ"``), which llama.cpp's BPE looks up as it is; a longer one (``é``, ``猫``) is a user-defined token, which
llama.cpp matches whole in the text before BPE runs (BPE with no merges could not join its bytes). A character
the vocabulary lacks is dropped, where qkv's own tokenizer writes ``<unk>``: llama.cpp's BPE has no unknown
token. A SentencePiece BPE (a pretrained Gemma's, Phi-3's or LLaMA 2's: ``▁`` for spaces, byte tokens for the rest) is
written as llama.cpp's ``llama`` tokenizer: its pieces with scores that rank them as its merges do, and whether a
``▁`` goes in front of the text.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor, nn

from ..files import check_out, write_atomically
from ..models import GPT
from ..tokenizers import BOS_ID, EOS_ID, PAD_ID, SPECIALS, CharTokenizer, PretrainedTokenizer
from .experts import per_expert, stacked
from .export import check_float, check_size, hf_tokenizer
from .families import FAMILIES, PERMUTED_ARCHITECTURES, gguf_keys, gguf_tensors, norm_shift
from .gguf import GLOBAL_NAMES, GPT2_CONV1D, GPT2_GLOBAL_NAMES, GPT2_LAYER_NAMES, _import_gguf

log = logging.getLogger(__name__)

TYPES = ("f32", "f16", "q8_0", "q4_0")


def export_gguf(model: nn.Module, tokenizer, out: str | Path, *, storage: str = "f16",
                chat_template: str | None = None) -> Path:
    """Write ``model`` and its tokenizer (byte-level BPE or characters) as the GGUF file ``out`` (see the
    module's text).

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
    arch = "gpt2" if hf_config["model_type"] == "gpt2" else FAMILIES[hf_config["model_type"]].gguf_arch
    if hf_config["model_type"] == "mistral" or (cfg.window and hf_config["model_type"] == "mixtral"):
        raise ValueError(f"llama.cpp's GGUF files have no sliding window (window={cfg.window}); export this model "
                         "with --format hf")
    keys = {} if arch == "gpt2" else gguf_keys(cfg, arch)
    vocab = _vocabulary(tokenizer, hf_config["vocab_size"])
    hf_tensors = gpt_state_dict_to_hf(model.state_dict(), cfg)
    if cfg.n_experts is not None:  # each layer's experts stacked, under the names the reader gives them
        hf_tensors = stacked(per_expert(hf_tensors, cfg))
    tensors = _gguf_tensors(hf_tensors, hf_config, arch) | gguf_tensors(cfg)
    kinds = {}

    def write(tmp: Path) -> None:
        writer = _writer(gguf, tmp, arch)
        _write_metadata(writer, gguf, hf_config, cfg, storage)
        _write_keys(writer, gguf, arch, keys)
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


def _gguf_tensors(hf: dict[str, Tensor], hf_config: dict[str, Any], arch: str) -> dict[str, Tensor]:
    """Hugging Face names -> llama.cpp's (the reader's tables inverted): q and k reordered for the architectures
    ggml rotates in pairs, GPT-2's Conv1D weights turned to ``(out, in)``, Gemma's norms stored as their gains."""
    gpt2 = hf_config["model_type"] == "gpt2"
    names = {theirs: ours for ours, theirs in (GPT2_GLOBAL_NAMES if gpt2 else GLOBAL_NAMES).items()}
    layers = GPT2_LAYER_NAMES if gpt2 else FAMILIES[hf_config["model_type"]].gguf_names
    layer_names = {theirs: ours for ours, theirs in layers.items()}
    heads = {} if arch not in PERMUTED_ARCHITECTURES else {
        "attn_q": hf_config["num_attention_heads"], "attn_k": hf_config["num_key_value_heads"]}
    shift = norm_shift(arch)
    out = {}
    for name, tensor in hf.items():
        if shift and name.endswith("norm.weight"):
            tensor = tensor + shift
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
        elif kind == "ffn_gate_inp_shexp":  # one row of a linear layer in Hugging Face's files, a vector here
            tensor = tensor.flatten()
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
    writer.add_rope_freq_base(cfg.rope_base)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_vocab_size(cfg.vocab_size)


def _write_keys(writer, gguf, arch: str, keys: dict[str, Any]) -> None:
    """The family's own keys (:func:`qkv.interop.families.gguf_keys`), typed as llama.cpp reads them."""
    kinds = gguf.GGUFValueType
    for key, value in keys.items():
        if isinstance(value, list):
            writer.add_array(f"{arch}.{key}", value)
        elif isinstance(value, str):
            writer.add_string(f"{arch}.{key}", value)
        elif isinstance(value, bool | int):
            writer.add_key_value(f"{arch}.{key}", int(value), kinds.UINT32)
        else:
            writer.add_key_value(f"{arch}.{key}", float(value), kinds.FLOAT32)


def _writer(gguf, path: Path, arch: str):
    """gguf's writer, able to write an empty array: a character vocabulary's merges, a key llama.cpp requires
    for byte-level BPE. The package refuses to (``add_array`` of nothing adds no key), although the format and
    llama.cpp read one; only the packing of an empty array is its own here, as an array of strings."""

    class Writer(gguf.GGUFWriter):
        def _pack_val(self, val, vtype, add_vtype, *args, **kwargs):
            if vtype != gguf.GGUFValueType.ARRAY or len(val):
                return super()._pack_val(val, vtype, add_vtype, *args, **kwargs)
            kind = self._pack("I", vtype) if add_vtype else b""
            return kind + self._pack("I", gguf.GGUFValueType.STRING) + self._pack("Q", 0)

    return Writer(str(path), arch)


def _vocabulary(tokenizer, vocab_size: int) -> dict[str, Any]:
    """The tokenizer as GGUF holds it: tokens in id order and their types (``CONTROL``: special;
    ``USER_DEFINED``: matched whole in the text; ``NORMAL``), merges, the pre-tokenizer's name, the special ids
    and whether a prompt starts with bos."""
    from .gguf_tokenizer import pre_tokenizer_name

    if isinstance(tokenizer, CharTokenizer):
        return _characters(tokenizer, vocab_size)
    hf, specials = hf_tokenizer(tokenizer)
    data = json.loads(hf.to_str())
    decoders = (data.get("decoder") or {}).get("decoders") or [data.get("decoder") or {}]  # one, or a Sequence
    if data["model"]["type"] == "BPE" and data["model"].get("byte_fallback"):
        return _sentencepiece(tokenizer, hf, data, specials, vocab_size)
    if data["model"]["type"] != "BPE" or not any(d.get("type") == "ByteLevel" for d in decoders):
        raise ValueError(f"GGUF files here hold byte-level BPE and character vocabularies; this one is "
                         f"{data['model']['type']} with a {decoders[-1].get('type', 'plain')} decoder: train the "
                         "model with qkv train lm's --tokenizer char or bpe (byte-level)")
    pre = pre_tokenizer_name(hf)
    if pre is None:
        raise ValueError("the tokenizer splits text in a way llama.cpp has no name for; it cannot be a GGUF file")
    size = hf.get_vocab_size(with_added_tokens=True)
    check_size(size, vocab_size, spare_rows=isinstance(tokenizer, PretrainedTokenizer))
    added = hf.get_added_tokens_decoder()
    types = ["NORMAL" if i not in added else "CONTROL" if added[i].special else "USER_DEFINED" for i in range(size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    ids = {role: hf.token_to_id(token) for role, token in specials.items() if role != "unk"}
    add_bos = bool(getattr(tokenizer, "add_bos", False))
    return _spare_rows({"model": "gpt2", "tokens": [hf.id_to_token(i) for i in range(size)], "types": types,
                        "merges": merges, "pre": pre, "ids": ids, "add_bos": add_bos}, vocab_size)


def _spare_rows(vocab: dict[str, Any], rows: int) -> dict[str, Any]:
    """``vocab`` with a token for each row of the table past the tokenizer's (a pretrained model's table is often
    longer), named and typed as llama.cpp's converter names them: ``[PAD{id}]``, unused."""
    spare = range(len(vocab["tokens"]), rows)
    extra = {"tokens": [f"[PAD{i}]" for i in spare], "types": ["UNUSED"] * len(spare), "scores": [-1e9] * len(spare)}
    return vocab | {key: vocab[key] + extra[key] for key in extra if key in vocab}


_BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")


def _sentencepiece(tokenizer, hf, data: dict, specials: dict, vocab_size: int) -> dict[str, Any]:
    """A SentencePiece BPE (Gemma's, LLaMA 2's, Phi-3's: ``▁`` for spaces, byte tokens for the rest) as llama.cpp's
    ``llama`` tokenizer holds it: each piece a score, the pieces that merges make ranked by their first merge
    (llama.cpp joins the pair whose piece scores highest: the same order), and whether a ``▁`` goes in front of the
    text (``add_space_prefix``)."""
    size = hf.get_vocab_size(with_added_tokens=True)
    check_size(size, vocab_size, spare_rows=isinstance(tokenizer, PretrainedTokenizer))
    tokens = [hf.id_to_token(i) for i in range(size)]
    rank: dict[str, int] = {}
    for i, merge in enumerate(data["model"]["merges"]):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        rank.setdefault(left + right, i)
    added = hf.get_added_tokens_decoder()
    unknown = data["model"].get("unk_token")
    types = ["CONTROL" if i in added and added[i].special else "USER_DEFINED" if i in added else
             "UNKNOWN" if token == unknown else "BYTE" if _BYTE_TOKEN.fullmatch(token) else "NORMAL"
             for i, token in enumerate(tokens)]
    scores = [-float(rank[token]) if token in rank else -1e9 for token in tokens]
    ids = {role: hf.token_to_id(token) for role, token in specials.items()}
    return _spare_rows({"model": "llama", "tokens": tokens, "types": types, "scores": scores, "pre": "default",
                        "ids": ids, "add_bos": bool(getattr(tokenizer, "add_bos", False)),
                        "space_prefix": "Prepend" in json.dumps(data.get("normalizer")) or
                        '"prepend_scheme": "first"' in json.dumps(data.get("pre_tokenizer"))}, vocab_size)


def _characters(tokenizer: CharTokenizer, vocab_size: int) -> dict[str, Any]:
    """A character vocabulary as byte-level BPE with no merges (see the module's text): the special tokens
    control tokens, a one-byte character a normal token in the byte alphabet, a longer one user-defined.

    Raises:
        ValueError: two characters that are one token there: a character of U+0100 to U+0121 (``Ċ``, ``č``)
            spells an ASCII control character or the space (``Ċ`` is ``"\\n"``).
    """
    from .gguf_tokenizer import byte_level

    check_size(tokenizer.vocab_size, vocab_size)
    types = ["CONTROL" if i < len(SPECIALS) else "NORMAL" if len(c.encode()) == 1 else "USER_DEFINED"
             for i, c in enumerate(tokenizer.itos)]
    tokens = [byte_level(c) if kind == "NORMAL" else c for c, kind in zip(tokenizer.itos, types, strict=True)]
    spelt: dict[str, str] = {}
    for token, char in zip(tokens, tokenizer.itos, strict=True):
        if spelt.setdefault(token, char) != char:
            raise ValueError(f"the characters {spelt[token]!r} and {char!r} are one GGUF token, {token!r}, in "
                             "llama.cpp's byte alphabet; export this model with --format hf")
    return {"model": "gpt2", "tokens": tokens, "types": types, "merges": [], "pre": "gpt-2",
            "ids": {"bos": BOS_ID, "eos": EOS_ID, "pad": PAD_ID}, "add_bos": False}


def _write_tokenizer(writer, gguf, vocab: dict[str, Any], chat_template: str | None) -> None:
    writer.add_tokenizer_model(vocab["model"])
    writer.add_tokenizer_pre(vocab["pre"])
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types([gguf.TokenType[kind] for kind in vocab["types"]])
    if vocab["model"] == "llama":
        writer.add_token_scores(vocab["scores"])
        writer.add_add_space_prefix(vocab["space_prefix"])
    else:  # add_token_merges([]) would add no key (see _writer)
        writer.add_key_value(gguf.Keys.Tokenizer.MERGES, vocab["merges"], gguf.GGUFValueType.ARRAY)
    adders = {"bos": writer.add_bos_token_id, "eos": writer.add_eos_token_id, "pad": writer.add_pad_token_id,
              "unk": writer.add_unk_token_id}
    for role, token_id in vocab["ids"].items():
        if token_id is not None:
            adders[role](token_id)
    writer.add_add_bos_token(vocab["add_bos"])
    if chat_template is not None:
        writer.add_chat_template(chat_template)


__all__ = ["TYPES", "export_gguf", "permute_rope_rows"]
