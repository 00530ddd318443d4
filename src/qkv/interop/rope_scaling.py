"""Rotary positions as a config.json states them -> qkv's rotary settings (:class:`~qkv.nn.RotaryEmbedding`).

A model trained on a short context reaches a longer one by turning its rotary pairs more slowly. Each scheme is a
divisor of each pair's frequency ``θ_i = base^(-2i/d)`` (qkv's ``rope_freq_factors``), some with a factor on cos
and sin (``rope_scale``), computed here once from the config:

==========  ================================================================  ============================
rope_type   divisor of θ_i                                                    cos and sin times
==========  ================================================================  ============================
default     1                                                                 1
linear      ``factor`` (every pair: positions interpolated)                   1
llama3      ``factor`` for pairs slower than the context / low_freq_factor,    1
            1 for those faster than it / high_freq_factor, a blend between
yarn        the same, with the ramp over the pairs that turn between          ``0.1 ln(factor) + 1``
            ``beta_fast`` and ``beta_slow`` times in the original context      (or as stated)
longrope    ``short_factor[i]``, or ``long_factor[i]`` once the positions      ``√(1 + ln s / ln L)``,
            reach the original context L (Phi-3)                              s = context / L
==========  ================================================================  ============================

``dynamic`` (NTK scaling that changes the base with each sequence's length) and any other type are refused in one
line naming it. Both ways configs write these are read: transformers 4's ``rope_theta``, ``rope_scaling`` and
``partial_rotary_factor`` beside the sizes, and transformers 5's ``rope_parameters`` (one dict, or one per layer
type: Gemma 3's local and global layers).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ..config import check_scale
from .sizes import BOUNDS, check_size

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
_ALIASES = {"su": "longrope"}  # Phi-3's first configs' name for LongRoPE


def rope_parameters(hf_config: Mapping[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """The rotary parameters of ``layer_type``'s layers (None: the model's), in transformers 5's names
    (``rope_type``, ``rope_theta``, ``partial_rotary_factor``, ``factor``, ...), from either format."""
    merged: dict[str, Any] = {
        "rope_type": "default", "rope_theta": hf_config.get("rope_theta"),
        "partial_rotary_factor": hf_config.get("partial_rotary_factor"),
        "original_max_position_embeddings": hf_config.get("original_max_position_embeddings"),
    }
    if layer_type == "sliding_attention" and hf_config.get("rope_local_base_freq") is not None:
        return merged | {"rope_theta": hf_config["rope_local_base_freq"]}  # Gemma 3 in transformers 4: unscaled
    for key in ("rope_scaling", "rope_parameters"):
        params = hf_config.get(key)
        if params is None:
            continue
        if not isinstance(params, Mapping):
            raise ValueError(f"{key} must be a dict, got {type(params).__name__} {params!r}")
        if any(isinstance(v, Mapping) for v in params.values()):  # one dict per layer type
            params = params.get(layer_type or "full_attention") or {}
        merged.update({k: v for k, v in params.items() if v is not None}, rope_type=_kind(key, params))
    return merged


def _kind(key: str, params: Mapping[str, Any]) -> str:
    kind = params.get("rope_type", params.get("type", "default"))
    kind = _ALIASES.get(kind, kind)
    if kind not in ROPE_TYPES:
        raise ValueError(f"{key} has rope_type={kind!r}, which qkv does not implement; it reads "
                         f"{', '.join(ROPE_TYPES)}")
    return kind


def rotary_settings(hf_config: Mapping[str, Any], head_dim: int, layer_type: str | None = None) -> dict[str, Any]:
    """The :class:`~qkv.config.GPTConfig` fields of these rotary positions: ``rope_base``, ``rotary_dim`` and the
    scaling's ``rope_freq_factors``, ``rope_scale``, ``rope_long_factors``, ``rope_original_context``.

    Raises:
        ValueError: a rope_type qkv does not implement, or a parameter out of its range (named).
    """
    params = rope_parameters(hf_config, layer_type)
    base = params["rope_theta"] if params["rope_theta"] is not None else 10000.0
    check_scale("rope_theta", base)
    check_size("rope_theta", base, BOUNDS["rope_theta"])
    partial = params.get("partial_rotary_factor") or 1.0
    if not 0 < partial <= 1:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {partial}")
    dim = int(head_dim * partial)
    settings: dict[str, Any] = {"rope_base": float(base), "rotary_dim": None if dim == head_dim else dim}
    kind = params["rope_type"]
    if kind == "default":
        return settings
    context = params.get("original_max_position_embeddings") or hf_config.get("max_position_embeddings")
    factor = params.get("factor")
    if factor is None and kind in ("yarn", "longrope") and context:
        factor = hf_config.get("max_position_embeddings", context) / context
    if kind != "longrope" and not (isinstance(factor, int | float) and factor > 0):
        raise ValueError(f"rope_type {kind!r} needs a positive factor, got {factor!r}")
    if kind == "linear":
        return settings | {"rope_freq_factors": [float(factor)] * (dim // 2)}
    if kind == "llama3":
        return settings | {"rope_freq_factors": _llama3(params, base, dim, factor, context)}
    if kind == "yarn":
        return settings | _yarn(params, base, dim, factor, context)
    return settings | _longrope(params, dim, factor, context)


def _llama3(params: Mapping[str, Any], base: float, dim: int, factor: float, context: float) -> list[float]:
    """Llama 3's divisors: a pair whose wavelength is longer than the original context over ``low_freq_factor``
    turns ``factor`` times slower; one shorter than the context over ``high_freq_factor`` is left alone; in between,
    the two blend by where the wavelength lies (Meta's published rule)."""
    low, high = (float(params.get(k, d)) for k, d in (("low_freq_factor", 1.0), ("high_freq_factor", 4.0)))
    context = float(params.get("original_max_position_embeddings") or 8192)
    if not (high > low > 0 and context > 0):
        raise ValueError(f"llama3 rope scaling needs high_freq_factor > low_freq_factor > 0, got {high}, {low}")
    factors = []
    for i in range(dim // 2):
        wavelength = 2 * math.pi * base ** (2 * i / dim)
        if wavelength < context / high:
            factors.append(1.0)
        elif wavelength > context / low:
            factors.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return factors


def _yarn(params: Mapping[str, Any], base: float, dim: int, factor: float, context: float) -> dict[str, Any]:
    """YaRN (Peng et al. 2023): pairs that turn fewer than ``beta_slow`` times over the original context are
    interpolated (divided by ``factor``), those that turn more than ``beta_fast`` times are left alone, with a
    linear ramp between; cos and sin grow by the attention factor."""
    fast, slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def pair_turning(turns: float) -> float:  # the pair index that turns ``turns`` times over the context
        return dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_turning(fast), pair_turning(slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    extrapolated = 1 - ramp  # 1: keep the pair's frequency; 0: divide it by factor
    divisors = 1 / (ramp / factor + extrapolated)  # θ / θ' with θ' = θ (ramp / factor + 1 - ramp)
    scale = params.get("attention_factor")
    if scale is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        scale = _mscale(factor, mscale) / _mscale(factor, mscale_all) if mscale and mscale_all else _mscale(factor)
    return {"rope_freq_factors": divisors.tolist(), "rope_scale": float(scale)}


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _longrope(params: Mapping[str, Any], dim: int, factor: float | None, context: int | None) -> dict[str, Any]:
    """LongRoPE: searched divisors for the original context (``short_factor``) and beyond it (``long_factor``)."""
    short, long = params.get("short_factor"), params.get("long_factor")
    if not context or not isinstance(short, list) or not isinstance(long, list):
        raise ValueError("longrope scaling needs short_factor and long_factor lists and the "
                         "original_max_position_embeddings they switch at")
    scale = params.get("attention_factor")
    if scale is None:
        factor = factor or 1.0
        scale = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(context))
    return {"rope_freq_factors": [float(f) for f in short], "rope_long_factors": [float(f) for f in long],
            "rope_original_context": int(context), "rope_scale": float(scale)}


__all__ = ["ROPE_TYPES", "rope_parameters", "rotary_settings"]
