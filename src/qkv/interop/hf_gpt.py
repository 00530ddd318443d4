"""Hugging Face decoder checkpoints -> qkv's :class:`GPT`: GPT-2 and LLaMA-style models.

A Hugging Face checkpoint is a ``config.json`` (a dict here) and a state dict (tensor name -> tensor, e.g.
read from ``model.safetensors`` with ``safetensors.torch.load_file``). This module translates both with
torch alone; it never imports ``transformers``.

    config.json ── gpt_config_from_hf ─────> GPTConfig
    state dict  ── gpt_state_dict_from_hf ─> qkv state dict
    both        ── load_gpt_from_hf ───────> GPT (strictly loaded, eval mode)

and back, for export (:mod:`qkv.interop.export`): ``gpt_config_to_hf`` and ``gpt_state_dict_to_hf``, each
the inverse of the reader, and checked by it.

Layouts that differ on the way:

* GPT-2 keeps its linear layers as ``Conv1D``: weights ``(in, out)``, the transpose of ``nn.Linear``'s
  ``(out, in)``; and one fused ``c_attn`` projection whose output features are ``[q | k | v]``.
* LLaMA's ``q_proj``/``k_proj`` rows are in the "rotate half" order, which is qkv's default rotary layout
  (``RotaryEmbedding(interleaved=False)``), so they are copied unchanged.

The conversion is strict: every qkv tensor must come from the checkpoint with the expected shape, and every
checkpoint tensor must be used, apart from buffers (GPT-2's causal-mask tables, rotary frequencies). Anything
else raises one ValueError that lists every problem found.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..config import GPTConfig, check_scale
from ..footprint import build_model
from ..models import GPT
from .hf_common import HFStateDict, check_config, check_written, hf_field

GPT_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3")
# The LLaMA family: one layout, told apart by their configs (Mistral: a sliding window; Qwen2: biases on Q, K, V;
# Qwen3: RMSNorm on each head's queries and keys, and a head width of its own)
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")


_GPT2_ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu": "gelu",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}

# Every size a decoder's config states, with the largest qkv takes: far above any published model's (Llama 3.1
# 405B: 126 layers 16,384 wide, 128 heads of 128, 53,248 in the feed-forward layer, 131,072 positions), so that
# a damaged number fails here, before it sizes a loop or an allocation. What the tensors show (layers, widths,
# heads times their width, the vocabulary) is then checked against them by the strict converter.
#   config.json key (LLaMA family)  GPT-2's                GGUF key after "{arch}."             at most
SIZES = (
    ("num_hidden_layers",         "n_layer",            "block_count",                        2**10),
    ("hidden_size",               "n_embd",             "embedding_length",                   2**16),
    ("num_attention_heads",       "n_head",             "attention.head_count",               2**10),
    ("num_key_value_heads",       None,                 "attention.head_count_kv",            2**10),
    ("head_dim",                  None,                 "attention.key_length",               2**12),
    (None,                        None,                 "rope.dimension_count",               2**12),
    ("intermediate_size",         "n_inner",            "feed_forward_length",                2**20),
    ("vocab_size",                "vocab_size",         "vocab_size",                         2**22),
    ("max_position_embeddings",   "n_positions",        "context_length",                     2**24),
    ("rope_theta",                None,                 "rope.freq_base",                     10**12),
    ("rms_norm_eps",              None,                 "attention.layer_norm_rms_epsilon",   1),
    (None,                        "layer_norm_epsilon", "attention.layer_norm_epsilon",       1),
)


def check_size(name: str, value: Any, bound: float) -> None:
    """A number a file states (``name``, as the file names it), at most ``bound``."""
    if isinstance(value, int | float) and not isinstance(value, bool) and value > bound:
        raise ValueError(f"{name}={value} is beyond what qkv takes (at most {bound:,}); the file is damaged, or "
                         "not a model qkv reads")


BOUNDS = {key: bound for *keys, _, bound in SIZES for key in keys if key}  # config.json key -> its bound


def check_sizes(hf_config: Mapping[str, Any]) -> None:
    """Each number of :data:`SIZES` a config.json holds, at most its bound."""
    for key, bound in BOUNDS.items():
        check_size(key, hf_config.get(key), bound)



def gpt_config_from_hf(hf_config: Mapping[str, Any]) -> GPTConfig:
    """Translate a Hugging Face ``config.json`` of a GPT-2 or LLaMA model into a :class:`GPTConfig`.

    Dropout is set to 0 and ``pad_id`` to None (a language model masks padding through ``attention_mask``).

    Args:
        hf_config: the parsed ``config.json`` (or ``PretrainedConfig.to_dict()``); ``model_type`` picks the
            family: ``"gpt2"`` or ``"llama"``.

    Returns:
        The equivalent :class:`GPTConfig`.

    Raises:
        ValueError: for another model_type, a missing size, or a feature qkv does not implement (rope scaling,
            biases in a LLaMA model, GPT-2's per-layer attention scaling, ...).
    """
    model_type = hf_config.get("model_type")
    check_sizes(hf_config)
    if model_type == "gpt2":
        return _gpt2_config(hf_config)
    if model_type in LLAMA_FAMILY:
        return _llama_config(hf_config)
    raise ValueError(f"unsupported model_type {model_type!r} for a GPT; expected one of {list(GPT_MODEL_TYPES)}")



def _gpt2_config(hf_config: Mapping[str, Any]) -> GPTConfig:
    activation = hf_field(hf_config, "activation_function", "gelu_new")
    if activation not in _GPT2_ACTIVATIONS:
        raise ValueError(
            f"unsupported GPT-2 activation_function {activation!r}; expected one of {sorted(_GPT2_ACTIVATIONS)}"
        )
    if not hf_config.get("scale_attn_weights", True) or hf_config.get("scale_attn_by_inverse_layer_idx", False):
        raise ValueError(
            "qkv scales attention scores by 1/√head_dim only: scale_attn_weights must be true and "
            f"scale_attn_by_inverse_layer_idx false, got {hf_config.get('scale_attn_weights')!r} and "
            f"{hf_config.get('scale_attn_by_inverse_layer_idx')!r}"
        )
    if hf_config.get("add_cross_attention", False):
        raise ValueError("GPT-2 with add_cross_attention=true is not a decoder-only model; qkv's GPT has none")
    d_model = hf_field(hf_config, "n_embd")
    return GPTConfig(
        vocab_size=hf_field(hf_config, "vocab_size"),
        d_model=d_model,
        n_heads=hf_field(hf_config, "n_head"),
        n_layers=hf_field(hf_config, "n_layer"),
        d_ff=hf_field(hf_config, "n_inner", 4 * d_model),
        max_seq_len=hf_field(hf_config, "n_positions"),
        dropout=0.0,
        pad_id=None,
        norm_first=True,
        norm="layer",
        norm_eps=float(hf_field(hf_config, "layer_norm_epsilon", 1e-5)),
        activation=_GPT2_ACTIVATIONS[activation],
        bias=True,
        positional="learned",
        tie_embeddings=bool(hf_field(hf_config, "tie_word_embeddings", True)),
    )



def _llama_config(hf_config: Mapping[str, Any]) -> GPTConfig:
    for flag in ("attention_bias", "mlp_bias"):
        if hf_config.get(flag, False):
            raise ValueError(f"{flag}=true is not supported: a LLaMA-style qkv GPT has no biases (bias=False)")
    if hf_config.get("use_sliding_window", False):
        raise ValueError("use_sliding_window=true (a window on some layers only) is not supported")
    activation = hf_field(hf_config, "hidden_act", "silu")
    if activation != "silu":
        raise ValueError(f"LLaMA hidden_act must be 'silu' (qkv's swiglu), got {activation!r}")
    d_model, n_heads = hf_field(hf_config, "hidden_size"), hf_field(hf_config, "num_attention_heads")
    head_dim = hf_config.get("head_dim") or d_model // n_heads
    qwen3 = hf_config["model_type"] == "qwen3"
    return GPTConfig(
        vocab_size=hf_field(hf_config, "vocab_size"),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=hf_field(hf_config, "num_key_value_heads", n_heads),
        head_dim=head_dim,
        qk_norm=qwen3,
        n_layers=hf_field(hf_config, "num_hidden_layers"),
        d_ff=hf_field(hf_config, "intermediate_size"),
        max_seq_len=hf_field(hf_config, "max_position_embeddings", 2048),
        dropout=0.0,
        pad_id=None,
        norm_first=True,
        norm="rms",
        norm_eps=float(hf_field(hf_config, "rms_norm_eps", 1e-6)),
        activation="swiglu",
        bias=False,
        positional="rope",
        qkv_bias=hf_config["model_type"] == "qwen2",
        rope_base=_rope_base(hf_config),
        rope_freq_factors=hf_config.get("rope_freq_factors") or _llama3_factors(hf_config, head_dim),
        window=hf_config.get("sliding_window") if hf_config["model_type"] == "mistral" else None,
        tie_embeddings=bool(hf_field(hf_config, "tie_word_embeddings", False)),
    )



def _rope_params(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The rotary settings, in either format: transformers 5 writes ``rope_parameters``; 4.x wrote ``rope_theta``
    and ``rope_scaling`` (the later wins). Only plain RoPE and Llama 3's scaling are taken."""
    merged: dict[str, Any] = {"rope_theta": hf_config.get("rope_theta")}
    for key in ("rope_scaling", "rope_parameters"):
        params = hf_config.get(key)
        if params is None:
            continue
        if not isinstance(params, Mapping):
            raise ValueError(f"{key} must be a dict, got {type(params).__name__} {params!r}")
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in ("default", "llama3"):
            raise ValueError(f"{key} has rope_type={kind!r}; qkv implements plain RoPE and Llama 3's scaling only "
                             "(rope_type 'default' or 'llama3')")
        merged.update({k: v for k, v in params.items() if v is not None or k != "rope_theta"}, rope_type=kind)
    return merged


def _rope_base(hf_config: Mapping[str, Any]) -> float:
    theta = _rope_params(hf_config)["rope_theta"]
    if theta is None:
        return 10000.0
    check_scale("rope_theta", theta)  # named as the file names it
    check_size("rope_theta", theta, BOUNDS["rope_theta"])
    return float(theta)


def _llama3_factors(hf_config: Mapping[str, Any], head_dim: int) -> list[float] | None:
    """Llama 3's rotary scaling as one divisor per frequency (see ``RotaryEmbedding``'s ``freq_factors``): a
    pair whose wavelength is longer than the original context over ``low_freq_factor`` turns ``factor`` times
    slower; one shorter than the context over ``high_freq_factor`` is left alone; in between, the two blend by
    where the wavelength lies (Meta's published rule)."""
    params = _rope_params(hf_config)
    if params.get("rope_type") != "llama3":
        return None
    factor, low, high = (float(params.get(k, d)) for k, d in (("factor", 8.0), ("low_freq_factor", 1.0),
                                                                ("high_freq_factor", 4.0)))
    context = float(params.get("original_max_position_embeddings", 8192))
    if not (factor > 0 and high > low > 0 and context > 0):
        raise ValueError(f"llama3 rope scaling needs factor > 0 and high_freq_factor > low_freq_factor > 0, got "
                         f"{factor}, {high}, {low}")
    theta = _rope_base(hf_config)
    factors = []
    for i in range(head_dim // 2):
        wavelength = 2 * math.pi * theta ** (2 * i / head_dim)
        if wavelength < context / high:
            factors.append(1.0)
        elif wavelength > context / low:
            factors.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return factors



def _transposed(weight: Tensor | None) -> Tensor | None:
    """Conv1D ``(in, out)`` -> Linear ``(out, in)``."""
    return None if weight is None else weight.t().contiguous()



def _thirds(fused: Tensor | None) -> tuple[Tensor | None, ...]:
    """Split GPT-2's fused ``[q | k | v]`` along its last (output) dimension."""
    return (None, None, None) if fused is None else fused.chunk(3, dim=-1)



def gpt_state_dict_from_hf(state_dict: Mapping[str, Tensor], cfg: GPTConfig, model_type: str) -> dict[str, Tensor]:
    """Rename (and for GPT-2 reshape) a Hugging Face decoder's tensors into a :class:`GPT` state dict.

    Args:
        state_dict: tensors of a ``GPT2LMHeadModel``/``GPT2Model`` or ``LlamaForCausalLM``/``LlamaModel``,
            with or without the ``transformer.``/``model.`` prefix.
        cfg: the qkv config, usually from :func:`gpt_config_from_hf`.
        model_type: ``"gpt2"`` or ``"llama"``.

    Returns:
        A state dict for ``GPT(cfg).load_state_dict(..., strict=True)``. Tensors whose layout does not change
        are shared with ``state_dict``; with tied embeddings ``lm_head.weight`` is ``tok_emb.weight``.

    Raises:
        ValueError: for an unsupported model_type, a config that cannot hold such a checkpoint, or a state
            dict with missing, misshapen or unexpected tensors (all of them named).
    """
    if model_type == "gpt2":
        return _gpt2_state_dict(state_dict, cfg)
    if model_type in LLAMA_FAMILY:
        return _llama_state_dict(state_dict, cfg)
    raise ValueError(f"unsupported model_type {model_type!r} for a GPT; expected one of {list(GPT_MODEL_TYPES)}")


_GPT2_BUFFER = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")  # the causal-mask tables of older versions



def _gpt2_state_dict(state_dict: Mapping[str, Tensor], cfg: GPTConfig) -> dict[str, Tensor]:
    check_config(
        cfg, "GPT-2", norm=("layer",), positional=("learned",), bias=(True,), norm_first=(True,),
        activation=("relu", "gelu", "gelu_tanh", "silu"), gated_attention=(False,), window=(None,),
        n_kv_heads=(None, cfg.n_heads), head_dim=(cfg.d_model // cfg.n_heads,), qk_norm=(False,),
    )
    ckpt = HFStateDict(
        state_dict, family="GPT-2", prefix="transformer.", ignore=lambda key: bool(_GPT2_BUFFER.fullmatch(key))
    )
    d, d_ff = cfg.d_model, cfg.d_ff
    out: dict[str, Tensor | None] = {
        "tok_emb.weight": ckpt.take("wte.weight", (cfg.vocab_size, d)),
        "positions.weight": ckpt.take("wpe.weight", (cfg.max_seq_len, d)),
    }
    for i in ckpt.layers("h.", cfg.n_layers):
        hf, qkv = f"h.{i}.", f"decoder.layers.{i}."
        weights = _thirds(ckpt.take(hf + "attn.c_attn.weight", (d, 3 * d)))  # (in, out), out = [q | k | v]
        biases = _thirds(ckpt.take(hf + "attn.c_attn.bias", (3 * d,)))
        for proj, weight, bias in zip(("q_proj", "k_proj", "v_proj"), weights, biases, strict=True):
            out[f"{qkv}self_attn.{proj}.weight"] = _transposed(weight)
            out[f"{qkv}self_attn.{proj}.bias"] = bias
        out[qkv + "self_attn.out_proj.weight"] = _transposed(ckpt.take(hf + "attn.c_proj.weight", (d, d)))
        out[qkv + "self_attn.out_proj.bias"] = ckpt.take(hf + "attn.c_proj.bias", (d,))
        out[qkv + "feed_forward.up.weight"] = _transposed(ckpt.take(hf + "mlp.c_fc.weight", (d, d_ff)))
        out[qkv + "feed_forward.up.bias"] = ckpt.take(hf + "mlp.c_fc.bias", (d_ff,))
        out[qkv + "feed_forward.down.weight"] = _transposed(ckpt.take(hf + "mlp.c_proj.weight", (d_ff, d)))
        out[qkv + "feed_forward.down.bias"] = ckpt.take(hf + "mlp.c_proj.bias", (d,))
        for hf_norm, qkv_norm in (("ln_1", "self_attn_norm"), ("ln_2", "ffn_norm")):
            for part in ("weight", "bias"):
                out[f"{qkv}{qkv_norm}.{part}"] = ckpt.take(f"{hf}{hf_norm}.{part}", (d,))
    out["decoder.norm.weight"] = ckpt.take("ln_f.weight", (d,))
    out["decoder.norm.bias"] = ckpt.take("ln_f.bias", (d,))
    out["lm_head.weight"] = ckpt.output_head("lm_head.weight", cfg, out["tok_emb.weight"])
    return ckpt.finish(out)



def _llama_layer(cfg: GPTConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """One LLaMA-family layer's tensors: Hugging Face name -> (qkv name, shape); the rotate-half order of the
    query and key rows is qkv's too, so every tensor is taken as it is, both ways."""
    d, d_ff = cfg.d_model, cfg.d_ff
    d_q, d_kv = cfg.n_heads * cfg.head_dim, (cfg.n_kv_heads or cfg.n_heads) * cfg.head_dim
    layer = {
        "self_attn.q_proj.weight": ("self_attn.q_proj.weight", (d_q, d)),
        "self_attn.k_proj.weight": ("self_attn.k_proj.weight", (d_kv, d)),
        "self_attn.v_proj.weight": ("self_attn.v_proj.weight", (d_kv, d)),
        "self_attn.o_proj.weight": ("self_attn.out_proj.weight", (d, d_q)),
        "mlp.gate_proj.weight": ("feed_forward.gate.weight", (d_ff, d)),
        "mlp.up_proj.weight": ("feed_forward.up.weight", (d_ff, d)),
        "mlp.down_proj.weight": ("feed_forward.down.weight", (d, d_ff)),
        "input_layernorm.weight": ("self_attn_norm.weight", (d,)),
        "post_attention_layernorm.weight": ("ffn_norm.weight", (d,)),
    }
    if cfg.qkv_bias:  # Qwen2
        layer.update({f"self_attn.{p}.bias": (f"self_attn.{p}.bias", (n,)) for p, n in
                      (("q_proj", d_q), ("k_proj", d_kv), ("v_proj", d_kv))})
    if cfg.qk_norm:  # Qwen3
        layer.update({f"self_attn.{n}.weight": (f"self_attn.{n}.weight", (cfg.head_dim,))
                      for n in ("q_norm", "k_norm")})
    return layer


def _llama_state_dict(state_dict: Mapping[str, Tensor], cfg: GPTConfig) -> dict[str, Tensor]:
    check_config(
        cfg, "LLaMA", norm=("rms",), positional=("rope",), activation=("swiglu",), bias=(False,),
        norm_first=(True,), gated_attention=(False,),
    )
    ckpt = HFStateDict(
        state_dict, family="LLaMA", prefix="model.", ignore=lambda key: key.endswith("rotary_emb.inv_freq")
    )
    d = cfg.d_model
    out: dict[str, Tensor | None] = {"tok_emb.weight": ckpt.take("embed_tokens.weight", (cfg.vocab_size, d))}
    for i in ckpt.layers("layers.", cfg.n_layers):
        for hf_name, (qkv_name, shape) in _llama_layer(cfg).items():
            out[f"decoder.layers.{i}.{qkv_name}"] = ckpt.take(f"layers.{i}.{hf_name}", shape)
    out["decoder.norm.weight"] = ckpt.take("norm.weight", (d,))
    out["lm_head.weight"] = ckpt.output_head("lm_head.weight", cfg, out["tok_emb.weight"])
    return ckpt.finish(out)



def load_gpt_from_hf(state_dict: Mapping[str, Tensor], hf_config: Mapping[str, Any]) -> GPT:
    """Build a :class:`GPT` from a Hugging Face GPT-2 or LLaMA checkpoint.

    Args:
        state_dict: the checkpoint's tensors (see :func:`gpt_state_dict_from_hf`).
        hf_config: its parsed ``config.json`` (see :func:`gpt_config_from_hf`).

    Returns:
        The model in eval mode, float32 like any freshly built qkv model (cast it afterwards if needed).

    Raises:
        ValueError: as :func:`gpt_config_from_hf` and :func:`gpt_state_dict_from_hf` do.
    """
    cfg = gpt_config_from_hf(hf_config)
    converted = gpt_state_dict_from_hf(state_dict, cfg, hf_config["model_type"])
    model = build_model(GPT, cfg, what="the Hugging Face model", initialise=False)  # weights loaded next
    model.load_state_dict(converted, strict=True)
    return model.eval()


# ------------------------------------------------------------------------------------ qkv -> Hugging Face

# The class transformers builds for each model_type (config.json's "architectures").
HF_ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Besides training's fields, not compared when a config is read back: padding a language model leaves to
# attention_mask, and table padding
_NOT_COMPARED = ("pad_id", "vocab_multiple")


def gpt_config_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of a :class:`GPT`: GPT-2's for a GPT-2-style model (LayerNorm, learned
    positions), else the LLaMA family's (RMSNorm, rotary positions, SwiGLU) as the model's features name it:
    Qwen3 with QK-norm, Qwen2 with biases on Q, K and V, Mistral with a sliding window, LLaMA otherwise.

    The result is read back with :func:`gpt_config_from_hf`: a field that would come back different (a window
    in a GPT-2, Llama 3's rotary scaling, which qkv keeps only as divisors) is an error, not a silent change.

    Raises:
        ValueError: a config that no Hugging Face family holds, naming the fields.
    """
    if cfg.norm == "layer" and cfg.positional == "learned":
        activation = {ours: theirs for theirs, ours in _GPT2_ACTIVATIONS.items()}.get(cfg.activation)
        if activation is None:
            raise ValueError(f"GPT-2 has no activation {cfg.activation!r}; a GPT-2-style model exports with one of "
                             f"{sorted(set(_GPT2_ACTIVATIONS.values()))}")
        hf = {"model_type": "gpt2", "vocab_size": cfg.vocab_size, "n_embd": cfg.d_model, "n_head": cfg.n_heads,
              "n_layer": cfg.n_layers, "n_inner": cfg.d_ff, "n_positions": cfg.max_seq_len,
              "activation_function": activation, "layer_norm_epsilon": cfg.norm_eps, "resid_pdrop": cfg.dropout,
              "embd_pdrop": cfg.dropout, "attn_pdrop": _attention_dropout(cfg), "scale_attn_weights": True}
    elif cfg.norm == "rms" and cfg.positional == "rope" and cfg.activation == "swiglu":
        model_type = "qwen3" if cfg.qk_norm else "qwen2" if _qkv_bias(cfg) else "mistral" if cfg.window else "llama"
        hf = {"model_type": model_type, "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
              "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
              "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads, "head_dim": cfg.head_dim,
              "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_base,
              "hidden_act": "silu", "attention_dropout": _attention_dropout(cfg)}
        hf |= {"mistral": {"sliding_window": cfg.window}, "llama": {"attention_bias": False, "mlp_bias": False}
               }.get(model_type, {"use_sliding_window": False})
    else:
        raise ValueError(f"a GPT with norm={cfg.norm!r}, positional={cfg.positional!r} and activation="
                         f"{cfg.activation!r} has no Hugging Face family: GPT-2 is norm 'layer' with positional "
                         "'learned'; LLaMA is norm 'rms', positional 'rope', activation 'swiglu'")
    hf |= {"architectures": [HF_ARCHITECTURES[hf["model_type"]]], "tie_word_embeddings": cfg.tie_embeddings}
    check_written(_seen(cfg), _seen(gpt_config_from_hf(hf)), hf["model_type"], ignore=_NOT_COMPARED)
    return hf


def _attention_dropout(cfg: GPTConfig) -> float:
    return cfg.dropout if cfg.attention_dropout is None else cfg.attention_dropout


def _qkv_bias(cfg: GPTConfig) -> bool:
    return cfg.bias if cfg.qkv_bias is None else cfg.qkv_bias


def _seen(cfg: GPTConfig) -> dict[str, Any]:
    """The config's fields with the defaults that mean the same spelt out (no n_kv_heads: one per head)."""
    return cfg.to_dict() | {"n_kv_heads": cfg.n_kv_heads or cfg.n_heads, "qkv_bias": _qkv_bias(cfg)}


def gpt_state_dict_to_hf(state_dict: Mapping[str, Tensor], cfg: GPTConfig) -> dict[str, Tensor]:
    """A :class:`GPT`'s tensors under the names (and, for GPT-2, in the layouts) of the Hugging Face family
    :func:`gpt_config_to_hf` chose: the inverse of :func:`gpt_state_dict_from_hf`. Embedding and output tables
    are cut to ``vocab_size`` rows (their padding is never a token); a tied output layer is not written twice.
    Every tensor is a fresh contiguous copy (safetensors stores no shared or strided tensors)."""
    sd = {k: v.detach() for k, v in state_dict.items()}
    head = {} if cfg.tie_embeddings else {"lm_head.weight": sd["lm_head.weight"][: cfg.vocab_size]}
    if cfg.norm == "layer":
        out = _gpt2_tensors(sd, cfg)
    else:
        out = {"model.embed_tokens.weight": sd["tok_emb.weight"][: cfg.vocab_size],
               "model.norm.weight": sd["decoder.norm.weight"]}
        for i in range(cfg.n_layers):
            for hf_name, (qkv_name, _) in _llama_layer(cfg).items():
                out[f"model.layers.{i}.{hf_name}"] = sd[f"decoder.layers.{i}.{qkv_name}"]
    return {name: t.contiguous().clone() for name, t in (out | head).items()}


def _gpt2_tensors(sd: Mapping[str, Tensor], cfg: GPTConfig) -> dict[str, Tensor]:
    """GPT-2's names, its Conv1D ``(in, out)`` weights and its fused ``[q | k | v]`` projection."""
    out = {"transformer.wte.weight": sd["tok_emb.weight"][: cfg.vocab_size], "transformer.wpe.weight":
           sd["positions.weight"], "transformer.ln_f.weight": sd["decoder.norm.weight"],
           "transformer.ln_f.bias": sd["decoder.norm.bias"]}
    for i in range(cfg.n_layers):
        hf, qkv = f"transformer.h.{i}.", f"decoder.layers.{i}."
        projections = [f"{qkv}self_attn.{p}_proj" for p in "qkv"]
        out[hf + "attn.c_attn.weight"] = torch.cat([sd[p + ".weight"] for p in projections]).T
        out[hf + "attn.c_attn.bias"] = torch.cat([sd[p + ".bias"] for p in projections])
        for hf_name, qkv_name in (("attn.c_proj", "self_attn.out_proj"), ("mlp.c_fc", "feed_forward.up"),
                                  ("mlp.c_proj", "feed_forward.down")):
            out[f"{hf}{hf_name}.weight"] = sd[f"{qkv}{qkv_name}.weight"].T
            out[f"{hf}{hf_name}.bias"] = sd[f"{qkv}{qkv_name}.bias"]
        for hf_norm, qkv_norm in (("ln_1", "self_attn_norm"), ("ln_2", "ffn_norm")):
            for part in ("weight", "bias"):
                out[f"{hf}{hf_norm}.{part}"] = sd[f"{qkv}{qkv_norm}.{part}"]
    return out


__all__ = ["GPT_MODEL_TYPES", "HF_ARCHITECTURES", "gpt_config_from_hf", "gpt_config_to_hf", "gpt_state_dict_from_hf",
           "gpt_state_dict_to_hf", "load_gpt_from_hf"]
