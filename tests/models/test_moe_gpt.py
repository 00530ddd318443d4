"""A GPT whose feed-forward networks are mixtures of experts (``GPTConfig.n_experts``): decoding through the cache is
a rerun, a padded batch is each row alone, a layer marked dense stays dense, it learns to copy as the dense model
does, and training adds the weighted balancing loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qkv import GPT, GPTConfig
from qkv.config import LayerSpec
from qkv.nn import FeedForward, MoEFeedForward

VOCAB = 12


def _config(**changes) -> GPTConfig:
    return GPTConfig.from_preset("llama", vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2, d_ff=48,
                                 max_seq_len=32, **{"n_experts": 4, "expert_top_k": 2, **changes})


def test_cached_decoding_and_a_padded_batch_are_each_row_alone():
    torch.manual_seed(0)
    model = GPT(_config(shared_expert_d_ff=16, layers=[LayerSpec(dense=True), LayerSpec()])).eval()
    assert isinstance(model.decoder.layers[0].feed_forward, FeedForward)
    assert isinstance(model.decoder.layers[1].feed_forward, MoEFeedForward)
    ids = torch.randint(1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        steps = [model(ids[:, :4], cache=cache)] + [model(ids[:, t : t + 1], cache=cache) for t in range(4, 10)]
        torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
        padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids[:1, :7]], 1)
        mask = padded != 0
        torch.testing.assert_close(model(padded, attention_mask=mask)[0, 3:], model(ids[:1, :7])[0],
                                   atol=1e-5, rtol=1e-5)


def _copy_loss(model: GPT, steps: int) -> float:
    """Train on sequences that repeat their first half; the loss of predicting the second half, at the end."""
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        half = torch.randint(1, VOCAB, (32, 6), generator=g)
        ids = torch.cat([half, half], 1)
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits[:, 6:].flatten(0, 1), ids[:, 7:].flatten())
        balance = model.balance_loss()
        (loss if balance is None else loss + balance).backward()
        opt.step()
        opt.zero_grad()
    return loss.item()


@pytest.mark.slow
def test_a_mixture_of_experts_learns_to_copy_as_the_dense_model_does():
    torch.manual_seed(0)
    moe = _copy_loss(GPT(_config()), 150)
    torch.manual_seed(0)
    dense = _copy_loss(GPT(_config(n_experts=None)), 150)
    assert moe < 0.3 and dense < 0.3, (moe, dense)  # from log(11) = 2.4: both have learnt to copy


def test_training_adds_the_weighted_balancing_loss():
    from qkv.nn.moe import balancing_loss

    torch.manual_seed(0)
    model = GPT(_config(balance_loss=0.1))
    model(torch.randint(0, VOCAB, (2, 8)))
    logits = [layer.feed_forward.router_logits for layer in model.decoder.layers]
    torch.testing.assert_close(model.balance_loss(), 0.1 * balancing_loss(logits, 2))
    assert GPT(_config(n_experts=None)).balance_loss() is None


@pytest.mark.parametrize(("changes", "message"), [({"expert_top_k": 5}, "expert_top_k=5 routes each token"),
                                                  ({"n_experts": 0}, "n_experts must be >= 1"),
                                                  ({"balance_loss": -1.0}, "balance_loss must be")])
def test_impossible_mixtures_are_one_line(changes, message):
    with pytest.raises(ValueError, match=message):
        _config(**changes)
