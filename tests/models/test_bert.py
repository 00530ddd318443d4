"""Encoder-only BERT: bidirectional attention, padding, token types, pooler, errors."""

import pytest
import torch

from qkv import BERT, BERTConfig
from qkv.models.common import WithAttention


def small(**overrides) -> BERT:
    cfg = dict(vocab_size=60, d_model=32, n_heads=4, n_layers=2, max_seq_len=20, dropout=0.0)
    return BERT(BERTConfig(**{**cfg, **overrides})).eval()


def test_every_token_sees_every_other():
    model = small()
    ids = torch.randint(1, 60, (1, 8))
    changed = ids.clone()
    changed[0, 7] = (ids[0, 7] % 59) + 1
    assert not torch.allclose(model(changed)[0, 0], model(ids)[0, 0])  # the last token changes the first


def test_padded_batch_equals_each_sequence_alone():
    model = small()
    seqs = [torch.randint(1, 60, (n,)) for n in (8, 3, 5)]
    batch = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=0)
    types = (torch.arange(8) >= 2).long().expand(3, 8)
    hidden = model(batch, token_type_ids=types)
    explicit = model(batch, attention_mask=(batch != 0).long(), token_type_ids=types)  # HF-style 0/1 mask
    torch.testing.assert_close(hidden, explicit)
    for i, s in enumerate(seqs):
        alone = model(s[None], token_type_ids=types[:1, : len(s)])[0]
        torch.testing.assert_close(hidden[i, : len(s)], alone, atol=1e-5, rtol=1e-5)


def test_without_positions_self_attention_is_permutation_equivariant():
    model = small(positional="none")
    ids = torch.randint(1, 60, (2, 9))
    perm = torch.randperm(9)
    torch.testing.assert_close(model(ids[:, perm]), model(ids)[:, perm], atol=1e-5, rtol=1e-5)


def test_token_types_matter_and_pooler():
    model = small()
    ids = torch.randint(1, 60, (2, 6))
    assert not torch.allclose(model(ids), model(ids, token_type_ids=torch.ones_like(ids)))
    pooled = model.pool(model(ids))
    assert pooled.shape == (2, 32) and pooled.abs().max() <= 1
    result = model(ids, return_attention=True)
    assert isinstance(result, WithAttention)
    torch.testing.assert_close(result.output, model(ids))
    assert len(result.attention) == 2 and result.attention[1].shape == (2, 4, 6, 6)


def test_errors():
    model = small()
    with pytest.raises(ValueError, match="token_type_ids holds token id 2"):
        model(torch.ones(1, 4, dtype=torch.long), token_type_ids=torch.full((1, 4), 2))
    with pytest.raises(ValueError, match="token_type_ids must have the shape of ids"):
        model(torch.ones(1, 4, dtype=torch.long), token_type_ids=torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="position 20 is beyond max_seq_len=20"):
        model(torch.ones(1, 21, dtype=torch.long))
    with pytest.raises(ValueError, match="pooler=False"):
        small(pooler=False).pool(torch.randn(1, 3, 32))
