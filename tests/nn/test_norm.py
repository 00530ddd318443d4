"""LayerNorm and RMSNorm against PyTorch's modules, with weights copied across."""

import pytest
import torch
from torch import nn

from qkv.nn import LayerNorm, RMSNorm, build_norm


@pytest.mark.parametrize("eps", [1e-5, 1e-12])
def test_layernorm_matches_torch(eps):
    ref = nn.LayerNorm(48, eps=eps)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    ours = LayerNorm(48, eps=eps)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(4, 9, 48) * 3 + 1
    torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)


def test_layernorm_uses_biased_variance():
    x = torch.tensor([[1.0, 3.0]])  # mean 2, biased variance 1 (unbiased would be 2)
    torch.testing.assert_close(LayerNorm(2, eps=0.0)(x), torch.tensor([[-1.0, 1.0]]))


def test_layernorm_without_bias():
    ours = LayerNorm(8, bias=False)
    assert ours.bias is None and [n for n, _ in ours.named_parameters()] == ["weight"]


@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_rmsnorm_matches_torch(eps):
    ref = nn.RMSNorm(48, eps=eps)
    with torch.no_grad():
        ref.weight.normal_()
    ours = RMSNorm(48, eps=eps)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(4, 9, 48) * 3 + 1
    torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm", [LayerNorm(16), RMSNorm(16)])
def test_low_precision_in_low_precision_out(norm):
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    y = norm(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), norm(x.float()), atol=1e-2, rtol=1e-2)


def test_build_norm_rejects_unknown():
    with pytest.raises(ValueError, match="norm must be 'layer' or 'rms', got 'batch'"):
        build_norm("batch", 8, eps=1e-5)
