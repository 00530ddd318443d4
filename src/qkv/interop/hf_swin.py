"""Hugging Face Swin checkpoints (``SwinModel``, ``SwinForImageClassification``) -> qkv's :class:`Swin`.

Names differ (and changed in transformers 5: ``attention.self.query`` became ``attention.q_proj``,
``intermediate.dense`` ``mlp.fc1``; both are read), layouts do not: the patch projection is the same
convolution, each block is Pre-Norm (``layernorm_before`` -> window attention, ``layernorm_after`` -> MLP),
the relative position table has the same ``((2M-1)², heads)`` rows and the same numbering of offsets, and
``downsample`` is the same patch merging. The ``relative_position_index`` buffers (recomputed from the window)
are skipped; ``SwinModel``'s pooler (a mean, no weights) is the classifier's mean; a
``SwinForImageClassification`` comes back as a :class:`SwinClassifier` with its ``classifier`` as the head.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from ..config import SwinConfig
from ..models.swin import Swin, SwinClassifier
from .hf_common import ACTIVATIONS, HFStateDict, hf_field, image_side, load_image_model, take_layer


def swin_config_from_hf(hf_config: Mapping[str, Any], *, n_classes: int | None = None) -> SwinConfig:
    """Translate a Hugging Face Swin ``config.json`` into a :class:`SwinConfig`.

    Raises:
        ValueError: for another model_type, absolute position embeddings, projections without biases
            (``qkv_bias=false``), a ``layer_norm_eps`` other than 1e-5 (Hugging Face keeps 1e-5 in the
            embedding and merging norms whatever it says; qkv has one epsilon), an activation qkv lacks, or a
            missing size.
    """
    if hf_config.get("model_type") != "swin":
        raise ValueError(f"unsupported model_type {hf_config.get('model_type')!r} for a Swin; expected 'swin'")
    if hf_config.get("use_absolute_embeddings", False):
        raise ValueError("Swin checkpoints with absolute position embeddings (use_absolute_embeddings=true) are "
                         "not supported")
    if not hf_config.get("qkv_bias", True):
        raise ValueError("Swin checkpoints without query/key/value biases (qkv_bias=false) are not supported")
    eps = hf_field(hf_config, "layer_norm_eps", 1e-5)
    if eps != 1e-5:
        raise ValueError(f"Swin layer_norm_eps must be 1e-5 (the epsilon of every norm in qkv's Swin), got {eps}")
    activation = hf_field(hf_config, "hidden_act", "gelu")
    if activation not in ACTIVATIONS:
        raise ValueError(f"Swin hidden_act must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    return SwinConfig(
        image_size=image_side(hf_field(hf_config, "image_size")),
        patch_size=image_side(hf_field(hf_config, "patch_size")),
        channels=hf_field(hf_config, "num_channels", 3),
        d_model=hf_field(hf_config, "embed_dim"),
        depths=tuple(hf_field(hf_config, "depths")),
        stage_heads=tuple(hf_field(hf_config, "num_heads")),
        window_size=hf_field(hf_config, "window_size"),
        mlp_ratio=hf_field(hf_config, "mlp_ratio", 4.0),
        norm_eps=eps,
        activation=ACTIVATIONS[activation],
        dropout=hf_field(hf_config, "hidden_dropout_prob", 0.0),
        attention_dropout=hf_field(hf_config, "attention_probs_dropout_prob", 0.0),
        n_classes=n_classes,
    )


_BLOCK = {  # Hugging Face module (transformers 5 names) -> qkv module, under the same stage and block
    "attention.q_proj": "attention.mha.q_proj",
    "attention.k_proj": "attention.mha.k_proj",
    "attention.v_proj": "attention.mha.v_proj",
    "attention.o_proj": "attention.mha.out_proj",
    "mlp.fc1": "feed_forward.up",
    "mlp.fc2": "feed_forward.down",
    "layernorm_before": "attn_norm",
    "layernorm_after": "ffn_norm",
}
_TABLE = "attention.relative_position_bias.relative_position_bias_table"
_OLD_NAMES = [  # files written before transformers 5 (most on disk): old name -> new name
    (re.compile(r"\.attention\.self\.query\."), ".attention.q_proj."),
    (re.compile(r"\.attention\.self\.key\."), ".attention.k_proj."),
    (re.compile(r"\.attention\.self\.value\."), ".attention.v_proj."),
    (re.compile(r"\.attention\.self\.relative_position_bias_table$"), "." + _TABLE),
    (re.compile(r"\.attention\.output\.dense\."), ".attention.o_proj."),  # before the block's output.dense
    (re.compile(r"\.intermediate\.dense\."), ".mlp.fc1."),
    (re.compile(r"(\.blocks\.\d+)\.output\.dense\."), r"\1.mlp.fc2."),
]


def _new_name(key: str) -> str:
    for pattern, replacement in _OLD_NAMES:
        key = pattern.sub(replacement, key)
    return key


def _ignored(key: str) -> bool:
    """Buffers computed from the config, and the parts that are not the backbone."""
    return key.endswith("relative_position_index") or key.startswith(("classifier.", "embeddings.mask_token"))


def swin_state_dict_from_hf(state_dict: Mapping[str, Tensor], cfg: SwinConfig) -> dict[str, Tensor]:
    """Rename a Hugging Face Swin's tensors into a :class:`Swin` state dict (``swin.`` prefix dropped; buffers,
    the mask token and a classifier are left out: see :func:`load_swin_from_hf`).

    Raises:
        ValueError: a state dict with missing, misshapen or unexpected tensors (all of them named).
    """
    ckpt = HFStateDict(state_dict, family="Swin", prefix="swin.", rename=_new_name, ignore=_ignored)
    d, c, p, m = cfg.d_model, cfg.channels, cfg.patch_size, cfg.window_size
    out: dict[str, Tensor | None] = {
        "patches.proj.weight": ckpt.take("embeddings.patch_embeddings.projection.weight", (d, c, p, p)),
        "patches.proj.bias": ckpt.take("embeddings.patch_embeddings.projection.bias", (d,)),
    }
    for part in ("weight", "bias"):
        out[f"embed_norm.{part}"] = ckpt.take(f"embeddings.norm.{part}", (d,))
        out[f"norm.{part}"] = ckpt.take(f"layernorm.{part}", (cfg.stage_widths[-1],))
    for i, (width, d_ff, heads) in enumerate(zip(cfg.stage_widths, cfg.ffn_widths, cfg.stage_heads, strict=True)):
        for j in range(cfg.depths[i]):
            hf, qkv = f"encoder.layers.{i}.blocks.{j}.", f"stages.{i}.blocks.{j}."
            out |= take_layer(ckpt, _BLOCK, hf, qkv, width, d_ff)
            out[f"{qkv}attention.bias_table"] = ckpt.take(hf + _TABLE, ((2 * m - 1) ** 2, heads))
        if i < len(cfg.depths) - 1:
            hf, qkv = f"encoder.layers.{i}.downsample.", f"stages.{i}.merge."
            out[qkv + "reduction.weight"] = ckpt.take(hf + "reduction.weight", (2 * width, 4 * width))
            for part in ("weight", "bias"):
                out[f"{qkv}norm.{part}"] = ckpt.take(f"{hf}norm.{part}", (4 * width,))
    return ckpt.finish(out)


def load_swin_from_hf(state_dict: Mapping[str, Tensor], hf_config: Mapping[str, Any]) -> Swin | SwinClassifier:
    """Build a qkv Swin from a Hugging Face checkpoint: a :class:`Swin` from a ``SwinModel``, a
    :class:`SwinClassifier` from a ``SwinForImageClassification`` (its state dict has ``classifier.*``).

    Returns:
        The model in eval mode, float32.

    Raises:
        ValueError: as :func:`swin_config_from_hf` and :func:`swin_state_dict_from_hf` do.
    """
    return load_image_model(state_dict, hf_config, swin_config_from_hf, swin_state_dict_from_hf, Swin,
                             (SwinClassifier, "swin"))
