"""Masks against their definitions, checked entry by entry over many sizes (hypothesis)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from qkv.nn import causal_mask, key_padding_to_attention, padding_mask, sliding_window_mask

sizes = st.integers(1, 12).flatmap(lambda t_k: st.tuples(st.integers(1, t_k), st.just(t_k)))


@given(sizes)
def test_causal_mask_lets_a_query_see_itself_and_the_past(t):
    t_q, t_k = t
    mask = causal_mask(t_q, t_k)
    offset = t_k - t_q  # queries are the last t_q positions
    assert mask.shape == (t_q, t_k) and mask.dtype == torch.bool
    for i in range(t_q):
        for j in range(t_k):
            assert mask[i, j] == (j <= offset + i)


@given(sizes, st.integers(1, 6), st.booleans())
def test_sliding_window_mask(t, window, causal):
    t_q, t_k = t
    mask = sliding_window_mask(t_q, t_k, window=window, causal=causal)
    offset = t_k - t_q
    for i in range(t_q):
        for j in range(t_k):
            distance = offset + i - j
            expected = 0 <= distance < window if causal else abs(distance) < window
            assert mask[i, j] == expected
    assert mask.any(-1).all()  # every query sees at least itself


def test_window_as_long_as_the_sequence_is_causal():
    assert torch.equal(sliding_window_mask(6, window=6), causal_mask(6))


def test_padding_mask_and_broadcast_shape():
    ids = torch.tensor([[5, 6, 0, 0], [7, 0, 0, 0]])
    mask = padding_mask(ids, pad_id=0)
    assert mask.tolist() == [[True, True, False, False], [True, False, False, False]]
    assert key_padding_to_attention(mask).shape == (2, 1, 1, 4)


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="more queries than keys"):
        causal_mask(5, 3)
    with pytest.raises(ValueError, match="window must be a positive"):
        sliding_window_mask(3, window=0)
