"""Hugging Face BERT checkpoints (``BertModel``, and the encoders of sentence-transformers) -> qkv's :class:`BERT`.

    config.json ── bert_config_from_hf ─────> BERTConfig
    state dict  ── bert_state_dict_from_hf ─> qkv state dict
    both        ── load_bert_from_hf ───────> BERT (strictly loaded, eval mode)

BERT differs in names only; checkpoints converted from TensorFlow call LayerNorm's γ and β ``gamma`` and
``beta``. The conversion is strict, as in :mod:`qkv.interop.hf_gpt`, apart from buffers (position ids) and
BERT's pre-training heads (``cls.*``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from ..config import BERTConfig
from ..footprint import build_model
from ..models import BERT
from .hf_common import HFStateDict, check_config, check_written, hf_field


def bert_config_from_hf(hf_config: Mapping[str, Any]) -> BERTConfig:
    """Translate a Hugging Face BERT ``config.json`` into a :class:`BERTConfig` (with pooler).

    qkv has one dropout rate; it is taken from ``hidden_dropout_prob`` (``attention_probs_dropout_prob`` is
    ignored). ``pad_id`` is ``pad_token_id``, so qkv's BERT masks pad tokens when no attention_mask is given.

    Args:
        hf_config: the parsed ``config.json`` with ``model_type`` ``"bert"``.

    Returns:
        The equivalent :class:`BERTConfig`.

    Raises:
        ValueError: for another model_type, an activation other than exact GELU, relative position
            embeddings, a decoder configuration, or a missing size.
    """
    model_type = hf_config.get("model_type")
    if model_type != "bert":
        raise ValueError(f"unsupported model_type {model_type!r} for a BERT; expected 'bert'")
    activation = hf_field(hf_config, "hidden_act", "gelu")
    if activation != "gelu":
        raise ValueError(f"BERT hidden_act must be 'gelu' (exact, erf-based), got {activation!r}")
    positions = hf_field(hf_config, "position_embedding_type", "absolute")
    if positions != "absolute":
        raise ValueError(f"BERT position_embedding_type must be 'absolute', got {positions!r}")
    if hf_config.get("is_decoder", False) or hf_config.get("add_cross_attention", False):
        raise ValueError("a BERT configured as a decoder (is_decoder/add_cross_attention) is not supported")
    return BERTConfig(
        vocab_size=hf_field(hf_config, "vocab_size"),
        d_model=hf_field(hf_config, "hidden_size"),
        n_heads=hf_field(hf_config, "num_attention_heads"),
        n_layers=hf_field(hf_config, "num_hidden_layers"),
        d_ff=hf_field(hf_config, "intermediate_size"),
        max_seq_len=hf_field(hf_config, "max_position_embeddings", 512),
        type_vocab_size=hf_field(hf_config, "type_vocab_size", 2),
        dropout=float(hf_field(hf_config, "hidden_dropout_prob", 0.1)),
        pad_id=hf_config.get("pad_token_id", 0),
        norm_first=False,
        norm="layer",
        norm_eps=float(hf_field(hf_config, "layer_norm_eps", 1e-12)),
        activation="gelu",
        bias=True,
        positional="learned",
        pooler=True,
    )


_BERT_BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")



def _bert_rename(key: str) -> str:
    """TensorFlow-converted checkpoints name LayerNorm's γ and β ``gamma`` and ``beta``."""
    if key.endswith("LayerNorm.gamma"):
        return key.removesuffix("gamma") + "weight"
    if key.endswith("LayerNorm.beta"):
        return key.removesuffix("beta") + "bias"
    return key



def _bert_layer(cfg: BERTConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """One layer: Hugging Face module -> (qkv module, weight shape); each has a bias of ``weight_shape[0]``."""
    d, d_ff = cfg.d_model, cfg.d_ff
    return {
        "attention.self.query": ("self_attn.q_proj", (d, d)),
        "attention.self.key": ("self_attn.k_proj", (d, d)),
        "attention.self.value": ("self_attn.v_proj", (d, d)),
        "attention.output.dense": ("self_attn.out_proj", (d, d)),
        "attention.output.LayerNorm": ("self_attn_norm", (d,)),  # Post-Norm: after attention + residual
        "intermediate.dense": ("feed_forward.up", (d_ff, d)),
        "output.dense": ("feed_forward.down", (d, d_ff)),
        "output.LayerNorm": ("ffn_norm", (d,)),
    }


def bert_state_dict_from_hf(state_dict: Mapping[str, Tensor], cfg: BERTConfig) -> dict[str, Tensor]:
    """Rename a Hugging Face BERT's tensors into a :class:`BERT` state dict.

    Args:
        state_dict: tensors of a ``BertModel`` (or ``BertForPreTraining``/``BertForMaskedLM``, whose ``cls.*``
            heads are dropped), with or without the ``bert.`` prefix.
        cfg: the qkv config, usually from :func:`bert_config_from_hf`; with ``pooler=False`` the checkpoint
            must have no pooler either.

    Returns:
        A state dict for ``BERT(cfg).load_state_dict(..., strict=True)``; the tensors are shared with
        ``state_dict``.

    Raises:
        ValueError: for a config that cannot hold a BERT checkpoint, or a state dict with missing, misshapen or
            unexpected tensors (all of them named).
    """
    check_config(
        cfg, "BERT", norm=("layer",), positional=("learned",), bias=(True,), norm_first=(False,),
        activation=("gelu",), gated_attention=(False,), window=(None,), n_kv_heads=(None, cfg.n_heads),
    )
    ckpt = HFStateDict(
        state_dict, family="BERT", prefix="bert.", rename=_bert_rename,
        ignore=lambda key: key in _BERT_BUFFERS or key.startswith("cls."),
    )
    d = cfg.d_model
    out: dict[str, Tensor | None] = {
        "tok_emb.weight": ckpt.take("embeddings.word_embeddings.weight", (cfg.vocab_size, d)),
        "positions.weight": ckpt.take("embeddings.position_embeddings.weight", (cfg.max_seq_len, d)),
        "type_emb.weight": ckpt.take("embeddings.token_type_embeddings.weight", (cfg.type_vocab_size, d)),
        "emb_norm.weight": ckpt.take("embeddings.LayerNorm.weight", (d,)),
        "emb_norm.bias": ckpt.take("embeddings.LayerNorm.bias", (d,)),
    }
    for i in ckpt.layers("encoder.layer.", cfg.n_layers):
        for hf_name, (qkv_name, weight_shape) in _bert_layer(cfg).items():
            hf, qkv = f"encoder.layer.{i}.{hf_name}", f"encoder.layers.{i}.{qkv_name}"
            out[qkv + ".weight"] = ckpt.take(hf + ".weight", weight_shape)
            out[qkv + ".bias"] = ckpt.take(hf + ".bias", (weight_shape[0],))
    if cfg.pooler:
        out["pooler.weight"] = ckpt.take("pooler.dense.weight", (d, d))
        out["pooler.bias"] = ckpt.take("pooler.dense.bias", (d,))
    return ckpt.finish(out)



def load_bert_from_hf(state_dict: Mapping[str, Tensor], hf_config: Mapping[str, Any]) -> BERT:
    """Build a :class:`BERT` from a Hugging Face BERT checkpoint.

    The model gets a pooler exactly when the checkpoint has one (``BertForMaskedLM`` and some sentence
    encoders are saved without).

    Args:
        state_dict: the checkpoint's tensors (see :func:`bert_state_dict_from_hf`).
        hf_config: its parsed ``config.json`` (see :func:`bert_config_from_hf`).

    Returns:
        The model in eval mode, float32.

    Raises:
        ValueError: as :func:`bert_config_from_hf` and :func:`bert_state_dict_from_hf` do.
    """
    cfg = bert_config_from_hf(hf_config)
    cfg.pooler = any(name.removeprefix("bert.").startswith("pooler.") for name in state_dict)
    converted = bert_state_dict_from_hf(state_dict, cfg)
    model = build_model(BERT, cfg, what="the Hugging Face model", initialise=False)  # weights loaded next
    model.load_state_dict(converted, strict=True)
    return model.eval()


# ------------------------------------------------------------------------------------ qkv -> Hugging Face

# Besides training's fields: the pooler (written when the model has one) and the classifier's own fields
_NOT_COMPARED = ("pooler", "n_labels", "pooling")


def bert_config_to_hf(cfg: BERTConfig) -> dict[str, Any]:
    """The ``config.json`` of a ``BertModel`` holding ``cfg``; read back with :func:`bert_config_from_hf`, a field
    that would come back different is an error, naming it."""
    hf = {"model_type": "bert", "architectures": ["BertModel"], "vocab_size": cfg.vocab_size,
          "hidden_size": cfg.d_model, "num_attention_heads": cfg.n_heads, "num_hidden_layers": cfg.n_layers,
          "intermediate_size": cfg.d_ff, "max_position_embeddings": cfg.max_seq_len,
          "type_vocab_size": cfg.type_vocab_size, "hidden_dropout_prob": cfg.dropout,
          "attention_probs_dropout_prob": cfg.dropout if cfg.attention_dropout is None else cfg.attention_dropout,
          "pad_token_id": cfg.pad_id, "layer_norm_eps": cfg.norm_eps, "hidden_act": "gelu",
          "position_embedding_type": "absolute"}
    check_written(cfg.to_dict(), bert_config_from_hf(hf).to_dict(), "BERT", ignore=_NOT_COMPARED)
    return hf


def bert_state_dict_to_hf(state_dict: Mapping[str, Tensor], cfg: BERTConfig, prefix: str = "") -> dict[str, Tensor]:
    """A :class:`BERT`'s tensors under ``BertModel``'s names, each after ``prefix`` (``"bert."`` inside a
    classifier); the inverse of :func:`bert_state_dict_from_hf`, fresh contiguous copies."""
    names = {"tok_emb": "embeddings.word_embeddings", "positions": "embeddings.position_embeddings",
             "type_emb": "embeddings.token_type_embeddings", "emb_norm": "embeddings.LayerNorm",
             "pooler": "pooler.dense"}
    for i in range(cfg.n_layers):
        names |= {f"encoder.layers.{i}.{ours}": f"encoder.layer.{i}.{theirs}"
                  for theirs, (ours, _) in _bert_layer(cfg).items()}
    out = {}
    for name, tensor in state_dict.items():
        module, _, part = name.rpartition(".")
        out[f"{prefix}{names[module]}.{part}"] = tensor.detach().contiguous().clone()
    return out


__all__ = ["bert_config_from_hf", "bert_config_to_hf", "bert_state_dict_from_hf", "bert_state_dict_to_hf",
           "load_bert_from_hf"]
