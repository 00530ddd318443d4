"""What every model family shares: building blocks from a config, input checks, initialisation, counts."""

from __future__ import annotations

import contextlib
import math
from typing import Any, ClassVar, NamedTuple, TypeAlias

import torch
from torch import Tensor, nn

from ..config import ModelConfig
from ..nn import (
    DecoderLayer,
    EncoderLayer,
    FeedForward,
    LayerNorm,
    LearnedPositionalEmbedding,
    MultiHeadAttention,
    RMSNorm,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    build_norm,
)

# One (B, H, T_query, T_key) tensor per layer; by attention kind for an encoder-decoder (see WithAttention).
AttentionMaps: TypeAlias = list[Tensor] | dict[str, list[Tensor]]


class WithAttention(NamedTuple):
    """A model's output together with the attention weights that made it: what ``return_attention=True`` gives.

    A tuple, so ``logits, attention = model(..., return_attention=True)`` unpacks it; the names say which is
    which. ``attention`` holds one ``(B, H, T_query, T_key)`` tensor per layer, each row a distribution over the
    keys (padded keys get zero weight): a list for a single stack (GPT, BERT, the Transformer's encoder), or a
    dict of lists by attention kind (``"encoder"``, ``"decoder_self"``, ``"decoder_cross"``) for an
    encoder-decoder. Each model's docstring says exactly what it returns.
    """

    output: Tensor  # logits, or hidden states for BERT
    attention: AttentionMaps


def absolute_positions(cfg: ModelConfig) -> nn.Module | None:
    """The position table added to embeddings, or None when positions are rotary (or absent)."""
    if cfg.positional == "sinusoidal":
        return SinusoidalPositionalEncoding(cfg.d_model, cfg.max_seq_len, halves=cfg.sinusoidal_layout == "halves")
    if cfg.positional == "learned":
        return LearnedPositionalEmbedding(cfg.d_model, cfg.max_seq_len)
    return None


def rotary(cfg: ModelConfig, *, base: float | None = None, scaled: bool = True) -> RotaryEmbedding | None:
    """The config's rotary embedding (None without one); ``base`` for another θ base than the config's, and
    ``scaled=False`` without its scaling (the local layers of Gemma 3)."""
    if cfg.positional != "rope":
        return None
    scaling = dict(freq_factors=cfg.rope_freq_factors, scale=cfg.rope_scale, long_factors=cfg.rope_long_factors,
                   original_context=cfg.rope_original_context) if scaled else {}
    return RotaryEmbedding(cfg.head_dim, base=base or cfg.rope_base, rotary_dim=cfg.rotary_dim, **scaling)


def norm(cfg: ModelConfig, width: int | None = None) -> nn.Module:
    """The config's norm over ``width`` features (default ``d_model``)."""
    return build_norm(cfg.norm, width or cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias, unit_offset=cfg.norm_offset)


def head_norm(cfg: ModelConfig) -> nn.Module:
    """The norm of one head's queries or keys (``qk_norm``): the config's kind, over ``head_dim`` features."""
    return norm(cfg, cfg.head_dim)


def final_norm(cfg: ModelConfig) -> nn.Module | None:
    """The norm after the last layer: Pre-Norm stacks need it; Post-Norm ones already end normalised."""
    return norm(cfg) if cfg.norm_first else None


def attention(cfg: ModelConfig, *, causal: bool, rope: RotaryEmbedding | None = None, cross: bool = False,
              **options: Any):
    """Self-attention (with the config's window, grouping, gate and rotary) or plain cross-attention; both with
    the config's head width and norms on queries and keys. ``options``: :class:`~qkv.nn.MultiHeadAttention`'s
    arguments set otherwise (a decoder layer's own window, the scores' scale, ...)."""
    head_norms = {"q_norm": head_norm(cfg), "k_norm": head_norm(cfg)} if cfg.qk_norm else {}
    return MultiHeadAttention(cfg.d_model, cfg.n_heads, **{
        "n_kv_heads": None if cross else cfg.n_kv_heads,
        "dropout": cfg.dropout if cfg.attention_dropout is None else cfg.attention_dropout,
        "bias": cfg.bias,
        "qkv_bias": None if cross else cfg.qkv_bias,
        "causal": causal,
        "window": None if cross else cfg.window,
        "gated": cfg.gated_attention,
        "rotary": None if cross else rope,
        "head_dim": cfg.head_dim,
        **head_norms,
        **options,
    })


def feed_forward(cfg: ModelConfig) -> FeedForward:
    dropout = cfg.dropout if cfg.activation_dropout is None else cfg.activation_dropout
    return FeedForward(cfg.d_model, cfg.d_ff, activation=cfg.activation, dropout=dropout, bias=cfg.bias)


def encoder_layer(cfg: ModelConfig, rope: RotaryEmbedding | None) -> EncoderLayer:
    return EncoderLayer(
        self_attn=attention(cfg, causal=False, rope=rope),
        feed_forward=feed_forward(cfg),
        self_attn_norm=norm(cfg),
        ffn_norm=norm(cfg),
        dropout=cfg.dropout,
        norm_first=cfg.norm_first,
    )


def decoder_layer(cfg: ModelConfig, rope: RotaryEmbedding | None, *, cross: bool) -> DecoderLayer:
    return DecoderLayer(
        self_attn=attention(cfg, causal=True, rope=rope),
        cross_attn=attention(cfg, causal=False, cross=True) if cross else None,
        feed_forward=feed_forward(cfg),
        self_attn_norm=norm(cfg),
        cross_attn_norm=norm(cfg) if cross else None,
        ffn_norm=norm(cfg),
        dropout=cfg.dropout,
        norm_first=cfg.norm_first,
    )


def check_ids(ids: Tensor, vocab_size: int, name: str = "ids") -> None:
    """Token ids must be an integer ``(B, T)`` tensor with every id in ``[0, vocab_size)``.

    The range is checked only for ids on the CPU, the public boundary where a person's ids come in, and not
    while ``torch.compile`` traces: reading a value back from a GPU makes the host wait for it on every forward
    (and breaks a compiled graph). Ids made on a device come from qkv's own tokenizers and data, which only
    write ids of their vocabulary.
    """
    if not isinstance(ids, Tensor):
        raise TypeError(f"{name} must be a torch.LongTensor of shape (B, T), got {type(ids).__name__}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must hold integer token ids (torch.long), got dtype {ids.dtype}")
    if ids.dim() != 2:
        raise ValueError(f"{name} must have shape (B, T), got {ids.dim()} dimensions {tuple(ids.shape)}")
    if ids.numel() and ids.device.type == "cpu" and not torch.compiler.is_compiling():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{name} holds token id {bad}, outside the vocabulary [0, {vocab_size})")


def check_mask(mask: Tensor, like: Tensor, name: str) -> Tensor:
    """A ``(B, T)`` padding mask (bool, or 0/1 integers as Hugging Face writes them) -> bool."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a tensor of shape {tuple(like.shape)}, got {type(mask).__name__}")
    if mask.shape != like.shape:
        raise ValueError(f"{name} must have shape {tuple(like.shape)}, got {tuple(mask.shape)}")
    return mask.bool()


def check_batch(a: Tensor, b: Tensor, a_name: str, b_name: str) -> None:
    if a.size(0) != b.size(0):
        raise ValueError(f"batch sizes differ: {a_name} has {a.size(0)} rows, {b_name} has {b.size(0)}")


@contextlib.contextmanager
def skip_init():
    """Build models without random initialisation, for when a checkpoint overwrites every weight next.

    Drawing 135M random numbers takes seconds on a CPU only to be thrown away. Inside this block the
    ``torch.nn.init`` functions (which ``nn.Linear``, ``nn.Embedding``, the norms and :func:`init_weights` all
    use) leave tensors as they are: uninitialised memory. Load the weights with ``strict=True`` afterwards, so
    that a weight the checkpoint lacks is an error, not garbage. Buffers computed from the config (position
    tables, RoPE frequencies) are built as usual.
    """
    names = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "xavier_uniform_",
             "xavier_normal_", "kaiming_uniform_", "kaiming_normal_")
    saved = {name: getattr(nn.init, name) for name in names}
    try:
        for name in names:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def init_weights(model: nn.Module, cfg: ModelConfig, *, residual_layers: int | None = None) -> None:
    """Initialise a freshly built model.

    ``normal``: every linear and embedding weight from N(0, init_std), biases zero (GPT-2, BERT). With
    ``residual_layers`` the projections that write into the residual stream (attention output, FFN down)
    are scaled by 1/√(2·layers) so the stream's variance does not grow with depth (GPT-2).

    ``xavier``: Xavier-uniform linear weights, as ``nn.Transformer`` does, and embeddings from
    N(0, d_model^-0.5), so that embeddings scaled by √d_model start with unit variance (the paper).

    Norms start as the identity (γ = 1, β = 0). With ``cfg.zero_init`` the residual-writing projections and an
    untied output layer (``model.output_layer``) start at zero.
    """
    writes_residual = {id(m.out_proj) for m in model.modules() if isinstance(m, MultiHeadAttention)} | \
        {id(m.down) for m in model.modules() if isinstance(m, FeedForward)}
    for module in model.modules():
        if isinstance(module, nn.Linear):
            if cfg.init == "xavier":
                nn.init.xavier_uniform_(module.weight)
            else:
                std = cfg.init_std
                if residual_layers and id(module) in writes_residual:
                    std /= math.sqrt(2 * residual_layers)
                nn.init.normal_(module.weight, 0.0, std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (LayerNorm, RMSNorm)):  # gains of 1 (stored as 0 where they are 1 + weight)
            (nn.init.zeros_ if getattr(module, "unit_offset", False) else nn.init.ones_)(module.weight)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
    # Embeddings last: a tied output projection shares their matrix and must keep their initialisation.
    embeddings = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            std = cfg.d_model**-0.5 if cfg.init == "xavier" else cfg.init_std
            nn.init.normal_(module.weight, 0.0, std)
            embeddings.add(id(module.weight))
    if getattr(cfg, "zero_init", False):
        output = getattr(model, getattr(model, "output_layer", ""), None)
        for module in model.modules():
            untied_output = module is output and id(module.weight) not in embeddings
            if id(module) in writes_residual or untied_output:
                nn.init.zeros_(module.weight)

def classifier_head(width: int, n_classes: int, init_std: float) -> nn.Linear:
    """A linear layer from a pooled vector to class scores, starting from small random weights: with a zero head
    (a common choice) the encoder would get no gradient at first and learn several times slower."""
    head = nn.Linear(width, n_classes)
    nn.init.normal_(head.weight, std=init_std)
    nn.init.zeros_(head.bias)
    return head


class Model(nn.Module):
    """A qkv model: an ``nn.Module`` that counts its own parameters (:func:`num_parameters`) and reads weights
    saved under the names its layers had before (:attr:`renamed_weights`)."""

    renamed_weights: ClassVar[dict[str, str]] = {}  # {name in older checkpoints: name now}, both from the model's root

    def __init__(self) -> None:
        super().__init__()
        self._register_load_state_dict_pre_hook(self._rename_old_weights)

    def _rename_old_weights(self, state_dict, prefix, *_args) -> None:
        for old, new in self.renamed_weights.items():
            if prefix + old in state_dict and prefix + new not in state_dict:
                state_dict[prefix + new] = state_dict.pop(prefix + old)

    def current_name(self, name: str) -> str:
        """A weight's name in this version of the model, given its name in any checkpoint."""
        return self.renamed_weights.get(name, name)

    def num_parameters(self, *, exclude_embeddings: bool = False) -> int:
        return num_parameters(self, exclude_embeddings=exclude_embeddings)


def compile_blocks(model: nn.Module, **options: Any) -> nn.Module:
    """``torch.compile`` each encoder and decoder layer of ``model`` on its own (in place; returns the model), with
    ``options`` as :meth:`nn.Module.compile` takes them. The layers of a stack run the same code, so one graph
    serves them all: compiled once, in about a minute on a CPU, where the whole model's graph takes many."""
    for module in model.modules():
        if isinstance(module, EncoderLayer | DecoderLayer):
            module.compile(**options)
    return model


def num_parameters(model: nn.Module, *, exclude_embeddings: bool = False) -> int:
    """Trainable parameters, each shared tensor counted once; optionally without the embedding tables
    (token, position, token-type), the count scaling laws use."""
    skip = set()
    if exclude_embeddings:
        skip = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)



class ImageClassifier(Model):
    """An image backbone (:class:`~qkv.models.vit.ViT`, :class:`~qkv.models.swin.Swin`) with a linear head on its
    pooled vector, split as timm splits its models: :meth:`forward_features` (the backbone's token states),
    :meth:`pool` (one vector an image, as the backbone pools), :meth:`forward_head` (class scores).

    Shape:
        pixels ``(B, C, H, W)`` -> logits ``(B, n_classes)``.
    """

    backbone_name: ClassVar[str]  # the backbone's name in the state dict (``vit``, ``swin``: Hugging Face's)

    def __init__(self, config: Any, backbone: nn.Module, width: int) -> None:
        super().__init__()
        if config.n_classes is None:
            raise ValueError(f"a {type(self).__name__} needs n_classes in its {type(config).__name__}")
        self.config = config
        setattr(self, self.backbone_name, backbone)
        self.head = classifier_head(width, config.n_classes, config.init_std)

    @property
    def backbone(self) -> nn.Module:
        return getattr(self, self.backbone_name)

    def forward_features(self, pixels: Tensor, *, return_attention: bool = False) -> Tensor | WithAttention:
        return self.backbone(pixels, return_attention=return_attention)

    def pool(self, hidden: Tensor) -> Tensor:
        return self.backbone.pool(hidden)  # (B, N, D) -> (B, D)

    def forward_head(self, pooled: Tensor) -> Tensor:
        return self.head(pooled)  # (B, D) -> (B, n_classes)

    def forward(self, pixels: Tensor, *, return_attention: bool = False) -> Tensor | WithAttention:
        out = self.forward_features(pixels, return_attention=return_attention)
        logits = self.forward_head(self.pool(out.output if return_attention else out))
        return WithAttention(logits, out.attention) if return_attention else logits
