"""How mixture-of-experts checkpoints store their experts, and the one way qkv reads them all.

Each family stores a layer's router and experts its own way; qkv reads every way into one, Qwen-MoE's and OLMoE's
own names, an expert at a time (``i`` a layer, ``e`` an expert):

==========================================  ===========================================================
stored                                      read as (under ``model.layers.{i}.``)
==========================================  ===========================================================
Qwen2/3-MoE, OLMoE                          ``mlp.gate`` (E, d) the router; ``mlp.experts.{e}.gate_proj``,
                                            ``up_proj`` (ff, d), ``down_proj`` (d, ff); Qwen2-MoE's
                                            ``mlp.shared_expert.*`` and ``mlp.shared_expert_gate`` (1, d)
Mixtral                                     ``block_sparse_moe.gate``; ``block_sparse_moe.experts.{e}.w1``
                                            (gate), ``w3`` (up), ``w2`` (down)
Granite-MoE                                 ``block_sparse_moe.router.layer``; ``block_sparse_moe.input_linear``
                                            (E, 2 ff, d): each expert's gate rows, then its up rows;
                                            ``output_linear`` (E, d, ff)
transformers 5 in memory                    ``mlp.experts.gate_up_proj`` (E, 2 ff, d), ``down_proj`` (E, d, ff)
GGUF, as the reference path reads it        ``mlp.experts.gate_proj.weight`` (E, ff, d), ``up_proj``, ``down_proj``
==========================================  ===========================================================

Stacked tensors are cut into each expert's (views, no copy); a stacked tensor whose shape does not divide into the
config's experts is left whole, for the strict converter to name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import Tensor

from ..config import GPTConfig

PARTS = ("gate_proj", "up_proj", "down_proj")
# Stored name (within a layer) -> the name read, for the families whose experts are stored one by one
_RENAMES = (
    (re.compile(r"block_sparse_moe\.gate\.weight"), "mlp.gate.weight"),
    (re.compile(r"block_sparse_moe\.router(\.layer)?\.weight"), "mlp.gate.weight"),
    (re.compile(r"block_sparse_moe\.experts\.(\d+)\.w1\.weight"), r"mlp.experts.\1.gate_proj.weight"),
    (re.compile(r"block_sparse_moe\.experts\.(\d+)\.w3\.weight"), r"mlp.experts.\1.up_proj.weight"),
    (re.compile(r"block_sparse_moe\.experts\.(\d+)\.w2\.weight"), r"mlp.experts.\1.down_proj.weight"),
    (re.compile(r"block_sparse_moe\.input_linear\.weight"), "mlp.experts.gate_up_proj.weight"),
    (re.compile(r"block_sparse_moe\.output_linear\.weight"), "mlp.experts.down_proj.weight"),
    (re.compile(r"block_sparse_moe\.experts\.(gate_up_proj|down_proj)"), r"mlp.experts.\1"),
)
_LAYER = re.compile(r"(.*layers\.\d+\.)(.+)")
_STACKED = re.compile(r"mlp\.experts\.(gate_up_proj|gate_proj|up_proj|down_proj)(\.weight)?")


def read_name(name: str) -> str:
    """A stored tensor's name -> the name qkv reads it by (see the module's text); others as they are."""
    match = _LAYER.fullmatch(name)
    if match is None:
        return name
    for pattern, read in _RENAMES:
        if pattern.fullmatch(match[2]):
            return match[1] + pattern.sub(read, match[2])
    return name


def per_expert(state_dict: Mapping[str, Tensor], cfg: GPTConfig) -> dict[str, Tensor]:
    """A checkpoint's tensors with every expert's under its own name (see the module's text); a dense model's as they
    are."""
    if cfg.n_experts is None:
        return dict(state_dict)
    out: dict[str, Tensor] = {}
    for name, tensor in state_dict.items():
        name = read_name(name)
        match = _LAYER.fullmatch(name)
        stacked = _STACKED.fullmatch(match[2]) if match else None
        pieces = None if stacked is None else _cut(tensor, stacked[1], cfg)
        if pieces is None:
            out[name] = tensor
            continue
        for e, parts in enumerate(pieces):
            out |= {f"{match[1]}mlp.experts.{e}.{part}.weight": t for part, t in parts.items()}
    return out


def _cut(tensor: Tensor, part: str, cfg: GPTConfig) -> list[dict[str, Tensor]] | None:
    """A stacked tensor ``(E, rows, inputs)`` -> each expert's parts; None when its shape does not divide so."""
    n = cfg.n_experts
    if tensor.dim() != 3 or tensor.size(0) != n or (part == "gate_up_proj" and tensor.size(1) % 2):
        return None
    if part == "gate_up_proj":
        return [dict(zip(PARTS[:2], expert.chunk(2), strict=True)) for expert in tensor.unbind(0)]
    return [{part: expert} for expert in tensor.unbind(0)]


def expert_tensors(cfg: GPTConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """One MoE layer's feed-forward tensors: the name read (under ``model.layers.{i}.``) -> (qkv's name, shape)."""
    d, ff = cfg.d_model, cfg.expert_d_ff or cfg.d_ff
    shapes = {"gate": (ff, d), "up": (ff, d), "down": (d, ff)}
    out = {"mlp.gate.weight": ("feed_forward.router.proj.weight", (cfg.n_experts, d))}
    for e in range(cfg.n_experts):
        out |= {f"mlp.experts.{e}.{part}_proj.weight": (f"feed_forward.experts.{e}.{part}.weight", shape)
                for part, shape in shapes.items()}
    if cfg.shared_expert_d_ff is not None:
        shared = cfg.shared_expert_d_ff
        out |= {f"mlp.shared_expert.{part}_proj.weight": (f"feed_forward.shared.{part}.weight", shape)
                for part, shape in {"gate": (shared, d), "up": (shared, d), "down": (d, shared)}.items()}
        out["mlp.shared_expert_gate.weight"] = ("feed_forward.shared_gate.weight", (1, d))
    return out


def stored(state_dict: Mapping[str, Tensor], layout: str) -> dict[str, Tensor]:
    """The inverse of :func:`per_expert`: each expert's tensors as a family stores them (``layout``: "qwen" as
    read, "mixtral" expert by expert under its names, "granite" stacked)."""
    if layout == "qwen":
        return dict(state_dict)
    out, experts = {}, {}
    for name, tensor in state_dict.items():
        match = re.fullmatch(r"(.*layers\.\d+\.)mlp\.(gate\.weight|experts\.(\d+)\.(\w+)\.weight)", name)
        if match is None:
            out[name] = tensor
        elif match[3] is None:
            out[match[1] + ("block_sparse_moe.gate.weight" if layout == "mixtral" else
                            "block_sparse_moe.router.layer.weight")] = tensor
        elif layout == "mixtral":
            w = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[match[4]]
            out[f"{match[1]}block_sparse_moe.experts.{match[3]}.{w}.weight"] = tensor
        else:
            experts.setdefault(match[1], {}).setdefault(int(match[3]), {})[match[4]] = tensor
    for prefix, layer in experts.items():
        ordered = [layer[e] for e in sorted(layer)]
        out[f"{prefix}block_sparse_moe.input_linear.weight"] = torch.stack(
            [torch.cat([p["gate_proj"], p["up_proj"]]) for p in ordered])
        out[f"{prefix}block_sparse_moe.output_linear.weight"] = torch.stack([p["down_proj"] for p in ordered])
    return out


def stacked(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Each layer's experts as GGUF files hold them: every expert's gate projections in one ``(E, ff, d)`` tensor,
    ``mlp.experts.gate_proj.weight`` (and ``up_proj``, ``down_proj``), from the names :func:`per_expert` gives."""
    out, experts = {}, {}
    for name, tensor in state_dict.items():
        match = re.fullmatch(r"(.*layers\.\d+\.mlp\.experts\.)(\d+)\.(\w+)\.weight", name)
        if match is None:
            out[name] = tensor
        else:
            experts.setdefault((match[1], match[3]), {})[int(match[2])] = tensor
    for (prefix, part), layer in experts.items():
        out[f"{prefix}{part}.weight"] = torch.stack([layer[e] for e in sorted(layer)])
    return out


__all__ = ["PARTS", "expert_tensors", "per_expert", "read_name", "stacked", "stored"]
