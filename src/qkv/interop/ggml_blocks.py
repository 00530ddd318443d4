"""ggml's 4-bit blocks as qkv's int4 groups: codes, scales and zero points, read straight from a GGUF tensor.

A quantized GGUF tensor is stored row by row, each row a run of blocks. Three of ggml's 4-bit formats are, group
for group, the line qkv's :class:`~qkv.quantized.Int4Linear` computes, ``W = (q - 8) · s + z`` over groups of 32
inputs, so their 4-bit codes are taken over as they are and only the scales change form:

=======  ===================================================  ============================================
format   block (bytes) and what it stores                     as a group of 32: scale s, zero point z
=======  ===================================================  ============================================
Q4_0     32 weights (18): fp16 d, 16 bytes of codes           ``W = d (q - 8)``: s = d, z = 0
Q4_1     32 weights (20): fp16 d and m, 16 bytes of codes     ``W = d q + m``: s = d, z = m + 8 d
Q4_K     256 weights (144): fp16 d and dmin, 8 six-bit        ``W = d·sc_j q - dmin·m_j`` for sub-block j:
         scales sc_j and mins m_j (12 bytes), 128 of codes     s = d·sc_j, z = 8 s - dmin·m_j
=======  ===================================================  ============================================

The codes lie two to a byte: Q4_0 and Q4_1 keep weight ``i`` in the low nibble of byte ``i`` and weight ``i + 16``
in its high nibble; Q4_K does the same for each pair of sub-blocks (64 weights, 32 bytes), weights ``i`` and
``i + 32``. :func:`int4_groups` returns the bytes as they are, with that distance (:data:`SPANS`), for
:meth:`~qkv.quantized.Int4Linear.write_pairs`. The other formats
(Q8_0, Q5_K, Q6_K, fp16, bf16, fp32) have no int4 form; :func:`dequantized_rows` decodes them, a few rows at a
time, for a layer that is quantized again (see :mod:`qkv.quantize`). Q8_0's blocks are the form of qkv's int8
kernel layer (:class:`~qkv.kernel_layers.KernelInt8Linear`): :func:`int8_blocks` gives them as they are; Q6_K's and
Q5_K's are the forms of its 6-bit and 5-bit layers: :func:`q6_k_blocks` and :func:`q5_k_blocks` give their codes and
scales as stored.
"""

from __future__ import annotations

import numpy as np
import torch

GROUP = 32  # weights per group of every format here (a Q4_K super-block holds eight)
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144)}  # format -> (weights, bytes) of a block
SPANS = {"Q4_0": 16, "Q4_1": 16, "Q4_K": 32}  # format -> distance between the two weights of a byte
REPACKED = tuple(BLOCKS)


def int4_groups(kind: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The int4 form of ``raw``, rows of ``kind`` blocks as a GGUF file stores them.

    Args:
        kind: "Q4_0", "Q4_1" or "Q4_K".
        raw: ``(rows, bytes_per_row)`` uint8.

    Returns:
        ``pairs`` ``(rows, blocks, bytes)`` uint8, the codes two to a byte ``SPANS[kind]`` weights apart, read
        in place (one code per weight: ``qkv.quantized.unpaired(pairs.reshape(rows, -1), SPANS[kind])``), and
        ``scales`` and ``zeros`` ``(rows, inputs / 32)`` float32, such that weight ``[r, i] = (code[r, i] - 8)
        * scales[r, i // 32] + zeros[r, i // 32]``.

    Raises:
        ValueError: another format, or rows that are not whole blocks.
    """
    if kind not in BLOCKS:
        raise ValueError(f"{kind} blocks have no int4 form; expected one of {', '.join(REPACKED)}")
    size = BLOCKS[kind][1]
    rows, width = raw.shape
    if width % size:
        raise ValueError(f"a row of {width} bytes is not a whole number of {kind} blocks of {size} bytes")
    blocks = np.ascontiguousarray(raw).reshape(rows, width // size, size)
    pairs, scales, zeros = (_q4_k if kind == "Q4_K" else _q4_0_1)(blocks, kind)
    return pairs, scales.reshape(rows, -1), zeros.reshape(rows, -1)


def int4_halves(kind: str, raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 or Q4_1 rows as qkv's kernel holds them, nothing widened: ``pairs`` as :func:`int4_groups` gives them
    (a view of ``raw``), and each block's scale ``d`` and offset ``m`` ``(rows, blocks)`` float16, each weight
    ``code · d + m``: Q4_1's two halves as stored (views), Q4_0's ``d`` and ``-8 d`` (exact in fp16, or infinite
    where it overflows: the caller checks them)."""
    if kind not in ("Q4_0", "Q4_1"):
        raise ValueError(f"{kind} blocks have no fp16 scale and offset per 32 weights; expected Q4_0 or Q4_1")
    size = BLOCKS[kind][1]
    rows, width = raw.shape
    if width % size:
        raise ValueError(f"a row of {width} bytes is not a whole number of {kind} blocks of {size} bytes")
    blocks = torch.from_numpy(np.ascontiguousarray(raw)).view(rows, width // size, size)
    if kind == "Q4_1":
        halves = blocks[..., :4].view(torch.float16)  # (rows, blocks, 2): d, m
        return blocks[..., 4:20], halves[..., 0], halves[..., 1]
    d = blocks[..., :2].view(torch.float16)[..., 0]
    return blocks[..., 2:18], d, -8 * d


def _fp16(blocks: np.ndarray, at: int, count: int = 1) -> np.ndarray:
    """The ``count`` (1 or 2) little-endian fp16s from byte ``at`` of each block, as float32 ``(..., count)``.
    They are gathered as whole integers (two fp16s as one 4-byte word where the blocks allow) into one
    contiguous run, then widened by PyTorch: a strided fp16 read is several times slower."""
    words = torch.from_numpy(blocks)
    if count == 2 and at % 4 == 0 and blocks.shape[-1] % 4 == 0:
        halves = words.view(torch.int32)[..., at // 4].contiguous()
    else:
        halves = words.view(torch.int16)[..., at // 2 : at // 2 + count].contiguous()
    return halves.view(torch.float16).float().view(*blocks.shape[:-1], count).numpy()


def _q4_0_1(blocks: np.ndarray, kind: str):
    if kind == "Q4_0":
        d = _fp16(blocks, 0)[..., 0]
        return blocks[..., 2:18], d, np.zeros_like(d)
    dm = _fp16(blocks, 0, 2)
    d = dm[..., 0]
    return blocks[..., 4:20], d, dm[..., 1] + 8 * d


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A K-quant super-block's eight six-bit scales and eight six-bit minimums from their 12 bytes (Q4_K, Q5_K)."""
    low, high = packed[..., 0:4], packed[..., 4:8]
    sc = np.concatenate([low & 63, (packed[..., 8:12] & 0x0F) | ((low >> 6) << 4)], axis=-1)
    mins = np.concatenate([high & 63, (packed[..., 8:12] >> 4) | ((high >> 6) << 4)], axis=-1)
    return sc, mins


def _q4_k(blocks: np.ndarray, kind: str):
    d, dmin = np.moveaxis(_fp16(blocks, 0, 2), -1, 0)
    sc, mins = _k_scales(blocks[..., 4:16].astype(np.uint8))  # 8 six-bit scales and mins in 12 bytes
    pairs = blocks[..., 16:144]  # four runs of 32 bytes: sub-blocks 2c and 2c + 1
    scales = d[..., None] * sc
    return pairs, scales, 8 * scales - dmin[..., None] * mins


def int8_blocks(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of Q8_0 blocks (34 bytes: an fp16 scale d, then 32 int8 codes q; each weight ``d q``) as the codes
    ``(rows, inputs)`` int8 and the scales ``(rows, inputs / 32)`` float32 (fp16's values, exactly)."""
    if raw.shape[1] % 34:
        raise ValueError(f"a row of {raw.shape[1]} bytes is not a whole number of Q8_0 blocks of 34 bytes")
    blocks = np.ascontiguousarray(raw).reshape(len(raw), -1, 34)
    codes = torch.from_numpy(blocks[..., 2:]).view(torch.int8).reshape(len(raw), -1)
    return codes, torch.from_numpy(_fp16(blocks, 0))[..., 0]


def q6_k_blocks(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of Q6_K blocks (210 bytes for 256 weights: 128 bytes of the codes' low four bits, 64 of their high two,
    16 int8 scales ``sc``, one per 16 weights, and an fp16 ``d``; each weight ``d · sc · (q - 32)``) as the codes
    ``q`` ``(rows, inputs)`` uint8 in 0..63, in the weights' order, ``d`` ``(rows, inputs / 256)`` float16 and
    ``sc`` ``(rows, inputs / 16)`` int8, the numbers as stored.

    In a block each half of 128 weights has 64 bytes of low bits and 32 of high ones: weight ``32 k + l`` of the
    half (``k`` 0..3) takes the low nibble of byte ``l`` (k = 0), of ``32 + l`` (1), their high nibbles (2, 3),
    and bits ``2 k``, ``2 k + 1`` of high byte ``l``."""
    if raw.shape[1] % 210:
        raise ValueError(f"a row of {raw.shape[1]} bytes is not a whole number of Q6_K blocks of 210 bytes")
    rows = len(raw)
    blocks = torch.from_numpy(np.ascontiguousarray(raw)).view(rows, -1, 210)
    low = blocks[..., :128].reshape(rows, -1, 2, 2, 32)  # (half, byte run 0..31 or 32..63, l)
    high = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32)
    nibbles = torch.stack([low[..., 0, :] & 15, low[..., 1, :] & 15, low[..., 0, :] >> 4, low[..., 1, :] >> 4], 3)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
    q = nibbles | ((high >> shifts) & 3) << 4  # (rows, blocks, half, k, l)
    d = blocks[..., 208:210].contiguous().view(torch.float16)[..., 0]
    return q.reshape(rows, -1), d, blocks[..., 192:208].contiguous().view(torch.int8).reshape(rows, -1)


def q5_k_blocks(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of Q5_K blocks (176 bytes for 256 weights: fp16 ``d`` and ``dmin``, eight six-bit scales ``sc`` and
    minimums ``m`` in 12 bytes, 32 bytes of the codes' fifth bits, 128 of their low four; weight ``j`` of sub-block
    ``b`` is ``d · sc_b · q_j - dmin · m_b``) as the codes ``q`` ``(rows, inputs)`` uint8 in 0..31, in the weights'
    order, ``d`` and ``dmin`` ``(rows, inputs / 256, 2)`` float16, and the scales and minimums ``(rows, inputs /
    32)`` uint8 each, the numbers as stored.

    Sub-blocks ``2 c`` and ``2 c + 1`` share 32 bytes of low bits (the low and the high nibble of byte ``l`` for
    their weight ``l``) and take their fifth bits from bits ``2 c`` and ``2 c + 1`` of fifth-bit byte ``l``."""
    if raw.shape[1] % 176:
        raise ValueError(f"a row of {raw.shape[1]} bytes is not a whole number of Q5_K blocks of 176 bytes")
    rows = len(raw)
    array = np.ascontiguousarray(raw).reshape(rows, -1, 176)
    sc, mins = _k_scales(array[..., 4:16])
    blocks = torch.from_numpy(array)
    low = blocks[..., 48:176].reshape(rows, -1, 4, 1, 32)  # (c, l)
    nibbles = torch.cat([low & 15, low >> 4], dim=3)  # (rows, blocks, c, 2, l): sub-block 2 c + h
    shifts = torch.arange(8, dtype=torch.uint8).view(4, 2, 1)
    fifth = (blocks[..., 16:48].reshape(rows, -1, 1, 1, 32) >> shifts) & 1
    q = nibbles | fifth << 4
    dm = blocks[..., :4].contiguous().view(torch.float16)
    return (q.reshape(rows, -1), dm, torch.from_numpy(sc.reshape(rows, -1).copy()),
            torch.from_numpy(mins.reshape(rows, -1).copy()))


def dequantized_rows(kind: str, raw: np.ndarray, tensor_type) -> np.ndarray:
    """Rows of any format the ``gguf`` package reads, as float32 ``(rows, inputs)``; ``tensor_type`` is its
    ``GGMLQuantizationType``. Q8_0, most files' token table, is decoded here, in PyTorch: each weight is its
    int8 code times its block's fp16 scale, a product float32 holds exactly, so the bits are the package's."""
    if kind == "Q8_0":
        codes, scales = int8_blocks(raw)
        return (codes.view(len(raw), -1, GROUP) * scales[..., None]).view(len(raw), -1).numpy()
    from gguf.quants import dequantize

    try:
        return np.asarray(dequantize(raw, tensor_type), dtype=np.float32)
    except NotImplementedError:
        raise ValueError(f"tensors stored as {kind} cannot be decoded by the gguf package") from None


__all__ = ["GROUP", "REPACKED", "SPANS", "dequantized_rows", "int4_groups", "int4_halves", "int8_blocks",
           "q5_k_blocks", "q6_k_blocks"]
