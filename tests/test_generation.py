"""Decoding: greedy and beam search over the KV-cached decoder, and the invariants between them."""

import hashlib
from collections.abc import Callable

import pytest
import torch
from decoding_reference import exhaustive_search, reference_beam_search, reference_greedy

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


def test_greedy_matches_the_obvious_implementation(model):
    srcs = sources()
    got = greedy(model.start_decoding(batch(srcs)), bos_id=BOS, eos_id=EOS, max_new_tokens=12)
    assert got == [reference_greedy(model, s, 12, bos_id=BOS, eos_id=EOS) for s in srcs]
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


class PrefixDecoder:
    """An ``IncrementalDecoder`` without a model: the next-token logits are a fixed pseudo-random function of
    (input row, every token so far), so each sequence's probability is known exactly and beam search can be
    checked against trying every sequence."""

    def __init__(self, n_inputs: int, vocab: int) -> None:
        self.vocab = vocab
        self.rows: list[tuple[int, tuple[int, ...]]] = [(i, ()) for i in range(n_inputs)]  # (input, tokens)
        self.batch_size, self.device = n_inputs, torch.device("cpu")

    def logits(self, row: int, tokens: tuple[int, ...]) -> torch.Tensor:
        digest = hashlib.sha256(repr((row, tokens)).encode()).digest()  # a seed that depends on the whole prefix
        return torch.randn(self.vocab, generator=torch.Generator().manual_seed(int.from_bytes(digest[:8], "little")))

    def logprobs(self, row: int) -> Callable[[tuple[int, ...]], torch.Tensor]:
        """The next-token log-probabilities of input ``row`` after the generated ``prefix`` (``<s>`` first)."""
        return lambda prefix: torch.log_softmax(self.logits(row, (BOS, *prefix)).double(), -1)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.rows = [(row, (*seen, *new)) for (row, seen), new in zip(self.rows, tokens.tolist(), strict=True)]
        return torch.stack([self.logits(row, seen) for row, seen in self.rows])

    def reorder(self, index: torch.Tensor) -> None:
        self.rows = [self.rows[i] for i in index.tolist()]
        self.batch_size = len(self.rows)


# 4 tokens and </s>, a token budget per input: few enough sequences to try them all. The tests check that the
# problem is not trivial: some best outputs end with </s>, others run to their budget; greedy misses the best for
# some inputs; α changes it for some.
VOCAB, LIMITS, ALPHA = 5, [4, 3, 2, 4, 3, 2], 1.5


def exhaustive(alpha: float) -> list[list[tuple[float, list[int]]]]:
    decoder = PrefixDecoder(len(LIMITS), VOCAB)
    return [exhaustive_search(decoder.logprobs(row), max_len=limit, eos_id=EOS, alpha=alpha)
            for row, limit in enumerate(LIMITS)]


def search(beam_size: int, alpha: float, *, vocab: int = VOCAB, limits: list[int] = LIMITS) -> list[list[int]]:
    return beam_search(PrefixDecoder(len(limits), vocab), bos_id=BOS, eos_id=EOS, max_new_tokens=limits,
                       beam_size=beam_size, alpha=alpha)


@pytest.mark.parametrize("alpha", [0.0, ALPHA])
def test_a_beam_wide_enough_to_keep_everything_finds_the_exhaustive_optimum(alpha):
    """Alive at depth d: 4^d unfinished hypotheses and 4^0 + ... + 4^(d-1) that ended with </s>. A beam that
    wide drops none, so beam search must return the best of all sequences by its own score."""
    wide = max(4**n + sum(4**i for i in range(n)) for n in LIMITS)  # 341
    ranked = exhaustive(alpha)
    assert all(r[0][0] - r[1][0] > 1e-3 for r in ranked)  # no near-ties: one right answer per input
    best = [r[0][1] for r in ranked]
    assert {len(b) == limit for b, limit in zip(best, LIMITS, strict=True)} == {True, False}  # cut and ended
    if alpha:
        assert best != [r[0][1] for r in exhaustive(0.0)]  # the length penalty matters here
    assert search(wide, alpha) == best


def test_a_narrow_beam_never_beats_the_exhaustive_optimum():
    """At α = 0 the score is the plain log-probability: no beam finds a sequence more probable than the most
    probable one; greedy (beam 1) misses it here, so the search matters."""
    scores = [{tuple(hyp): score for score, hyp in r} for r in exhaustive(0.0)]
    optimum = [max(s.values()) for s in scores]
    for beam_size in (1, 2, 3, 8):
        found = [s[tuple(hyp)] for s, hyp in zip(scores, search(beam_size, 0.0), strict=True)]  # KeyError: invalid
        assert all(f <= o + 1e-9 for f, o in zip(found, optimum, strict=True))
        if beam_size == 1:
            assert any(f < o - 1e-3 for f, o in zip(found, optimum, strict=True))


@pytest.mark.parametrize("alpha", [0.0, ALPHA])
@pytest.mark.parametrize("beam_size", [1, 2, 3, 5])
def test_a_narrow_beam_keeps_what_a_written_out_beam_search_keeps(beam_size, alpha):
    """Which hypotheses a narrow beam prunes, checked on more inputs and longer outputs than can be enumerated."""
    vocab, limits = 6, [6, 5, 4, 3] * 4
    decoder = PrefixDecoder(len(limits), vocab)
    expected = [reference_beam_search(decoder.logprobs(row), beam_size=beam_size, max_len=limit, eos_id=EOS,
                                      alpha=alpha) for row, limit in enumerate(limits)]
    assert search(beam_size, alpha, vocab=vocab, limits=limits) == expected


def test_length_penalty_formula():
    torch.testing.assert_close(length_penalty(torch.tensor([1.0, 7.0]), 1.0), torch.tensor([1.0, 2.0]))
    assert (length_penalty(torch.tensor([3.0, 50.0]), 0.0) == 1).all()


def test_translate_ids_keeps_input_order(model):
    srcs = sources(n=9, seed=13)
    together = translate_ids(model, srcs, batch_tokens=20)  # several length-sorted batches
    assert together == [translate_ids(model, [s])[0] for s in srcs]
