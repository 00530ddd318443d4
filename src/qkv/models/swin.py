"""Swin Transformer (Liu et al. 2021): a ViT whose attention stays inside small windows, in a hierarchy of stages.

    pixels (B, C, H, W) ─ 4×4 patches ─ linear ─ norm ─ stage 1 ─ merge ─ stage 2 ─ merge ─ ... ─ stage S ─ norm
    stage: blocks of  x = x + W-MSA(LN(x)),  x = x + MLP(LN(x)),  the window grid shifted by M/2 in every other

* Patches: the image is cut into 4×4 patches, each projected to ``C = d_model`` (a strided convolution).
* Windows: attention runs inside non-overlapping windows of M×M patches (M = 7), each window alone: a token
  sees the M² tokens of its window, with a learned bias per relative offset (a table of (2M-1)² entries per
  head) in place of absolute positions.
* Shifted windows: every other block moves the window grid by M/2 patches, so that the windows of one block
  straddle the borders of the previous block's and information crosses them. The move is a cyclic shift
  of the image (``torch.roll``) by -M/2, so the windows stay M×M; the windows along the right and bottom
  edges then hold patches that wrapped around from the far side, and a mask lets a token attend only to
  tokens of its own region (they were neighbours before the roll). The shift is undone afterwards.
* Patch merging: between stages, each 2×2 group of tokens is concatenated (4C) and projected to 2C: the grid
  halves in each direction and the width doubles, as a CNN's pyramid does (strides 4, 8, 16, 32).

Why: attention over all N patches costs O(N²); inside windows it costs O(N·M²), linear in the number of
patches. Counting multiply-adds of a block's attention on N tokens of width C (the paper's formula):

    MSA (ViT):  4·N·C² + 2·N²·C        W-MSA (Swin):  4·N·C² + 2·M²·N·C

the first term being the four projections (Q, K, V, output), the second QKᵀ and the weighted sum of V. A
window costs M⁴·C whatever the image size; four times the pixels means four times the windows, four times
the FLOPs. At 224×224 with 4×4 patches (N = 3136, M = 7) the score matrices are 64 times smaller than ViT's.

As in Hugging Face ``SwinModel`` (whose weights :mod:`qkv.interop.hf_swin` loads):

* a stage whose grid is no larger than the window in some direction (``min(H, W) ≤ M``) uses one window of
  side ``min(H, W)`` and never shifts: there is nothing left to connect;
* a grid whose sides are not multiples of the window is padded with zero tokens on the right and bottom
  (after the norm, so they are zero vectors) to whole windows, attended to like the others in unshifted
  blocks, and cut off afterwards; a patch merging pads an odd side with one zero row or column. Images
  themselves must have sides that are multiples of ``patch_size`` (a ``ValueError`` otherwise).

Stochastic depth (drop path), used to train the paper's large models, is not implemented.

    SwinClassifier:  Swin ─ mean over the last stage's tokens ─ linear -> logits ``(B, n_classes)``
"""

from __future__ import annotations

import math
from typing import Literal, overload

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import SwinConfig
from ..nn import FeedForward, MultiHeadAttention, build_norm
from . import common
from .common import WithAttention
from .vit import PatchEmbedding, check_pixels


def window_partition(x: Tensor, window: int) -> Tensor:
    """Cut a grid of tokens into non-overlapping ``window × window`` windows, in row-major order.

    Shape:
        ``(B, H, W, C)`` -> ``(B·nW, window, window, C)`` with ``nW = (H/window)·(W/window)``, the windows
        of image 0 first.
    """
    b, h, w, c = x.shape
    x = x.reshape(b, h // window, window, w // window, window, c)  # (B, rows, M, cols, M, C)
    return x.transpose(2, 3).reshape(-1, window, window, c)  # (B·rows·cols, M, M, C)


def window_reverse(windows: Tensor, window: int, height: int, width: int) -> Tensor:
    """Put windows back into a grid: the inverse of :func:`window_partition`.

    Shape:
        ``(B·nW, window, window, C)`` -> ``(B, height, width, C)``.
    """
    c = windows.size(-1)
    x = windows.reshape(-1, height // window, width // window, window, window, c)  # (B, rows, cols, M, M, C)
    return x.transpose(2, 3).reshape(-1, height, width, c)  # (B, H, W, C)


def relative_position_index(window: int, table_window: int | None = None) -> Tensor:
    """Row of the relative-position table for every (query, key) pair of a window.

    Two patches of a window at (r₁, c₁) and (r₂, c₂) are offset by (r₁ - r₂, c₁ - c₂), each in
    [-(M-1), M-1]: (2M-1)² possible offsets, numbered row-major, ``(dr + M-1)·(2M-1) + (dc + M-1)``.
    A window smaller than the table's (a stage with fewer than M patches a side) uses the table's middle.

    Args:
        window: side of the window, in patches.
        table_window: the window the table was made for (default ``window``).

    Raises:
        ValueError: a window larger than the table's.

    Shape:
        -> ``(window², window²)`` long, indices into a ``((2·table_window - 1)², heads)`` table.
    """
    table_window = window if table_window is None else table_window
    if window > table_window:
        raise ValueError(f"a window of {window} patches needs a larger table than window_size={table_window}")
    rows, cols = torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")
    rows, cols = rows.flatten(), cols.flatten()  # (M²,) each, row-major positions in the window
    d_row = rows[:, None] - rows[None, :] + table_window - 1  # (M², M²), in [0, 2M-2]
    d_col = cols[:, None] - cols[None, :] + table_window - 1
    return d_row * (2 * table_window - 1) + d_col


def shifted_window_mask(
    height: int, width: int, window: int, shift: int, device: torch.device | str | None = None
) -> Tensor:
    """Which tokens may attend to each other inside the windows of the rolled image (``True`` = may attend).

    After rolling the image by -shift, the grid splits along each axis into three bands: ``[0, H-M)``,
    untouched; ``[H-M, H-shift)``, the last window's share of untouched tokens; ``[H-shift, H)``, the tokens
    that wrapped around from the top (left). The 3 × 3 bands label 9 regions; tokens of one window may
    attend to each other when their labels are equal, that is when they were neighbours before the roll.
    With ``shift = 0`` every pair of a window is allowed.

    Args:
        height, width: the (padded) grid, multiples of ``window``.
        window: side M of a window.
        shift: how far the image was rolled, ``< window``.
        device: where to build the mask.

    Shape:
        -> ``(nW, M², M²)`` bool, windows in the order of :func:`window_partition`.
    """
    labels = torch.zeros(height, width, dtype=torch.long, device=device)

    def bands(n: int) -> tuple[slice, slice, slice]:
        return slice(0, n - window), slice(n - window, n - shift), slice(n - shift, n)

    for i, rows in enumerate(bands(height)):
        for j, cols in enumerate(bands(width)):
            labels[rows, cols] = 3 * i + j
    labels = window_partition(labels[None, :, :, None], window).flatten(1)  # (nW, M²)
    return labels[:, :, None] == labels[:, None, :]  # (nW, M², M²)


class WindowAttention(nn.Module):
    """Multi-head self-attention inside each window, with a learned relative position bias.

        Attention(Q, K, V) = softmax(Q Kᵀ / √d + B) V,   B[h, i, j] = table[offset(i, j), h]

    The attention itself is qkv's :class:`MultiHeadAttention`, every window a row of the batch: the bias is
    its ``attn_bias``, the shifted windows' region mask its ``attn_mask``. (Hugging Face adds -100 to the
    masked scores where qkv removes them: e^-100 ≈ 4e-44, so the two agree.)

    Args:
        d_model: token width.
        n_heads: attention heads.
        window: side M of the windows; the table holds ``(2M-1)²`` offsets.
        dropout: dropout on the attention weights during training.
        bias: biases in the projections.
        head_norms: ``{"q_norm": ..., "k_norm": ...}`` to normalise each head's queries and keys (``qk_norm``),
            or nothing.

    Shape:
        windows ``(B·nW, w², d_model)``, mask ``(B·nW, 1, w², w²)`` -> ``(B·nW, w², d_model)``, weights
        ``(B·nW, n_heads, w², w²)``; ``w ≤ M``.
    """

    def __init__(self, d_model: int, n_heads: int, window: int, *, dropout: float = 0.0, bias: bool = True,
                 head_norms: dict[str, nn.Module] | None = None) -> None:
        super().__init__()
        self.window = window
        self.mha = MultiHeadAttention(d_model, n_heads, dropout=dropout, bias=bias, **(head_norms or {}))
        self.bias_table = nn.Parameter(torch.zeros((2 * window - 1) ** 2, n_heads))  # a score per offset and head
        self.register_buffer("bias_index", relative_position_index(window), persistent=False)

    def position_bias(self, window: int) -> Tensor:
        """The bias ``(n_heads, w², w²)`` of a ``w × w`` window."""
        index = self.bias_index if window == self.window else \
            relative_position_index(window, self.window).to(self.bias_table.device)
        return self.bias_table[index].permute(2, 0, 1)  # (w², w², heads) -> (heads, w², w²)

    def forward(
        self, windows: Tensor, mask: Tensor | None = None, *, need_weights: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        bias = self.position_bias(math.isqrt(windows.size(1)))
        return self.mha(windows, attn_bias=bias, attn_mask=mask, need_weights=need_weights)


class SwinBlock(nn.Module):
    """One Swin block, Pre-Norm:  x = x + (shifted) window attention(LN(x));  x = x + MLP(LN(x)).

    Args:
        attention: the window attention; its window M.
        feed_forward: the MLP.
        attn_norm: norm before the attention.
        ffn_norm: norm before the MLP.
        shifted: move the windows by M/2 (every odd block of a stage); ignored where the grid is no larger
            than M.
        dropout: dropout on each branch before the residual addition.

    Shape:
        x ``(B, H·W, C)`` with ``size = (H, W)`` -> same; weights ``(B, nW, heads, w², w²)``.
    """

    def __init__(
        self,
        *,
        attention: WindowAttention,
        feed_forward: nn.Module,
        attn_norm: nn.Module,
        ffn_norm: nn.Module,
        shifted: bool,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.attention, self.feed_forward = attention, feed_forward
        self.attn_norm, self.ffn_norm = attn_norm, ffn_norm
        self.shifted = shifted
        self.dropout = nn.Dropout(dropout)

    def window_and_shift(self, height: int, width: int) -> tuple[int, int]:
        """The window side and the shift used on a ``height × width`` grid."""
        window = self.attention.window
        if min(height, width) <= window:
            return min(height, width), 0  # one window spans the short side: nothing to connect
        return window, window // 2 if self.shifted else 0

    def forward(self, x: Tensor, size: tuple[int, int], *, need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        (height, width), (b, n, c) = size, x.shape
        window, shift = self.window_and_shift(height, width)
        h = self.attn_norm(x).view(b, height, width, c)  # (B, H, W, C)
        h = F.pad(h, (0, 0, 0, -width % window, 0, -height % window))  # zero tokens up to whole windows
        padded = h.shape[1:3]  # (H', W')
        mask = None
        if shift:
            h = torch.roll(h, (-shift, -shift), dims=(1, 2))
            mask = shifted_window_mask(*padded, window, shift, device=x.device)  # (nW, w², w²)
            mask = mask.repeat(b, 1, 1).unsqueeze(1)  # (B·nW, 1, w², w²), image-major like the windows
        windows = window_partition(h, window).flatten(1, 2)  # (B·nW, w², C)
        out, weights = self.attention(windows, mask, need_weights=need_weights)
        h = window_reverse(out.view(-1, window, window, c), window, *padded)  # (B, H', W', C)
        if shift:
            h = torch.roll(h, (shift, shift), dims=(1, 2))
        h = h[:, :height, :width].reshape(b, n, c)  # (B, H·W, C)
        x = x + self.dropout(h)
        x = x + self.dropout(self.feed_forward(self.ffn_norm(x)))
        if weights is not None:
            weights = weights.view(b, -1, *weights.shape[1:])  # (B, nW, heads, w², w²)
        return x, weights


class PatchMerging(nn.Module):
    """Merge each 2×2 group of tokens into one: concatenate (4C), normalise, project to 2C.

    The four are concatenated in the order (row 0, col 0), (row 1, col 0), (row 0, col 1), (row 1, col 1),
    as the reference implementation does (it fixes the meaning of the projection's columns). An odd side is
    padded with a row or column of zero tokens first.

    Shape:
        x ``(B, H·W, C)`` with ``size = (H, W)`` -> ``(B, ⌈H/2⌉·⌈W/2⌉, 2C)``.
    """

    def __init__(self, d_model: int, *, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm  # over 4·d_model
        self.reduction = nn.Linear(4 * d_model, 2 * d_model, bias=False)

    def forward(self, x: Tensor, size: tuple[int, int]) -> Tensor:
        (height, width), (b, _, c) = size, x.shape
        x = x.view(b, height, width, c)  # (B, H, W, C)
        x = F.pad(x, (0, 0, 0, width % 2, 0, height % 2))  # (B, 2⌈H/2⌉, 2⌈W/2⌉, C)
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], dim=-1)
        return self.reduction(self.norm(x.flatten(1, 2)))  # (B, H/2·W/2, 4C) -> (B, H/2·W/2, 2C)


class SwinStage(nn.Module):
    """The blocks of one resolution, then (except after the last stage) a patch merging.

    Shape:
        x ``(B, H·W, C)`` with ``size = (H, W)`` -> ``(B, H'·W', C')`` and ``(H', W')``: halved and doubled
        when the stage merges, unchanged otherwise.
    """

    def __init__(self, blocks: list[SwinBlock], merge: PatchMerging | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.merge = merge

    def forward(
        self, x: Tensor, size: tuple[int, int], *, need_weights: bool = False
    ) -> tuple[Tensor, tuple[int, int], list[Tensor]]:
        all_weights = []
        for block in self.blocks:
            x, weights = block(x, size, need_weights=need_weights)
            if need_weights:
                all_weights.append(weights)
        if self.merge is not None:
            x, size = self.merge(x, size), ((size[0] + 1) // 2, (size[1] + 1) // 2)
        return x, size, all_weights


def _block(cfg: SwinConfig, stage: int, shifted: bool) -> SwinBlock:
    width, heads, d_ff = cfg.stage_widths[stage], cfg.stage_heads[stage], cfg.ffn_widths[stage]
    attention_dropout = cfg.dropout if cfg.attention_dropout is None else cfg.attention_dropout
    activation_dropout = cfg.dropout if cfg.activation_dropout is None else cfg.activation_dropout
    head_norms = {name: build_norm(cfg.norm, width // heads, eps=cfg.norm_eps, bias=cfg.bias)
                  for name in ("q_norm", "k_norm")} if cfg.qk_norm else None
    return SwinBlock(
        attention=WindowAttention(width, heads, cfg.window_size, dropout=attention_dropout, bias=cfg.bias,
                                  head_norms=head_norms),
        feed_forward=FeedForward(width, d_ff, activation=cfg.activation, dropout=activation_dropout, bias=cfg.bias),
        attn_norm=build_norm(cfg.norm, width, eps=cfg.norm_eps, bias=cfg.bias),
        ffn_norm=build_norm(cfg.norm, width, eps=cfg.norm_eps, bias=cfg.bias),
        shifted=shifted,
        dropout=cfg.dropout,
    )


def _stage(cfg: SwinConfig, stage: int) -> SwinStage:
    width, last = cfg.stage_widths[stage], stage == len(cfg.depths) - 1
    merge = None if last else PatchMerging(width, norm=build_norm(cfg.norm, 4 * width, eps=cfg.norm_eps, bias=cfg.bias))
    return SwinStage([_block(cfg, stage, shifted=i % 2 == 1) for i in range(cfg.depths[stage])], merge)


class Swin(common.Model):
    """The Swin Transformer's backbone, configured by a :class:`SwinConfig` (as Hugging Face ``SwinModel``).

    Shape:
        pixels ``(B, C, H, W)`` -> hidden ``(B, N, d)``: the last stage's ``N = ⌈H/(P·2^(S-1))⌉·⌈W/(P·2^(S-1))⌉``
        tokens (row-major), ``d = d_model·2^(S-1)`` wide, after the final norm (SwinModel's
        ``last_hidden_state``).
    """

    def __init__(self, config: SwinConfig) -> None:
        super().__init__()
        cfg = self.config = config
        self.patches = PatchEmbedding(cfg.channels, cfg.patch_size, cfg.d_model)
        self.embed_norm = build_norm(cfg.norm, cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
        self.emb_dropout = nn.Dropout(cfg.dropout)
        self.stages = nn.ModuleList([_stage(cfg, i) for i in range(len(cfg.depths))])
        self.norm = build_norm(cfg.norm, cfg.stage_widths[-1], eps=cfg.norm_eps, bias=cfg.bias)
        common.init_weights(self, cfg)
        for module in self.modules():
            if isinstance(module, WindowAttention):
                nn.init.trunc_normal_(module.bias_table, std=cfg.init_std)

    @overload
    def forward(self, pixels: Tensor, *, return_attention: Literal[False] = False) -> Tensor: ...
    @overload
    def forward(self, pixels: Tensor, *, return_attention: Literal[True]) -> WithAttention: ...

    def forward(self, pixels: Tensor, *, return_attention: bool = False) -> Tensor | WithAttention:
        """Hidden states of the last stage's tokens, after the final norm.

        Returns:
            hidden ``(B, N, d)``; with ``return_attention``, ``WithAttention(hidden, attention)`` where
            attention is a list with one tensor per block (``sum(depths)``, stage by stage), each
            ``(B, nW, heads, w², w²)``: for each image and window, where each of the window's ``w²`` tokens
            (row-major inside the window) looks. ``w`` is the block's window side (``window_size``, or the
            stage's shorter side when that is smaller), ``nW`` the number of windows of the stage's grid
            padded to whole windows, row-major; in a shifted block the windows are those of the rolled grid.

        Raises:
            TypeError, ValueError: images that are not a float ``(B, channels, H, W)`` tensor with sides
                that are multiples of ``patch_size``.
        """
        cfg = self.config
        check_pixels(pixels, cfg.channels, cfg.patch_size)
        x = self.emb_dropout(self.embed_norm(self.patches(pixels)))  # (B, N, d_model)
        size = (pixels.size(2) // cfg.patch_size, pixels.size(3) // cfg.patch_size)
        attention: list[Tensor] = []
        for stage in self.stages:
            x, size, weights = stage(x, size, need_weights=return_attention)
            attention += weights
        x = self.norm(x)
        return WithAttention(x, attention) if return_attention else x

    def pool(self, hidden: Tensor) -> Tensor:
        """The image vector ``(B, d)``: the mean of the last stage's tokens."""
        return hidden.mean(dim=1)


class SwinClassifier(common.ImageClassifier):
    """A :class:`Swin` with a linear head on the mean of its last stage's tokens (``SwinForImageClassification``).

    Raises:
        ValueError: a config without ``n_classes``.

    Shape:
        pixels ``(B, C, H, W)`` -> logits ``(B, n_classes)``.
    """

    backbone_name = "swin"

    def __init__(self, config: SwinConfig) -> None:
        super().__init__(config, Swin(config), config.stage_widths[-1])
