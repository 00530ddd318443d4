"""LoRA adapters on a model's projections: which layers get one, and the model with them merged.

The adapter itself is :class:`qkv.nn.LoRALinear`. This module places them in a model by the names everyone uses
for its projections, Hugging Face's and PEFT's. A :class:`Layout` says where those are in qkv's model of a
family; two families have one:

=============  ==============================  =====================================
LLaMA family   qkv's layer (in each block)     stacked form (quantized models)
(:data:`LLAMA`, a :class:`~qkv.models.GPT`)
=============  ==============================  =====================================
q_proj         ``self_attn.q_proj``            ``self_attn.qkv_proj``, rows [W^Q; W^K; W^V]
k_proj         ``self_attn.k_proj``
v_proj         ``self_attn.v_proj``
o_proj         ``self_attn.out_proj``
gate_proj      ``feed_forward.gate``           ``feed_forward.gate_up``, rows [W_g; W_1]
up_proj        ``feed_forward.up``
down_proj      ``feed_forward.down``
=============  ==============================  =====================================

=============  ==============================================  ======================================
Marian         qkv's layer (encoder and decoder blocks)        Hugging Face's module (``MarianMTModel``)
(:data:`MARIAN`, a :class:`~qkv.models.Transformer`)
=============  ==============================================  ======================================
q_proj ...     ``self_attn.{q,k,v,out}_proj``                   ``self_attn.{q,k,v,out}_proj``
               ``cross_attn.{q,k,v,out}_proj`` (decoder)        ``encoder_attn.{q,k,v,out}_proj``
fc1, fc2       ``feed_forward.up``, ``feed_forward.down``       ``fc1``, ``fc2``
=============  ==============================================  ======================================

A target names every module of that name, as PEFT matches its ``target_modules``: Marian's ``q_proj`` is the
queries of the self-attention of both stacks and of the decoder's cross-attention. A stacked layer gets one
:class:`~qkv.nn.LoRALinear` with an adapter per targeted part, so the adapters are the same whether the model
was loaded with separate or stacked projections (:mod:`qkv.adapters` writes them under PEFT's names).
Everything else of the model is frozen: the embeddings, norms, biases, the output layer and the base weights;
the optimizer sees only the adapters.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from torch import nn

from .nn import LoRALinear
from .nn.feedforward import GATED


@dataclass(frozen=True, eq=False)
class Layout:
    """Where a family's projections are, by Hugging Face's (and PEFT's) names.

    Attributes:
        family: the family's name in messages.
        stacks: qkv's stacks of blocks -> Hugging Face's (``"decoder.layers"`` -> ``"model.layers"``).
        layers: a block's projection layers, by qkv's block-relative name -> the Hugging Face modules each holds
            (several for a stacked layer, in the order of its rows). A module's target is its last name.
        task: PEFT's ``task_type`` for the family's model.
        fused: LLaMA's names -> the family's fused layer that holds them (Phi-3), so LLaMA's targets are read as
            the family's (:meth:`own`); the model's separate layers are stacked to match.
    """

    family: str
    stacks: Mapping[str, str]
    layers: Mapping[str, tuple[str, ...]]
    task: str
    fused: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def own(self, targets: tuple[str, ...]) -> tuple[str, ...]:
        """``targets`` in this family's names: the LLaMA names of a fused layer's parts (Phi-3's ``qkv_proj``
        holds q_proj, k_proj and v_proj) become that layer's, all its parts or none.

        Raises:
            ValueError: some parts of a fused layer targeted, not all."""
        for whole in dict.fromkeys(self.fused.values()):
            parts = [t for t, w in self.fused.items() if w == whole]
            chosen = [t for t in parts if t in targets]
            if chosen and len(chosen) < len(parts):
                raise ValueError(f"a {self.family} model holds {', '.join(parts)} in one layer, {whole}: target "
                                 f"{whole} (all of them), not {', '.join(chosen)} alone")
        return tuple(dict.fromkeys(self.fused.get(t, t) for t in targets))

    @property
    def targets(self) -> tuple[str, ...]:
        """The family's targets, in the order of a block's layers."""
        return tuple(dict.fromkeys(target_of(m) for modules in self.layers.values() for m in modules))


def target_of(module: str) -> str:
    """The target a Hugging Face module path is: its last name (``"encoder_attn.q_proj"`` -> ``"q_proj"``)."""
    return module.rsplit(".", 1)[-1]


# Q, K and V: separate, or stacked into one layer (quantized models); the same names in both families
_INPUT_PROJECTIONS = {**{f"self_attn.{p}_proj": (f"self_attn.{p}_proj",) for p in "qkv"},
                      "self_attn.qkv_proj": tuple(f"self_attn.{p}_proj" for p in "qkv")}
LLAMA = Layout(
    family="LLaMA-family", task="CAUSAL_LM", stacks={"decoder.layers": "model.layers"},
    layers={**_INPUT_PROJECTIONS, "self_attn.out_proj": ("self_attn.o_proj",), "feed_forward.gate": ("mlp.gate_proj",),
            "feed_forward.up": ("mlp.up_proj",), "feed_forward.gate_up": ("mlp.gate_proj", "mlp.up_proj"),
            "feed_forward.down": ("mlp.down_proj",)})
# Phi-3 stores [W^Q; W^K; W^V] and [W_g; W_1] as one matrix each, and PEFT adapts each as one layer: one A for all
# its rows. qkv's model takes the same stacked layers, each adapter spanning all of the layer's rows.
PHI3 = Layout(
    family="Phi-3", task="CAUSAL_LM", stacks={"decoder.layers": "model.layers"},
    layers={"self_attn.qkv_proj": ("self_attn.qkv_proj",), "self_attn.out_proj": ("self_attn.o_proj",),
            "feed_forward.gate_up": ("mlp.gate_up_proj",), "feed_forward.down": ("mlp.down_proj",)},
    fused={"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
           "up_proj": "gate_up_proj"})
MARIAN = Layout(
    family="Marian", task="SEQ_2_SEQ_LM",
    stacks={"encoder.layers": "model.encoder.layers", "decoder.layers": "model.decoder.layers"},
    layers={**_INPUT_PROJECTIONS, "self_attn.out_proj": ("self_attn.out_proj",),
            **{f"cross_attn.{p}_proj": (f"encoder_attn.{p}_proj",) for p in ("q", "k", "v", "out")},
            "feed_forward.up": ("fc1",), "feed_forward.down": ("fc2",)})
TARGETS = LLAMA.targets
KNOWN_TARGETS = tuple(dict.fromkeys(LLAMA.targets + MARIAN.targets + PHI3.targets))


def layout_of(model: nn.Module) -> Layout:
    """The :class:`Layout` of ``model``: :data:`LLAMA` for a GPT with RMSNorm, RoPE and a gated feed-forward (the
    LLaMA family: Gemma, SmolLM3, OLMo 2, Granite, Qwen and Mistral name their projections as LLaMA does),
    :data:`PHI3` for a Phi-3's, :data:`MARIAN` for a Post-Norm encoder-decoder Transformer with an ungated
    feed-forward.

    Raises:
        ValueError: any other model, described.
    """
    from .model_types import model_type_of
    from .models import GPT, Transformer

    config = getattr(model, "config", None)
    if isinstance(model, GPT) and (config.norm, config.positional) == ("rms", "rope") and config.activation in GATED:
        return PHI3 if (config.family or model_type_of(config)) == "phi3" else LLAMA
    if isinstance(model, Transformer) and not config.norm_first and config.activation not in GATED:
        return MARIAN
    if isinstance(model, GPT):
        what = (f"a GPT with norm={config.norm!r}, positional={config.positional!r}, "
                f"activation={config.activation!r}")
    elif isinstance(model, Transformer):
        what = f"a Transformer with norm_first={config.norm_first}, activation={config.activation!r}"
    else:
        what = f"a {type(model).__name__}"
    raise ValueError("LoRA adapters are placed by Hugging Face's names in the LLaMA family (a GPT with RMSNorm, RoPE "
                     "and a gated feed-forward network: llama, mistral, qwen2, qwen3, gemma, phi3, smollm3, olmo2, "
                     f"granite) and in Marian translation models (a Post-Norm Transformer), got {what}")


@dataclass(frozen=True)
class LoRAConfig:
    """How a model is adapted: rank r, scale α (α / r, or α / √r with ``rslora``), dropout on the adapters'
    input, and the targets (default :data:`TARGETS`: every attention and feed-forward projection of the LLaMA
    family; a Marian model's are ``MARIAN.targets``).

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
        unknown = [t for t in self.targets if t not in KNOWN_TARGETS]
        if unknown or not self.targets:
            raise ValueError(f"unknown LoRA target modules {unknown or '(none given)'}; choose among "
                             f"{', '.join(TARGETS)} (the LLaMA family) or {', '.join(MARIAN.targets)} (Marian)")
        object.__setattr__(self, "targets", tuple(self.targets))

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "targets": list(self.targets)}


def _parts(name: str, layer: nn.Module, attention: nn.Module, layout: Layout) -> list[tuple[str, int]]:
    """The targets a projection layer holds, with their widths in its output rows."""
    targets = [target_of(m) for m in layout.layers[name]]
    if len(targets) == 1:
        return [(targets[0], layer.out_features)]
    if targets[0] == "q_proj":  # [W^Q; W^K; W^V]: the queries' heads, then the key and value heads
        kv = attention.n_kv_heads * attention.head_dim
        return [("q_proj", attention.inner_dim), ("k_proj", kv), ("v_proj", kv)]
    half = layer.out_features // 2  # [W_g; W_1]
    return [("gate_proj", half), ("up_proj", half)]


def _projections(model: nn.Module, layout: Layout) -> Iterator[tuple[str, str, nn.Module, nn.Module]]:
    """(full name, block-relative name, layer, its block's self-attention) of each projection of every block."""
    for stack in layout.stacks:
        for i, block in enumerate(model.get_submodule(stack)):
            for name in layout.layers:
                owner, _, attr = name.partition(".")
                layer = getattr(getattr(block, owner, None), attr, None)
                if layer is not None:
                    yield f"{stack}.{i}.{name}", name, layer, block.self_attn


def add_lora(model: nn.Module, config: LoRAConfig) -> nn.Module:
    """Freeze ``model`` and wrap each targeted projection of its blocks in a :class:`~qkv.nn.LoRALinear` (in
    place); returns the model. Layers already adapted are left as they are.

    Raises:
        ValueError: a model without a :class:`Layout` (:func:`layout_of`), targets that are not the family's, or a
            rank larger than a targeted layer's side.
    """
    layout = layout_of(model)
    targets = layout.own(config.targets)
    foreign = [t for t in targets if t not in layout.targets]
    if foreign:
        raise ValueError(f"the LoRA target modules {foreign} are not projections of a {layout.family} model; choose "
                         f"among {', '.join(layout.targets)}")
    model.requires_grad_(False)
    if layout.fused:  # the family's adapters span stacked layers: the model's Q, K, V and gate, up stacked too
        from .quantize import stack_projections

        stack_projections(model)
    for full, name, layer, attention in list(_projections(model, layout)):
        parts = _parts(name, layer, attention, layout)
        if isinstance(layer, LoRALinear) or not any(p in targets for p, _ in parts):
            continue
        try:
            adapted = LoRALinear(layer, rank=config.rank, alpha=config.alpha, dropout=config.dropout,
                                 rslora=config.rslora, parts=parts if len(parts) > 1 else None,
                                 targets=None if len(parts) == 1 else targets)
        except ValueError as err:
            raise ValueError(f"{full}: {err}") from None
        _set(model, full, adapted.train(layer.training))  # new modules train by default: dropout in an eval model
    return model


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """Every adapted layer of ``model``, by its name in the model."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def _prefix(name: str, layout: Layout) -> tuple[str, str]:
    """(Hugging Face's path of the block, qkv's block-relative name) of the layer ``name``
    (``encoder.layers.0.self_attn.qkv_proj`` -> ``model.encoder.layers.0``, ``self_attn.qkv_proj``)."""
    owner, stack, index, block_name = name.split(".", 3)
    return f"{layout.stacks[f'{owner}.{stack}']}.{index}", block_name


def modules_of(name: str, layer: LoRALinear, layout: Layout) -> list[tuple[str, str]]:
    """(Hugging Face's module path in the model, qkv's part name) of each adapter of the adapted layer ``name``,
    in its parts' order; a layer of one part has the part name ``""``."""
    prefix, block_name = _prefix(name, layout)
    modules = layout.layers[block_name]
    if len(layer.parts) == 1:
        return [(f"{prefix}.{modules[0]}", "")]
    return [(f"{prefix}.{m}", target_of(m)) for m in modules if target_of(m) in layer.targets]


def hf_modules(model: nn.Module, layout: Layout) -> Iterator[str]:
    """Hugging Face's path of every projection of ``model`` (adapted or not), in the model's order: a stacked
    layer's several (``model.layers.0.self_attn.q_proj``, ``...k_proj``, ...)."""
    for full, name, _, _ in _projections(model, layout):
        prefix, _ = _prefix(full, layout)
        yield from (f"{prefix}.{module}" for module in layout.layers[name])


def targets_of(name: str, layer: LoRALinear, layout: Layout) -> list[str]:
    """The targets adapted in the layer named ``name`` of the model, in its parts' order."""
    return [target_of(module) for module, _ in modules_of(name, layer, layout)]


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
    layout = layout_of(model)
    found = {t for name, m in layers.items() for t in targets_of(name, m, layout)}
    return LoRAConfig(rank=rank, alpha=alpha, dropout=dropout, rslora=rslora,
                      targets=tuple(t for t in layout.targets if t in found))


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` with every adapter switched off while inside: each adapted layer computes its base alone, so the
    model is the one the adapters were added to, with no copy of it (the reference of :mod:`qkv.preference`'s
    objectives)."""
    layers = list(lora_layers(model).values())
    for layer in layers:
        layer.enabled = False
    try:
        yield model
    finally:
        for layer in layers:
            layer.enabled = True


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace each adapted layer by one float32 ``nn.Linear`` holding ``W + s · B A`` (in place); returns the
    model. A quantized base is dequantized first: quantize the merged model again if it should be small."""
    for name, layer in lora_layers(model).items():
        _set(model, name, layer.merged())
    return model


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


__all__ = [
    "KNOWN_TARGETS",
    "LLAMA",
    "MARIAN",
    "PHI3",
    "TARGETS",
    "Layout",
    "LoRAConfig",
    "adapters_off",
    "add_lora",
    "hf_modules",
    "layout_of",
    "lora_config_of",
    "lora_layers",
    "merge_lora",
    "modules_of",
    "target_of",
    "targets_of",
]
