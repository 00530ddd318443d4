"""Hugging Face decoder checkpoints -> qkv's :class:`GPT`: GPT-2, and the LLaMA family (LLaMA, Mistral, Qwen2 and 3,
Gemma 2 and 3, Phi-3, SmolLM3, OLMo 2, Granite: each a table in :mod:`qkv.interop.families`).

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

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..config import GATED_ACTIVATIONS, GPTConfig
from ..footprint import build_model
from ..models import GPT
from .experts import per_expert, stored
from .families import FAMILIES, MODEL_TYPES, config_from_hf, config_to_hf, family_of, fused_back, layer_tensors, unfused
from .hf_common import HFStateDict, check_config, check_written, hf_field
from .sizes import check_sizes

# GPT-2, and the LLaMA family: one layout, its members told apart by the blocks their configs name
# (qkv.interop.families)
GPT_MODEL_TYPES = ("gpt2", *MODEL_TYPES)


_GPT2_ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu": "gelu",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}

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
    if model_type in MODEL_TYPES:
        return config_from_hf(hf_config)
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
    if model_type in MODEL_TYPES:
        return _llama_state_dict(state_dict, cfg, model_type)
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



def _llama_state_dict(state_dict: Mapping[str, Tensor], cfg: GPTConfig, model_type: str) -> dict[str, Tensor]:
    check_config(cfg, "LLaMA", norm=("rms",), positional=("rope",), activation=GATED_ACTIVATIONS,
                 bias=(False,), gated_attention=(False,))
    ckpt = HFStateDict(per_expert(unfused(state_dict, cfg, model_type), cfg), family=FAMILIES[model_type].title,
                       prefix="model.", ignore=lambda key: key.endswith("rotary_emb.inv_freq"))
    d = cfg.d_model
    out: dict[str, Tensor | None] = {"tok_emb.weight": ckpt.take("embed_tokens.weight", (cfg.vocab_size, d))}
    for i in ckpt.layers("layers.", cfg.n_layers):
        for hf_name, (qkv_name, shape) in layer_tensors(cfg, model_type, i).items():
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
HF_ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", **{name: f.architecture for name, f in FAMILIES.items()}}
# Besides training's fields, not compared when a config is read back: padding a language model leaves to
# attention_mask, and table padding
_NOT_COMPARED = ("pad_id", "vocab_multiple", "family", "balance_loss")


def gpt_config_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of a :class:`GPT`: GPT-2's for a GPT-2-style model (LayerNorm, learned
    positions), else that of the LLaMA family's member whose blocks the model uses
    (:func:`qkv.interop.families.family_of`: Gemma, Phi-3, SmolLM3, OLMo 2, Granite, Qwen3 with QK-norm, Qwen2 with
    biases on Q, K and V, Mistral with a sliding window, LLaMA otherwise).

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
    elif cfg.norm == "rms" and cfg.positional == "rope" and cfg.activation in GATED_ACTIVATIONS:
        hf = config_to_hf(cfg) | {"attention_dropout": _attention_dropout(cfg)}
    else:
        raise ValueError(f"a GPT with norm={cfg.norm!r}, positional={cfg.positional!r} and activation="
                         f"{cfg.activation!r} has no Hugging Face family: GPT-2 is norm 'layer' with positional "
                         "'learned'; LLaMA is norm 'rms', positional 'rope', activation 'swiglu' (Gemma's geglu)")
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
        model_type = family_of(cfg).model_type
        out = {"model.embed_tokens.weight": sd["tok_emb.weight"][: cfg.vocab_size],
               "model.norm.weight": sd["decoder.norm.weight"]}
        for i in range(cfg.n_layers):
            for hf_name, (qkv_name, _) in layer_tensors(cfg, model_type, i).items():
                out[f"model.layers.{i}.{hf_name}"] = sd[f"decoder.layers.{i}.{qkv_name}"]
        out = stored(fused_back(out, model_type), FAMILIES[model_type].experts or "qwen")
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
