"""Hugging Face CLIP checkpoints (``CLIPModel``) -> qkv's :class:`CLIP`.

Layouts match, names differ: the image tower is a ViT with a norm before its first layer (``pre_layrnorm``,
sic) and one after its last (``post_layernorm``, read on the [CLS] state), the text tower a causal Pre-Norm
stack ending in ``final_layer_norm``; in both, each layer is ``layer_norm1`` -> attention, ``layer_norm2`` ->
MLP. The names are the same in transformers 4 and 5; older files also store ``position_ids`` buffers, which
are skipped. A text config with ``eos_token_id=2`` (written before Hugging Face fixed that id) pools at the
highest id of each row, as OpenAI's code does: qkv's ``eos_id=None``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from ..config import CLIPConfig, CLIPTextConfig, ViTConfig
from ..footprint import build_model
from ..models.clip import CLIP
from .hf_common import ACTIVATIONS, HFStateDict, hf_field, image_side, take_layer

_LEGACY_EOS = 2  # Hugging Face's old default eos_token_id, which means "the highest id of each row"


def _activation(sub: Mapping[str, Any]) -> str:
    activation = hf_field(sub, "hidden_act", "quick_gelu")
    if activation not in ACTIVATIONS:
        raise ValueError(f"CLIP hidden_act must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    return ACTIVATIONS[activation]


def _vision_config(sub: Mapping[str, Any]) -> ViTConfig:
    return ViTConfig(
        image_size=image_side(hf_field(sub, "image_size")),
        patch_size=image_side(hf_field(sub, "patch_size")),
        channels=hf_field(sub, "num_channels", 3),
        d_model=hf_field(sub, "hidden_size"),
        n_heads=hf_field(sub, "num_attention_heads"),
        n_layers=hf_field(sub, "num_hidden_layers"),
        d_ff=hf_field(sub, "intermediate_size"),
        norm_eps=hf_field(sub, "layer_norm_eps", 1e-5),
        activation=_activation(sub),
        attention_dropout=hf_field(sub, "attention_dropout", 0.0),
        embed_norm=True,
        patch_bias=False,
    )


def _text_config(sub: Mapping[str, Any]) -> CLIPTextConfig:
    eos = hf_field(sub, "eos_token_id", 49407)
    return CLIPTextConfig(
        vocab_size=hf_field(sub, "vocab_size"),
        eos_id=None if eos == _LEGACY_EOS else eos,
        d_model=hf_field(sub, "hidden_size"),
        n_heads=hf_field(sub, "num_attention_heads"),
        n_layers=hf_field(sub, "num_hidden_layers"),
        d_ff=hf_field(sub, "intermediate_size"),
        max_seq_len=hf_field(sub, "max_position_embeddings"),
        norm_eps=hf_field(sub, "layer_norm_eps", 1e-5),
        activation=_activation(sub),
        attention_dropout=hf_field(sub, "attention_dropout", 0.0),
    )


def clip_config_from_hf(hf_config: Mapping[str, Any]) -> CLIPConfig:
    """Translate a Hugging Face CLIP ``config.json`` (with its ``vision_config`` and ``text_config``) into a
    :class:`CLIPConfig`.

    Raises:
        ValueError: for another model_type, an activation qkv lacks, or a missing size.
    """
    if hf_config.get("model_type") != "clip":
        raise ValueError(f"unsupported model_type {hf_config.get('model_type')!r} for CLIP; expected 'clip'")
    return CLIPConfig(
        vision=_vision_config(hf_field(hf_config, "vision_config")),
        text=_text_config(hf_field(hf_config, "text_config")),
        projection_dim=hf_field(hf_config, "projection_dim", 512),
        logit_scale_init=hf_field(hf_config, "logit_scale_init_value", 2.6592),
    )


_LAYER = {  # Hugging Face module -> qkv module, the same in both towers
    "self_attn.q_proj": "self_attn.q_proj",
    "self_attn.k_proj": "self_attn.k_proj",
    "self_attn.v_proj": "self_attn.v_proj",
    "self_attn.out_proj": "self_attn.out_proj",
    "mlp.fc1": "feed_forward.up",
    "mlp.fc2": "feed_forward.down",
    "layer_norm1": "self_attn_norm",
    "layer_norm2": "ffn_norm",
}


def _layers(ckpt: HFStateDict, hf_prefix: str, qkv_prefix: str, d: int, d_ff: int, n_layers: int) -> dict:
    out = {}
    for i in ckpt.layers(f"{hf_prefix}.", n_layers):
        out |= take_layer(ckpt, _LAYER, f"{hf_prefix}.{i}.", f"{qkv_prefix}.{i}.", d, d_ff)
    return out


def _norm(ckpt: HFStateDict, hf_name: str, qkv_name: str, d: int) -> dict:
    return {f"{qkv_name}.{part}": ckpt.take(f"{hf_name}.{part}", (d,)) for part in ("weight", "bias")}


def _reshaped(tensor: Tensor | None, shape: tuple[int, ...]) -> Tensor | None:
    return None if tensor is None else tensor.reshape(shape)


def clip_state_dict_from_hf(state_dict: Mapping[str, Tensor], cfg: CLIPConfig) -> dict[str, Tensor]:
    """Rename a Hugging Face ``CLIPModel``'s tensors into a :class:`CLIP` state dict.

    Raises:
        ValueError: a state dict with missing, misshapen or unexpected tensors (all of them named).
    """
    ckpt = HFStateDict(state_dict, family="CLIP", prefix="", ignore=lambda key: key.endswith("position_ids"))
    vision, text = cfg.vision, cfg.text
    dv, dt, c, p = vision.d_model, text.d_model, vision.channels, vision.patch_size
    embeddings = "vision_model.embeddings."
    out: dict[str, Tensor | None] = {
        "vision.cls_token": _reshaped(ckpt.take(embeddings + "class_embedding", (dv,)), (1, 1, dv)),
        "vision.positions": _reshaped(ckpt.take(embeddings + "position_embedding.weight", (1 + vision.n_patches, dv)),
                                      (1, 1 + vision.n_patches, dv)),
        "vision.patches.proj.weight": ckpt.take(embeddings + "patch_embedding.weight", (dv, c, p, p)),
        **_norm(ckpt, "vision_model.pre_layrnorm", "vision.embed_norm", dv),
        **_layers(ckpt, "vision_model.encoder.layers", "vision.encoder.layers", dv, vision.d_ff, vision.n_layers),
        **_norm(ckpt, "vision_model.post_layernorm", "vision.encoder.norm", dv),
        "text.tok_emb.weight": ckpt.take("text_model.embeddings.token_embedding.weight", (text.vocab_size, dt)),
        "text.positions.weight": ckpt.take("text_model.embeddings.position_embedding.weight", (text.max_seq_len, dt)),
        **_layers(ckpt, "text_model.encoder.layers", "text.decoder.layers", dt, text.d_ff, text.n_layers),
        **_norm(ckpt, "text_model.final_layer_norm", "text.decoder.norm", dt),
        "visual_projection.weight": ckpt.take("visual_projection.weight", (cfg.projection_dim, dv)),
        "text_projection.weight": ckpt.take("text_projection.weight", (cfg.projection_dim, dt)),
        "logit_scale": ckpt.take("logit_scale", ()),
    }
    return ckpt.finish(out)


def load_clip_from_hf(state_dict: Mapping[str, Tensor], hf_config: Mapping[str, Any]) -> CLIP:
    """Build a qkv :class:`CLIP` from a Hugging Face ``CLIPModel`` checkpoint.

    Returns:
        The model in eval mode, float32.

    Raises:
        ValueError: as :func:`clip_config_from_hf` and :func:`clip_state_dict_from_hf` do.
    """
    cfg = clip_config_from_hf(hf_config)
    converted = clip_state_dict_from_hf(state_dict, cfg)
    model = build_model(CLIP, cfg, what="the Hugging Face model", initialise=False)  # weights loaded next
    model.load_state_dict(converted, strict=True)
    return model.eval()
