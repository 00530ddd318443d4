"""Language-model decoding: sampling filters against Hugging Face's, and the invariants users rely on
(cached = uncached, batched left-padded prompts = one at a time, top-k 1 = greedy, temperature -> 0 = greedy,
seeded = reproducible, beam size 1 = greedy)."""

import pytest
import torch
from decoding_reference import continue_prompts
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv import GPT, GPTConfig
from qkv.generation import LMDecoder, beam_search
from qkv.sampling import (
    GREEDY,
    Sampling,
    apply_repetition_penalty,
    choose,
    next_token_logits,
    top_k_filter,
    top_p_filter,
)

VOCAB = 50


def sharpen(model, factor=3.0):
    with torch.no_grad():  # more varied, less uniform distributions than the initialisation gives
        for p in model.parameters():
            p.mul_(factor)
    return model.eval()


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def model(request):
    torch.manual_seed(0)
    if request.param == "gpt2":
        cfg = GPTConfig(vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2, d_ff=64, dropout=0.0, max_seq_len=64)
    else:
        cfg = GPTConfig.from_preset("llama", vocab_size=VOCAB, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2,
                                    d_ff=64, max_seq_len=64)
    return sharpen(GPT(cfg))


PROMPTS = [[5, 6, 7], [8], [9, 10, 11, 12, 13, 14], [15, 16]]


def run(model, prompts=PROMPTS, *, use_cache=True, n=10, **kwargs):
    return continue_prompts(model, prompts, n, use_cache=use_cache, context=prompts, **kwargs)


def obvious_greedy(model, prompt, n):
    """Rerun the whole model on the whole sequence for every token, one prompt alone."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(model(torch.tensor([ids]))[0, -1].argmax().item())
    return ids[len(prompt) :]


def test_greedy_equals_the_obvious_implementation(model):
    assert run(model) == [obvious_greedy(model, p, 10) for p in PROMPTS]


@pytest.mark.parametrize("sampling", [GREEDY, Sampling(temperature=0.9, top_k=20, top_p=0.95),
                                      Sampling(temperature=0.0, repetition_penalty=1.5)])
def test_cached_equals_uncached(model, sampling):
    def sample(use_cache):
        return run(model, use_cache=use_cache, sampling=sampling, generator=torch.Generator().manual_seed(3))

    assert sample(True) == sample(False)


def test_batched_left_padded_prompts_equal_one_at_a_time(model):
    assert run(model) == [run(model, [p])[0] for p in PROMPTS]
    beams = beam_search(LMDecoder(model, PROMPTS), start=LMDecoder(model, PROMPTS).start, max_new_tokens=8,
                        beam_size=3, stop_ids={0})
    alone = []
    for p in PROMPTS:
        decoder = LMDecoder(model, [p])
        alone += beam_search(decoder, start=decoder.start, max_new_tokens=8, beam_size=3, stop_ids={0})
    assert beams == alone


def test_beam_size_one_is_greedy(model):
    decoder = LMDecoder(model, PROMPTS)
    assert beam_search(decoder, start=decoder.start, max_new_tokens=10, beam_size=1, stop_ids={0}) == run(model)


def test_top_k_one_and_temperature_near_zero_are_greedy(model):
    greedy = run(model)
    g = torch.Generator().manual_seed(0)
    assert run(model, sampling=Sampling(temperature=1.5, top_k=1), generator=g) == greedy
    assert run(model, sampling=Sampling(temperature=1e-4), generator=g) == greedy
    assert run(model, sampling=Sampling(temperature=1.0, top_p=1e-6), generator=g) == greedy


def test_seeded_sampling_is_reproducible_and_seeds_differ(model):
    def sample(seed):
        return run(model, n=20, sampling=Sampling(temperature=1.0), generator=torch.Generator().manual_seed(seed))

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)
    assert sample(7) != run(model, n=20)  # and it is not greedy


def test_stop_tokens_end_a_row_and_are_not_returned(model):
    free = run(model, n=12)
    stop = free[0][4]
    stopped = run(model, n=12, stop_ids={stop})
    for row, out in zip(free, stopped, strict=True):
        expected = row[: row.index(stop)] if stop in row else row
        assert out == expected
    assert stopped[0] == free[0][: free[0].index(stop)]


def test_streaming_sees_every_token_in_order(model):
    streamed = [[] for _ in PROMPTS]
    out = run(model, on_token=lambda row, token: streamed[row].append(token))
    assert streamed == out


def test_per_row_token_budgets(model):
    out = run(model, n=[3, 10, 1, 5])
    assert [len(o) for o in out] == [3, 10, 1, 5]
    assert out == [o[:n] for o, n in zip(run(model), [3, 10, 1, 5], strict=True)]


def test_past_the_position_table_the_window_slides_and_cache_still_equals_no_cache():
    torch.manual_seed(1)
    model = sharpen(GPT(GPTConfig(vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2, d_ff=64, dropout=0.0,
                                  max_seq_len=16)))
    cached = run(model, n=40)
    assert [len(o) for o in cached] == [40] * len(PROMPTS)
    assert cached == run(model, n=40, use_cache=False)


def test_prompt_errors(model):
    with pytest.raises(ValueError, match="at least one token"):
        LMDecoder(model, [[1, 2], []])
    with pytest.raises(ValueError, match="reads at most 64"):
        LMDecoder(model, [list(range(1, 40)) * 2])


# --- the filters, against Hugging Face's logits processors --------------------------------------------------

def random_logits(seed, b=4, v=VOCAB):
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("k", [1, 5, 49, 50, 80])
def test_top_k_matches_transformers(k):
    tp = pytest.importorskip("transformers.generation.logits_process")
    logits = random_logits(k)
    torch.testing.assert_close(top_k_filter(logits, k), tp.TopKLogitsWarper(top_k=k)(None, logits.clone()))


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.99])
def test_top_p_matches_transformers(p):
    tp = pytest.importorskip("transformers.generation.logits_process")
    logits = random_logits(int(p * 100))
    torch.testing.assert_close(top_p_filter(logits, p), tp.TopPLogitsWarper(top_p=p)(None, logits.clone()))


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty):
    tp = pytest.importorskip("transformers.generation.logits_process")
    logits = random_logits(3)
    context = torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(4))
    seen = torch.zeros_like(logits, dtype=torch.bool).scatter(1, context, True)
    expected = tp.RepetitionPenaltyLogitsProcessor(penalty=penalty)(context, logits.clone())
    torch.testing.assert_close(apply_repetition_penalty(logits, seen, penalty), expected)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), p=st.floats(0.01, 0.999))
def test_top_p_keeps_the_smallest_set_reaching_p(seed, p):
    logits = random_logits(seed, b=1, v=30)[0]
    kept = torch.isfinite(top_p_filter(logits[None], p)[0])
    probs = logits.softmax(-1)
    assert probs[kept].sum() >= p - 1e-6  # enough mass ...
    assert probs[kept].min() >= probs[~kept].max() if (~kept).any() else True  # ... the most probable tokens ...
    assert probs[kept].sum() - probs[kept].min() < p + 1e-6  # ... and no token more than needed


def test_samples_follow_the_filtered_distribution():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, -3.0]])
    sampling = Sampling(temperature=0.8, top_k=4, top_p=0.9)
    expected = next_token_logits(logits, sampling).softmax(-1)[0]
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([choose(logits, sampling, generator=g) for _ in range(20_000)]).flatten()
    freq = torch.bincount(draws, minlength=6).float() / draws.numel()
    assert (freq[expected == 0] == 0).all()  # filtered tokens never appear
    torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)


def test_sampling_options_are_checked():
    for bad in (dict(temperature=-1), dict(top_k=0), dict(top_p=0.0), dict(top_p=1.5), dict(repetition_penalty=0)):
        with pytest.raises(ValueError):
            Sampling(**bad)
