"""LayerNorm and RMSNorm against PyTorch's modules, with weights copied across."""

import pytest
import torch
from torch import nn

from qkv.nn import LayerNorm, RMSNorm, build_norm


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("eps", [1e-5, 1e-12])
def test_layernorm_matches_torch(eps, fused):
    ref = nn.LayerNorm(48, eps=eps)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    ours = LayerNorm(48, eps=eps, fused=fused)
    ours.load_state_dict(ref.state_dict())
    x = (torch.randn(4, 9, 48) * 3 + 1).requires_grad_()
    torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)
    grad_ours = torch.autograd.grad(ours(x).pow(2).sum(), (x, ours.weight, ours.bias))
    grad_ref = torch.autograd.grad(ref(x).pow(2).sum(), (x, ref.weight, ref.bias))
    torch.testing.assert_close(grad_ours, grad_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fused", [True, False])
def test_layernorm_uses_biased_variance(fused):
    x = torch.tensor([[1.0, 3.0]])  # mean 2, biased variance 1 (unbiased would be 2)
    torch.testing.assert_close(LayerNorm(2, eps=0.0, fused=fused)(x), torch.tensor([[-1.0, 1.0]]))


def test_layernorm_without_bias():
    ours = LayerNorm(8, bias=False)
    assert ours.bias is None and [n for n, _ in ours.named_parameters()] == ["weight"]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_rmsnorm_matches_torch(eps, fused):
    ref = nn.RMSNorm(48, eps=eps)
    with torch.no_grad():
        ref.weight.normal_()
    ours = RMSNorm(48, eps=eps, fused=fused)
    ours.load_state_dict(ref.state_dict())
    x = (torch.randn(4, 9, 48) * 3 + 1).requires_grad_()
    torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)
    grad_ours = torch.autograd.grad(ours(x).pow(2).sum(), (x, ours.weight))
    grad_ref = torch.autograd.grad(ref(x).pow(2).sum(), (x, ref.weight))
    torch.testing.assert_close(grad_ours, grad_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("norm", [LayerNorm(16), RMSNorm(16), LayerNorm(16, fused=False), RMSNorm(16, fused=False)])
def test_low_precision_in_low_precision_out(norm):
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    y = norm(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), norm(x.float()), atol=1e-2, rtol=1e-2)


def test_build_norm_rejects_unknown():
    with pytest.raises(ValueError, match="norm must be 'layer' or 'rms', got 'batch'"):
        build_norm("batch", 8, eps=1e-5)
