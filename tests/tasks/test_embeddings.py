"""Sentence embeddings with a small random BERT: pooling, batching invariance, normalisation, truncation,
search and attention maps. (Parity with sentence-transformers: tests/interop/test_sentence.py.)"""

import pytest
import torch
import torch.nn.functional as F

from qkv import BERT, BERTConfig
from qkv.tasks.embeddings import cosine_similarity, embed, pool, search, self_attention
from qkv.tokenizers import WordPieceTokenizer

TEXTS = ["a cat sat on the mat", "dogs bark", "the weather is nice today in the park", "x",
         "cats and dogs and birds and fish and more cats"]


@pytest.fixture(scope="module")
def tok():
    return WordPieceTokenizer.train(TEXTS * 3, vocab_size=100, min_frequency=1)


@pytest.fixture(scope="module")
def bert(tok):
    torch.manual_seed(0)
    return BERT(BERTConfig(vocab_size=tok.vocab_size, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_seq_len=16,
                           dropout=0.1, pad_id=tok.pad_id)).eval()


def test_mean_pooling_ignores_padding():
    hidden = torch.randn(2, 4, 3)
    mask = torch.tensor([[True, True, False, False], [True, True, True, True]])
    pooled = pool(hidden, mask, "mean")
    torch.testing.assert_close(pooled[0], hidden[0, :2].mean(0))
    torch.testing.assert_close(pooled[1], hidden[1].mean(0))
    torch.testing.assert_close(pool(hidden, mask, "cls"), hidden[:, 0])
    torch.testing.assert_close(pool(hidden, mask, "max")[0], hidden[0, :2].amax(0))
    assert torch.equal(pool(hidden, torch.zeros(2, 4, dtype=torch.bool), "mean"), torch.zeros(2, 3))  # no NaN
    with pytest.raises(ValueError, match="pooling must be one of"):
        pool(hidden, mask, "median")


@pytest.mark.parametrize("pooling", ["mean", "cls", "max"])
def test_a_sentence_embeds_the_same_alone_or_in_any_batch(bert, tok, pooling):
    together = embed(bert, tok, TEXTS, pooling=pooling, batch_size=2)
    for i, text in enumerate(TEXTS):
        torch.testing.assert_close(together[i], embed(bert, tok, [text], pooling=pooling)[0], atol=1e-5, rtol=1e-5)
    assert not bert.training  # dropout off: the same sentence gives the same vector twice


def test_vectors_are_unit_length_unless_asked_otherwise(bert, tok):
    normalized, raw = embed(bert, tok, TEXTS), embed(bert, tok, TEXTS, normalize=False)
    torch.testing.assert_close(normalized.norm(dim=-1), torch.ones(len(TEXTS)))
    torch.testing.assert_close(normalized, F.normalize(raw, dim=-1))
    assert not torch.allclose(raw.norm(dim=-1), torch.ones(len(TEXTS)))


def test_long_inputs_are_cut_at_max_length(bert, tok):
    long = " ".join(TEXTS * 3)
    ids = tok.encode(long)
    cut = tok.decode(ids[:4])
    torch.testing.assert_close(embed(bert, tok, [long], max_length=6), embed(bert, tok, [cut], max_length=6))
    embed(bert, tok, [long])  # the model's own limit (16) by default: no error for a 60-token text
    with pytest.raises(ValueError, match=r"max_length must be in \[3, 16\]"):
        embed(bert, tok, TEXTS, max_length=17)


def test_bad_inputs_are_refused(bert, tok):
    with pytest.raises(ValueError, match="no sentences"):
        embed(bert, tok, [])
    with pytest.raises(TypeError, match="one str"):
        embed(bert, tok, "a cat")
    with pytest.raises(TypeError, match=r"texts\[1\] must be a str"):
        embed(bert, tok, ["a", 2])
    with pytest.raises(ValueError, match="batch_size"):
        embed(bert, tok, TEXTS, batch_size=0)


def test_search_ranks_by_cosine():
    corpus = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.0]])
    queries = torch.tensor([[2.0, 0.1], [0.0, -1.0]])
    scores, indices = search(queries, corpus, k=3)
    assert indices.tolist() == [[0, 2, 1], [3, 0, 2]]
    expected = F.cosine_similarity(queries[:, None], corpus[None], dim=-1)
    torch.testing.assert_close(cosine_similarity(queries, corpus), expected)
    torch.testing.assert_close(scores, expected.gather(1, indices))
    assert search(queries, corpus, k=10)[1].shape == (2, 4)
    with pytest.raises(ValueError, match="k must be >= 1"):
        search(queries, corpus, k=0)
    with pytest.raises(ValueError, match=r"\(N, D\) and \(M, D\)"):
        cosine_similarity(queries, torch.ones(3, 5))


def test_self_attention_of_any_layer_and_head(bert, tok):
    per_head = [self_attention(bert, tok, TEXTS[2], layer=1, head=h)[0] for h in range(4)]
    mean, tokens = self_attention(bert, tok, TEXTS[2], layer=-1)
    assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]" and mean.shape == (len(tokens), len(tokens))
    torch.testing.assert_close(mean, torch.stack(per_head).mean(0))
    torch.testing.assert_close(per_head[0].sum(-1), torch.ones(len(tokens)))
    assert not torch.allclose(per_head[0], per_head[1])
    assert not torch.allclose(self_attention(bert, tok, TEXTS[2], layer=0)[0], mean)
    with pytest.raises(ValueError, match=r"layer must be in \[-2, 1\], got 2"):
        self_attention(bert, tok, "x", layer=2)
    with pytest.raises(ValueError, match=r"head must be in \[0, 3\], got 4"):
        self_attention(bert, tok, "x", head=4)
