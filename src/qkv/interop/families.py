"""The decoder families qkv reads, each as a table: what its ``config.json`` says -> the
:class:`~qkv.config.GPTConfig` fields that set it apart from LLaMA, and its tensors' names -> qkv's.

Every family here is a LLaMA (RMSNorm, rotary positions, a gated feed-forward network, grouped key/value heads, no
biases) with a few blocks changed, each a block of :mod:`qkv.nn`; "what makes Gemma 3 Gemma 3" is its entry below.

=============  =====================================================================================================
family         what differs from LLaMA (the GPTConfig fields)
=============  =====================================================================================================
llama          nothing (Llama 3's rotary scaling is read from its rope_scaling)
mistral        a sliding window in every layer (``window``)
qwen2          biases on Q, K and V (``qkv_bias``)
qwen3          RMSNorm on each head's queries and keys (``qk_norm``); heads wider than ``d_model / n_heads``
gemma3         GeGLU; sandwich norms (``branch_norm``); RMSNorm gains 1 + w (``norm_offset``); QK-norm; embeddings
               × √d; five local layers (window 512 at 270M, θ 10k) to one global (θ 1M); scores × 1/√q_pre_attn
gemma2         Gemma 3 without QK-norm, one local layer to one global, attention and final logits capped with tanh
phi3           Q, K, V and gate, up stored fused; rotary on part of each head; LongRoPE
smollm3        no rotary positions in every fourth layer ("NoPE")
olmo2          norms on each sub-layer's output only (x + N(f(x))); QK-norm over the whole projection
granite        embeddings, attention scores, each branch and the logits scaled by constants
mixtral        a mixture of experts in place of each feed-forward network (``n_experts``, ``expert_top_k``)
qwen2_moe      Qwen2 with experts, their top-k weights as the softmax gave them, and a shared expert
qwen3_moe      Qwen3 with experts (renormalised top-k or not: ``norm_topk_prob``), some layers dense
olmoe          experts, QK-norm over the whole projection
granitemoe     Granite with experts
=============  =====================================================================================================
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..config import GPTConfig, LayerSpec
from ..model_types import model_type_of
from .experts import expert_tensors
from .hf_common import hf_field
from .rope_scaling import rope_parameters, rotary_settings

# One LLaMA layer's tensors: Hugging Face name (under model.layers.{i}.) -> qkv name (under decoder.layers.{i}.)
LLAMA_NAMES = {
    "self_attn.q_proj": "self_attn.q_proj",
    "self_attn.k_proj": "self_attn.k_proj",
    "self_attn.v_proj": "self_attn.v_proj",
    "self_attn.o_proj": "self_attn.out_proj",
    "mlp.gate_proj": "feed_forward.gate",
    "mlp.up_proj": "feed_forward.up",
    "mlp.down_proj": "feed_forward.down",
    "input_layernorm": "self_attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
QK_NORMS = {"self_attn.q_norm": "self_attn.q_norm", "self_attn.k_norm": "self_attn.k_norm"}
# Gemma's four norms a layer: LLaMA's "post_attention_layernorm" (its norm before the feed-forward network) is
# Gemma's norm of the attention's output
GEMMA_NAMES = {**{k: v for k, v in LLAMA_NAMES.items() if k != "post_attention_layernorm"},
               "post_attention_layernorm": "self_attn_out_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "ffn_out_norm"}
OLMO2_NAMES = {**{k: v for k, v in LLAMA_NAMES.items() if "layernorm" not in k},
               "post_attention_layernorm": "self_attn_out_norm", "post_feedforward_layernorm": "ffn_out_norm",
               **QK_NORMS}
# The same layers in GGUF files, as llama.cpp names them: GGUF name (under blk.{i}.) -> Hugging Face name
LLAMA_GGUF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
              "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
              "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
GEMMA_GGUF = {**LLAMA_GGUF, "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
              "post_ffw_norm": "post_feedforward_layernorm"}
OLMO2_GGUF = {k: v for k, v in GEMMA_GGUF.items() if k not in ("attn_norm", "ffn_norm")}
PHI3_GGUF = {**{k: v for k, v in LLAMA_GGUF.items() if k not in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")},
             "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# A mixture of experts' tensors in GGUF files (3-D: one matrix an expert) -> the names qkv reads them by
# (qkv.interop.experts); Qwen2-MoE's shared expert and its gate
MOE_GGUF = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
            "ffn_down_exps": "mlp.experts.down_proj", "ffn_gate_up_exps": "mlp.experts.gate_up_proj",
            "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
            "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
# Phi-3 stores [Q; K; V] as one matrix and [gate; up] as another: read apart, written back together
PHI3_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


@dataclass(frozen=True)
class Family:
    """One family: its names, what sets it apart, and how to read that from its ``config.json``.

    Attributes:
        model_type: config.json's ``model_type``.
        title: the family's name for people.
        architecture: the class transformers builds (config.json's ``architectures``).
        differs: what differs from LLaMA, in a line.
        settings: config.json -> the GPTConfig fields that set the family apart.
        names: one layer's tensors, Hugging Face names -> qkv's (weights; ``.weight``/``.bias`` added).
        fused: tensors the family stores stacked, Hugging Face name -> the LLaMA names of its parts, in order.
        gguf_names: one layer's tensors in a GGUF file, llama.cpp's names -> Hugging Face's.
        gguf_arch: llama.cpp's ``general.architecture`` for the family.
        from_gguf: what a GGUF file says of the family beyond LLaMA's keys, as config.json keys: called with a
            checked getter of ``{arch}.{key}`` numbers, the metadata and the tensors.
        experts: how the family's files store a mixture of experts (:func:`qkv.interop.experts.stored`: "qwen",
            "mixtral", "granite"); None: a dense family.
    """

    model_type: str
    title: str
    architecture: str
    differs: str
    settings: Callable[[Mapping[str, Any]], dict[str, Any]] = lambda hf: {}
    names: Mapping[str, str] = field(default_factory=lambda: LLAMA_NAMES)
    fused: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    gguf_names: Mapping[str, str] = field(default_factory=lambda: LLAMA_GGUF)
    gguf_arch: str = "llama"
    from_gguf: Callable[[Callable, Mapping[str, Any], Mapping[str, Any]], dict[str, Any]] = \
        lambda get, meta, tensors: {}
    experts: str | None = None


def _mistral(hf: Mapping[str, Any]) -> dict[str, Any]:
    return {"window": hf.get("sliding_window")}


def _layer_types(hf: Mapping[str, Any], every: int) -> list[str]:
    """Gemma's ``layer_types``, or as older configs imply it: one global layer after ``every - 1`` local ones."""
    n = hf_field(hf, "num_hidden_layers")
    types = hf.get("layer_types")
    if types is None:
        every = hf.get("sliding_window_pattern") or every
        types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown or len(types) != n:
        raise ValueError(f"layer_types must name each of the {n} layers 'full_attention' or 'sliding_attention', got "
                         f"{unknown or len(types)}")
    return list(types)


def _gemma(hf: Mapping[str, Any], *, every: int) -> dict[str, Any]:
    """What Gemma 2 and 3 share: GeGLU, sandwich norms of 1 + w, √d embeddings, local and global layers, and the
    caps on scores and logits that Gemma 2 sets."""
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=true (an encoder, EmbeddingGemma) is not a decoder qkv reads")
    activation = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    gated = {"gelu_pytorch_tanh": "geglu_tanh", "gelu_new": "geglu_tanh", "gelu": "geglu"}.get(activation)
    if gated is None:
        raise ValueError(f"Gemma's hidden_activation must be gelu_pytorch_tanh or gelu, got {activation!r}")
    head_dim = hf_field(hf, "head_dim")
    local = rotary_settings(hf, head_dim, "sliding_attention")
    if set(local) - {"rope_base", "rotary_dim"}:
        raise ValueError("qkv scales the rotary positions of Gemma's global layers only; the sliding_attention "
                         f"layers' rope_type must be 'default', got {rope_parameters(hf, 'sliding_attention')}")
    window = hf_field(hf, "sliding_window")
    layers = [LayerSpec(window=window, rope_base=local["rope_base"], rope_scaled=False) if kind == "sliding_attention"
              else LayerSpec() for kind in _layer_types(hf, every)]
    scalar = hf.get("query_pre_attn_scalar") or head_dim
    return {"activation": gated, "norm_offset": True, "branch_norm": True, "layers": layers,
            "embedding_scale": math.sqrt(hf_field(hf, "hidden_size")), "attention_scale": scalar**-0.5,
            "attention_softcap": hf.get("attn_logit_softcapping"), "logit_softcap": hf.get("final_logit_softcapping"),
            **rotary_settings(hf, head_dim, "full_attention")}


def _gemma2(hf: Mapping[str, Any]) -> dict[str, Any]:
    return _gemma(hf, every=2)


def _gemma3(hf: Mapping[str, Any]) -> dict[str, Any]:
    return _gemma(hf, every=6) | {"qk_norm": True}


def _phi3(hf: Mapping[str, Any]) -> dict[str, Any]:
    return {"window": hf.get("sliding_window")}


def _smollm3(hf: Mapping[str, Any]) -> dict[str, Any]:
    n = hf_field(hf, "num_hidden_layers")
    rope = hf.get("no_rope_layers")
    if rope is None:
        every = hf.get("no_rope_layer_interval") or 4
        rope = [int((i + 1) % every != 0) for i in range(n)]
    if len(rope) != n or any(r not in (0, 1) for r in rope):
        raise ValueError(f"no_rope_layers must be 1 (rotary) or 0 (none) for each of the {n} layers, got {rope}")
    return {"layers": [LayerSpec(rotary=bool(r)) for r in rope]}


def _olmo2(hf: Mapping[str, Any]) -> dict[str, Any]:
    return {"norm_first": False, "branch_norm": True, "qk_norm": True, "qk_norm_whole": True}


def _granite(hf: Mapping[str, Any]) -> dict[str, Any]:
    return {"embedding_scale": float(hf.get("embedding_multiplier", 1.0)),
            "residual_scale": float(hf.get("residual_multiplier", 1.0)),
            "attention_scale": float(hf["attention_multiplier"]) if hf.get("attention_multiplier") else None,
            "logit_scale": 1.0 / float(hf.get("logits_scaling", 1.0))}


def _experts(hf: Mapping[str, Any], *, normalize: bool | None = None, qwen: bool = False) -> dict[str, Any]:
    """A mixture of experts' fields: E, k, whether the k weights are renormalised (``norm_topk_prob`` where the
    family leaves it to the config), and Qwen's own: the experts' width (``moe_intermediate_size``; the others'
    are ``intermediate_size`` wide), a shared expert, and the layers that stay dense (``mlp_only_layers``,
    ``decoder_sparse_step``)."""
    n = hf.get("num_local_experts") or hf.get("num_experts")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"a {hf.get('model_type')} config names its experts in num_experts (or num_local_experts), an "
                         f"int >= 1; this one has {n!r}")
    k = hf_field(hf, "num_experts_per_tok")
    if not isinstance(k, int) or not 1 <= k <= n:
        raise ValueError(f"num_experts_per_tok={k!r} must be an int from 1 to the {n} experts (num_experts)")
    out = {"n_experts": n, "expert_top_k": k,
           "expert_normalize": bool(hf.get("norm_topk_prob", False) if normalize is None else normalize)}
    if not qwen:
        return out
    layers, step = hf_field(hf, "num_hidden_layers"), hf.get("decoder_sparse_step") or 1
    only = set(hf.get("mlp_only_layers") or ())
    dense = [i in only or (i + 1) % step != 0 for i in range(layers)]
    out |= {"expert_d_ff": hf.get("moe_intermediate_size"),
            "shared_expert_d_ff": hf.get("shared_expert_intermediate_size") or None}
    return out | ({"layers": [LayerSpec(dense=d) for d in dense]} if any(dense) else {})


def _olmoe(hf: Mapping[str, Any]) -> dict[str, Any]:
    if hf.get("clip_qkv") is not None:
        raise ValueError(f"clip_qkv={hf['clip_qkv']} (queries, keys and values clipped) is not supported")
    return {"qk_norm": True, "qk_norm_whole": True, **_experts(hf)}


def _moe_from_gguf(get: Callable, meta: Mapping[str, Any], tensors: Mapping[str, Any], *, normalize: bool
                   ) -> dict[str, Any]:
    """A GGUF file's experts as config.json states them; llama.cpp's graph of each architecture fixes whether the k
    weights are renormalised (Mixtral's, Qwen3-MoE's and Granite-MoE's are; Qwen2-MoE's and OLMoE's not)."""
    return {"num_experts": get("expert_count"), "num_experts_per_tok": get("expert_used_count"),
            "moe_intermediate_size": get("expert_feed_forward_length", None, optional=True),
            "shared_expert_intermediate_size": get("expert_shared_feed_forward_length", None, optional=True),
            "norm_topk_prob": normalize}


# ------------------------------------------------------------------------- what GGUF files say of each family
# llama.cpp's converter writes fewer keys than config.json holds; what it leaves out, llama.cpp's loader assumes,
# and so does qkv: Gemma 3's pattern of one global layer in six and its local θ of 10k, Gemma 2's alternation and
# window of 4,096, SmolLM3's NoPE layer in every four, and Gemma's attention scale of 1/√head_dim (the 27B
# models: 1/√(d_model / n_heads)).

def _gemma_from_gguf(get: Callable, meta: Mapping[str, Any], *, every: int, window: int | None, big: int
                     ) -> dict[str, Any]:
    arch = meta["general.architecture"]
    n, head_dim = get("block_count"), get("attention.key_length")
    window = get("attention.sliding_window", window)
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", every)
    local = list(pattern) if isinstance(pattern, list) else [i % pattern < pattern - 1 for i in range(n)]
    if len(local) != n:
        raise ValueError(f"{arch}.attention.sliding_window_pattern names {len(local)} layers; the model has {n}")
    scalar = get("embedding_length") // get("attention.head_count") if n == big else head_dim
    return {"sliding_window": window, "query_pre_attn_scalar": scalar, "hidden_activation": "gelu_pytorch_tanh",
            "layer_types": ["sliding_attention" if is_local and window else "full_attention" for is_local in local],
            "rope_local_base_freq": get("rope.freq_base_swa", 10000.0, real=True),
            "attn_logit_softcapping": meta.get(f"{arch}.attn_logit_softcapping"),
            "final_logit_softcapping": meta.get(f"{arch}.final_logit_softcapping")}


def _phi3_from_gguf(get: Callable, meta: Mapping[str, Any], tensors: Mapping[str, Any]) -> dict[str, Any]:
    out = {"sliding_window": get("attention.sliding_window", 0, minimum=0) or None}
    if "rope_factors_long.weight" in tensors:
        out["rope_scaling"] = {
            "rope_type": "longrope", "long_factor": tensors["rope_factors_long.weight"].flatten().tolist(),
            "short_factor": tensors["rope_factors_short.weight"].flatten().tolist(),
            "original_max_position_embeddings": get("rope.scaling.original_context_length"),
            "attention_factor": get("rope.scaling.attn_factor", 1.0, real=True)}
    return out


def _granite_from_gguf(get: Callable, meta: Mapping[str, Any], tensors: Mapping[str, Any]) -> dict[str, Any]:
    return {"embedding_multiplier": get("embedding_scale", 1.0, real=True),
            "residual_multiplier": get("residual_scale", 1.0, real=True),
            "attention_multiplier": get("attention.scale", None, real=True, optional=True),
            "logits_scaling": get("logit_scale", 1.0, real=True)}


def _smollm3_from_gguf(get: Callable, meta: Mapping[str, Any], tensors: Mapping[str, Any]) -> dict[str, Any]:
    return {"no_rope_layer_interval": 4}


def _olmo2_from_gguf(get: Callable, meta: Mapping[str, Any], tensors: Mapping[str, Any]) -> dict[str, Any]:
    if get("attention.sliding_window", 0, minimum=0):
        raise ValueError("olmo2.attention.sliding_window: OLMo 3's local layers are not read by qkv")
    return {}


FAMILIES = {f.model_type: f for f in (
    Family("llama", "LLaMA", "LlamaForCausalLM", "the base: RMSNorm, rotary positions, SwiGLU, grouped K/V heads"),
    Family("mistral", "Mistral", "MistralForCausalLM", "a sliding window in every layer", _mistral),
    Family("qwen2", "Qwen2", "Qwen2ForCausalLM", "biases on Q, K and V", lambda hf: {"qkv_bias": True},
           gguf_arch="qwen2"),
    Family("qwen3", "Qwen3", "Qwen3ForCausalLM", "RMSNorm on each head's queries and keys",
           lambda hf: {"qk_norm": True}, {**LLAMA_NAMES, **QK_NORMS}, gguf_arch="qwen3"),
    Family("gemma3_text", "Gemma 3", "Gemma3ForCausalLM",
           "GeGLU, sandwich norms (1 + w), QK-norm, √d embeddings, 5 local layers to 1 global with their own θ",
           _gemma3, {**GEMMA_NAMES, **QK_NORMS}, gguf_names=GEMMA_GGUF, gguf_arch="gemma3",
           from_gguf=lambda get, meta, tensors: _gemma_from_gguf(get, meta, every=6, window=None, big=62)),
    Family("gemma2", "Gemma 2", "Gemma2ForCausalLM",
           "GeGLU, sandwich norms (1 + w), √d embeddings, local and global layers, scores and logits capped",
           _gemma2, GEMMA_NAMES, gguf_names=GEMMA_GGUF, gguf_arch="gemma2",
           from_gguf=lambda get, meta, tensors: _gemma_from_gguf(get, meta, every=2, window=4096, big=46)),
    Family("phi3", "Phi-3", "Phi3ForCausalLM", "fused Q/K/V and gate/up, rotary on part of each head, LongRoPE",
           _phi3, fused=PHI3_FUSED, gguf_names=PHI3_GGUF, gguf_arch="phi3", from_gguf=_phi3_from_gguf),
    Family("smollm3", "SmolLM3", "SmolLM3ForCausalLM", "no rotary positions in every fourth layer (NoPE)", _smollm3,
           gguf_arch="smollm3", from_gguf=_smollm3_from_gguf),
    Family("olmo2", "OLMo 2", "Olmo2ForCausalLM", "norms on each sub-layer's output only, QK-norm over all heads",
           _olmo2, OLMO2_NAMES, gguf_names=OLMO2_GGUF, gguf_arch="olmo2", from_gguf=_olmo2_from_gguf),
    Family("granite", "Granite", "GraniteForCausalLM", "embeddings, scores, branches and logits scaled", _granite,
           gguf_arch="granite", from_gguf=_granite_from_gguf),
    Family("mixtral", "Mixtral", "MixtralForCausalLM", "a mixture of experts in each layer",
           lambda hf: _mistral(hf) | _experts(hf, normalize=True), gguf_names={**LLAMA_GGUF, **MOE_GGUF},
           from_gguf=lambda get, meta, tensors: _moe_from_gguf(get, meta, tensors, normalize=True), experts="mixtral"),
    Family("qwen2_moe", "Qwen2-MoE", "Qwen2MoeForCausalLM", "Qwen2 with experts and a shared expert",
           lambda hf: {"qkv_bias": bool(hf.get("qkv_bias", True))} | _experts(hf, qwen=True),
           gguf_names={**LLAMA_GGUF, **MOE_GGUF}, gguf_arch="qwen2moe",
           from_gguf=lambda get, meta, tensors: _moe_from_gguf(get, meta, tensors, normalize=False), experts="qwen"),
    Family("qwen3_moe", "Qwen3-MoE", "Qwen3MoeForCausalLM", "Qwen3 with experts",
           lambda hf: {"qk_norm": True} | _experts(hf, qwen=True), {**LLAMA_NAMES, **QK_NORMS},
           gguf_names={**LLAMA_GGUF, **MOE_GGUF}, gguf_arch="qwen3moe",
           from_gguf=lambda get, meta, tensors: _moe_from_gguf(get, meta, tensors, normalize=True), experts="qwen"),
    Family("olmoe", "OLMoE", "OlmoeForCausalLM", "experts, QK-norm over all heads", _olmoe,
           {**LLAMA_NAMES, **QK_NORMS}, gguf_names={**LLAMA_GGUF, **MOE_GGUF}, gguf_arch="olmoe",
           from_gguf=lambda get, meta, tensors: _moe_from_gguf(get, meta, tensors, normalize=False), experts="qwen"),
    Family("granitemoe", "Granite-MoE", "GraniteMoeForCausalLM", "Granite with experts",
           lambda hf: _granite(hf) | _experts(hf, normalize=True), gguf_names={**LLAMA_GGUF, **MOE_GGUF},
           gguf_arch="granitemoe",
           from_gguf=lambda get, meta, tensors: _granite_from_gguf(get, meta, tensors) |
           _moe_from_gguf(get, meta, tensors, normalize=True), experts="granite"),
)}
MODEL_TYPES = tuple(FAMILIES)
# GGUF architectures -> the family read from them (a Mistral file is a "llama" one, its window not stated, and a
# Mixtral file a "llama" one with experts: hf_config_from_gguf tells them apart)
GGUF_FAMILIES = {f.gguf_arch: f for f in FAMILIES.values() if f.model_type not in ("mistral", "mixtral")}
# The architectures whose Q and K rows llama.cpp's converter reorders for its interleaved rotary pairs (the others
# it rotates in halves, as Hugging Face does, and stores as they are)
PERMUTED_ARCHITECTURES = ("llama", "granite", "granitemoe", "smollm3")


def family(model_type: str) -> Family:
    if model_type not in FAMILIES:
        raise ValueError(f"unsupported model_type {model_type!r}; expected one of {['gpt2', *MODEL_TYPES]}")
    return FAMILIES[model_type]


# Multimodal folders whose text model qkv reads: model_type -> the key of the text model's config. Their vision
# tower and projector are not read (a log line says so).
MULTIMODAL = {"gemma3": "text_config"}
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))


def text_model(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The config of a multimodal folder's text model (Gemma 3 from 4B: ``Gemma3ForConditionalGeneration``), as a
    text-only folder writes it; any other config as it is."""
    key = MULTIMODAL.get(hf_config.get("model_type"))
    if key is None:
        return dict(hf_config)
    text = hf_config.get(key)
    if not isinstance(text, Mapping):
        raise ValueError(f"a {hf_config['model_type']!r} config holds its text model's in {key!r}; this one has none")
    return {"model_type": "gemma3_text", "tie_word_embeddings": hf_config.get("tie_word_embeddings", True), **text}


def text_tensor(name: str) -> str | None:
    """A multimodal folder's tensor name -> its name in the text model alone (None: the vision tower's or the
    projector's, not read)."""
    for prefix, text in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return text + name[len(prefix):]
    return None


# ---------------------------------------------------------------------- GPTConfig -> config.json (export)
# Each family's fields written back as its config.json states them; qkv reads the result back and compares
# (hf_gpt.gpt_config_to_hf), so a field written wrong is an error there, never a silent change of the model.

def family_of(cfg: GPTConfig) -> Family:
    """The family whose config.json holds ``cfg``: the one it was read from, else told apart by the blocks it uses
    (:func:`qkv.model_types.model_type_of`; LLaMA when none)."""
    return FAMILIES[cfg.family if cfg.family in FAMILIES else model_type_of(cfg)]


def rope_to_hf(cfg: GPTConfig, *, scaled: bool = True, base: float | None = None) -> dict[str, Any]:
    """``rope_parameters`` (transformers 5's) of the config's rotary positions: plain, linear (every divisor the
    same) or LongRoPE; other divisors (Llama 3's, YaRN's) are kept by qkv as divisors alone and are refused."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": base or cfg.rope_base}
    if cfg.rotary_dim is not None:
        params["partial_rotary_factor"] = cfg.rotary_dim / cfg.head_dim
    factors = cfg.rope_freq_factors if scaled else None
    if cfg.rope_long_factors is not None and scaled:
        return params | {"rope_type": "longrope", "short_factor": factors, "long_factor": cfg.rope_long_factors,
                         "original_max_position_embeddings": cfg.rope_original_context,
                         "attention_factor": cfg.rope_scale}
    if factors is None:
        return params
    if len(set(factors)) == 1 and cfg.rope_scale == 1.0:
        return params | {"rope_type": "linear", "factor": factors[0]}
    raise ValueError("a rotary scaling kept as per-pair divisors (Llama 3's, YaRN's) has no config.json form here; "
                     "rope_freq_factors would be lost")


def _gemma_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    specs = [cfg.layer(i) for i in range(cfg.n_layers)]
    local = [s for s in specs if s.window]
    if len({s.window for s in local}) > 1 or len({s.rope_base for s in local}) > 1 or \
            any(s.rope_scaled for s in local) or any(not s.rotary for s in specs):
        raise ValueError("Gemma's local layers share one window and one unscaled θ, and every layer turns")
    activation = {"geglu_tanh": "gelu_pytorch_tanh", "geglu": "gelu"}.get(cfg.activation)
    if activation is None:
        raise ValueError(f"Gemma's feed-forward network is GeGLU; activation={cfg.activation!r} has no Gemma form")
    types = ["sliding_attention" if s.window else "full_attention" for s in specs]
    full = rope_to_hf(cfg)
    rope = {"full_attention": full, "sliding_attention": rope_to_hf(cfg, scaled=False, base=local[0].rope_base)} \
        if local else {"full_attention": full, "sliding_attention": full}
    if not cfg.qk_norm:  # Gemma 2: one rotary setting for every layer
        rope = full
    scalar = cfg.head_dim if cfg.attention_scale is None else cfg.attention_scale**-2
    scalar = round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar  # transformers wants an int
    return {"hidden_activation": activation, "layer_types": types, "rope_parameters": rope,
            "sliding_window": local[0].window if local else cfg.max_seq_len, "query_pre_attn_scalar": scalar,
            "attn_logit_softcapping": cfg.attention_softcap, "final_logit_softcapping": cfg.logit_softcap}


def _phi3_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    rope = rope_to_hf(cfg)
    return {"rope_parameters": rope, "sliding_window": cfg.window,
            "original_max_position_embeddings": rope.get("original_max_position_embeddings", cfg.max_seq_len)}


def _smollm3_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    return {"no_rope_layers": [int(cfg.layer(i).rotary) for i in range(cfg.n_layers)], "use_sliding_window": False}


def _granite_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    return {"embedding_multiplier": cfg.embedding_scale, "residual_multiplier": cfg.residual_scale,
            "attention_multiplier": cfg.attention_scale or cfg.head_dim**-0.5, "logits_scaling": 1 / cfg.logit_scale}


def _moe_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    """A mixture of experts' keys in every MoE family's config.json (each family reads those it knows; what one
    cannot state comes back different and is refused by the export's check)."""
    dense = [i for i in range(cfg.n_layers) if cfg.layer(i).dense]
    return {"num_experts": cfg.n_experts, "num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.expert_top_k,
            "norm_topk_prob": cfg.expert_normalize, "moe_intermediate_size": cfg.expert_d_ff,
            "shared_expert_intermediate_size": cfg.shared_expert_d_ff, "mlp_only_layers": dense,
            "decoder_sparse_step": 1, "qkv_bias": bool(cfg.qkv_bias), "use_sliding_window": False,
            "sliding_window": cfg.window, "output_router_logits": False}


def _expert_width(cfg: GPTConfig) -> dict[str, Any]:
    """Mixtral's, OLMoE's and Granite-MoE's experts are ``intermediate_size`` wide."""
    return {"intermediate_size": cfg.expert_d_ff or cfg.d_ff}


_TO_HF = {"gemma3_text": _gemma_to_hf, "gemma2": _gemma_to_hf, "phi3": _phi3_to_hf, "smollm3": _smollm3_to_hf,
          "granite": _granite_to_hf, "mistral": lambda cfg: {"sliding_window": cfg.window},
          "llama": lambda cfg: {"attention_bias": False, "mlp_bias": False},
          "mixtral": lambda cfg: _moe_to_hf(cfg) | _expert_width(cfg), "qwen2_moe": _moe_to_hf, "qwen3_moe": _moe_to_hf,
          "olmoe": lambda cfg: _moe_to_hf(cfg) | _expert_width(cfg),
          "granitemoe": lambda cfg: _moe_to_hf(cfg) | _expert_width(cfg) | _granite_to_hf(cfg)}


def config_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    """The config.json of ``cfg``'s family (:func:`family_of`): LLaMA's keys and the family's own.

    Raises:
        ValueError: a config whose blocks no family's config.json states (said which)."""
    fam = family_of(cfg)
    hf = {"model_type": fam.model_type, "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
          "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
          "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads, "head_dim": cfg.head_dim,
          "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
          "rope_parameters": rope_to_hf(cfg), "architectures": [fam.architecture],
          "tie_word_embeddings": cfg.tie_embeddings, "pad_token_id": None}  # not a class default past the vocabulary
    if fam.model_type in ("qwen2", "qwen3"):
        hf["use_sliding_window"] = False
    return hf | _TO_HF.get(fam.model_type, lambda cfg: {})(cfg)


# --------------------------------------------------------------- GPTConfig -> GGUF metadata (export to llama.cpp)

def gguf_keys(cfg: GPTConfig, arch: str) -> dict[str, Any]:
    """What a GGUF file of ``arch`` states of ``cfg`` beyond LLaMA's keys (``{arch}.`` left off): the inverse of each
    family's ``from_gguf``, and only what llama.cpp reads.

    Raises:
        ValueError: a block llama.cpp's files of that architecture cannot state (named)."""
    specs = [cfg.layer(i) for i in range(cfg.n_layers)]
    keys: dict[str, Any] = {"rope.dimension_count": cfg.rotated}
    if cfg.rope_freq_factors is not None and cfg.rope_long_factors is None:  # linear, as rope_to_hf checks
        keys |= {"rope.scaling.type": rope_to_hf(cfg)["rope_type"], "rope.scaling.factor": cfg.rope_freq_factors[0]}
    if arch in ("gemma2", "gemma3"):
        local = [s for s in specs if s.window]
        llama_cpp_scale = (cfg.d_model // cfg.n_heads if cfg.n_layers == (62 if arch == "gemma3" else 46)
                           else cfg.head_dim) ** -0.5
        if cfg.attention_scale is not None and abs(cfg.attention_scale - llama_cpp_scale) > 1e-6:
            raise ValueError(f"llama.cpp's {arch} files state no attention scale: it takes {llama_cpp_scale:.4g}, "
                             f"this model {cfg.attention_scale:.4g} (query_pre_attn_scalar); export with --format hf")
        keys |= {"attention.sliding_window": local[0].window if local else 0,
                 "attention.sliding_window_pattern": [bool(s.window) for s in specs],
                 "rope.freq_base_swa": local[0].rope_base if local else cfg.rope_base}
        caps = {"attn_logit_softcapping": cfg.attention_softcap, "final_logit_softcapping": cfg.logit_softcap}
        keys |= {k: v for k, v in caps.items() if v is not None}
    elif arch == "phi3":
        keys |= {"attention.sliding_window": cfg.window or 0}
        if cfg.rope_long_factors is not None:
            keys |= {"rope.scaling.original_context_length": cfg.rope_original_context,
                     "rope.scaling.attn_factor": cfg.rope_scale}
    elif arch == "smollm3" and [s.rotary for s in specs] != [(i + 1) % 4 != 0 for i in range(cfg.n_layers)]:
        raise ValueError("llama.cpp's smollm3 files have no rotary positions in every fourth layer, and only there")
    elif arch in ("granite", "granitemoe"):
        keys |= {"embedding_scale": cfg.embedding_scale, "residual_scale": cfg.residual_scale,
                 "attention.scale": cfg.attention_scale or cfg.head_dim**-0.5, "logit_scale": 1 / cfg.logit_scale}
    return keys | (_moe_gguf_keys(cfg, arch) if cfg.n_experts is not None else {})


# Whether llama.cpp's graph of each architecture renormalises the k routing weights (it reads no key for it)
_NORMALISED = {"llama": True, "qwen3moe": True, "granitemoe": True, "qwen2moe": False, "olmoe": False}


def _moe_gguf_keys(cfg: GPTConfig, arch: str) -> dict[str, Any]:
    """A mixture of experts' keys, once llama.cpp's graph of ``arch`` is known to compute the same block."""
    if _NORMALISED.get(arch) != cfg.expert_normalize:
        raise ValueError(f"llama.cpp's {arch} files {'do not ' * (not _NORMALISED.get(arch, False))}renormalise the "
                         f"top-k routing weights; this model {'does' if cfg.expert_normalize else 'does not'}: export "
                         "with --format hf")
    if any(cfg.layer(i).dense for i in range(cfg.n_layers)):
        raise ValueError("llama.cpp's files have experts in every layer; this model has dense layers among them: "
                         "export with --format hf")
    if arch == "olmoe" and (cfg.n_kv_heads or cfg.n_heads) != cfg.n_heads:
        raise ValueError("llama.cpp's olmoe files normalise the keys over the model's width: no grouped K/V heads "
                         f"(n_kv_heads={cfg.n_kv_heads}, n_heads={cfg.n_heads}); export with --format hf")
    keys = {"expert_count": cfg.n_experts, "expert_used_count": cfg.expert_top_k}
    if arch in ("qwen2moe", "qwen3moe"):
        keys["expert_feed_forward_length"] = cfg.expert_d_ff or cfg.d_ff
    if cfg.shared_expert_d_ff is not None:
        keys["expert_shared_feed_forward_length"] = cfg.shared_expert_d_ff
    return keys


def gguf_tensors(cfg: GPTConfig) -> dict[str, Tensor]:
    """The rotary settings a GGUF file stores as tensors: Phi-3's LongRoPE sets."""
    if cfg.rope_long_factors is None:
        return {}
    return {"rope_factors_long.weight": torch.tensor(cfg.rope_long_factors, dtype=torch.float32),
            "rope_factors_short.weight": torch.tensor(cfg.rope_freq_factors, dtype=torch.float32)}


def norm_shift(gguf_architecture: str | None) -> float:
    """What a GGUF file of this architecture adds to each norm's stored weight: llama.cpp's converter writes Gemma's
    gains ``1 + w`` as they are applied, where Hugging Face stores ``w``."""
    return 1.0 if gguf_architecture in ("gemma2", "gemma3") else 0.0


def config_from_hf(hf_config: Mapping[str, Any]) -> GPTConfig:
    """A LLaMA-family ``config.json`` -> :class:`GPTConfig`: LLaMA's fields, then the family's own.

    Raises:
        ValueError: a missing size, a feature qkv does not implement (biases, a rotary scaling: named).
    """
    fam = family(hf_config.get("model_type"))
    for flag in ("attention_bias", "mlp_bias"):
        if hf_config.get(flag, False):
            raise ValueError(f"{flag}=true is not supported: a LLaMA-style qkv GPT has no biases (bias=False)")
    if hf_config.get("use_sliding_window", False):
        raise ValueError("use_sliding_window=true (a window on some layers only) is not supported")
    activation = hf_config.get("hidden_act") or "silu"
    if activation != "silu" and not fam.model_type.startswith("gemma"):
        raise ValueError(f"{fam.title}'s hidden_act must be 'silu' (qkv's swiglu), got {activation!r}")
    d_model, n_heads = hf_field(hf_config, "hidden_size"), hf_field(hf_config, "num_attention_heads")
    head_dim = hf_config.get("head_dim") or d_model // n_heads
    fields = dict(
        vocab_size=hf_field(hf_config, "vocab_size"), d_model=d_model, n_heads=n_heads,
        n_kv_heads=hf_field(hf_config, "num_key_value_heads", n_heads), head_dim=head_dim,
        n_layers=hf_field(hf_config, "num_hidden_layers"), d_ff=hf_field(hf_config, "intermediate_size"),
        max_seq_len=hf_field(hf_config, "max_position_embeddings", 2048), dropout=0.0, pad_id=None, norm_first=True,
        norm="rms", norm_eps=float(hf_field(hf_config, "rms_norm_eps", 1e-6)), activation="swiglu", bias=False,
        qkv_bias=False,
        positional="rope", rope_freq_factors=hf_config.get("rope_freq_factors"),
        tie_embeddings=bool(hf_field(hf_config, "tie_word_embeddings", False)),
    )
    fields |= {k: v for k, v in rotary_settings(hf_config, head_dim).items() if v is not None or k == "rotary_dim"}
    return GPTConfig(**fields | fam.settings(hf_config), family=fam.model_type)


def layer_tensors(cfg: GPTConfig, model_type: str, i: int = 0) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Layer ``i``'s tensors: Hugging Face name -> (qkv name, shape), fused tensors by their parts' LLaMA names (see
    :func:`unfused`), a mixture of experts' an expert at a time (:func:`qkv.interop.experts.expert_tensors`); every
    tensor is taken as it is, both ways (the rotate-half order of Q and K is qkv's too)."""
    d, d_ff = cfg.d_model, cfg.d_ff
    d_q, d_kv = cfg.n_heads * cfg.head_dim, (cfg.n_kv_heads or cfg.n_heads) * cfg.head_dim
    shapes = {"self_attn.q_proj": (d_q, d), "self_attn.k_proj": (d_kv, d), "self_attn.v_proj": (d_kv, d),
              "self_attn.out_proj": (d, d_q), "feed_forward.gate": (d_ff, d), "feed_forward.up": (d_ff, d),
              "feed_forward.down": (d, d_ff), "self_attn.q_norm": (d_q if cfg.qk_norm_whole else cfg.head_dim,),
              "self_attn.k_norm": (d_kv if cfg.qk_norm_whole else cfg.head_dim,)}
    names = family(model_type).names
    experts = cfg.n_experts is not None and not cfg.layer(i).dense
    layer = {f"{hf}.weight": (f"{ours}.weight", shapes.get(ours, (d,))) for hf, ours in names.items()
             if not (experts and hf.startswith("mlp."))}
    if experts:
        layer |= expert_tensors(cfg)
    if cfg.qkv_bias:  # Qwen2
        layer |= {f"self_attn.{p}.bias": (f"self_attn.{p}.bias", (n,)) for p, n in
                  (("q_proj", d_q), ("k_proj", d_kv), ("v_proj", d_kv))}
    return layer


def unfused(state_dict: Mapping[str, Tensor], cfg: GPTConfig, model_type: str) -> dict[str, Tensor]:
    """A family's stacked tensors (Phi-3's ``qkv_proj``, ``gate_up_proj``) cut into LLaMA's, by rows; the others as
    they are. A stacked tensor of the wrong size is left whole, for the strict converter to report."""
    fused = family(model_type).fused
    if not fused:
        return dict(state_dict)
    rows = _part_rows(cfg)
    out = {}
    for name, tensor in state_dict.items():
        stem, _, part = name.rpartition(".")
        whole = next((f for f in fused if stem.endswith(f)), None)
        sizes = [rows[p] for p in fused[whole]] if whole else None
        if whole is None or tensor.size(0) != sum(sizes):
            out[name] = tensor
            continue
        prefix = stem[: -len(whole)]
        for piece, chunk in zip(fused[whole], tensor.split(sizes), strict=True):
            out[f"{prefix}{piece}.{part}"] = chunk
    return out


def fused_back(state_dict: Mapping[str, Tensor], model_type: str) -> dict[str, Tensor]:
    """The inverse of :func:`unfused`: LLaMA's tensors stacked into the family's."""
    fused = family(model_type).fused
    out = dict(state_dict)
    for whole, pieces in fused.items():
        for name in [n for n in state_dict if n.endswith(f"{pieces[0]}.weight")]:
            prefix = name[: -len(f"{pieces[0]}.weight")]
            out[f"{prefix}{whole}.weight"] = torch.cat([out.pop(f"{prefix}{p}.weight") for p in pieces])
    return out


def _part_rows(cfg: GPTConfig) -> dict[str, int]:
    d_q, d_kv = cfg.n_heads * cfg.head_dim, (cfg.n_kv_heads or cfg.n_heads) * cfg.head_dim
    return {"self_attn.q_proj": d_q, "self_attn.k_proj": d_kv, "self_attn.v_proj": d_kv, "mlp.gate_proj": cfg.d_ff,
            "mlp.up_proj": cfg.d_ff}


__all__ = [
    "FAMILIES",
    "GGUF_FAMILIES",
    "MODEL_TYPES",
    "MULTIMODAL",
    "PERMUTED_ARCHITECTURES",
    "Family",
    "config_from_hf",
    "config_to_hf",
    "family",
    "family_of",
    "fused_back",
    "gguf_keys",
    "gguf_tensors",
    "layer_tensors",
    "norm_shift",
    "rope_to_hf",
    "text_model",
    "text_tensor",
    "unfused",
]
