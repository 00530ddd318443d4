"""Position encodings: the sinusoid formula, learned tables, and RoPE's relative-position property."""

import math

import pytest
import torch

from qkv.nn import LearnedPositionalEmbedding, RotaryEmbedding, SinusoidalPositionalEncoding


def test_sinusoidal_matches_the_formula():
    d, enc = 16, SinusoidalPositionalEncoding(16, 50)
    table = enc(torch.arange(50))
    for pos in (0, 1, 7, 49):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert math.isclose(table[pos, 2 * i].item(), math.sin(angle), abs_tol=1e-6)
            assert math.isclose(table[pos, 2 * i + 1].item(), math.cos(angle), abs_tol=1e-6)


def test_sinusoidal_table_is_a_buffer_not_a_weight():
    enc = SinusoidalPositionalEncoding(16, 50)
    assert list(enc.parameters()) == [] and "pe" not in enc.state_dict()


@pytest.mark.parametrize("cls", [SinusoidalPositionalEncoding, LearnedPositionalEmbedding])
def test_positions_beyond_the_table_raise(cls):
    enc = cls(8, 10)
    assert enc(torch.arange(10)).shape == (10, 8)
    assert enc(torch.arange(6).view(2, 3)).shape == (2, 3, 8)
    with pytest.raises(ValueError, match="position 10 is beyond max_seq_len=10"):
        enc(torch.arange(11))


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_scores_depend_only_on_relative_position(interleaved):
    rope = RotaryEmbedding(32, interleaved=interleaved)
    q, k = torch.randn(1, 1, 1, 32), torch.randn(1, 1, 1, 32)

    def score(m, n):
        return (rope(q, torch.tensor([m])) * rope(k, torch.tensor([n]))).sum().item()

    for m, n in [(0, 0), (5, 2), (3, 9)]:
        for shift in (1, 17, 300):
            assert math.isclose(score(m, n), score(m + shift, n + shift), rel_tol=1e-4, abs_tol=1e-4)
    assert not math.isclose(score(5, 2), score(2, 5), rel_tol=1e-3)


def test_rope_is_a_rotation():
    rope = RotaryEmbedding(16)
    x = torch.randn(2, 3, 10, 16)
    y = rope(x, torch.arange(10))
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[:, :, 0], x[:, :, 0])  # position 0: angle 0


def test_rope_pair_layouts_agree_up_to_a_permutation():
    """The half-split layout is the interleaved one with features reordered (0,2,4,..,1,3,5,..)."""
    half, inter = RotaryEmbedding(8), RotaryEmbedding(8, interleaved=True)
    x = torch.randn(1, 2, 5, 8)
    perm = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])  # interleaved index of each half-layout feature
    pos = torch.arange(5)
    torch.testing.assert_close(half(x[..., perm], pos), inter(x, pos)[..., perm])


def test_rope_rotates_the_first_pair_by_position_times_one():
    rope = RotaryEmbedding(4)  # theta_0 = 1: the first pair turns by exactly `pos` radians
    x = torch.tensor([1.0, 0.0, 0.0, 0.0]).view(1, 1, 1, 4)
    y = rope(x, torch.tensor([2]))
    torch.testing.assert_close(y[0, 0, 0, [0, 2]], torch.tensor([math.cos(2.0), math.sin(2.0)]))


def test_rope_per_sequence_positions():
    rope = RotaryEmbedding(8)
    x = torch.randn(2, 1, 4, 8)
    positions = torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]])
    y = rope(x, positions)
    torch.testing.assert_close(y[1:], rope(x[1:], torch.arange(5, 9)))
