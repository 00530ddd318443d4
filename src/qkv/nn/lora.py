"""LoRA: adapt a frozen linear layer by adding a trainable low-rank product (Hu et al., 2021).

    y = W x + b + s · B A x          A (r, in), B (out, r), r ≪ min(in, out);  s = α / r  (rsLoRA: α / √r)

Fine-tuning changes a pretrained weight by a ΔW that has low "intrinsic rank", so LoRA learns it as the product
B A of two thin matrices: r · (in + out) numbers instead of in · out (about 1% of a 576 × 576 projection at
r = 8). W stays as it is, frozen, in whatever form it is held: float32, or the 4- and 8-bit codes of
:mod:`qkv.quantize` (QLoRA: the gradient reaches the input through the quantized product, see
:class:`qkv.quantized.QuantizedLinear`; only A and B learn). B starts at zero, so the adapted layer starts as
its base; A starts random (Kaiming-uniform, as in the paper's code), so B's first gradient is not zero.
Rank-stabilised LoRA (Kalajdzievski, 2023) scales by α / √r, which keeps the update's size from shrinking as
the rank grows.

A layer can hold several projections stacked by rows (:class:`~qkv.nn.StackedSelfAttention`'s
``[W^Q; W^K; W^V]``, :class:`~qkv.nn.StackedFeedForward`'s ``[W_g; W_1]``). Then each part gets an adapter of
its own, as the separate layers would: ``parts`` names them with their widths, and ``targets`` says which are
adapted (the others add nothing). So an adapter trained on stacked layers is the same numbers as one trained on
separate layers, part for part.

Merged, ``W' = W + s · B A``, the layer is one plain linear layer again (:meth:`LoRALinear.merged`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class LoRALinear(nn.Module):
    """A frozen linear layer (float or quantized) plus a trainable low-rank update per part.

    Args:
        base: the layer adapted: any module with ``in_features`` and ``out_features`` mapping ``(..., in)`` to
            ``(..., out)`` (``nn.Linear``, :class:`~qkv.quantized.QuantizedLinear`). Its parameters are frozen.
        rank: r, the rank of each update.
        alpha: α; the update is scaled by α / r (``rslora``: α / √r).
        dropout: dropout on the input of the update during training (the base sees the input as it is).
        rslora: scale by α / √r.
        parts: the base's output rows as named parts ``(name, width)``, in order, widths adding up to
            ``out_features`` (default: one part, ``("", out_features)``).
        targets: the names of the parts adapted (default: all).

    Raises:
        ValueError: a rank below 1 or above the smaller side of a part, widths that do not add up, or targets
            that name no part.

    Shape:
        ``(..., in_features)`` -> ``(..., out_features)``.
    """

    def __init__(self, base: nn.Module, *, rank: int, alpha: float, dropout: float = 0.0, rslora: bool = False,
                 parts: Sequence[tuple[str, int]] | None = None, targets: Sequence[str] | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.parts = tuple(parts or (("", self.out_features),))
        if sum(width for _, width in self.parts) != self.out_features:
            raise ValueError(f"the parts' widths {[w for _, w in self.parts]} must add up to the layer's "
                             f"{self.out_features} outputs")
        names = [name for name, _ in self.parts]
        self.targets = tuple(names if targets is None else [n for n in names if n in targets])
        if not self.targets:
            raise ValueError(f"no part of the layer is a target: parts {names}, targets {list(targets or [])}")
        smallest = min(min(self.in_features, w) for n, w in self.parts if n in self.targets)
        if not 1 <= rank <= smallest:
            raise ValueError(f"the LoRA rank must be between 1 and the layer's smaller side ({smallest}), got {rank}")
        if not (math.isfinite(alpha) and alpha > 0) or not 0 <= dropout < 1:
            raise ValueError(f"alpha must be a positive number and dropout in [0, 1), got {alpha} and {dropout}")
        self.base = base.requires_grad_(False)
        self.rank, self.alpha, self.rslora = rank, float(alpha), rslora
        self.scale = alpha / (math.sqrt(rank) if rslora else rank)
        self.dropout = nn.Dropout(dropout)
        device = next((t.device for t in base.state_dict().values()), None)
        widths = sum(w for n, w in self.parts if n in self.targets)
        self.lora_A = nn.Parameter(torch.empty(len(self.targets) * rank, self.in_features, device=device))
        self.lora_B = nn.Parameter(torch.zeros(widths, rank, device=device))  # zero: the layer starts as its base
        self.enabled = True  # False: the layer is its base alone (a preference objective's reference model)
        for a in self.lora_A.data.split(rank):
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # as nn.Linear's weights, one part at a time

    def part(self, name: str) -> tuple[Tensor, Tensor]:
        """The adapter of part ``name``: ``A`` ``(r, in)`` and ``B`` ``(width, r)``, views of the parameters."""
        index = self.targets.index(name)
        start = sum(w for n, w in self.parts if n in self.targets[:index])
        width = dict(self.parts)[name]
        return self.lora_A[index * self.rank : (index + 1) * self.rank], self.lora_B[start : start + width]

    def delta(self) -> Tensor:
        """``s · B A`` for every output row ``(out_features, in_features)`` (zero rows for parts not adapted)."""
        rows = []
        for name, width in self.parts:
            if name in self.targets:
                a, b = self.part(name)
                rows.append(self.scale * (b @ a))
            else:
                rows.append(self.lora_A.new_zeros(width, self.in_features))
        return torch.cat(rows)

    def forward(self, x: Tensor) -> Tensor:
        if not self.enabled:
            return self.base(x)
        if self._fusable(x):
            return _Adapted.apply(x, self.base.weight, self.base.bias, self.lora_A, self._up(self.lora_B), self.scale)
        y = self.base(x)
        a, b = (self.lora_A, self.lora_B) if x.dtype == self.lora_A.dtype else (
            self.lora_A.to(x.dtype), self.lora_B.to(x.dtype))  # a bf16 base: the adapter computes in bf16 too
        # (..., n_targets · r), scaled on this thin side; then every part's B in one product
        down = F.linear(self.dropout(x) if self.training else x, a) * self.scale
        return y + F.linear(down, self._up(b)).to(y.dtype)

    def _fusable(self, x: Tensor) -> bool:
        """Whether :class:`_Adapted` computes this call: a frozen float ``nn.Linear`` base of ``x``'s dtype, no
        autocast, no dropout at work."""
        return (type(self.base) is nn.Linear and not any(p.requires_grad for p in self.base.parameters())
                and x.dtype == self.base.weight.dtype == self.lora_A.dtype
                and not torch.is_autocast_enabled(x.device.type) and not (self.training and self.dropout.p))

    def _up(self, b: Tensor) -> Tensor:
        """``B`` for all the parts at once, ``(out_features, n_targets · r)``: each adapted part's rows read its
        own ``r`` columns of ``A x``, and a part not adapted is zero rows."""
        if len(self.parts) == 1:
            return b
        blocks, start = [], 0
        for name, width in self.parts:
            taken = width if name in self.targets else 0
            blocks.append(b[start : start + taken] if taken else b.new_zeros(width, 0))
            start += taken
        return torch.block_diag(*blocks)

    def base_weight(self) -> Tensor:
        """The base's weight in float32 ``(out_features, in_features)``: a quantized layer's dequantized."""
        dequantized = getattr(self.base, "dequantized", None)
        return (dequantized() if dequantized is not None else self.base.weight).detach().float()

    @torch.no_grad()
    def merged(self) -> nn.Linear:
        """One float32 ``nn.Linear`` with ``W + s · B A`` (a quantized base dequantized first) and the base's bias."""
        weight = self.base_weight() + self.delta().float()
        bias = getattr(self.base, "bias", None)
        layer = nn.Linear(self.in_features, self.out_features, bias=bias is not None, device=weight.device)
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias.detach().float())
        return layer

    def extra_repr(self) -> str:
        targets = "" if self.parts == (("", self.out_features),) else f", parts {list(self.targets)}"
        return f"rank={self.rank}, alpha={self.alpha:g}{', rslora' if self.rslora else ''}{targets}"


class _Adapted(torch.autograd.Function):
    """``x Wᵀ + bias + (s · x Aᵀ) Bᵀ`` for a float base, forward and backward written out: the adapter's product
    added into the base's output as it is made, and in the backward pass the input's gradient from the adapter
    added into the base's (``dx = dy W + s · (dy B) A``), where autograd would write each of them whole and then
    add them: two passes over a layer's largest tensors fewer each way (about 5% of a LoRA step on a CPU).
    ``up``: ``B`` for every output ``(out, n_targets · r)``. The same numbers as the separate products
    (tests/nn/test_lora.py)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, a: Tensor, up: Tensor, scale: float) -> Tensor:
        flat = x.reshape(-1, x.size(-1))
        down = torch.mm(flat, a.t()).mul_(scale)  # (N, n_targets · r)
        y = torch.mm(flat, weight.t()) if bias is None else torch.addmm(bias, flat, weight.t())
        y.addmm_(down, up.t())
        ctx.save_for_backward(flat, down, weight, a, up)
        ctx.scale, ctx.shape = scale, x.shape
        return y.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, dy: Tensor):
        flat, down, weight, a, up = ctx.saved_tensors
        dy = dy.reshape(-1, dy.size(-1))
        d_down = torch.mm(dy, up).mul_(ctx.scale)  # (N, n_targets · r): the gradient of x Aᵀ
        dx = torch.mm(dy, weight).addmm_(d_down, a).view(ctx.shape) if ctx.needs_input_grad[0] else None
        return dx, None, None, d_down.t() @ flat, dy.t() @ down, None
