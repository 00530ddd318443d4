"""qkv's kernel on GGUF's K-quant blocks as stored, Q6_K and Q5_K (q4.c's Q6 and Q5): a file's blocks decoded as the
``gguf`` package decodes them, each block's integer sum exact in every variant, the product the float product of
the same weights within the error int8 activations add, and the SIMD variants equal to one another bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qkv import kernels
from qkv.interop.ggml_blocks import q5_k_blocks, q6_k_blocks

pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.why_not() or "available")

BLOCK, SUPER = kernels.BLOCK, kernels.SUPER
VARIANTS = [pytest.param(v, marks=pytest.mark.skipif(kernels.available() and not kernels.runs(v),
                                                      reason=f"this CPU does not run {v}")) for v in kernels.VARIANTS]
# A K-quant block's sum alone (kernels.block_sums) has one SIMD product, avx2's, for both SIMD variants; the
# AVX-512 variant's K-quant code takes a pair of blocks across a whole row, reached by kernels.matmul only: the
# product tests below and the bit-for-bit comparison of the SIMD variants hold it (a wrong scale for one of its
# half-blocks fails 14 of them).
BLOCK_SUM_VARIANTS = VARIANTS[: kernels.VARIANTS.index("avx2") + 1]
KINDS = ["Q6_K", "Q5_K"]
BYTES = {"Q6_K": 210, "Q5_K": 176}  # a super-block's
SCALES_AT = {"Q6_K": 208, "Q5_K": 0}  # where its fp16 scale (Q5_K: d and dmin) lies


def file_rows(kind: str, rows: int, n: int, seed: int = 0) -> np.ndarray:
    """Random rows of ``kind`` blocks as a file stores them: any code bits and small scales, finite fp16 ``d``
    (and ``dmin``)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, n // SUPER * BYTES[kind]), dtype=np.uint8)
    halves = 1 if kind == "Q6_K" else 2
    d = (rng.standard_normal((rows, n // SUPER, halves)) * 1e-3).astype(np.float16)
    at = SCALES_AT[kind]
    raw.reshape(rows, -1, BYTES[kind])[..., at : at + 2 * halves] = d.view(np.uint8).reshape(rows, -1, 2 * halves)
    return raw


def decoded(kind: str, raw: np.ndarray) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's buffers (codes, scales, offsets) of ``raw``, its codes ``q``, the scales each block's integer
    sum is multiplied by (Q6_K: per 16 inputs; Q5_K: per 32), and the weights in float64."""
    if kind == "Q6_K":
        q, d, sc = q6_k_blocks(raw)
        weights = d.double().repeat_interleave(SUPER, 1) * sc.double().repeat_interleave(16, 1) * (q.double() - 32)
        return (kernels.q6_codes(q), d, sc), q, sc, weights
    q, dm, sc, mins = q5_k_blocks(raw)
    d, dmin = (t.double().repeat_interleave(SUPER, 1) for t in dm.unbind(-1))
    scales, minimums = (t.double().repeat_interleave(BLOCK, 1) for t in (sc, mins))
    weights = d * scales * q.double() - dmin * minimums
    return (kernels.q5_codes(q), dm, torch.stack([sc, mins], dim=1).contiguous()), q, sc, weights


@pytest.mark.parametrize("kind", KINDS)
def test_k_quant_blocks_are_read_as_the_gguf_package_reads_them(kind):
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize

    raw = file_rows(kind, 5, 768)
    _, q, _, weights = decoded(kind, raw)
    assert q.shape == (5, 768) and int(q.min()) == 0 and int(q.max()) == (63 if kind == "Q6_K" else 31)
    expected = np.asarray(dequantize(raw, gguf.GGMLQuantizationType[kind]), dtype=np.float32)
    assert np.array_equal(weights.float().numpy(), expected)  # each product exact in fp32 as in fp64


def test_rows_that_are_not_whole_k_quant_blocks_are_refused():
    with pytest.raises(ValueError, match="not a whole number of Q6_K blocks"):
        q6_k_blocks(np.zeros((2, 300), dtype=np.uint8))
    with pytest.raises(ValueError, match="not a whole number of Q5_K blocks"):
        q5_k_blocks(np.zeros((2, 300), dtype=np.uint8))
    q, d, sc = q6_k_blocks(file_rows("Q6_K", 2, 256))
    with pytest.raises(ValueError, match="super-blocks of 256"):
        kernels.q6_codes(q[:, :224])
    with pytest.raises(ValueError, match="super-blocks of 256"):
        kernels.q5_codes(q[:, :224] & 31)
    with pytest.raises(ValueError, match="super-blocks of 256"):  # codes of one pair of blocks: 64 inputs
        kernels.matmul(torch.randn(1, 64), kernels.q6_codes(q)[:, :1].contiguous(), d, sc[:, :4])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("variant", BLOCK_SUM_VARIANTS)
@pytest.mark.parametrize(("rows", "n"), [(1, 256), (7, 512), (13, 1536)])
def test_each_k_quant_block_sum_is_the_exact_integer_sum(kind, variant, rows, n):
    raw = file_rows(kind, rows, n, seed=rows)
    _, q, sc, _ = decoded(kind, raw)
    q, sc = q.clone(), sc.clone()
    if kind == "Q6_K":  # the extremes: -32 and 31 by -128 and 127
        q[0, :16], q[0, 16:32], sc[0, :2] = 0, 63, torch.tensor([-128, 127])
        codes = kernels.q6_codes(q)
    else:  # 31 by 63
        q[0, :32], sc[0, 0] = 31, 63
        codes = kernels.q5_codes(q)
    xq = torch.randint(-127, 128, (n,), dtype=torch.int8)
    xq[:BLOCK] = torch.tensor([127, -127] * (BLOCK // 2), dtype=torch.int8)
    shifted = q.long() - 32 if kind == "Q6_K" else q.long()
    width = 16 if kind == "Q6_K" else BLOCK
    parts = (shifted * xq.long()).view(rows, -1, width).sum(-1) * sc.long()
    expected = parts.view(rows, -1, BLOCK // width).sum(-1)
    assert torch.equal(kernels.block_sums(codes, xq, variant=variant, sub=sc).long(), expected)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("batch", "rows", "n"), [(1, 1, 256), (3, 13, 512), (5, 33, 1536)])
@pytest.mark.parametrize("threads", [1, 4])
def test_the_k_quant_product_is_the_float_product_within_the_int8_activations_error(kind, variant, batch, rows, n,
                                                                                     threads):
    buffers, _, _, w = decoded(kind, file_rows(kind, rows, n, seed=batch))
    x = torch.randn(batch, n, generator=torch.Generator().manual_seed(batch))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = kernels.matmul(x, *buffers, variant=variant)
    finally:
        torch.set_num_threads(before)
    exact = x.double() @ w.T
    half_step = (x.view(batch, -1, BLOCK).abs().amax(-1) / 254).repeat_interleave(BLOCK, 1).double()
    bound = half_step @ w.abs().T + 1e-4 * (x.double().abs() @ w.abs().T)  # + float32 rounding
    assert ((y.double() - exact).abs() <= bound).all()
    # and the same arithmetic on the int8-rounded inputs, up to float32 sums taken in another order (a few units of
    # float32's last place of the sum of the products' sizes: the BLAS of each CPU sums in its own order)
    rounded = kernels.rounded_activations(x).double()
    sizes = rounded.abs() @ w.abs().T
    assert ((y.double() - rounded @ w.T).abs() <= 4e-6 * sizes + 1e-7).all()


@pytest.mark.parametrize("kind", KINDS)
def test_the_simd_variants_give_the_same_bits(kind):
    simd = [v for v in kernels.VARIANTS[1:] if kernels.runs(v)]
    if len(simd) < 2:
        pytest.skip("this CPU runs one SIMD variant")
    buffers, _, _, _ = decoded(kind, file_rows(kind, 40, 2048, seed=9))
    x = torch.randn(6, 2048)
    outputs = [kernels.matmul(x, *buffers, variant=v) for v in simd]
    assert all(torch.equal(outputs[0], y) for y in outputs[1:])
