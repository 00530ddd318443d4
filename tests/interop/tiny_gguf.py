"""Tiny LLaMA models as GGUF files, written with ``gguf.GGUFWriter`` from a random transformers model, q and k
permuted exactly as llama.cpp's converter does (for test_gguf.py and test_at_rest.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="reading GGUF files needs the gguf package: pip install gguf")
transformers = pytest.importorskip("transformers")

N_HEADS, N_KV_HEADS, D_MODEL = 4, 2, 32


# ---------------------------------------------------------------------------------------- tiny GGUF files


def llama_cpp_permute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """What llama.cpp's convert_hf_to_gguf.py (``LlamaModel.permute``) does to q_proj and k_proj rows."""
    rows, d_in = weight.shape
    return weight.reshape(n_heads, 2, rows // n_heads // 2, d_in).swapaxes(1, 2).reshape(rows, d_in)


def byte_alphabet() -> list[str]:
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet())


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
TOKENS = SPECIALS + byte_alphabet() + ["Ġt", "he", "Ġthe"]
VOCAB = len(TOKENS)


# A SentencePiece vocabulary (tokenizer.ggml.model "llama"): unknown, bos, eos, the 256 byte tokens, then pieces
# in the order BPE learnt them, each scored minus its rank, as LLaMA 2's are.
SPM_PIECES = ["▁", "t", "h", "e", "c", "a", "s", "i", "n", "o", "猫", "he", "▁t", "▁the", "at", "▁c", "▁cat",
              "in", "▁s", "it", "▁sit", "▁sits", "on", "▁on", "▁▁", "▁▁▁", "▁i", "▁in"]
SPM_TOKENS = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SPM_PIECES]
SPM_TYPES = [2, 3, 3, *[6] * 256, *[1] * len(SPM_PIECES)]
SPM_SCORES = [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))]


def tiny_llama(*, tie: bool, d_model: int = D_MODEL, d_ff: int = 64):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=d_model, num_attention_heads=N_HEADS, num_key_value_heads=N_KV_HEADS,
        num_hidden_layers=2, intermediate_size=d_ff, max_position_embeddings=64, rope_theta=500.0, rms_norm_eps=1e-5,
        tie_word_embeddings=tie, attn_implementation="eager",
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # away from the initial values (norm gains of 1), so a swapped tensor shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model.eval()


def gguf_tensors(model, *, matrices: str = "F32") -> dict[str, np.ndarray]:
    """The model's tensors under GGUF names, q/k permuted, 2-D weights stored as ``matrices`` (F32 or F16).

    With F16, the transformers model's weights are rounded in place too, so both sides hold the same values.
    """
    layer_names = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    }
    out = {}
    for name, param in model.named_parameters():  # a tied lm_head is not listed: llama.cpp writes no output
        if matrices == "F16" and param.dim() == 2:
            with torch.no_grad():
                param.copy_(param.half().float())
        weight = param.detach()
        if name == "model.embed_tokens.weight":
            key = "token_embd.weight"
        elif name == "model.norm.weight":
            key = "output_norm.weight"
        elif name == "lm_head.weight":
            key = "output.weight"
        else:
            _, _, layer, module = name.removesuffix(".weight").split(".", 3)
            key = f"blk.{layer}.{layer_names[module]}.weight"
            if module == "self_attn.q_proj":
                weight = llama_cpp_permute(weight, N_HEADS)
            elif module == "self_attn.k_proj":
                weight = llama_cpp_permute(weight, N_KV_HEADS)
        array = weight.numpy()
        out[key] = array.astype(np.float16) if matrices == "F16" and array.ndim == 2 else array
    return out


def write_gguf(path, tensors, *, arch="llama", tokenizer=True, chat_template=None, pre="smollm", d_model=D_MODEL,
               d_ff=64, **metadata):
    """A GGUF file with LLaMA metadata for the tiny model (``d_model`` and ``d_ff`` as :func:`tiny_llama`'s);
    ``metadata`` adds or overrides raw keys. ``tokenizer``: True (byte-level BPE), "llama" (SentencePiece) or
    False."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_context_length(64)
    writer.add_embedding_length(d_model)
    writer.add_feed_forward_length(d_ff)
    writer.add_head_count(N_HEADS)
    writer.add_head_count_kv(N_KV_HEADS)
    writer.add_rope_freq_base(500.0)
    writer.add_layer_norm_rms_eps(1e-5)
    if tokenizer == "llama":
        writer.add_tokenizer_model("llama")
        writer.add_token_list(SPM_TOKENS)
        writer.add_token_scores(SPM_SCORES)
        writer.add_token_types(SPM_TYPES)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
    elif tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(TOKENS)
        writer.add_token_merges(MERGES)
        writer.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(TOKENS) - 3))
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for key, value in metadata.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif value >= 2**32:
            writer.add_uint64(key, value)
        else:
            writer.add_uint32(key, value)
    for name, array in tensors.items():  # an array, or (stored bytes, their GGMLQuantizationType or None)
        array, kind = array if isinstance(array, tuple) else (array, None)
        writer.add_tensor(name, array, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def q6_k(weights: np.ndarray) -> np.ndarray:
    """``weights`` ``(rows, n)`` (n a multiple of 256) as Q6_K blocks, the bytes a file stores (the ``gguf`` package
    reads them but cannot write them): per 16 weights a scale ``amax / 31`` as an int8 multiple of the super-block's
    fp16 ``d`` (the largest of them / 127), codes ``round(w / (d · sc)) + 32`` in 0..63; the bytes laid out as
    ggml's block_q6_K (low nibbles, high bit pairs, scales, d)."""
    rows, n = weights.shape
    groups = weights.astype(np.float64).reshape(rows, n // 256, 16, 16)
    wanted = np.abs(groups).max(-1) / 31  # (rows, blocks, 16)
    d = (wanted.max(-1) / 127).astype(np.float16)
    d = np.where(d > 0, d, np.float16(2**-24))
    sc = np.clip(np.round(wanted / d[..., None].astype(np.float64)), -128, 127).astype(np.int8)
    step = (d[..., None].astype(np.float64) * sc)[..., None]
    q = np.where(step > 0, np.round(groups / np.where(step > 0, step, 1)) + 32, 32)
    q = np.clip(q, 0, 63).astype(np.uint8).reshape(rows, n // 256, 2, 4, 32)  # (half, k, l): weight 32 k + l
    low, high = q & 15, q >> 4
    ql = np.concatenate([low[..., 0, :] | low[..., 2, :] << 4, low[..., 1, :] | low[..., 3, :] << 4], axis=-1)
    qh = high[..., 0, :] | high[..., 1, :] << 2 | high[..., 2, :] << 4 | high[..., 3, :] << 6
    blocks = np.concatenate([ql.reshape(rows, n // 256, 128), qh.reshape(rows, n // 256, 64),
                             sc.view(np.uint8), d[..., None].view(np.uint8)], axis=-1)
    return blocks.reshape(rows, -1)


def q5_k(weights: np.ndarray) -> np.ndarray:
    """``weights`` ``(rows, n)`` (n a multiple of 256) as Q5_K blocks, the bytes a file stores (the ``gguf`` package
    reads them but cannot write them): per 32 weights a scale ``(max - min) / 31`` and a minimum ``-min`` (0 if the
    least weight is positive) as six-bit multiples of the super-block's fp16 ``d`` and ``dmin``, codes ``round((w +
    dmin · m) / (d · sc))`` in 0..31; the bytes laid out as ggml's block_q5_K (d, dmin, the packed scales, the fifth
    bits, the low nibbles)."""
    rows, n = weights.shape
    groups = weights.astype(np.float64).reshape(rows, n // 256, 8, 32)
    lows = np.minimum(groups.min(-1), 0)
    wanted_sc, wanted_m = (groups.max(-1) - lows) / 31, -lows
    d = np.maximum(wanted_sc.max(-1) / 63, 2**-24).astype(np.float16)
    dmin = np.maximum(wanted_m.max(-1) / 63, 2**-24).astype(np.float16)
    sc = np.clip(np.round(wanted_sc / d[..., None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(wanted_m / dmin[..., None]), 0, 63).astype(np.uint8)
    step = (d[..., None].astype(np.float64) * sc)[..., None]
    shifted = groups + (dmin[..., None].astype(np.float64) * m)[..., None]
    q = np.clip(np.where(step > 0, np.round(shifted / np.where(step > 0, step, 1)), 0), 0, 31).astype(np.uint8)
    packed = np.concatenate([sc[..., :4] | (sc[..., 4:] >> 4) << 6, m[..., :4] | (m[..., 4:] >> 4) << 6,
                             (sc[..., 4:] & 15) | (m[..., 4:] & 15) << 4], axis=-1)
    pairs = q.reshape(rows, n // 256, 4, 2, 32)  # sub-blocks 2 c and 2 c + 1
    qs = (pairs[..., 0, :] & 15) | (pairs[..., 1, :] & 15) << 4
    qh = sum(((q[..., j, :] >> 4) & 1) << j for j in range(8)).astype(np.uint8)
    blocks = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), packed, qh,
                             qs.reshape(rows, n // 256, 128)], axis=-1)
    return blocks.reshape(rows, -1)
