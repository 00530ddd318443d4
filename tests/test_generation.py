"""Decoding: greedy and beam search over the KV-cached decoder, and the invariants between them."""

import pytest
import torch

from qkv import Transformer, TransformerConfig
from qkv.generation import beam_search, greedy, length_penalty
from qkv.tasks.translation import translate_ids

BOS, EOS = 1, 2


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(1)
    cfg = TransformerConfig(src_vocab_size=40, tgt_vocab_size=30, d_model=32, n_heads=4, n_layers=2, d_ff=64,
                            dropout=0.0, max_seq_len=64)
    m = Transformer(cfg).eval()
    with torch.no_grad():  # sharper, more varied distributions than the initialisation gives
        for p in m.parameters():
            p.mul_(3.0)
    return m


def sources(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 9, (n,), generator=g).tolist()
    return [torch.randint(4, 40, (n_,), generator=g).tolist() for n_ in lengths]


def batch(srcs):
    return torch.nn.utils.rnn.pad_sequence([torch.tensor(s) for s in srcs], batch_first=True, padding_value=0)


def reference_greedy(model, src, steps):
    """Greedy decoding the slow, obvious way: rerun the whole model on the whole prefix at every step."""
    ys = [BOS]
    for _ in range(steps):
        nxt = model(torch.tensor([src]), torch.tensor([ys]))[0, -1].argmax().item()
        ys.append(nxt)
        if nxt == EOS:
            break
    out = ys[1:]
    return out[: out.index(EOS)] if EOS in out else out


def test_greedy_matches_the_obvious_implementation(model):
    srcs = sources()
    got = greedy(model.start_decoding(batch(srcs)), bos_id=BOS, eos_id=EOS, max_new_tokens=12)
    assert got == [reference_greedy(model, s, 12) for s in srcs]
    assert any(len(g) < 12 for g in got) and any(len(g) > 0 for g in got)  # the test exercises stopping


def test_cached_equals_uncached(model):
    srcs = sources(seed=3)
    for search in (greedy, lambda d, **kw: beam_search(d, beam_size=3, **kw)):
        cached = search(model.start_decoding(batch(srcs)), bos_id=BOS, eos_id=EOS, max_new_tokens=12)
        uncached = search(model.start_decoding(batch(srcs), use_cache=False), bos_id=BOS, eos_id=EOS,
                          max_new_tokens=12)
        assert cached == uncached


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_beam_size_one_is_greedy(model, alpha):
    srcs = sources(seed=5)
    g = greedy(model.start_decoding(batch(srcs)), bos_id=BOS, eos_id=EOS, max_new_tokens=12)
    b = beam_search(model.start_decoding(batch(srcs)), bos_id=BOS, eos_id=EOS, max_new_tokens=12, beam_size=1,
                    alpha=alpha)
    assert b == g


def test_batched_beam_search_equals_one_sentence_at_a_time(model):
    srcs = sources(n=5, seed=7)
    batched = beam_search(model.start_decoding(batch(srcs)), bos_id=BOS, eos_id=EOS, max_new_tokens=12,
                          beam_size=4)
    alone = [beam_search(model.start_decoding(batch([s])), bos_id=BOS, eos_id=EOS, max_new_tokens=12,
                         beam_size=4)[0] for s in srcs]
    assert batched == alone


def sequence_logprob(model, src, hyp):
    tgt_in = torch.tensor([[BOS, *hyp]])
    logp = torch.log_softmax(model(torch.tensor([src]), tgt_in)[0], -1)
    return sum(logp[i, t].item() for i, t in enumerate([*hyp, EOS]))


def test_beam_search_finds_at_least_as_likely_translations_as_greedy(model):
    srcs = sources(n=8, seed=11)
    g = greedy(model.start_decoding(batch(srcs)), bos_id=BOS, eos_id=EOS, max_new_tokens=30)
    b = beam_search(model.start_decoding(batch(srcs)), bos_id=BOS, eos_id=EOS, max_new_tokens=30, beam_size=5,
                    alpha=0.0)
    finished = [i for i in range(len(srcs)) if len(g[i]) < 30 and len(b[i]) < 30]
    assert finished
    for i in finished:  # with α = 0 beam search maximises the plain log-probability
        assert sequence_logprob(model, srcs[i], b[i]) >= sequence_logprob(model, srcs[i], g[i]) - 1e-4
    assert any(b[i] != g[i] for i in finished)


def test_length_penalty_formula():
    torch.testing.assert_close(length_penalty(torch.tensor([1.0, 7.0]), 1.0), torch.tensor([1.0, 2.0]))
    assert (length_penalty(torch.tensor([3.0, 50.0]), 0.0) == 1).all()


def test_translate_ids_keeps_input_order(model):
    srcs = sources(n=9, seed=13)
    together = translate_ids(model, srcs, batch_tokens=20)  # several length-sorted batches
    assert together == [translate_ids(model, [s])[0] for s in srcs]
