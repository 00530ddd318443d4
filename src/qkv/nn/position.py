"""Position information: attention alone is blind to order, so positions are added or rotated in.

Three ways from the notes:

* sinusoidal (fixed):  PE(pos, 2i) = sin(pos / 10000^(2i/d)),  PE(pos, 2i+1) = cos(pos / 10000^(2i/d))
* learned: one trained vector per absolute position, as in GPT-2 and BERT
* rotary (RoPE): rotate each (query, key) pair of features by an angle proportional to the position,
  so that the score q_m · k_n depends on m - n only.

The absolute encodings map positions ``(T,)`` or ``(B, T)`` to vectors ``(..., d_model)`` that the model
adds to its token embeddings. Rotary acts inside attention, on queries and keys.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def _check_positions(positions: Tensor, max_len: int) -> None:
    if positions.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"positions must be an integer tensor, got dtype {positions.dtype}")
    # Values are read only on the CPU and outside torch.compile: on a GPU reading one back makes the host wait on
    # every forward (qkv.models.common.check_ids follows the same rule).
    if positions.numel() and positions.device.type == "cpu" and not torch.compiler.is_compiling() and \
            int(positions.max()) >= max_len:
        raise ValueError(
            f"position {int(positions.max())} is beyond max_seq_len={max_len}; "
            "shorten the input or build the model with a larger max_seq_len"
        )


class SinusoidalPositionalEncoding(nn.Module):
    """Fixed sinusoidal encodings of "Attention Is All You Need", precomputed into a buffer.

    Args:
        d_model: model width (even).
        max_len: number of positions in the table.
        base: the 10000 of the formula.
        halves: every sine first, then every cosine (tensor2tensor, fairseq, Marian), instead of each
            frequency's sine and cosine side by side; the same features in another order.

    Shape:
        positions ``(T,)`` or ``(B, T)`` -> ``(T, d_model)`` or ``(B, T, d_model)``.
    """

    def __init__(self, d_model: int, max_len: int, *, base: float = 10000.0, halves: bool = False) -> None:
        super().__init__()
        if d_model % 2:
            raise ValueError(f"sinusoidal encodings need an even d_model, got d_model={d_model}")
        # Computed on the CPU, then moved to the default device: on the meta device (used to size a model
        # before building it) these ops would pull in PyTorch's compiler stack, a second of imports.
        pos = torch.arange(max_len, dtype=torch.float64, device="cpu")[:, None]  # (max_len, 1)
        two_i = torch.arange(0, d_model, 2, dtype=torch.float64, device="cpu")  # (d/2,)
        angle = pos / base ** (two_i / d_model)  # (max_len, d/2)
        pe = torch.empty(max_len, d_model, dtype=torch.float64, device="cpu")
        sines, cosines = (pe[:, : d_model // 2], pe[:, d_model // 2 :]) if halves else (pe[:, 0::2], pe[:, 1::2])
        sines.copy_(torch.sin(angle))
        cosines.copy_(torch.cos(angle))
        # Not persistent: it is a function of the config, so checkpoints need not carry it.
        self.register_buffer("pe", pe.float().to(torch.get_default_device()), persistent=False)
        self.max_len = max_len

    def forward(self, positions: Tensor) -> Tensor:
        _check_positions(positions, self.max_len)
        return self.pe[positions]


class LearnedPositionalEmbedding(nn.Embedding):
    """One trained vector per absolute position (GPT-2, BERT).

    Shape:
        positions ``(T,)`` or ``(B, T)`` -> ``(..., d_model)``.
    """

    def __init__(self, d_model: int, max_len: int) -> None:
        super().__init__(max_len, d_model)
        self.max_len = max_len

    def forward(self, positions: Tensor) -> Tensor:
        _check_positions(positions, self.max_len)
        return super().forward(positions)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE, Su et al. 2021).

    Feature pairs ``(x_a, x_b)`` of each head are rotated by the angle ``pos * theta_i`` with
    ``theta_i = base^(-2i/rotary_dim)``:

        x_a' = x_a cos(pos θ_i) - x_b sin(pos θ_i)
        x_b' = x_a sin(pos θ_i) + x_b cos(pos θ_i)

    Because rotations compose, ``R(m)q · R(n)k = q · R(n - m)k``: scores depend on relative position only.
    There is no table limit; angles are computed for the positions asked for.

    Longer contexts than a model was trained on are reached by slowing the rotations, each scheme a set of
    divisors of ``θ_i`` (``freq_factors``), some with a factor on cos and sin (``scale``):

    * linear ("position interpolation"): every ``θ_i`` divided by the same factor;
    * Llama 3 and YaRN: the slow pairs divided by the factor, the fast ones left alone, a ramp between (YaRN also
      scales cos and sin by ``0.1 ln(factor) + 1``);
    * LongRoPE (Phi-3): searched divisors, one set for sequences within the original context (``freq_factors``) and
      one for longer ones (``long_factors``), the set chosen by the longest position in the call.

    Args:
        head_dim: features per head.
        base: the θ base (10000 in the paper, 100000 for SmolLM2).
        interleaved: pair features ``(0, 1), (2, 3), ...`` as in the paper and GGUF files; the default pairs
            ``(i, i + rotary_dim/2)``, the "rotate half" layout of Hugging Face LLaMA checkpoints.
        freq_factors: ``θ_i`` divided by ``freq_factors[i]`` (``rotary_dim / 2`` of them).
        rotary_dim: the features of each head that turn, its first ``rotary_dim`` (even); the rest pass unturned
            (Phi-3's partial rotary). Default: all of them.
        scale: cos and sin multiplied by this: the attention scores of rotated features grow by its square
            (YaRN's and LongRoPE's "attention factor").
        long_factors: LongRoPE's divisors for calls whose positions reach ``original_context`` or beyond.
        original_context: the context the model was trained on (LongRoPE).

    Shape:
        x ``(B, H, T, head_dim)``, positions ``(T,)`` or ``(B, T)`` -> ``(B, H, T, head_dim)``.
    """

    def __init__(self, head_dim: int, *, base: float = 10000.0, interleaved: bool = False,
                 freq_factors: list[float] | None = None, rotary_dim: int | None = None, scale: float = 1.0,
                 long_factors: list[float] | None = None, original_context: int | None = None) -> None:
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary embeddings turn an even number of a head's features, at most head_dim={head_dim};"
                             f" got rotary_dim={rotary_dim}")
        if (long_factors is None) != (original_context is None):
            raise ValueError("long_factors and original_context go together (LongRoPE)")
        self.register_buffer("inv_freq", self._inv_freq(rotary_dim, base, freq_factors), persistent=False)
        self.register_buffer("long_inv_freq", None if long_factors is None else
                             self._inv_freq(rotary_dim, base, long_factors), persistent=False)
        self.head_dim, self.rotary_dim, self.scale = head_dim, rotary_dim, scale
        self.original_context = original_context
        self.interleaved = interleaved
        self._last: tuple[Tensor, tuple[Tensor, Tensor]] | None = None  # (positions, their cos and sin)

    @staticmethod
    def _inv_freq(rotary_dim: int, base: float, factors: list[float] | None) -> Tensor:
        """``θ_i = base^(-2i/rotary_dim) / factors[i]``, ``(rotary_dim/2,)``."""
        # on the CPU: see SinusoidalPositionalEncoding
        two_i = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device="cpu")
        inv_freq = 1.0 / base ** (two_i / rotary_dim)  # (Dr/2,)
        if factors is not None:
            if len(factors) != rotary_dim // 2:
                raise ValueError(f"rotary frequency factors must be rotary_dim/2={rotary_dim // 2}, got {len(factors)}")
            inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32, device="cpu")
        return inv_freq.to(torch.get_default_device())

    def _frequencies(self, positions: Tensor) -> Tensor:
        """``θ``, ``(Dr/2,)`` or ``(B, 1, Dr/2)``: LongRoPE's long set for a sequence whose last position lies past
        the original context, each row of a batch as if alone (chosen on the device: no value is read back); else
        the one set."""
        if self.long_inv_freq is None:
            return self.inv_freq
        last = positions.max(dim=-1, keepdim=True).values  # (1,) or (B, 1)
        beyond = (last + 1 > self.original_context)[..., None]  # (1, 1) or (B, 1, 1)
        inv_freq = torch.where(beyond, self.long_inv_freq, self.inv_freq)
        return inv_freq[0] if positions.dim() == 1 else inv_freq

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Cosines and sines of ``positions``' angles (times ``scale``), laid out as :meth:`forward` multiplies them
        and shaped to broadcast over heads: ``(1 or B, 1, T, Dr/2)`` for the interleaved layout; for "rotate half",
        ``(cos, cos)`` and ``(-sin, sin)`` side by side, ``(1 or B, 1, T, Dr)``.

        One module serves every layer, and a forward pass hands all of them the same ``positions`` tensor: the
        tables of the last one are kept, so a decoding step computes them once, not twice a layer.
        """
        compiling = torch.compiler.is_compiling()  # a compiled graph computes them once anyway
        if not compiling and self._last is not None and self._last[0] is positions:
            return self._last[1]
        inv_freq = self._frequencies(positions)
        angle = positions.to(inv_freq.dtype)[..., None] * inv_freq  # (..., T, Dr/2)
        if angle.dim() == 2:
            angle = angle[None]  # (1, T, Dr/2)
        angle = angle[:, None]  # (B or 1, 1, T, Dr/2)
        cos, sin = angle.cos(), angle.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        result = (cos, sin) if self.interleaved else (torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1))
        if not compiling:
            self._last = (positions, result)
        return result

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        cos, sin = self.cos_sin(positions)
        xf = x.float()
        turned, still = (xf, None) if self.rotary_dim == self.head_dim else \
            (xf[..., : self.rotary_dim], xf[..., self.rotary_dim :])
        if self.interleaved:
            a, b = turned[..., 0::2], turned[..., 1::2]  # (B, H, T, Dr/2) each
            out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
        else:
            # pairs (a, b) = (x_i, x_{i+Dr/2}): rolling by Dr/2 puts b beside a and a beside b, so one product
            # with (cos, cos) and one with (-sin, sin) give (a cos - b sin, b cos + a sin): four operations
            out = turned * cos + turned.roll(self.rotary_dim // 2, dims=-1) * sin
        if still is not None:
            out = torch.cat((out, still), dim=-1)
        return out.type_as(x)
