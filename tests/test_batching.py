"""Continuous batching: rows that join a running decode between steps and leave when done are decoded exactly as
each would be alone (greedy, or sampled with its own seed), whatever else shares the batch; the cache keeps no
column no row uses; a cancelled row is gone before the next step; log-probabilities are the model's. (On SmolLM2 as
stored, where int8-rounded activations turn rounding differences into other tokens, tests/serve holds the same.)"""

import pytest
import torch
from decoding_reference import continue_prompts

from qkv import GPT, GPTConfig
from qkv.batching import Batch, Row
from qkv.config import LayerSpec
from qkv.sampling import GREEDY, Sampling
from qkv.speculative import DraftModel, Lookup, Speculation

VOCAB = 50
STOP = 3


# Gemma's blocks (a local layer with a window shorter than a row, a global one, sandwich norms of 1 + w, QK-norm,
# capped scores and logits) and Phi-3's (rotary on part of each head, LongRoPE switching sets at position 8)
FAMILY_BLOCKS = {
    "gemma": dict(layers=[LayerSpec(window=4), LayerSpec()], norm_offset=True, branch_norm=True, qk_norm=True,
                  attention_softcap=5.0, logit_softcap=10.0, embedding_scale=2.0, activation="geglu_tanh"),
    "phi": dict(rotary_dim=4, rope_freq_factors=[1.0, 2.0], rope_long_factors=[2.0, 4.0], rope_original_context=8,
                rope_scale=1.1),
    # a mixture of experts: each row's tokens to their own 2 of 4 experts, and a shared expert
    "moe": dict(n_experts=4, expert_top_k=2, expert_d_ff=32, shared_expert_d_ff=16),
}


@pytest.fixture(scope="module", params=["gpt2", "llama", "mistral", "gemma", "phi", "moe"])
def model(request):
    torch.manual_seed(0)
    if request.param == "gpt2":
        cfg = GPTConfig(vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2, d_ff=64, dropout=0.0, max_seq_len=64)
    elif request.param in FAMILY_BLOCKS:
        cfg = GPTConfig.from_preset("llama", vocab_size=VOCAB, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2,
                                    d_ff=64, max_seq_len=64, **FAMILY_BLOCKS[request.param])
    else:  # grouped-query attention and rotary positions; mistral's with a sliding window shorter than a row
        cfg = GPTConfig.from_preset("llama", vocab_size=VOCAB, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2,
                                    d_ff=64, max_seq_len=64, window=6 if request.param == "mistral" else None)
    model = GPT(cfg).eval()
    with torch.no_grad():  # sharper, more varied distributions than the initialisation gives
        for p in model.parameters():
            p.mul_(3.0)
    return model


def alone(model, row: Row, seed: int | None) -> list[int]:
    """The row decoded by itself, with generate: its tokens, a final stop token included."""
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    out = continue_prompts(model, [list(row.prompt)], row.limit, sampling=row.sampling, generator=generator,
                           stop_ids=set(row.stop_ids))[0]
    return [*out, STOP] if len(out) < row.limit else out


def make_rows(n: int, seed: int) -> tuple[list[Row], list[int | None]]:
    g = torch.Generator().manual_seed(seed)
    rows, seeds = [], []
    for i in range(n):
        prompt = torch.randint(4, VOCAB, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        sampled = i % 3 == 1
        seeds.append(100 + i if sampled else None)
        rows.append(Row(prompt, limit=int(torch.randint(1, 20, (1,), generator=g)),
                        sampling=Sampling(temperature=0.8, top_p=0.9) if sampled else GREEDY,
                        generator=torch.Generator().manual_seed(100 + i) if sampled else None,
                        stop_ids={STOP} if i % 2 else ()))
    return rows, seeds


def run(batch: Batch, arrivals: dict[int, list[Row]]) -> list[int]:
    """Step the batch, rows joining at the steps ``arrivals`` names; returns the batch's size at every step."""
    sizes, step = [], 0
    while len(batch) or any(s >= step for s in arrivals):
        batch.join(arrivals.get(step, []))
        sizes.append(len(batch))
        batch.step()
        step += 1
    return sizes


def test_rows_joining_and_leaving_decode_as_each_would_alone(model):
    rows, seeds = make_rows(12, seed=1)
    arrivals = {0: rows[:3], 1: rows[3:4], 4: rows[4:8], 9: rows[8:11], 15: rows[11:]}
    sizes = run(Batch(model), arrivals)
    assert max(sizes) >= 5 and len(set(sizes)) > 3  # rows really shared steps, and came and went
    for row, seed in zip(rows, seeds, strict=True):
        assert row.finish in ("stop", "length")
        assert row.tokens == alone(model, row, seed)
        assert (row.finish == "stop") == (row.tokens[-1] == STOP and STOP in row.stop_ids)


@pytest.mark.parametrize("drafter", ["lookup", "draft"])
def test_rows_with_drafts_decode_as_each_would_alone(model, drafter):
    """Speculative decoding in a running batch (rows of different lengths joining and leaving, several tokens a row
    checked at once): greedy rows get the tokens they get alone; sampled rows end as they should."""
    rows, _ = make_rows(10, seed=2)
    for row in rows:  # prompts that repeat themselves, so that prompt lookup has something to find
        row.prompt = [*row.prompt, *row.prompt][:20]
    source = Lookup() if drafter == "lookup" else DraftModel(model)
    speculation = Speculation(source, most=5)
    run(Batch(model, speculation=speculation), {0: rows[:3], 2: rows[3:6], 5: rows[6:]})
    for row in rows:
        assert row.finish in ("stop", "length") and 0 < len(row.tokens) <= row.limit
        if row.sampling.greedy:
            assert row.tokens == alone(model, row, None)
    assert speculation.accepted > 0


def test_the_cache_keeps_only_columns_a_row_uses_and_starts_afresh_when_empty(model):
    batch = Batch(model)
    short, long = Row([5], limit=30), Row(list(range(4, 24)), limit=3)
    batch.join([short, long])
    starts = lambda: [layer.self_attn.starts for layer in batch.cache.layers]  # noqa: E731
    assert len(batch.cache) == 20 and starts() == [[19, 0]] * 2
    for _ in range(3):
        batch.step()
    assert batch.rows == [short]  # the long prompt is done: its columns are trimmed
    assert len(batch.cache) == 4 and starts() == [[0]] * 2 and batch.lengths.tolist() == [4]
    short.cancel()
    assert batch.step() == [short] and short.finish == "cancelled" and len(batch) == 0 and len(batch.cache) == 0


def test_a_cancelled_row_leaves_before_the_next_step_and_the_others_go_on(model):
    rows = [Row([5, 6, 7], limit=10), Row([8], limit=10), Row([9, 10], limit=10)]
    batch = Batch(model)
    batch.join(rows)
    batch.step()
    rows[1].cancel()
    assert batch.step() == [rows[1]] and len(rows[1].tokens) == 2
    while len(batch):
        batch.step()
    assert [r.tokens for r in (rows[0], rows[2])] == [alone(model, r, None) for r in (rows[0], rows[2])]


def test_on_token_sees_every_token_but_a_stop_token_and_can_end_the_row(model):
    seen = []
    row = Row([5, 6], limit=10, on_token=lambda token, _: seen.append(token) or len(seen) == 4)
    batch = Batch(model)
    batch.join([row])
    while len(batch):
        batch.step()
    assert seen == row.tokens == alone(model, Row([5, 6], limit=4), None) and row.finish == "stop"


def test_a_row_whose_receiver_or_prompt_fails_ends_alone_and_the_others_go_on(model):
    def broken(token, _):
        raise RuntimeError("its text could not be made")

    fine = Row([5, 6, 7], limit=8)
    bad, unreadable = Row([8, 9], limit=8, on_token=broken), Row([VOCAB + 5], limit=8)  # an id past the table
    batch = Batch(model)
    ended = batch.join([fine, unreadable, bad])
    assert ended == [unreadable, bad] and [r.finish for r in ended] == ["error", "error"]
    assert isinstance(bad.error, RuntimeError) and unreadable.error is not None and len(batch) == 1
    while len(batch):
        batch.step()
    assert fine.tokens == alone(model, Row([5, 6, 7], limit=8), None) and fine.finish == "length"


def test_logprobs_are_the_models_own_and_the_top_ones_are_the_most_probable(model):
    got = []
    row = Row([5, 6, 7], limit=4, logprobs=3, on_token=lambda token, logprob: got.append(logprob) and False)
    batch = Batch(model)
    batch.join([Row([9], limit=6), row])  # in company: a padded batch
    while len(batch):
        batch.step()
    ids = [5, 6, 7, *row.tokens]
    with torch.no_grad():
        logp = model(torch.tensor([ids]))[0].log_softmax(-1)
    for i, (token, logprob) in enumerate(zip(row.tokens, got, strict=True)):
        expected = logp[2 + i]
        assert logprob.value == pytest.approx(float(expected[token]), abs=1e-4)
        assert [t for t, _ in logprob.top] == expected.topk(3).indices.tolist()
        assert [v for _, v in logprob.top] == pytest.approx(expected.topk(3).values.tolist(), abs=1e-4)


def test_rows_that_do_not_fit_are_refused(model):
    with pytest.raises(ValueError, match="at least one token"):
        Row([], limit=3)
    with pytest.raises(ValueError, match="at least one token"):
        Row([5], limit=0)
    with pytest.raises(ValueError, match="repetition penalty"):
        Row([5], limit=3, sampling=Sampling(temperature=0, repetition_penalty=1.2))
    with pytest.raises(ValueError, match="do not fit"):
        Batch(model).join([Row([5] * 60, limit=5)])



def test_a_cache_of_rows_of_different_lengths_refuses_what_it_cannot_do(model):
    """Its attention reads each row's own keys: a mask or weights are refused rather than run over the padding."""
    batch = Batch(model)
    batch.join([Row([5, 6, 7], limit=5), Row([8], limit=5)])
    ids = torch.tensor([[9], [10]])
    with pytest.raises(ValueError, match="rows of different lengths"):
        model(ids, positions=batch.lengths[:, None], cache=batch.cache, return_attention=True)
    with pytest.raises(ValueError, match="rows of different lengths"):
        model(ids, attention_mask=torch.ones(2, 4, dtype=torch.bool), cache=batch.cache)
    assert len(batch.cache) == 3  # nothing was written into it


def test_several_new_tokens_a_row_read_as_one_at_a_time(model):
    """Rows of different lengths fed three tokens each in one step (speculative decoding's check) get the logits
    they get fed one token a step, and dropping the last columns again (drop_right) leaves the cache as it was."""
    new = torch.tensor([[9, 11, 12], [10, 13, 14]])
    one, many = Batch(model), Batch(model)
    for b in (one, many):
        b.join([Row([5, 6, 7, 3], limit=5), Row([8], limit=5)])
    stepped = []
    for t in range(3):
        positions = one.lengths[:, None] + t
        stepped.append(model(new[:, t : t + 1], positions=positions, cache=one.cache)[:, -1])
    positions = many.lengths[:, None] + torch.arange(3)
    together = model(new, positions=positions, cache=many.cache)
    torch.testing.assert_close(together, torch.stack(stepped, dim=1), atol=1e-5, rtol=1e-5)
    many.cache.drop_right(2)
    again = model(new[:, 1:2], positions=many.lengths[:, None] + 1, cache=many.cache)[:, -1]
    torch.testing.assert_close(again, stepped[1], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="cannot drop"):
        many.cache.drop_right(99)
