"""LoRA adapters on a language model's projections: which layers get one, and the model with them merged.

The adapter itself is :class:`qkv.nn.LoRALinear`. This module places them in a :class:`~qkv.models.GPT` by the
names everyone uses for a decoder layer's projections, Hugging Face's and PEFT's (:data:`TARGETS`):

=============  ==============================  =====================================
target         qkv's layer (in each block)     stacked form (quantized models)
=============  ==============================  =====================================
q_proj         ``self_attn.q_proj``            ``self_attn.qkv_proj``, rows [W^Q; W^K; W^V]
k_proj         ``self_attn.k_proj``
v_proj         ``self_attn.v_proj``
o_proj         ``self_attn.out_proj``
gate_proj      ``feed_forward.gate``           ``feed_forward.gate_up``, rows [W_g; W_1]
up_proj        ``feed_forward.up``
down_proj      ``feed_forward.down``
=============  ==============================  =====================================

A stacked layer gets one :class:`~qkv.nn.LoRALinear` with an adapter per targeted part, so the adapters are the
same whether the model was loaded with separate or stacked projections (:mod:`qkv.interop.peft` writes them
under PEFT's names). Everything else of the model is frozen: the embeddings, norms, biases, the output layer
and the base weights; the optimizer sees only the adapters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from torch import nn

from .nn import LoRALinear

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# A block's projection layers as qkv names them, and the targets each holds (several when stacked).
LAYER_TARGETS = {
    "self_attn.q_proj": ("q_proj",),
    "self_attn.k_proj": ("k_proj",),
    "self_attn.v_proj": ("v_proj",),
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.out_proj": ("o_proj",),
    "feed_forward.gate": ("gate_proj",),
    "feed_forward.up": ("up_proj",),
    "feed_forward.gate_up": ("gate_proj", "up_proj"),
    "feed_forward.down": ("down_proj",),
}


@dataclass(frozen=True)
class LoRAConfig:
    """How a model is adapted: rank r, scale α (α / r, or α / √r with ``rslora``), dropout on the adapters'
    input, and the targets (:data:`TARGETS`; default: every attention and feed-forward projection).

    Raises:
        ValueError: a rank below 1, α not positive, dropout outside [0, 1), or an unknown target.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    rslora: bool = False
    targets: tuple[str, ...] = TARGETS

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"the LoRA rank must be at least 1, got {self.rank}")
        if not self.alpha > 0 or self.alpha == float("inf"):
            raise ValueError(f"the LoRA alpha must be a positive number, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"the LoRA dropout must be in [0, 1), got {self.dropout}")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets:
            raise ValueError(f"unknown LoRA target modules {unknown or '(none given)'}; choose among "
                             f"{', '.join(TARGETS)}")
        object.__setattr__(self, "targets", tuple(self.targets))

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "targets": list(self.targets)}


def _parts(name: str, layer: nn.Module, attention: nn.Module | None) -> list[tuple[str, int]]:
    """The targets a projection layer holds, with their widths in its output rows."""
    targets = LAYER_TARGETS[name]
    if len(targets) == 1:
        return [(targets[0], layer.out_features)]
    if targets[0] == "q_proj":  # [W^Q; W^K; W^V]: the queries' heads, then the key and value heads
        kv = attention.n_kv_heads * attention.head_dim
        return [("q_proj", attention.inner_dim), ("k_proj", kv), ("v_proj", kv)]
    half = layer.out_features // 2  # [W_g; W_1]
    return [("gate_proj", half), ("up_proj", half)]


def _projections(model: nn.Module) -> Iterator[tuple[str, str, nn.Module, nn.Module]]:
    """(full name, block-relative name, layer, its attention module) of each projection of every block."""
    for i, block in enumerate(model.decoder.layers):
        for name in LAYER_TARGETS:
            owner, _, attr = name.partition(".")
            parent = getattr(block, owner, None)
            layer = getattr(parent, attr, None)
            if layer is not None:
                yield f"decoder.layers.{i}.{name}", name, layer, block.self_attn


def add_lora(model: nn.Module, config: LoRAConfig) -> nn.Module:
    """Freeze ``model`` and wrap each targeted projection of its blocks in a :class:`~qkv.nn.LoRALinear` (in
    place); returns the model. Layers already adapted are left as they are.

    Raises:
        ValueError: targets that match no layer of the model, or a rank larger than a targeted layer's side.
    """
    model.requires_grad_(False)
    found = False
    for full, name, layer, attention in list(_projections(model)):
        parts = _parts(name, layer, attention)
        if isinstance(layer, LoRALinear) or not any(p in config.targets for p, _ in parts):
            continue
        try:
            adapted = LoRALinear(layer, rank=config.rank, alpha=config.alpha, dropout=config.dropout,
                                 rslora=config.rslora, parts=parts if len(parts) > 1 else None,
                                 targets=None if len(parts) == 1 else config.targets)
        except ValueError as err:
            raise ValueError(f"{full}: {err}") from None
        _set(model, full, adapted.train(layer.training))  # new modules train by default: dropout in an eval model
        found = True
    if not found:
        raise ValueError(f"the LoRA target modules {list(config.targets)} match no layer of this model; choose among "
                         f"{', '.join(TARGETS)}")
    return model


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """Every adapted layer of ``model``, by its name in the model."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def targets_of(name: str, layer: LoRALinear) -> Sequence[str]:
    """The targets (PEFT's module names) adapted in the layer named ``name`` of the model, in its parts' order."""
    block_name = name.split(".", 3)[3]  # decoder.layers.{i}.<block-relative name>
    if len(layer.parts) == 1:
        return LAYER_TARGETS[block_name]
    return layer.targets


def lora_config_of(model: nn.Module) -> LoRAConfig:
    """The :class:`LoRAConfig` of a model's adapters, read from the adapted layers themselves.

    Raises:
        ValueError: a model with no adapters, or adapters of different ranks or scales.
    """
    layers = lora_layers(model)
    if not layers:
        raise ValueError("the model has no LoRA adapters")
    kinds = {(m.rank, m.alpha, m.rslora, m.dropout.p) for m in layers.values()}
    if len(kinds) > 1:
        raise ValueError(f"the model's adapters differ in rank, alpha or dropout ({sorted(kinds)[:2]}); one "
                         "configuration is expected")
    rank, alpha, rslora, dropout = kinds.pop()
    found = {t for name, m in layers.items() for t in targets_of(name, m)}
    return LoRAConfig(rank=rank, alpha=alpha, dropout=dropout, rslora=rslora,
                      targets=tuple(t for t in TARGETS if t in found))


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace each adapted layer by one float32 ``nn.Linear`` holding ``W + s · B A`` (in place); returns the
    model. A quantized base is dequantized first: quantize the merged model again if it should be small."""
    for name, layer in lora_layers(model).items():
        _set(model, name, layer.merged())
    return model


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


__all__ = ["TARGETS", "LoRAConfig", "add_lora", "lora_config_of", "lora_layers", "merge_lora", "targets_of"]
