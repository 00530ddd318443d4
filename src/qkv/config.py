"""One dataclass per model family, with validation and named presets.

A config is the whole recipe of a model: two models built from equal configs have the same shapes, and a
checkpoint is a config (JSON) plus weights. Every field is checked when the config is made, so a bad value
fails at once with a message naming the field, the expected and the actual value.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

NORMS = ("layer", "rms")
POSITIONALS = ("sinusoidal", "learned", "rope", "none")
GATED_ACTIVATIONS = ("swiglu", "geglu", "geglu_tanh")  # a gate and an up projection (qkv.nn.feedforward)
ACTIVATIONS = ("relu", "relu2", "gelu", "gelu_tanh", "quick_gelu", "silu", *GATED_ACTIVATIONS)
INITS = ("normal", "xavier")


def _check_int(name: str, value: Any, *, minimum: int = 1, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {name}={value}")


def _check_probability(name: str, value: float | None) -> None:
    """A dropout rate: in [0, 1) (None: not set)."""
    if value is not None and not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {name}={value}")


def check_scale(name: str, value: Any) -> None:
    """A scale (an epsilon, a rotary base, a standard deviation): a positive, finite number. NaN fails here, where
    it passes ``value <= 0``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


# A field's annotation -> the JSON values it takes (an int is a float too; a bool is not a number).
_JSON_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}
_TYPE_NAMES = {"int": "an int", "float": "a finite number", "bool": "true or false", "str": "a string"}


def _check_json_type(name: str, value: Any, annotation: str) -> None:
    """``value`` (from JSON) against a field annotated ``int``, ``float | None``, ...; other annotations (tuples,
    nested configs) are checked by the config itself."""
    parts = [part.strip() for part in annotation.split("|")]
    kinds = [part for part in parts if part != "None"]
    if len(kinds) != 1 or kinds[0] not in _JSON_TYPES or (value is None and "None" in parts):
        return
    kind = kinds[0]
    ok = isinstance(value, _JSON_TYPES[kind]) and (kind == "bool" or not isinstance(value, bool))
    if ok and kind == "float":
        ok = math.isfinite(value)
    if not ok:
        expected = _TYPE_NAMES[kind] + (" or null" if "None" in parts else "")
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")


class Config:
    """What every config shares: a JSON-able dict round trip (for checkpoints) and named presets."""

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        """Build from a dict (e.g. a checkpoint's JSON); unknown keys are an error, not silently dropped, and
        so is a value of another JSON type than its field's (``"dropout": "0.1"``, ``"bias": "yes"``)."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields {unknown}; expected some of {sorted(fields)}")
        for name, value in data.items():
            _check_json_type(name, value, str(fields[name].type))
        return cls(**data)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any):
        """A named configuration (see ``PRESETS``), with any field overridden."""
        if name not in cls.PRESETS:
            raise ValueError(f"unknown {cls.__name__} preset {name!r}; choose from {sorted(cls.PRESETS)}")
        return cls(**{**cls.PRESETS[name], **overrides})


@dataclass(kw_only=True)
class ModelConfig(Config):
    """Fields every family shares. See the subclasses for each family's defaults.

    Attributes:
        d_model: width of every token vector.
        n_heads: attention heads; must divide ``d_model`` unless ``head_dim`` is given.
        n_layers: number of layers (for the encoder-decoder: each side, unless overridden).
        d_ff: hidden width of the feed-forward network (default 4 * d_model).
        max_seq_len: longest sequence; a hard limit for absolute (sinusoidal, learned) positions.
        dropout: dropout on embeddings and residual branches (and, unless set apart below, on attention
            weights and feed-forward activations).
        attention_dropout: dropout on attention weights (None: ``dropout``).
        activation_dropout: dropout on the feed-forward hidden activations (None: ``dropout``). Setting it to 0
            is common (fairseq) and saves much time on a CPU, where drawing random masks is slow.
        pad_id: token id of padding; keys equal to it are masked out (None: the model masks nothing itself).
        norm_first: Pre-Norm (True) or Post-Norm (False) residual connections.
        norm: ``"layer"`` (LayerNorm) or ``"rms"`` (RMSNorm).
        norm_eps: the epsilon of the norms.
        norm_offset: RMSNorm gains kept as their offset from 1, applied as ``1 + weight`` (Gemma).
        activation: feed-forward activation: relu, relu2 (ReLU squared), gelu, gelu_tanh, quick_gelu, silu or
            swiglu.
        bias: biases in the linear layers (and LayerNorm shift).
        qkv_bias: biases in the query, key and value projections alone (None: as ``bias``; Qwen2 has them
            where nothing else has).
        positional: ``"sinusoidal"``, ``"learned"``, ``"rope"`` or ``"none"``.
        sinusoidal_layout: where the sinusoidal table puts each frequency's sine and cosine: ``"interleaved"``
            (side by side, as the paper writes it) or ``"halves"`` (every sine, then every cosine: tensor2tensor,
            fairseq and Marian).
        rope_base: the θ base of rotary embeddings.
        rope_freq_factors: the rotary frequencies divided by these, one per feature pair (``rotary_dim / 2``);
            Llama 3, YaRN and linear scaling slow the rotations this way for long contexts (None: unscaled).
        rotary_dim: the features of each head that rotary positions turn, the first ones (None: all ``head_dim``;
            Phi-3 and Phi-4-mini turn part of each head).
        rope_scale: rotary cos and sin times this (YaRN's and LongRoPE's attention factor; 1: none).
        rope_long_factors: LongRoPE's divisors for calls whose positions reach ``rope_original_context``; the
            shorter ones use ``rope_freq_factors`` (Phi-3).
        rope_original_context: the context a LongRoPE model was trained on.
        n_kv_heads: key/value heads for grouped-query attention (default: n_heads).
        head_dim: features per head (default ``d_model / n_heads``); Qwen3 sets it apart, so that its heads
            together are wider or narrower than the model.
        qk_norm: normalise each head's queries and keys (with ``norm``, over ``head_dim``) before the rotary
            positions, as Qwen3 does: the scores then cannot grow without bound.
        gated_attention: add the sigmoid output gate to attention.
        window: sliding-window size of self-attention (None: full attention).
        init: ``"normal"`` (N(0, init_std)) or ``"xavier"`` (Xavier-uniform linear layers).
        zero_init: the projections that write into the residual stream (attention output, FFN down) and an
            untied output layer start at zero: each block starts as the identity and the model predicts the
            uniform distribution, as the GPT-2 speedruns start.
        init_std: standard deviation of the normal initialisation.
    """

    d_model: int = 512
    n_heads: int = 8
    n_layers: int = 6
    d_ff: int | None = None
    max_seq_len: int = 512
    dropout: float = 0.1
    attention_dropout: float | None = None
    activation_dropout: float | None = None
    pad_id: int | None = 0
    norm_first: bool = True
    norm: str = "layer"
    norm_eps: float = 1e-5
    norm_offset: bool = False
    activation: str = "relu"
    bias: bool = True
    qkv_bias: bool | None = None
    positional: str = "sinusoidal"
    sinusoidal_layout: str = "interleaved"
    rope_base: float = 10000.0
    rope_freq_factors: list[float] | None = None
    rotary_dim: int | None = None
    rope_scale: float = 1.0
    rope_long_factors: list[float] | None = None
    rope_original_context: int | None = None
    n_kv_heads: int | None = None
    head_dim: int | None = None
    qk_norm: bool = False
    gated_attention: bool = False
    window: int | None = None
    init: str = "normal"
    init_std: float = 0.02
    zero_init: bool = False

    def __post_init__(self) -> None:
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        for name in ("d_model", "n_heads", "n_layers", "d_ff", "max_seq_len"):
            _check_int(name, getattr(self, name))
        _check_int("n_kv_heads", self.n_kv_heads, optional=True)
        _check_int("head_dim", self.head_dim, optional=True)
        _check_int("window", self.window, optional=True)
        _check_int("rotary_dim", self.rotary_dim, optional=True)
        _check_int("rope_original_context", self.rope_original_context, optional=True)
        _check_int("pad_id", self.pad_id, minimum=0, optional=True)
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
            self.head_dim = self.d_model // self.n_heads
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}")
        for name in ("dropout", "attention_dropout", "activation_dropout"):
            _check_probability(name, getattr(self, name))
        for name in ("norm_eps", "init_std", "rope_base", "rope_scale"):
            check_scale(name, getattr(self, name))
        _check_choice("norm", self.norm, NORMS)
        _check_choice("positional", self.positional, POSITIONALS)
        _check_choice("sinusoidal_layout", self.sinusoidal_layout, ("interleaved", "halves"))
        _check_choice("activation", self.activation, ACTIVATIONS)
        _check_choice("init", self.init, INITS)
        if self.positional == "rope" and self.head_dim % 2:
            raise ValueError(f"rope needs an even head dimension, got head_dim={self.head_dim}")
        if self.rotary_dim is not None and (self.rotary_dim % 2 or self.rotary_dim > self.head_dim):
            raise ValueError(f"rotary_dim turns an even number of a head's features, at most head_dim={self.head_dim};"
                             f" got rotary_dim={self.rotary_dim}")
        if self.norm_offset and self.norm != "rms":
            raise ValueError(f"norm_offset (gains of 1 + weight) is an RMSNorm's; norm is {self.norm!r}")
        if self.positional == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"sinusoidal positions need an even d_model, got {self.d_model}")
        self._check_freq_factors()

    @property
    def rotated(self) -> int:
        """The features of each head that rotary positions turn."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def _check_freq_factors(self) -> None:
        if (self.rope_long_factors is None) != (self.rope_original_context is None):
            raise ValueError("rope_long_factors and rope_original_context go together (LongRoPE), got "
                             f"{str(self.rope_long_factors)[:40]} and {self.rope_original_context}")
        for name in ("rope_freq_factors", "rope_long_factors"):
            factors = getattr(self, name)
            if factors is None:
                continue
            if self.positional != "rope":
                raise ValueError(f"{name} scale rotary positions; positional is {self.positional!r}")
            if not isinstance(factors, list) or len(factors) != self.rotated // 2 or not all(
                    isinstance(f, (int, float)) and 0 < f < float("inf") for f in factors):
                raise ValueError(f"{name} must be {self.rotated // 2} positive numbers (one per rotary feature "
                                 f"pair), got {str(factors)[:60]}")

    def table_rows(self, vocab_size: int) -> int:
        """Rows of an embedding or output table: ``vocab_size`` rounded up to ``vocab_multiple``.

        A matrix product whose sizes are multiples of 64 runs on whole tiles (GPT-2's 50,257 rows padded to
        50,304 train about a tenth faster on a GPU). The extra rows are never a token: no id points at them,
        and the model cuts its logits back to the vocabulary, so they are never chosen and never in a loss.
        """
        multiple = getattr(self, "vocab_multiple", 1)
        return -(-vocab_size // multiple) * multiple

    def _check_vocab(self, name: str, size: int) -> None:
        _check_int(name, size)
        if self.pad_id is not None and self.pad_id >= size:
            raise ValueError(f"pad_id={self.pad_id} is outside the vocabulary: {name}={size}")

@dataclass(kw_only=True)
class TransformerConfig(ModelConfig):
    """The encoder-decoder Transformer of "Attention Is All You Need".

    Attributes:
        src_vocab_size: source vocabulary size.
        tgt_vocab_size: target vocabulary size.
        n_encoder_layers, n_decoder_layers: override ``n_layers`` for one side.
        share_embeddings: one embedding matrix for source and target (needs one shared vocabulary).
        tie_output: the output projection reuses the target embedding matrix.
        output_bias: the output projection adds a bias to each token's logit (Marian's final_logits_bias).
        scale_embeddings: multiply token embeddings by √d_model, as the paper does.
        vocab_multiple: the embedding and output tables have a multiple of this many rows (see
            :meth:`ModelConfig.table_rows`); logits are cut back to ``tgt_vocab_size``.
    """

    src_vocab_size: int
    tgt_vocab_size: int
    n_encoder_layers: int | None = None
    n_decoder_layers: int | None = None
    share_embeddings: bool = False
    tie_output: bool = True
    output_bias: bool = False
    scale_embeddings: bool = True
    init: str = "xavier"
    vocab_multiple: int = 1

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        # Vaswani et al. 2017, Table 3 "base": Post-Norm, ReLU, sinusoidal.
        "base": dict(d_model=512, n_heads=8, n_layers=6, d_ff=2048, dropout=0.1, norm_first=False),
        "big": dict(d_model=1024, n_heads=16, n_layers=6, d_ff=4096, dropout=0.3, norm_first=False),
        # The 9M-parameter model often trained on Multi30k: 3+3 layers, d=256, 8 heads, FFN 512.
        "small": dict(d_model=256, n_heads=8, n_layers=3, d_ff=512, dropout=0.1),
        # qkv train's default: small with a feed-forward network twice as wide, and dropout on the residual stream
        # only (drawing masks inside attention and the feed-forward network costs a fifth of a step on a CPU).
        "multi30k": dict(d_model=256, n_heads=8, n_layers=3, d_ff=1024, dropout=0.1, attention_dropout=0.0,
                         activation_dropout=0.0),
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_vocab("src_vocab_size", self.src_vocab_size)
        self._check_vocab("tgt_vocab_size", self.tgt_vocab_size)
        _check_int("vocab_multiple", self.vocab_multiple)
        if self.n_encoder_layers is None:
            self.n_encoder_layers = self.n_layers
        if self.n_decoder_layers is None:
            self.n_decoder_layers = self.n_layers
        _check_int("n_encoder_layers", self.n_encoder_layers)
        _check_int("n_decoder_layers", self.n_decoder_layers)
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise ValueError(
                "share_embeddings needs one vocabulary, got "
                f"src_vocab_size={self.src_vocab_size} != tgt_vocab_size={self.tgt_vocab_size}"
            )


@dataclass(frozen=True, kw_only=True)
class LayerSpec:
    """What sets one decoder layer apart from the others of its model (Gemma's local and global layers, SmolLM3's
    layers without positions).

    Attributes:
        window: this layer's sliding window: a query sees the ``window`` latest positions, itself included (None:
            every earlier position).
        rotary: rotary positions in this layer (False: none at all, "NoPE": its attention sees order only through
            what earlier layers wrote).
        rope_base: this layer's θ base (None: the model's ``rope_base``).
        rope_scaled: the model's rotary scaling (``rope_freq_factors``, ``rope_scale``, LongRoPE) applies here.
        dense: in a mixture-of-experts model, this layer's feed-forward network is one dense network.
    """

    window: int | None = None
    rotary: bool = True
    rope_base: float | None = None
    rope_scaled: bool = True
    dense: bool = False

    def __post_init__(self) -> None:
        _check_int("window", self.window, optional=True)
        if not all(isinstance(flag, bool) for flag in (self.rotary, self.rope_scaled, self.dense)):
            raise TypeError(f"a layer's rotary, rope_scaled and dense are true or false, got {self.rotary!r}, "
                            f"{self.rope_scaled!r} and {self.dense!r}")
        if self.rope_base is not None:
            check_scale("rope_base", self.rope_base)

    @classmethod
    def of(cls, value: Any) -> LayerSpec:
        """A spec, from itself or from its dict (a checkpoint's JSON); unknown keys are an error."""
        if isinstance(value, LayerSpec):
            return value
        fields = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(value, dict) or set(value) - fields:
            raise ValueError(f"a layer is described by some of {sorted(fields)}, got {str(value)[:80]}")
        return cls(**value)


@dataclass(kw_only=True)
class GPTConfig(ModelConfig):
    """Decoder-only language model; GPT-2 style by default, LLaMA style with the switches, and the blocks that set
    today's families apart from LLaMA (each default is LLaMA's, and each family's table is in
    :mod:`qkv.interop.families`).

    Attributes:
        vocab_size: vocabulary size.
        tie_embeddings: the output projection reuses the token embedding matrix.
        vocab_multiple: the embedding and output tables have a multiple of this many rows (see
            :meth:`ModelConfig.table_rows`); logits are cut back to ``vocab_size``.
        layers: one :class:`LayerSpec` per layer (None: every layer alike, with the model's ``window``).
        branch_norm: normalise what each sub-layer adds to the stream, before the addition: with ``norm_first``,
            Gemma's sandwich ``x + N'(f(N(x)))``; without, OLMo 2's ``x + N'(f(x))``.
        qk_norm_whole: ``qk_norm`` over all heads' queries (and all keys) together, not head by head (OLMo 2).
        embedding_scale: token embeddings times this (Gemma: √d_model; Granite's ``embedding_multiplier``).
        residual_scale: each sub-layer's output times this before it is added (Granite's ``residual_multiplier``).
        attention_scale: the attention scores' factor (None: 1/√head_dim; Gemma's ``query_pre_attn_scalar^-½``,
            Granite's ``attention_multiplier``).
        attention_softcap: attention scores capped at ±this with tanh (Gemma 2).
        logit_scale: the logits times this (Granite divides by ``logits_scaling``).
        logit_softcap: the logits capped at ±this with tanh (Gemma 2).
        family: the Hugging Face ``model_type`` whose files the model was read from: the names its exports and
            adapters use (Phi-3's fused layers, say, where its blocks alone would read as LLaMA's); None: told by
            its blocks.
        n_experts: a mixture of this many experts in place of each feed-forward network (:mod:`qkv.nn.moe`;
            None: dense), each ``expert_d_ff`` wide (None: ``d_ff``), each token sent to ``expert_top_k`` of them,
            their weights renormalised to sum to 1 (``expert_normalize``); ``shared_expert_d_ff``: an expert every
            token goes through as well (None: none).
        balance_loss: the weight of the experts' balancing loss in training (Switch Transformer: 0.01).
    """

    vocab_size: int
    vocab_multiple: int = 1
    d_model: int = 768
    n_heads: int = 12
    n_layers: int = 12
    max_seq_len: int = 1024
    dropout: float = 0.0
    pad_id: int | None = None
    activation: str = "gelu_tanh"
    positional: str = "learned"
    tie_embeddings: bool = True
    layers: list[LayerSpec] | None = None
    branch_norm: bool = False
    qk_norm_whole: bool = False
    embedding_scale: float = 1.0
    residual_scale: float = 1.0
    attention_scale: float | None = None
    attention_softcap: float | None = None
    logit_scale: float = 1.0
    logit_softcap: float | None = None
    family: str | None = None
    n_experts: int | None = None
    expert_top_k: int = 2
    expert_d_ff: int | None = None
    expert_normalize: bool = True
    shared_expert_d_ff: int | None = None
    balance_loss: float = 0.01

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "gpt2": dict(vocab_size=50257, d_model=768, n_heads=12, n_layers=12, max_seq_len=1024),
        # LLaMA switches: RMSNorm, RoPE, SwiGLU, no biases (add n_kv_heads for grouped-query attention).
        "llama": dict(norm="rms", norm_eps=1e-5, positional="rope", activation="swiglu", bias=False),
        "smollm2-135m": dict(
            vocab_size=49152, d_model=576, n_heads=9, n_kv_heads=3, n_layers=30, d_ff=1536, max_seq_len=8192,
            norm="rms", norm_eps=1e-5, positional="rope", rope_base=100000.0, activation="swiglu", bias=False,
        ),
        # Small GPTs for training on a CPU (GPT-2 style unless the llama switches are added). The tiny one uses
        # the exact GELU, as nanoGPT does: on a CPU half the time of GPT-2's tanh form, forward and backward.
        "tiny": dict(d_model=128, n_heads=4, n_layers=4, max_seq_len=64, activation="gelu"),
        # Its dropout (none unless --dropout) is on the residual stream only: dropout on the attention weights
        # takes SDPA off its fused CPU kernel, about a fifth of the step's speed at this size.
        "mini": dict(d_model=256, n_heads=4, n_layers=4, max_seq_len=128, attention_dropout=0.0,
                     activation_dropout=0.0),
        # nanoGPT's character-level Shakespeare model.
        "shakespeare-char": dict(d_model=384, n_heads=6, n_layers=6, max_seq_len=256, dropout=0.2),
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_vocab("vocab_size", self.vocab_size)
        _check_int("vocab_multiple", self.vocab_multiple)
        for name in ("embedding_scale", "residual_scale", "logit_scale"):
            check_scale(name, getattr(self, name))
        for name in ("attention_scale", "attention_softcap", "logit_softcap"):
            if getattr(self, name) is not None:
                check_scale(name, getattr(self, name))
        self._check_experts()
        if self.qk_norm_whole and not self.qk_norm:
            raise ValueError("qk_norm_whole says how qk_norm normalises; it needs qk_norm=True")
        if self.layers is not None:
            self._check_layers()

    def _check_experts(self) -> None:
        for name in ("n_experts", "expert_d_ff", "shared_expert_d_ff"):
            _check_int(name, getattr(self, name), optional=True)
        _check_int("expert_top_k", self.expert_top_k)
        if self.n_experts is not None and self.expert_top_k > self.n_experts:
            raise ValueError(f"expert_top_k={self.expert_top_k} routes each token to more experts than there are "
                             f"(n_experts={self.n_experts})")
        if not 0 <= self.balance_loss < math.inf:
            raise ValueError(f"balance_loss must be a finite number >= 0, got {self.balance_loss}")

    def _check_layers(self) -> None:
        if not isinstance(self.layers, list | tuple) or len(self.layers) != self.n_layers:
            raise ValueError(f"layers must describe each of the n_layers={self.n_layers} layers, got "
                             f"{str(self.layers)[:80]}")
        self.layers = [LayerSpec.of(spec) for spec in self.layers]
        if self.window is not None:
            raise ValueError(f"with layers, each layer has its own window; leave window unset (got {self.window})")
        if self.positional != "rope" and any(not s.rotary or s.rope_base or not s.rope_scaled for s in self.layers):
            raise ValueError(f"layers set rotary positions apart; positional is {self.positional!r}, not 'rope'")

    def layer(self, i: int) -> LayerSpec:
        """Layer ``i`` as it is built: its own spec, or the model's window and rotary positions."""
        if self.layers is None:
            return LayerSpec(window=self.window, rotary=self.positional == "rope", rope_base=self.rope_base)
        spec = self.layers[i]
        return dataclasses.replace(spec, rotary=spec.rotary and self.positional == "rope",
                                   rope_base=spec.rope_base or self.rope_base)


@dataclass(kw_only=True)
class BERTConfig(ModelConfig):
    """Encoder-only model (BERT): learned positions, token types, Post-Norm, GELU.

    Attributes:
        vocab_size: vocabulary size.
        type_vocab_size: number of segment (token type) ids.
        pooler: add the pooler (dense + tanh on the first token).
    """

    vocab_size: int
    d_model: int = 768
    n_heads: int = 12
    n_layers: int = 12
    max_seq_len: int = 512
    norm_first: bool = False
    norm_eps: float = 1e-12
    activation: str = "gelu"
    positional: str = "learned"
    type_vocab_size: int = 2
    pooler: bool = True

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "bert-base": dict(vocab_size=30522, d_model=768, n_heads=12, n_layers=12, d_ff=3072),
        "minilm-l6": dict(vocab_size=30522, d_model=384, n_heads=12, n_layers=6, d_ff=1536),
        # BERT-Tiny and BERT-Mini of Turc et al. 2019 ("Well-Read Students Learn Better"), for training on a CPU.
        "tiny": dict(d_model=128, n_heads=2, n_layers=2, d_ff=512, max_seq_len=128),
        "mini": dict(d_model=256, n_heads=4, n_layers=4, d_ff=1024, max_seq_len=128),
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_vocab("vocab_size", self.vocab_size)
        _check_int("type_vocab_size", self.type_vocab_size)


VIT_POOLINGS = ("cls", "mean")
VIT_STEMS = ("patch", "conv")


@dataclass(kw_only=True)
class ImageConfig(ModelConfig):
    """What the vision families share: square images cut into square patches, and an optional class head.

    Attributes:
        image_size: side of the (square) images it is built for, in pixels; other sizes whose sides are
            multiples of ``patch_size`` work too.
        patch_size: side of a patch; an image is cut into ``(image_size / patch_size)²`` patches.
        channels: colour channels of the input (1 grey, 3 RGB).
        n_classes: classes of the classification head (None: no head).
    """

    image_size: int = 224
    patch_size: int = 16
    channels: int = 3
    n_classes: int | None = None
    dropout: float = 0.0
    pad_id: int | None = None
    activation: str = "gelu"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("image_size", "patch_size", "channels"):
            _check_int(name, getattr(self, name))
        _check_int("n_classes", self.n_classes, minimum=2, optional=True)
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size={self.image_size} must be divisible by patch_size={self.patch_size}")

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(kw_only=True)
class ViTConfig(ImageConfig):
    """Vision Transformer (Dosovitskiy et al. 2020): image patches as tokens, a Pre-Norm encoder (the image
    fields are :class:`ImageConfig`'s; other image sizes interpolate the position table).

    Attributes:
        pooling: the image vector the head reads: ``"cls"`` (the [CLS] token's state) or ``"mean"`` (the
            mean of the patch states).
        patch_bias: a bias in the patch projection (ViT has one, CLIP's image encoder not).
        embed_norm: a LayerNorm on the embeddings before the first layer (CLIP's ``pre_layrnorm``).
        stem: how pixels become patch vectors: ``"patch"`` (one linear map of each patch, the paper's) or
            ``"conv"`` (3×3 convolutions of stride 2, one per halving of the side, then a 1×1 one: see
            :class:`qkv.models.vit.ConvStem`); ``"conv"`` needs a patch size that is a power of two.
        patch_dropout: the fraction of each image's patch tokens left out in training, drawn afresh for every
            image (PatchDropout: :func:`qkv.models.vit.drop_patches`); evaluation reads them all, and so does
            training in wsd's cool-down.
    """

    pooling: str = "cls"
    stem: str = "patch"
    patch_dropout: float = 0.0
    patch_bias: bool = True
    embed_norm: bool = False
    d_model: int = 768
    n_heads: int = 12
    n_layers: int = 12
    positional: str = "learned"
    norm_eps: float = 1e-12

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "vit-base": dict(image_size=224, patch_size=16, d_model=768, n_heads=12, n_layers=12, d_ff=3072),
        # Small enough to train on Fashion-MNIST on a CPU: 49 patches of 4x4 pixels.
        "fashion": dict(image_size=28, patch_size=4, channels=1, d_model=128, n_heads=4, n_layers=6, d_ff=256,
                        norm_eps=1e-6),
        # A quarter of its parameters, three times the images a second: more epochs in a short budget.
        "fashion-small": dict(image_size=28, patch_size=4, channels=1, d_model=64, n_heads=4, n_layers=4, d_ff=256,
                              norm_eps=1e-6),
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_choice("pooling", self.pooling, VIT_POOLINGS)
        _check_choice("stem", self.stem, VIT_STEMS)
        _check_probability("patch_dropout", self.patch_dropout)
        power_of_two = self.patch_size & (self.patch_size - 1) == 0
        if self.stem == "conv" and (self.patch_size < 2 or not power_of_two or self.d_model % (self.patch_size // 2)):
            raise ValueError(f"stem='conv' halves the image with 3x3 convolutions down to the patch grid: patch_size "
                             f"must be a power of two (at least 2) and d_model a multiple of patch_size / 2, got "
                             f"patch_size={self.patch_size}, d_model={self.d_model}")
        if self.positional != "learned":
            raise ValueError(f"a ViT learns its positions: positional must be 'learned', got {self.positional!r}")
        self.max_seq_len = 1 + self.n_patches


@dataclass(kw_only=True)
class SwinConfig(ImageConfig):
    """Swin Transformer (Liu et al. 2021): attention inside shifted local windows, a hierarchy of stages.

    Stage ``i`` reads a grid ``2^i`` times coarser than the patch grid, with tokens ``d_model · 2^i`` wide,
    ``stage_heads[i]`` heads, ``depths[i]`` Pre-Norm blocks and an MLP ``mlp_ratio`` times its width. The
    shared fields ``n_heads``, ``n_layers`` and ``d_ff`` are derived (the first stage's heads and MLP width,
    the number of blocks); values passed for them are replaced. Every norm uses ``norm_eps``.

    The image fields are :class:`ImageConfig`'s (``patch_size`` 4 in the paper); Swin has no position table,
    so other image sizes use the same weights.

    Attributes:
        depths: blocks per stage; ``len(depths)`` stages.
        stage_heads: attention heads per stage; each must divide its stage's width.
        window_size: side M of the attention windows, in patches (7 in the paper).
        mlp_ratio: hidden width of every MLP as a multiple of its stage's width.
    """

    patch_size: int = 4
    depths: tuple[int, ...] = (2, 2, 6, 2)
    stage_heads: tuple[int, ...] = (3, 6, 12, 24)
    window_size: int = 7
    mlp_ratio: float = 4.0
    d_model: int = 96
    positional: str = "none"

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "swin-tiny": dict(image_size=224, patch_size=4, d_model=96, depths=(2, 2, 6, 2), stage_heads=(3, 6, 12, 24),
                          window_size=7),
        # Small enough to train on Fashion-MNIST on 2 CPU cores (0.3M parameters, 51 MFLOP a forward): 14x14
        # patches of 2x2 pixels in four 7x7 windows, then 7x7 tokens, 96 wide, in one window.
        "fashion": dict(image_size=28, patch_size=2, channels=1, d_model=48, depths=(2, 2), stage_heads=(3, 6),
                        window_size=7),
        # The same windows, two thirds the width (0.14M parameters, about half the FLOPs): on 2 cores it sees
        # 1.8 times the images in a time budget, and ends higher (91.5% against 90.1% in 30 minutes).
        "fashion-small": dict(image_size=28, patch_size=2, channels=1, d_model=32, depths=(2, 2), stage_heads=(2, 4),
                              window_size=7),
    }

    def __post_init__(self) -> None:
        self.depths, self.stage_heads = tuple(self.depths), tuple(self.stage_heads)  # JSON gives lists
        if not self.depths or len(self.stage_heads) != len(self.depths):
            raise ValueError(f"depths and stage_heads need one entry per stage, got depths={self.depths} and "
                             f"stage_heads={self.stage_heads}")
        for i, (depth, heads) in enumerate(zip(self.depths, self.stage_heads, strict=True)):
            _check_int(f"depths[{i}]", depth)
            _check_int(f"stage_heads[{i}]", heads)
        _check_int("d_model", self.d_model)
        if not self.mlp_ratio > 0:
            raise ValueError(f"mlp_ratio must be positive, got mlp_ratio={self.mlp_ratio}")
        self.n_heads, self.n_layers, self.d_ff = self.stage_heads[0], sum(self.depths), self.ffn_widths[0]
        super().__post_init__()
        _check_int("window_size", self.window_size)
        for i, (width, heads) in enumerate(zip(self.stage_widths, self.stage_heads, strict=True)):
            if width % heads:
                raise ValueError(f"stage {i} is d_model·2^{i}={width} wide, which must be divisible by "
                                 f"stage_heads[{i}]={heads}")
        if self.positional != "none":
            raise ValueError("Swin has no absolute positions (a relative position bias inside each window): "
                             f"positional must be 'none', got {self.positional!r}")
        if not self.norm_first:
            raise ValueError("Swin's blocks are Pre-Norm: norm_first must be True")
        if self.n_kv_heads is not None or self.window is not None or self.gated_attention or \
                self.head_dim != self.d_model // self.n_heads:
            raise ValueError("Swin's window attention has no n_kv_heads, head_dim, sliding window or gated_attention; "
                             "leave them unset (the window is window_size)")
        self.max_seq_len = self.n_patches

    @property
    def stage_widths(self) -> tuple[int, ...]:
        """Token width of each stage: ``d_model``, doubled by every patch merging."""
        return tuple(self.d_model * 2**i for i in range(len(self.depths)))

    @property
    def ffn_widths(self) -> tuple[int, ...]:
        """Hidden width of each stage's MLP: ``int(mlp_ratio · width)``."""
        return tuple(int(self.mlp_ratio * width) for width in self.stage_widths)


@dataclass(kw_only=True)
class CLIPTextConfig(ModelConfig):
    """CLIP's text encoder: GPT-2's causal Pre-Norm stack read once; the end-of-text token's state is the
    text's vector.

    Attributes:
        vocab_size: vocabulary size.
        eos_id: the end-of-text token; the state at its first occurrence in each row is pooled. None: the state
            at the highest id of each row, OpenAI's original rule (their end-of-text token is the vocabulary's
            last), which Hugging Face keeps for configs with ``eos_token_id=2``.
    """

    vocab_size: int
    eos_id: int | None
    d_model: int = 512
    n_heads: int = 8
    n_layers: int = 12
    max_seq_len: int = 77
    dropout: float = 0.0
    pad_id: int | None = None
    activation: str = "quick_gelu"
    positional: str = "learned"
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_vocab("vocab_size", self.vocab_size)
        _check_int("eos_id", self.eos_id, minimum=0, optional=True)
        if self.eos_id is not None and self.eos_id >= self.vocab_size:
            raise ValueError(f"eos_id={self.eos_id} is outside the vocabulary: vocab_size={self.vocab_size}")
        if self.pad_id is not None and self.pad_id == self.eos_id:
            raise ValueError(f"pad_id={self.pad_id} equals eos_id: masking the padding would hide the end-of-text "
                             "token; set pad_id=None and pass an attention_mask")


# What makes a ViT CLIP's image encoder: a LayerNorm before the first layer, no patch bias, QuickGELU.
_CLIP_VISION = dict(embed_norm=True, patch_bias=False, activation="quick_gelu", norm_eps=1e-5)


@dataclass(kw_only=True)
class CLIPConfig(Config):
    """CLIP (Radford et al. 2021): an image encoder and a text encoder projected into one embedding space.

    Attributes:
        vision: the image encoder, a ViT with CLIP's switches (``embed_norm=True``, ``patch_bias=False``,
            ``activation="quick_gelu"``, ``norm_eps=1e-5``); a dict (from JSON) is read as a :class:`ViTConfig`.
        text: the text encoder; a dict is read as a :class:`CLIPTextConfig`.
        projection_dim: width of the shared embedding space.
        logit_scale_init: log(1/τ) at the start, ln(1/0.07) = 2.6592 as in the paper.
    """

    vision: ViTConfig
    text: CLIPTextConfig
    projection_dim: int = 512
    logit_scale_init: float = 2.6592

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        # OpenAI's ViT-B/32 (the text sizes of every CLIP up to ViT-B; their BPE has 49,408 tokens, EOT last).
        "vit-b-32": dict(
            vision=dict(image_size=224, patch_size=32, d_model=768, n_heads=12, n_layers=12, **_CLIP_VISION),
            text=dict(vocab_size=49408, eos_id=49407, d_model=512, n_heads=8, n_layers=12, max_seq_len=77),
            projection_dim=512,
        ),
        # Fashion-MNIST (28x28 grey, 49 patches) with short captions on 2 CPU cores: 0.3M parameters, 60 to 300
        # image-caption pairs/s at batch 256 (busy to idle cores), so 15 minutes are one to four epochs. The
        # tokenizer gives the vocabulary: CLIPConfig.from_preset("fashion", text=dict(vocab_size=..., eos_id=...)).
        "fashion": dict(
            vision=dict(image_size=28, patch_size=4, channels=1, d_model=64, n_heads=4, n_layers=4, **_CLIP_VISION),
            text=dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=16),
            projection_dim=64,
        ),
    }

    def __post_init__(self) -> None:
        if isinstance(self.vision, dict):
            self.vision = ViTConfig.from_dict(self.vision)
        if isinstance(self.text, dict):
            self.text = CLIPTextConfig.from_dict(self.text)
        for name, kind in (("vision", ViTConfig), ("text", CLIPTextConfig)):
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"{name} must be a {kind.__name__} (or a dict of one), got {type(getattr(self, name))}")
        _check_int("projection_dim", self.projection_dim)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any):
        """A named configuration; a dict given for ``vision`` or ``text`` is merged into the preset's one, so
        ``from_preset("fashion", text=dict(vocab_size=40, eos_id=1))`` keeps the preset's text sizes."""
        if name not in cls.PRESETS:
            raise ValueError(f"unknown {cls.__name__} preset {name!r}; choose from {sorted(cls.PRESETS)}")
        preset = cls.PRESETS[name]
        merged = {key: {**preset[key], **value} if key in ("vision", "text") and isinstance(value, dict) else value
                  for key, value in overrides.items()}
        return cls(**{**preset, **merged})


CLASSIFIER_POOLINGS = ("pooler", "mean")


@dataclass(kw_only=True)
class BERTClassifierConfig(BERTConfig):
    """A BERT with a classification layer on its sentence vector.

    Attributes:
        n_labels: number of classes.
        pooling: the sentence vector: ``"pooler"`` (BERT's pooled output, tanh(W h_[CLS] + b), as
            ``BertForSequenceClassification``) or ``"mean"`` (the mean of the token states, as sentence
            encoders pool).
    """

    n_labels: int
    pooling: str = "pooler"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_int("n_labels", self.n_labels, minimum=2)
        _check_choice("pooling", self.pooling, CLASSIFIER_POOLINGS)
        if self.pooling == "pooler" and not self.pooler:
            raise ValueError("pooling='pooler' needs pooler=True (or use pooling='mean')")


RNN_ATTENTIONS = ("none", "dot", "additive")


@dataclass(kw_only=True)
class RNNConfig(Config):
    """The LSTM encoder-decoder that came before the Transformer (:mod:`qkv.models.rnn`).

    The encoder and the decoder have ``n_layers`` LSTM layers each, so that the encoder's final state of every
    layer can start the decoder's layer of the same depth. A bidirectional encoder runs ``hidden_size // 2``
    cells each way, so its outputs, the two directions side by side, are ``hidden_size`` wide like the decoder
    state they are compared with.

    Attributes:
        src_vocab_size: source vocabulary size.
        tgt_vocab_size: target vocabulary size.
        embedding_dim: width of the token embeddings (and of the decoder's pre-output layer, so the output
            projection can share the target embedding matrix).
        hidden_size: width of the decoder's LSTM state and of every encoder output.
        n_layers: LSTM layers of the encoder and of the decoder.
        bidirectional: the encoder reads the sentence both ways; its final states are bridged to the
            (one-directional) decoder.
        attention: how the decoder sees the source: ``"none"`` (one context vector, the encoder's final state,
            fed at every step: the bottleneck), ``"dot"`` (scaled dot-product attention, no parameters) or
            ``"additive"`` (Bahdanau's vᵀ tanh(W_q s + W_k h)).
        attention_dim: width of the additive attention's tanh layer (default ``hidden_size``).
        dropout: dropout on embeddings, between LSTM layers and on the pre-output layer.
        pad_id: token id of padding; the encoder stops at it and attention gives it no weight (None: no
            padding).
        share_embeddings: one embedding matrix for source and target (needs one shared vocabulary).
        tie_output: the output projection reuses the target embedding matrix.
        init_range: every parameter starts uniform in [-init_range, init_range] (Sutskever et al. 2014 used
            0.08, Luong et al. 2015 0.1).
    """

    src_vocab_size: int
    tgt_vocab_size: int
    embedding_dim: int = 256
    hidden_size: int = 512
    n_layers: int = 2
    bidirectional: bool = True
    attention: str = "additive"
    attention_dim: int | None = None
    dropout: float = 0.3
    pad_id: int | None = 0
    share_embeddings: bool = False
    tie_output: bool = True
    init_range: float = 0.1

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        # Sizes for training on a CPU in under an hour (Multi30k): one or two layers, embeddings 256, state 512.
        "small": dict(embedding_dim=256, hidden_size=512, n_layers=1, dropout=0.3),
        "base": dict(embedding_dim=256, hidden_size=512, n_layers=2, dropout=0.3),
        # The scale of Sutskever et al. 2014 and Luong et al. 2015: 4 layers of 1000 cells, 1000-d embeddings.
        "big": dict(embedding_dim=1000, hidden_size=1000, n_layers=4, dropout=0.2),
    }

    def __post_init__(self) -> None:
        if self.attention_dim is None:
            self.attention_dim = self.hidden_size
        for name in ("embedding_dim", "hidden_size", "n_layers", "attention_dim"):
            _check_int(name, getattr(self, name))
        _check_int("pad_id", self.pad_id, minimum=0, optional=True)
        for name in ("src_vocab_size", "tgt_vocab_size"):
            _check_int(name, getattr(self, name))
            if self.pad_id is not None and self.pad_id >= getattr(self, name):
                raise ValueError(f"pad_id={self.pad_id} is outside the vocabulary: {name}={getattr(self, name)}")
        _check_choice("attention", self.attention, RNN_ATTENTIONS)
        if self.bidirectional and self.hidden_size % 2:
            raise ValueError(f"a bidirectional encoder splits hidden_size in two halves; got odd "
                             f"hidden_size={self.hidden_size}")
        _check_probability("dropout", self.dropout)
        if not self.init_range > 0:
            raise ValueError(f"init_range must be positive, got init_range={self.init_range}")
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise ValueError(
                "share_embeddings needs one vocabulary, got "
                f"src_vocab_size={self.src_vocab_size} != tgt_vocab_size={self.tgt_vocab_size}"
            )


__all__ = ["BERTClassifierConfig", "BERTConfig", "Config", "GPTConfig", "ModelConfig", "RNNConfig",
           "TransformerConfig", "check_scale"]
