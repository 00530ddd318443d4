"""Hugging Face ViT checkpoints (``ViTModel``, ``ViTForImageClassification``) -> qkv's :class:`ViT`.

Names differ (and changed in transformers 5: ``encoder.layer.0.attention.attention.query`` became
``layers.0.attention.q_proj``; both are read), layouts do not: the patch projection is the same convolution,
and each layer is the Pre-Norm encoder layer (``layernorm_before`` -> attention, ``layernorm_after`` -> MLP).
``ViTModel``'s pooler (a dense layer and tanh on [CLS], used by no classifier) is left out; a
``ViTForImageClassification`` comes back as a :class:`ViTClassifier` with its ``classifier`` as the head.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from ..config import ViTConfig
from ..models.vit import ViT, ViTClassifier
from .hf_common import (
    ACTIVATIONS,
    HFStateDict,
    check_written,
    hf_field,
    image_side,
    load_image_model,
    take_layer,
)


def vit_config_from_hf(hf_config: Mapping[str, Any], *, n_classes: int | None = None) -> ViTConfig:
    """Translate a Hugging Face ViT ``config.json`` into a :class:`ViTConfig`.

    Raises:
        ValueError: for another model_type, projections without biases (``qkv_bias=false``), an activation
            qkv lacks, or a missing size.
    """
    if hf_config.get("model_type") != "vit":
        raise ValueError(f"unsupported model_type {hf_config.get('model_type')!r} for a ViT; expected 'vit'")
    if not hf_config.get("qkv_bias", True):
        raise ValueError("ViT checkpoints without query/key/value biases (qkv_bias=false) are not supported")
    activation = hf_field(hf_config, "hidden_act", "gelu")
    if activation not in ACTIVATIONS:
        raise ValueError(f"ViT hidden_act must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    return ViTConfig(
        image_size=image_side(hf_field(hf_config, "image_size")),
        patch_size=image_side(hf_field(hf_config, "patch_size")),
        channels=hf_field(hf_config, "num_channels", 3),
        d_model=hf_field(hf_config, "hidden_size"),
        n_heads=hf_field(hf_config, "num_attention_heads"),
        n_layers=hf_field(hf_config, "num_hidden_layers"),
        d_ff=hf_field(hf_config, "intermediate_size"),
        norm_eps=hf_field(hf_config, "layer_norm_eps", 1e-12),
        activation=ACTIVATIONS[activation],
        dropout=hf_field(hf_config, "hidden_dropout_prob", 0.0),
        n_classes=n_classes,
    )


_LAYER = {  # Hugging Face module (transformers 5 names) -> qkv module, under layers.{i} / encoder.layers.{i}
    "attention.q_proj": "self_attn.q_proj",
    "attention.k_proj": "self_attn.k_proj",
    "attention.v_proj": "self_attn.v_proj",
    "attention.o_proj": "self_attn.out_proj",
    "mlp.fc1": "feed_forward.up",
    "mlp.fc2": "feed_forward.down",
    "layernorm_before": "self_attn_norm",
    "layernorm_after": "ffn_norm",
}
_OLD_NAMES = [  # files written before transformers 5 (most on disk): old name -> new name
    (re.compile(r"^encoder\.layer\.(\d+)\."), r"layers.\1."),
    (re.compile(r"\.attention\.attention\.query\."), ".attention.q_proj."),
    (re.compile(r"\.attention\.attention\.key\."), ".attention.k_proj."),
    (re.compile(r"\.attention\.attention\.value\."), ".attention.v_proj."),
    (re.compile(r"\.attention\.output\.dense\."), ".attention.o_proj."),
    (re.compile(r"\.intermediate\.dense\."), ".mlp.fc1."),
    (re.compile(r"^(layers\.\d+)\.output\.dense\."), r"\1.mlp.fc2."),
]


def _new_name(key: str) -> str:
    for pattern, replacement in _OLD_NAMES:
        key = pattern.sub(replacement, key)
    return key


def vit_state_dict_from_hf(state_dict: Mapping[str, Tensor], cfg: ViTConfig) -> dict[str, Tensor]:
    """Rename a Hugging Face ViT's tensors into a :class:`ViT` state dict (``vit.`` prefix dropped; the
    pooler, the mask token and a classifier are left out: see :func:`load_vit_from_hf`).

    Raises:
        ValueError: a state dict with missing, misshapen or unexpected tensors (all of them named).
    """
    ckpt = HFStateDict(state_dict, family="ViT", prefix="vit.", rename=_new_name,
                       ignore=lambda key: key.startswith(("pooler.", "classifier.", "embeddings.mask_token")))
    d, d_ff, c, p = cfg.d_model, cfg.d_ff, cfg.channels, cfg.patch_size
    out: dict[str, Tensor | None] = {
        "cls_token": ckpt.take("embeddings.cls_token", (1, 1, d)),
        "positions": ckpt.take("embeddings.position_embeddings", (1, 1 + cfg.n_patches, d)),
        "patches.proj.weight": ckpt.take("embeddings.patch_embeddings.projection.weight", (d, c, p, p)),
        "patches.proj.bias": ckpt.take("embeddings.patch_embeddings.projection.bias", (d,)),
        "encoder.norm.weight": ckpt.take("layernorm.weight", (d,)),
        "encoder.norm.bias": ckpt.take("layernorm.bias", (d,)),
    }
    for i in ckpt.layers("layers.", cfg.n_layers):
        out |= take_layer(ckpt, _LAYER, f"layers.{i}.", f"encoder.layers.{i}.", d, d_ff)
    return ckpt.finish(out)




def load_vit_from_hf(state_dict: Mapping[str, Tensor], hf_config: Mapping[str, Any]) -> ViT | ViTClassifier:
    """Build a qkv ViT from a Hugging Face checkpoint: a :class:`ViT` from a ``ViTModel``, a
    :class:`ViTClassifier` from a ``ViTForImageClassification`` (its state dict has ``classifier.*``).

    Returns:
        The model in eval mode, float32.

    Raises:
        ValueError: as :func:`vit_config_from_hf` and :func:`vit_state_dict_from_hf` do.
    """
    return load_image_model(state_dict, hf_config, vit_config_from_hf, vit_state_dict_from_hf, ViT,
                             (ViTClassifier, "vit"))


# ------------------------------------------------------------------------------------ qkv -> Hugging Face

# The names files before transformers 5 use, which every version reads (transformers 5 renames them on load)
_WRITTEN = {"attention.q_proj": "attention.attention.query", "attention.k_proj": "attention.attention.key",
            "attention.v_proj": "attention.attention.value", "attention.o_proj": "attention.output.dense",
            "mlp.fc1": "intermediate.dense", "mlp.fc2": "output.dense", "layernorm_before": "layernorm_before",
            "layernorm_after": "layernorm_after"}
_NOT_COMPARED = ("pad_id",)  # besides training's fields: images have no padding


def vit_config_to_hf(cfg: ViTConfig) -> dict[str, Any]:
    """The ``config.json`` of a ``ViTModel`` (or, with ``n_classes``, the classifier's backbone) holding ``cfg``;
    read back with :func:`vit_config_from_hf`, a field that would come back different is an error, naming it."""
    activation = {ours: theirs for theirs, ours in ACTIVATIONS.items()}.get(cfg.activation)
    if activation is None or cfg.pooling != "cls":
        what = f"activation={cfg.activation!r}" if activation is None else "pooling='mean'"
        raise ValueError(f"a Hugging Face ViT config cannot hold {what} (ViTForImageClassification reads the [CLS] "
                         "state)")
    hf = {"model_type": "vit", "architectures": ["ViTModel"], "image_size": cfg.image_size,
          "patch_size": cfg.patch_size, "num_channels": cfg.channels, "hidden_size": cfg.d_model,
          "num_attention_heads": cfg.n_heads, "num_hidden_layers": cfg.n_layers, "intermediate_size": cfg.d_ff,
          "layer_norm_eps": cfg.norm_eps, "hidden_act": activation, "hidden_dropout_prob": cfg.dropout,
          "attention_probs_dropout_prob": cfg.dropout if cfg.attention_dropout is None else cfg.attention_dropout,
          "qkv_bias": True}
    check_written(cfg.to_dict(), vit_config_from_hf(hf, n_classes=cfg.n_classes).to_dict(), "ViT",
                  ignore=_NOT_COMPARED)
    return hf


def vit_state_dict_to_hf(state_dict: Mapping[str, Tensor], cfg: ViTConfig, prefix: str = "") -> dict[str, Tensor]:
    """A :class:`ViT`'s tensors under ``ViTModel``'s names, each after ``prefix`` (``"vit."`` inside a
    classifier); the inverse of :func:`vit_state_dict_from_hf`, fresh contiguous copies."""
    names = {"cls_token": "embeddings.cls_token", "positions": "embeddings.position_embeddings",
             "patches.proj.weight": "embeddings.patch_embeddings.projection.weight",
             "patches.proj.bias": "embeddings.patch_embeddings.projection.bias",
             "encoder.norm.weight": "layernorm.weight", "encoder.norm.bias": "layernorm.bias"}
    for i in range(cfg.n_layers):
        for theirs, ours in _LAYER.items():
            for part in ("weight", "bias"):
                names[f"encoder.layers.{i}.{ours}.{part}"] = f"encoder.layer.{i}.{_WRITTEN[theirs]}.{part}"
    return {f"{prefix}{names[name]}": t.detach().contiguous().clone() for name, t in state_dict.items()}


__all__ = ["load_vit_from_hf", "vit_config_from_hf", "vit_config_to_hf", "vit_state_dict_from_hf",
           "vit_state_dict_to_hf"]
