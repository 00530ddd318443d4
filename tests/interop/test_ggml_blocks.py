"""ggml's 4-bit blocks read as qkv's int4 groups give back, weight for weight, what the gguf package's own
dequantizer gives (the independent reference), for random blocks of every repacked format; Q8_0, which qkv
decodes itself, gives the package's bits."""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="reading GGUF files needs the gguf package: pip install gguf")

import torch  # noqa: E402

from qkv.interop.ggml_blocks import SPANS, dequantized_rows, int4_groups  # noqa: E402
from qkv.quantized import unpaired  # noqa: E402


def _random_rows(kind: str, rows: int, inputs: int, seed: int = 0) -> np.ndarray:
    """Real blocks of ``kind``: random fp32 weights quantized by the gguf package (random bytes would hold NaN
    scales); Q4_K, which the package does not write, as random bytes behind finite fp16 d and dmin."""
    rng = np.random.default_rng(seed)
    if kind == "Q4_K":
        blocks = rng.integers(0, 256, (rows, inputs // 256, 144), dtype=np.uint8)
        scales = rng.uniform(1e-3, 0.1, (rows, inputs // 256, 2)).astype(np.float16)
        blocks[..., :4] = scales.view(np.uint8).reshape(rows, inputs // 256, 4)
        return blocks.reshape(rows, -1)
    w = (rng.standard_normal((rows, inputs)) * rng.uniform(0.01, 1.0, (rows, 1))).astype(np.float32)
    w[0, :7] = 3.0  # an outlier group
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_int4_groups_are_the_weights_ggml_decodes(kind):
    raw = _random_rows(kind, rows=5, inputs=512)
    pairs, scales, zeros = int4_groups(kind, raw)
    codes = unpaired(torch.from_numpy(pairs).reshape(5, -1), SPANS[kind]).numpy()
    assert pairs.shape[0] == 5 and pairs[0].size == 256 and codes.shape == (5, 512)
    assert scales.shape == zeros.shape == (5, 16)
    assert codes.min() >= 0 and codes.max() <= 15
    ours = (codes.astype(np.float32) - 8).reshape(5, 16, 32) * scales[..., None] + zeros[..., None]
    reference = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
    np.testing.assert_allclose(ours.reshape(5, 512), reference, rtol=1e-5, atol=1e-6)


def test_other_formats_and_broken_rows_are_refused():
    with pytest.raises(ValueError, match="Q8_0 blocks have no int4 form"):
        int4_groups("Q8_0", np.zeros((1, 34), np.uint8))
    with pytest.raises(ValueError, match="a row of 19 bytes is not a whole number of Q4_0 blocks of 18 bytes"):
        int4_groups("Q4_0", np.zeros((1, 19), np.uint8))


def test_q8_0_rows_are_the_packages_bits():
    """Every int8 code (-128 included) times fp16 scales of every kind: negative, subnormal, the largest."""
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (7, 6, 34), dtype=np.uint8)
    scales = np.array([1e-3, -0.5, 6e-8, 65504.0, -2.0, 0.0], dtype=np.float16)
    blocks[..., :2] = scales.view(np.uint8).reshape(1, 6, 2)
    raw = blocks.reshape(7, -1)
    ours = dequantized_rows("Q8_0", raw, gguf.GGMLQuantizationType.Q8_0)
    reference = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0)
    assert ours.dtype == np.float32 and ours.shape == (7, 192)
    np.testing.assert_array_equal(ours, reference)
