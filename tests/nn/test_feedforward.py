"""The position-wise feed-forward network against an nn.Sequential and the SwiGLU formula."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkv.nn import FeedForward, StackedFeedForward


@pytest.mark.parametrize("activation, torch_act", [("relu", nn.ReLU()), ("gelu", nn.GELU()),
                                                    ("gelu_tanh", nn.GELU(approximate="tanh"))])
def test_ffn_matches_sequential(activation, torch_act):
    ffn = FeedForward(16, 64, activation=activation)
    ref = nn.Sequential(nn.Linear(16, 64), torch_act, nn.Linear(64, 16))
    ref[0].load_state_dict(ffn.up.state_dict())
    ref[2].load_state_dict(ffn.down.state_dict())
    x = torch.randn(3, 5, 16)
    torch.testing.assert_close(ffn(x), ref(x))


def test_swiglu_formula():
    ffn = FeedForward(16, 40, activation="swiglu", bias=False)
    x = torch.randn(3, 5, 16)
    w1, wg, w2 = ffn.up.weight, ffn.gate.weight, ffn.down.weight
    expected = (F.silu(x @ wg.T) * (x @ w1.T)) @ w2.T
    torch.testing.assert_close(ffn(x), expected)


def test_relu2_is_relu_squared():
    """ReLU² = max(0, x)²: zero for x <= 0, x² above; its derivative 2·max(0, x) is continuous at zero."""
    ffn = FeedForward(16, 40, activation="relu2")
    x = torch.randn(3, 5, 16)
    hidden = x @ ffn.up.weight.T + ffn.up.bias
    expected = torch.where(hidden > 0, hidden * hidden, 0.0) @ ffn.down.weight.T + ffn.down.bias
    torch.testing.assert_close(ffn(x), expected)
    t = torch.tensor([-1.0, 0.0, 2.0], requires_grad=True)
    ffn.act(t).sum().backward()
    assert t.grad.tolist() == [0.0, 0.0, 4.0]


def test_ffn_is_position_wise():
    ffn = FeedForward(16, 32)
    x = torch.randn(2, 6, 16)
    torch.testing.assert_close(ffn(x)[:, 3], ffn(x[:, 3:4])[:, 0])


def test_unknown_activation():
    with pytest.raises(ValueError, match=r"activation must be one of .* got 'tanh'"):
        FeedForward(8, 16, activation="tanh")


def test_stacked_gate_and_up_give_the_same_output():
    torch.manual_seed(0)
    ffn, x = FeedForward(16, 40, activation="swiglu", bias=True), torch.randn(3, 5, 16)
    with torch.no_grad():
        expected = ffn(x)
        stacked = StackedFeedForward.from_feed_forward(ffn)
        assert not hasattr(stacked, "gate") and not hasattr(stacked, "up") and stacked.gate_up.out_features == 80
        assert stacked.down is ffn.down and ffn.gate is not None  # the separate one is untouched
        torch.testing.assert_close(stacked(x), expected, atol=1e-6, rtol=1e-5)


def test_only_a_gated_feed_forward_is_stacked():
    assert StackedFeedForward.from_feed_forward(FeedForward(16, 40, activation="gelu")) is None
    with pytest.raises(ValueError, match="only a gated activation"):
        StackedFeedForward(16, 40, activation="relu")
    built = StackedFeedForward(16, 40, activation="swiglu", bias=False)
    assert sorted(built.state_dict()) == ["down.weight", "gate_up.weight"]
