"""qkv's kernel on GGUF's Q6_K blocks as stored (q4.c's Q6): a file's blocks decoded as the ``gguf`` package decodes
them, each block's integer sum exact in every variant, the product the float product of the same weights within the
error int8 activations add, and the SIMD variants equal to one another bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qkv import kernels
from qkv.interop.ggml_blocks import q6_k_blocks

pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.why_not() or "available")

BLOCK, SUPER = kernels.BLOCK, kernels.SUPER
VARIANTS = [pytest.param(v, marks=pytest.mark.skipif(kernels.available() and not kernels.runs(v),
                                                      reason=f"this CPU does not run {v}")) for v in kernels.VARIANTS]


def q6_file_rows(rows: int, n: int, seed: int = 0) -> np.ndarray:
    """Random Q6_K rows as a file stores them: any code bits and scales, a finite fp16 d per super-block."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, n // SUPER * 210), dtype=np.uint8)
    d = (rng.standard_normal((rows, n // SUPER)) * 1e-3).astype(np.float16)
    raw.reshape(rows, -1, 210)[..., 208:] = d.view(np.uint8).reshape(rows, -1, 2)
    return raw


def widened(q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """The weights ``d · sc · (q - 32)``, float64."""
    return (d.double().repeat_interleave(SUPER, 1) * sc.double().repeat_interleave(16, 1) * (q.double() - 32))


def test_q6_k_blocks_are_read_as_the_gguf_package_reads_them():
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize

    raw = q6_file_rows(5, 768)
    q, d, sc = q6_k_blocks(raw)
    assert q.shape == (5, 768) and int(q.max()) == 63 and int(q.min()) == 0
    expected = np.asarray(dequantize(raw, gguf.GGMLQuantizationType.Q6_K), dtype=np.float32)
    assert np.array_equal(widened(q, d, sc).float().numpy(), expected)  # d · sc exact in fp32, times q - 32 too


def test_a_row_that_is_not_whole_q6_k_blocks_is_refused():
    with pytest.raises(ValueError, match="not a whole number of Q6_K blocks"):
        q6_k_blocks(np.zeros((2, 300), dtype=np.uint8))
    q, d, sc = q6_k_blocks(q6_file_rows(2, 256))
    with pytest.raises(ValueError, match="super-blocks of 256"):
        kernels.q6_codes(q[:, :224])
    with pytest.raises(ValueError, match="super-blocks of 256"):  # codes of one pair of blocks: 64 inputs
        kernels.matmul(torch.randn(1, 64), kernels.q6_codes(q)[:, :1].contiguous(), d, sc[:, :4])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("rows", "n"), [(1, 256), (7, 512), (13, 1536)])
def test_each_q6_block_sum_is_the_exact_integer_sum(variant, rows, n):
    q, _, sc = q6_k_blocks(q6_file_rows(rows, n, seed=rows))
    q, sc = q.clone(), sc.clone()
    q[0, :16], q[0, 16:32], sc[0, :2] = 0, 63, torch.tensor([-128, 127])  # the extremes: -32 and 31 by -128, 127
    xq = torch.randint(-127, 128, (n,), dtype=torch.int8)
    xq[:BLOCK] = torch.tensor([127, -127] * (BLOCK // 2), dtype=torch.int8)
    halves = ((q.long() - 32) * xq.long()).view(rows, -1, 16).sum(-1)
    expected = (halves * sc.long()).view(rows, -1, 2).sum(-1)
    assert torch.equal(kernels.block_sums(kernels.q6_codes(q), xq, variant=variant, sub=sc).long(), expected)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("batch", "rows", "n"), [(1, 1, 256), (3, 13, 512), (5, 33, 1536)])
@pytest.mark.parametrize("threads", [1, 4])
def test_the_q6_product_is_the_float_product_within_the_int8_activations_error(variant, batch, rows, n, threads):
    q, d, sc = q6_k_blocks(q6_file_rows(rows, n, seed=batch))
    x = torch.randn(batch, n)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = kernels.matmul(x, kernels.q6_codes(q), d, sc, variant=variant)
    finally:
        torch.set_num_threads(before)
    w = widened(q, d, sc)
    exact = x.double() @ w.T
    half_step = (x.view(batch, -1, BLOCK).abs().amax(-1) / 254).repeat_interleave(BLOCK, 1).double()
    bound = half_step @ w.abs().T + 1e-4 * (x.double().abs() @ w.abs().T)  # + float32 rounding
    assert ((y.double() - exact).abs() <= bound).all()
    # and the same arithmetic on the int8-rounded inputs, up to the order of the float sums
    torch.testing.assert_close(y, kernels.rounded_activations(x) @ w.float().T, rtol=1e-5, atol=1e-5)


def test_the_simd_q6_variants_give_the_same_bits():
    simd = [v for v in kernels.VARIANTS[1:] if kernels.runs(v)]
    if len(simd) < 2:
        pytest.skip("this CPU runs one SIMD variant")
    q, d, sc = q6_k_blocks(q6_file_rows(40, 2048, seed=9))
    x = torch.randn(6, 2048)
    outputs = [kernels.matmul(x, kernels.q6_codes(q), d, sc, variant=v) for v in simd]
    assert all(torch.equal(outputs[0], y) for y in outputs[1:])
