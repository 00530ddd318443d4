"""Speculative decoding: drafts checked in one forward give plain decoding's greedy text, and sampled tokens
distributed as plain sampling's."""

import math
from collections import Counter

import pytest
import torch

from qkv import GPT, GPTConfig
from qkv.generation import LMDecoder, generate
from qkv.sampling import GREEDY, Sampling, next_token_logits
from qkv.speculative import DraftModel, Lookup, Speculation, accept

VOCAB = 40


def make(seed, preset="llama", vocab=VOCAB, layers=2):
    torch.manual_seed(seed)
    cfg = GPTConfig.from_preset(preset, vocab_size=vocab, d_model=32, n_heads=4, n_kv_heads=2, n_layers=layers,
                                d_ff=64, max_seq_len=96) if preset == "llama" else \
        GPTConfig(vocab_size=vocab, d_model=32, n_heads=4, n_layers=layers, d_ff=64, dropout=0.0, max_seq_len=96)
    model = GPT(cfg)
    with torch.no_grad():  # sharper distributions than the initialisation gives
        for p in model.parameters():
            p.mul_(3.0)
    return model.eval()


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model(request):
    return make(0, request.param)


# prompts that repeat themselves, so that prompt lookup has something to find
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [8], [9, 10, 11, 12, 13, 14, 9, 10, 11, 12], [15, 16, 15]]


def run(model, prompts=PROMPTS, speculation=None, n=24, **kwargs):
    decoder = LMDecoder(model, prompts)
    return generate(decoder, start=decoder.start, max_new_tokens=n, context=prompts, speculation=speculation,
                    **kwargs)


def test_lookup_proposes_what_followed_the_latest_match():
    lookup = Lookup(longest=3)
    assert lookup.find([1, 2, 3, 4, 5, 9, 2, 3], 2) == [4, 5]  # the tail (2, 3) seen before
    assert lookup.find([1, 2, 3, 7, 1, 2, 3, 8, 2, 3], 3) == [8, 2, 3]  # the latest occurrence
    assert lookup.find([3, 1, 2, 5, 9, 1, 2, 6, 3, 1, 2], 1) == [5]  # (3, 1, 2) beats (1, 2)'s later match
    assert lookup.find([1, 2, 3], 4) == []  # nothing seen twice
    assert lookup.find([7], 4) == []
    with pytest.raises(ValueError, match="n-gram"):
        Lookup(longest=1, shortest=2)


def test_greedy_accepts_drafts_while_they_are_the_most_probable_token():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    assert accept(logits, [1, 0], GREEDY) == [1, 0, 2]  # both accepted, then the model's own
    assert accept(logits, [1, 2], GREEDY) == [1, 0]  # the second refused: the model's choice there
    assert accept(logits, [2, 0], GREEDY) == [1]
    assert accept(logits[:1], [], GREEDY) == [1]


def test_sampled_tokens_follow_the_models_distribution_whatever_the_draft():
    """The first token after a check: with the draft most probable, improbable or impossible under p, it is
    distributed as p (a chi-square test at 1e-4 over 6,000 draws)."""
    logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0], [0.0, 1.0, 0.0, 0.0, 0.0]])
    sampling = Sampling(temperature=0.8, top_k=4)
    p = next_token_logits(logits[:1], sampling).softmax(-1)[0]
    generator = torch.Generator().manual_seed(0)
    for draft in (3, 4, 2):  # 2 is outside the top 4: never accepted
        counts = Counter(accept(logits, [draft], sampling, generator)[0] for _ in range(6000))
        chi2 = sum((counts[t] - 6000 * float(p[t])) ** 2 / (6000 * float(p[t])) for t in range(5) if p[t] > 0)
        assert chi2 < 21.1, (draft, counts, p)  # chi-square with 3 degrees of freedom: P(> 21.1) = 1e-4
        assert counts[2] == 0


@pytest.mark.parametrize("drafter", ["lookup", "same", "other"])
def test_greedy_text_is_plain_decodings(model, drafter):
    """Prompt lookup, the model itself as its draft (every draft accepted) and another model (most refused): the
    same tokens as plain greedy decoding, for rows of different lengths with their own limits and a stop token."""
    source = {"lookup": Lookup(), "same": DraftModel(model), "other": DraftModel(make(7))}[drafter]
    speculation = Speculation(source, most=6)
    expected = run(model, n=[24, 7, 30, 1], stop_ids={3})
    assert run(model, speculation=speculation, n=[24, 7, 30, 1], stop_ids={3}) == expected
    assert speculation.drafted > 0
    if drafter == "same":
        assert speculation.accepted == speculation.drafted
    assert "drafted tokens accepted" in speculation.summary()


def test_streamed_tokens_are_the_output_in_order(model):
    streamed = {i: [] for i in range(len(PROMPTS))}
    out = run(model, speculation=Speculation(DraftModel(model)), on_token=lambda row, t: streamed[row].append(t))
    assert [streamed[i] for i in range(len(PROMPTS))] == out


def test_a_repetition_penalty_or_a_constraint_drafts_nothing(model):
    speculation = Speculation(Lookup())
    penalised = Sampling(temperature=0.0, repetition_penalty=1.3)
    assert run(model, speculation=speculation, sampling=penalised) == run(model, sampling=penalised)
    assert speculation.drafted == 0


def test_near_the_end_of_the_positions_drafts_stop_and_the_text_goes_on(model):
    """A prompt close to max_seq_len: no draft may run past it, and the decoder starts over as without drafts."""
    prompt = [[(i * 7) % 30 + 4 for i in range(90)]]
    speculation = Speculation(DraftModel(model))
    assert run(model, prompt, speculation, n=20) == run(model, prompt, n=20)


def test_sampled_sequences_are_distributed_as_without_drafts():
    """Three tokens sampled after a prompt from a 6-token vocabulary (the first alone, the second drafted by a model
    that often disagrees and checked with the third): the frequencies of the (second, third) pairs over 3,000 rows
    match the model's exact probabilities (chi-square at 1e-4)."""
    vocab = 6
    model, draft = make(3, vocab=vocab), make(4, vocab=vocab)
    prompt = [1, 2, 3]
    with torch.no_grad():
        def probs(prefixes):
            return model(torch.tensor([[*prompt, *p] for p in prefixes]))[:, -1].softmax(-1)

        p1 = probs([[]])[0]
        p2 = probs([[a] for a in range(vocab)])  # (t1, t2)
        p3 = probs([[a, b] for a in range(vocab) for b in range(vocab)]).view(vocab, vocab, vocab)
    exact = (p1[:, None, None] * p2[:, :, None] * p3).sum(0)  # (t2, t3)
    rows = 3000
    speculation = Speculation(DraftModel(draft), first=2)
    out = run(model, [prompt] * rows, speculation, n=3, sampling=Sampling(temperature=1.0),
              generator=torch.Generator().manual_seed(1))
    counts = Counter((o[1], o[2]) for o in out)
    chi2 = sum((counts[(a, b)] - rows * float(exact[a, b])) ** 2 / (rows * float(exact[a, b]))
               for a in range(vocab) for b in range(vocab))
    assert chi2 < 80.1, chi2  # 35 degrees of freedom: P(> 80.1) < 1e-4
    assert 0 < speculation.accepted < speculation.drafted == rows
    assert math.isclose(sum(counts.values()), rows)


def test_draft_sizes_adapt_to_acceptance():
    speculation = Speculation(Lookup(), most=8, first=4)
    speculation.sizes = [4, 4, 4]
    speculation.settle([[1, 2, 3, 4], [1, 2, 3, 4], []], [[1, 2, 3, 4, 5], [1, 9], [7]])
    assert speculation.sizes == [6, 3, 4]
    assert (speculation.drafted, speculation.accepted) == (8, 5)
    with pytest.raises(ValueError, match="at least 1"):
        Speculation(Lookup(), most=0)
