"""[CLS] attention maps and attention rollout, against hand computations."""

import pytest
import torch

from qkv.config import ViTConfig
from qkv.models.vit import ViT
from qkv.tasks.image_attention import attention_rollout, cls_attention


def _rows_softmax(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).softmax(-1)


def test_cls_attention_is_row_0_over_the_patches_on_the_grid():
    attention = [_rows_softmax(2, 3, 7, 7, seed=s) for s in range(2)]  # [CLS] + a 2x3 grid
    maps = cls_attention(attention, image=1, grid=(2, 3))
    assert maps.shape == (2, 3, 2, 3)
    torch.testing.assert_close(maps[1, 2, 1, 0], attention[1][1, 2, 0, 4])  # patch (1, 0) is token 1 + 3
    with pytest.raises(ValueError, match="not \\[CLS\\] and a 2x2 patch grid"):
        cls_attention(attention)


def test_rollout_equals_the_hand_written_product():
    attention = [_rows_softmax(1, 4, 5, 5, seed=s) for s in range(3)]
    eye = torch.eye(5)
    flow = eye
    for a in attention:
        layer = 0.5 * a[0].mean(0) + 0.5 * eye
        flow = (layer / layer.sum(-1, keepdim=True)) @ flow
    torch.testing.assert_close(attention_rollout(attention), flow[0, 1:].view(2, 2))


def test_rollout_of_attention_to_oneself_stays_on_the_cls_token_and_uniform_attention_spreads_evenly():
    itself = [torch.eye(5).expand(1, 2, 5, 5)] * 3
    torch.testing.assert_close(attention_rollout(itself), torch.zeros(2, 2))
    uniform = [torch.full((1, 2, 5, 5), 0.2)] * 3
    rollout = attention_rollout(uniform)
    torch.testing.assert_close(rollout, torch.full((2, 2), rollout[0, 0].item()))
    assert 0.1 < rollout.sum() < 1  # the rest stayed with [CLS]


def test_maps_of_a_real_vit_are_distributions_over_the_patches():
    cfg = ViTConfig(image_size=8, patch_size=2, channels=1, d_model=16, n_heads=2, n_layers=2, d_ff=32)
    out = ViT(cfg).eval()(torch.randn(1, 1, 8, 8), return_attention=True)
    maps, rollout = cls_attention(out.attention), attention_rollout(out.attention)
    assert maps.shape == (2, 2, 4, 4) and rollout.shape == (4, 4)
    assert (maps >= 0).all() and (maps.sum((-1, -2)) <= 1 + 1e-6).all() and 0 < rollout.sum() <= 1 + 1e-6
