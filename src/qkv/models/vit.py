"""Vision Transformer (ViT): an image read as a sequence of patches by the Transformer's encoder.

    pixels (B, C, H, W) ─ cut into P×P patches ─ linear ─ [CLS] + patches + positions ─ N × Pre-Norm layer ─ norm
                                                                  pool ([CLS] or mean) ─ linear -> a score per class

Nothing in the encoder knows it reads an image: a 28×28 picture cut into 4×4 patches is a "sentence" of 49
"words", each word the 16 pixels of its patch projected to ``d_model``. The only image-specific parts are the
patch embedding and the position table, which is a grid: a model trained at one size reads another by
interpolating the grid (bicubic), as ViT does when it fine-tunes at a higher resolution.

Because the encoder reads a set of tokens, each carrying its position, it can also read *part* of an image:
training on a random half of each image's patches (PatchDropout, Liu et al. 2022: ``patch_dropout=0.5``) costs
about half the compute per image, so a time budget sees twice the images, and each image is a different view every
epoch. Evaluation reads every patch, and so does training once the rate starts its final fall (wsd's cool-down,
:meth:`qkv.tasks.image_classify.ImageClassifyTask.cool_down`): the model ends fitted to whole images.

    ViTClassifier:  ViT ─ pool ─ linear -> logits ``(B, n_classes)``
"""

from __future__ import annotations

import itertools
import math
from typing import Literal, overload

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ViTConfig
from ..nn import Encoder, LayerNorm
from . import common
from .common import WithAttention


class PatchEmbedding(nn.Module):
    """Cut an image into non-overlapping ``P×P`` patches and project each to ``d_model``.

    Written as a convolution with kernel and stride ``P``: each output position sees exactly one patch and
    multiplies its ``C·P·P`` pixels by the same ``(d_model, C·P·P)`` matrix. That is the same as unfolding
    the patches into vectors (``F.unfold``, one column per patch, channels then rows then columns) and
    applying a linear layer whose weight is the kernel flattened: :meth:`as_linear` does that, and the tests
    check that the two agree. The convolution is the faster of the two.

    Shape:
        ``(B, C, H, W)`` -> ``(B, (H/P)·(W/P), d_model)``, patches in row-major order.
    """

    def __init__(self, channels: int, patch_size: int, d_model: int, *, bias: bool = True) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(channels, d_model, kernel_size=patch_size, stride=patch_size, bias=bias)

    def forward(self, pixels: Tensor) -> Tensor:
        return self.proj(pixels).flatten(2).transpose(1, 2)  # (B, D, H/P, W/P) -> (B, N, D)

    def as_linear(self, pixels: Tensor) -> Tensor:
        """The same embedding written as unfold + linear (the textbook form; slower)."""
        patches = F.unfold(pixels, kernel_size=self.patch_size, stride=self.patch_size)  # (B, C·P·P, N)
        weight = self.proj.weight.flatten(1)  # (D, C·P·P)
        return F.linear(patches.transpose(1, 2), weight, self.proj.bias)  # (B, N, D)


class ConvStem(nn.Module):
    """Patch vectors from a few convolutions instead of one linear map per patch (``stem="conv"``; Xiao et al.
    2021, "Early Convolutions Help Transformers See Better").

    A patch embedding sees each ``P×P`` patch alone, through one matrix: an edge that crosses a patch's border
    is split between two unrelated vectors, and the only non-linearity is the first attention layer's. The stem
    instead halves the image ``log2(P)`` times with 3×3 convolutions of stride 2 (padding 1), each followed by
    a GELU, the widths doubling up to ``d_model`` (for ``P = 4``: ``d_model/2``, then ``d_model``), and ends with
    a 1×1 convolution: the same ``(H/P)·(W/P)`` tokens, each built from overlapping neighbourhoods of pixels. On
    Fashion-MNIST a small ViT learns faster from it at first, for about a fifth more time per image, but ends no
    better after 30 minutes of training (docs/vision.md).

    Shape:
        ``(B, C, H, W)`` -> ``(B, (H/P)·(W/P), d_model)``, in row-major order, like :class:`PatchEmbedding`.
    """

    def __init__(self, channels: int, patch_size: int, d_model: int, *, bias: bool = True) -> None:
        super().__init__()
        halvings = patch_size.bit_length() - 1
        widths = [channels] + [d_model >> (halvings - 1 - i) for i in range(halvings)]
        layers: list[nn.Module] = []
        for c_in, c_out in itertools.pairwise(widths):
            layers += [nn.Conv2d(c_in, c_out, kernel_size=3, stride=2, padding=1), nn.GELU()]
        self.convs = nn.Sequential(*layers)
        self.proj = nn.Conv2d(d_model, d_model, kernel_size=1, bias=bias)

    def forward(self, pixels: Tensor) -> Tensor:
        return self.proj(self.convs(pixels)).flatten(2).transpose(1, 2)  # (B, D, H/P, W/P) -> (B, N, D)


def drop_patches(tokens: Tensor, fraction: float) -> Tensor:
    """PatchDropout: the [CLS] token and a random ``1 - fraction`` of the patch tokens after it (at least one),
    drawn for each image alone and kept in their order. Positions are added before: a kept token still says
    where it came from.

    Shape:
        ``(B, 1 + N, D)`` -> ``(B, 1 + K, D)`` with ``K = max(1, round(N · (1 - fraction)))``.
    """
    batch, n = tokens.size(0), tokens.size(1) - 1
    kept = max(1, round(n * (1 - fraction)))
    patches = torch.rand(batch, n, device=tokens.device).argsort(dim=1)[:, :kept].sort(dim=1).values + 1
    index = torch.cat([patches.new_zeros(batch, 1), patches], dim=1)  # (B, 1 + K): [CLS] first
    return tokens.gather(1, index[..., None].expand(-1, -1, tokens.size(2)))


def check_pixels(pixels: Tensor, channels: int, patch_size: int) -> None:
    """Images must be a float ``(B, C, H, W)`` tensor with the model's channel count and sides that are whole
    numbers of patches."""
    if not isinstance(pixels, Tensor) or not pixels.is_floating_point():
        kind = pixels.dtype if isinstance(pixels, Tensor) else type(pixels).__name__
        raise TypeError(f"images must be a float tensor (B, C, H, W), got {kind}")
    if pixels.dim() != 4:
        raise ValueError(f"images must have shape (B, C, H, W), got {pixels.dim()} dimensions {tuple(pixels.shape)}")
    _, c, h, w = pixels.shape
    if c != channels:
        raise ValueError(f"this model reads images with {channels} channel(s), got {c}; convert the images "
                         f"({'to grey' if channels == 1 else 'to RGB'}) first")
    if h % patch_size or w % patch_size:
        raise ValueError(f"image sides must be multiples of the patch size {patch_size}, got {h}x{w}; resize them")


class ViT(common.Model):
    """The Vision Transformer's encoder, configured by a :class:`ViTConfig` (as Hugging Face ``ViTModel``).

    Shape:
        pixels ``(B, C, H, W)`` -> hidden ``(B, 1 + N, d_model)``: the [CLS] token, then the N patches.
    """

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        cfg = self.config = config
        stem = ConvStem if cfg.stem == "conv" else PatchEmbedding
        self.patches = stem(cfg.channels, cfg.patch_size, cfg.d_model, bias=cfg.patch_bias)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.d_model))
        self.positions = nn.Parameter(torch.zeros(1, 1 + cfg.n_patches, cfg.d_model))  # [CLS], then the grid
        self.patch_dropout = cfg.patch_dropout  # in training; 0 in wsd's cool-down (see the module's text)
        self.emb_dropout = nn.Dropout(cfg.dropout)
        self.embed_norm = LayerNorm(cfg.d_model, eps=cfg.norm_eps) if cfg.embed_norm else None
        self.encoder = Encoder([common.encoder_layer(cfg, None) for _ in range(cfg.n_layers)], common.final_norm(cfg))
        common.init_weights(self, cfg)
        nn.init.trunc_normal_(self.cls_token, std=cfg.init_std)
        nn.init.trunc_normal_(self.positions, std=cfg.init_std)

    def position_table(self, rows: int, cols: int) -> Tensor:
        """Positions for a ``rows × cols`` patch grid ``(1, 1 + rows·cols, D)``: the learned table, or the
        table's grid resized bicubically when the image has another size."""
        side = math.isqrt(self.config.n_patches)
        if (rows, cols) == (side, side):
            return self.positions
        cls, grid = self.positions[:, :1], self.positions[:, 1:]
        grid = grid.reshape(1, side, side, -1).permute(0, 3, 1, 2)  # (1, D, side, side)
        grid = F.interpolate(grid, size=(rows, cols), mode="bicubic", align_corners=False)
        return torch.cat([cls, grid.flatten(2).transpose(1, 2)], dim=1)  # (1, 1 + rows·cols, D)

    def embed(self, pixels: Tensor) -> Tensor:
        """[CLS] + patch embeddings + positions: the encoder's input ``(B, 1 + N, D)``; in training with
        ``patch_dropout`` (the attribute, from the config), ``(B, 1 + K, D)`` (:func:`drop_patches`)."""
        cfg = self.config
        check_pixels(pixels, cfg.channels, cfg.patch_size)
        x = self.patches(pixels)  # (B, N, D)
        x = torch.cat([self.cls_token.expand(x.size(0), -1, -1), x], dim=1)  # (B, 1 + N, D)
        x = x + self.position_table(pixels.size(2) // cfg.patch_size, pixels.size(3) // cfg.patch_size)
        if self.training and self.patch_dropout > 0:  # before dropout: no work on the tokens left out
            x = drop_patches(x, self.patch_dropout)
        x = self.emb_dropout(x)
        return x if self.embed_norm is None else self.embed_norm(x)

    @overload
    def forward(self, pixels: Tensor, *, return_attention: Literal[False] = False) -> Tensor: ...
    @overload
    def forward(self, pixels: Tensor, *, return_attention: Literal[True]) -> WithAttention: ...

    def forward(self, pixels: Tensor, *, return_attention: bool = False) -> Tensor | WithAttention:
        """Hidden states of the [CLS] token and every patch, after the final norm.

        Returns:
            hidden ``(B, 1 + N, d_model)``; with ``return_attention``, ``WithAttention(hidden, attention)``
            where attention is a list of ``n_layers`` tensors ``(B, H, 1 + N, 1 + N)``: row 0 is where the
            [CLS] token looks.
        """
        hidden, weights = self.encoder(self.embed(pixels), need_weights=return_attention)
        return WithAttention(hidden, weights) if return_attention else hidden

    def pool(self, hidden: Tensor) -> Tensor:
        """The image vector ``(B, D)``: the [CLS] state, or the mean of the patch states."""
        return hidden[:, 0] if self.config.pooling == "cls" else hidden[:, 1:].mean(dim=1)


class ViTClassifier(common.ImageClassifier):
    """A :class:`ViT` with a linear classification head on its pooled vector (``ViTForImageClassification``).

    Shape:
        pixels ``(B, C, H, W)`` -> logits ``(B, n_classes)``.
    """

    backbone_name = "vit"

    def __init__(self, config: ViTConfig) -> None:
        super().__init__(config, ViT(config), config.d_model)
