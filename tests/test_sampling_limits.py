"""Numbers at the edge of what sampling and seeding can take: a temperature so small that dividing by it
overflows, and seeds as large as the command line accepts."""

import pytest
import torch

from qkv.sampling import Sampling, choose, next_token_logits


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 1e-38, 1e-30, 1e-4])
def test_a_tiny_temperature_samples_the_most_probable_token(temperature):
    """Dividing float32 logits by 1e-300 gave inf and nan ("probability tensor contains inf, nan")."""
    logits = torch.tensor([[3.0, -2.0, 7.5, 0.0], [-1e4, 5.0, 4.0, -3.0]])
    sampling = Sampling(temperature=temperature)
    probs = next_token_logits(logits, sampling).softmax(-1)
    assert torch.isfinite(probs).all()
    assert choose(logits, sampling, generator=torch.Generator().manual_seed(0)).tolist() == [2, 1]


@pytest.mark.parametrize("temperature", [1e-300, 1e-45])
def test_a_tiny_temperature_shares_a_tie(temperature):
    """The limit of softmax(z / t) as t -> 0 is uniform over the largest logits: ties are no 0/0."""
    logits = torch.tensor([[1.0, 4.0, 4.0, -2.0, float("-inf")]])
    sampling = Sampling(temperature=temperature)
    torch.testing.assert_close(next_token_logits(logits, sampling).softmax(-1), torch.tensor([[0, .5, .5, 0, 0]]))
    g = torch.Generator().manual_seed(0)
    draws = {int(choose(logits, sampling, generator=g)) for _ in range(50)}
    assert draws == {1, 2}


@pytest.mark.parametrize("top_p", [1e-30, 1e-45, 1e-300, 5e-324])
def test_a_tiny_top_p_keeps_the_most_probable_token_alone(top_p):
    """1e-300 compared with float32 masses is 0, which the mass before the first token reaches: every token was
    dropped, and the draw failed ("probability tensor contains inf, nan"), for every row of the batch."""
    logits = torch.tensor([[3.0, -2.0, 7.5, 0.0], [-1e4, 5.0, 4.0, -3.0]])
    sampling = Sampling(temperature=1.0, top_p=top_p)
    kept = torch.isfinite(next_token_logits(logits, sampling))
    assert kept.tolist() == [[False, False, True, False], [False, True, False, False]]
    assert choose(logits, sampling, generator=torch.Generator().manual_seed(0)).tolist() == [2, 1]


def test_the_shift_leaves_ordinary_temperatures_as_they_were():
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(1))
    sampling = Sampling(temperature=0.7, top_k=5, top_p=0.9)
    expected = (logits / 0.7).softmax(-1)
    kept = torch.isfinite(next_token_logits(logits, sampling))
    probs = next_token_logits(logits, sampling).softmax(-1)
    torch.testing.assert_close(probs, (expected * kept) / (expected * kept).sum(-1, keepdim=True))


def test_the_largest_seed_reaches_every_generator():
    """A seed the command line accepts also seeds the generators qkv derives from it (seed × 100,003 + epoch,
    then × 1,000,003 + batch for the image batches), which overflowed torch's 64 bits."""
    from qkv.cli import parse
    from qkv.tasks.image_classify import EpochBatches

    seed = parse(["train", "vit", "--out", "r", "--seed", str(2**32 - 1)]).seed

    class Task:
        train, batch_size = list(range(10)), 4

        def __init__(self):
            self.seed = seed

        def batch(self, data, rows, *, generator):
            return generator.initial_seed()

    assert EpochBatches(Task(), epoch=3)[2] == ((seed * 100_003 + 3) * 1_000_003 + 2) % 2**64


@pytest.mark.parametrize("value", [str(2**32), str(2**70)])
def test_a_seed_too_large_is_refused_naming_the_option(value, capsys):
    """``--seed 2**70`` ended in "Overflow when unpacking long long", naming no option."""
    from qkv.cli import parse

    with pytest.raises(SystemExit):
        parse(["generate", "--seed", value])
    err = capsys.readouterr().err
    assert f"argument --seed: must be an integer in [0, 4294967295], got '{value}'" in err, err
