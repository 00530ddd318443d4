"""Swin Transformer: parity with Hugging Face Swin, shifted-window masks, windows, cost, errors."""

import re

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from qkv.config import SwinConfig, ViTConfig
from qkv.interop.hf_swin import load_swin_from_hf
from qkv.models.swin import (
    Swin,
    SwinClassifier,
    SwinStage,
    shifted_window_mask,
    window_partition,
    window_reverse,
)
from qkv.models.vit import ViT
from qkv.nn import MultiHeadAttention

transformers = pytest.importorskip("transformers")

# 32x32 images in 2x2 patches: stages of 16x16 (16 windows of 4x4, shifted every other block), 8x8 (4 windows)
# and 4x4 tokens, where the grid is one window and the shift is switched off.
HF_SMALL = dict(image_size=32, patch_size=2, num_channels=3, embed_dim=16, depths=[2, 2, 2], num_heads=[2, 4, 8],
                window_size=4, hidden_act="gelu")
SMALL = dict(image_size=32, patch_size=2, channels=3, d_model=16, depths=(2, 2), stage_heads=(2, 4), window_size=4)


def hf_swin(cls=None, **overrides):
    torch.manual_seed(0)
    config = transformers.SwinConfig(**{**HF_SMALL, **overrides})
    config._attn_implementation = "eager"  # the one that returns attention weights
    model = (cls or transformers.SwinModel)(config).eval()
    with torch.no_grad():  # random everything, so that a weight loaded in the wrong place shows
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model, config


def every_block_attention(model):
    """Hugging Face returns the last block's attention of each stage; hooks collect every block's."""
    maps = []
    for stage in model.encoder.layers:
        for block in stage.blocks:
            block.attention.register_forward_hook(lambda module, args, out: maps.append(out[1]))
    return maps


def test_hidden_states_and_attention_equal_hugging_face_swin_model():
    hf, config = hf_swin()
    ours = load_swin_from_hf(hf.state_dict(), config.to_dict())
    theirs_per_block = every_block_attention(hf)
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = hf(pixel_values=pixels, output_attentions=True)
        hidden, attention = ours(pixels, return_attention=True)
        fused = ours(pixels)  # without weights, attention runs on PyTorch's fused kernel
    torch.testing.assert_close(hidden, expected.last_hidden_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused, expected.last_hidden_state, atol=1e-5, rtol=1e-5)
    assert [tuple(a.shape) for a in attention] == [(2, 16, 2, 16, 16)] * 2 + [(2, 4, 4, 16, 16)] * 2 + \
        [(2, 1, 8, 16, 16)] * 2
    for mine, theirs in zip(attention, theirs_per_block, strict=True):  # theirs: (B·nW, heads, w², w²)
        torch.testing.assert_close(mine, theirs.view(mine.shape), atol=1e-5, rtol=1e-5)
    for mine, theirs in zip(attention[1::2], expected.attentions, strict=True):
        torch.testing.assert_close(mine, theirs.view(mine.shape), atol=1e-5, rtol=1e-5)


def test_grids_padded_to_whole_windows_equal_hugging_face():
    hf, config = hf_swin(depths=[2, 2], num_heads=[2, 4])
    ours = load_swin_from_hf(hf.state_dict(), config.to_dict())
    pixels = torch.randn(2, 3, 28, 24)  # 14x12 patches padded to 16x12; merged 7x6 (odd) padded to 8x8
    with torch.no_grad():
        torch.testing.assert_close(ours(pixels), hf(pixel_values=pixels).last_hidden_state, atol=1e-5, rtol=1e-5)


def test_classifier_logits_equal_hugging_face():
    hf, config = hf_swin(transformers.SwinForImageClassification, num_labels=5)
    ours = load_swin_from_hf(hf.state_dict(), config.to_dict())
    assert isinstance(ours, SwinClassifier)
    pixels = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(pixels), hf(pixel_values=pixels).logits, atol=1e-5, rtol=1e-5)


def test_checkpoints_with_the_names_before_transformers_5_load_the_same_model():
    hf, config = hf_swin(depths=[2, 2], num_heads=[2, 4])
    old_names = [(".attention.q_proj.", ".attention.self.query."), (".attention.k_proj.", ".attention.self.key."),
                 (".attention.v_proj.", ".attention.self.value."), (".attention.o_proj.", ".attention.output.dense."),
                 (".mlp.fc1.", ".intermediate.dense."), (".mlp.fc2.", ".output.dense."),
                 (".attention.relative_position_bias.", ".attention.self.")]
    old = {}
    for name, tensor in hf.state_dict().items():
        for new, before in old_names:
            name = name.replace(new, before)
        old[f"swin.{name}"] = tensor
    old["swin.encoder.layers.0.blocks.0.attention.self.relative_position_index"] = torch.zeros(16, 16).long()
    pixels = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(load_swin_from_hf(old, config.to_dict())(pixels),
                                   hf(pixel_values=pixels).last_hidden_state, atol=1e-5, rtol=1e-5)


def brute_force_shift_mask(height, width, window, shift):
    """For every window of the rolled grid and every pair of its positions: may they attend? Yes when they have
    the same region label: whether the token came around the bottom edge, and whether around the right edge."""
    def label(i, j):
        return (i + shift >= height, j + shift >= width)  # rolled (i, j) was ((i + shift) % H, (j + shift) % W)

    masks = []
    for top in range(0, height, window):
        for left in range(0, width, window):
            cells = [(top + r, left + c) for r in range(window) for c in range(window)]
            masks.append([[label(*p) == label(*q) for q in cells] for p in cells])
    return torch.tensor(masks)


@pytest.mark.parametrize(("height", "width", "window", "shift"), [(8, 8, 4, 2), (12, 8, 4, 2), (14, 14, 7, 3),
                                                                 (6, 9, 3, 1), (8, 8, 4, 0)])
def test_shifted_window_mask_equals_brute_force_over_region_labels(height, width, window, shift):
    mask = shifted_window_mask(height, width, window, shift)
    assert mask.dtype == torch.bool and mask.shape == (height * width // window**2, window**2, window**2)
    assert torch.equal(mask, brute_force_shift_mask(height, width, window, shift))


def test_window_partition_round_trip_and_order():
    x = torch.randn(2, 8, 12, 3)
    windows = window_partition(x, 4)
    assert windows.shape == (12, 4, 4, 3)  # 2 images x 2 rows x 3 columns of windows
    torch.testing.assert_close(windows[1], x[0, 0:4, 4:8])  # row-major windows
    torch.testing.assert_close(windows[3], x[0, 4:8, 0:4])
    torch.testing.assert_close(windows[6], x[1, 0:4, 0:4])  # then the next image
    torch.testing.assert_close(window_reverse(windows, 4, 8, 12), x)


@pytest.mark.parametrize("side", [4, 3])
def test_one_window_over_the_whole_grid_is_full_attention(side):
    """A shifted block on a grid no larger than its window: full attention over every token with the relative
    position bias, looked up here offset by offset (the table's rows are the offsets, row-major)."""
    torch.manual_seed(0)
    model = Swin(SwinConfig(**{**SMALL, "depths": (2,), "stage_heads": (2,)})).eval()
    block = model.stages[0].blocks[1]
    assert block.shifted
    torch.nn.init.normal_(block.attention.bias_table)
    table, m = block.attention.bias_table, 4
    offsets = [(dr, dc) for dr in range(-(m - 1), m) for dc in range(-(m - 1), m)]
    cells = [(r, c) for r in range(side) for c in range(side)]
    bias = torch.stack([torch.stack([table[offsets.index((r1 - r2, c1 - c2))] for r2, c2 in cells])
                        for r1, c1 in cells]).permute(2, 0, 1)  # (heads, T, T)
    full: MultiHeadAttention = block.attention.mha
    x = torch.randn(2, side * side, 16)
    with torch.no_grad():
        expected = x + full(block.attn_norm(x), attn_bias=bias)[0]
        expected = expected + block.feed_forward(block.ffn_norm(expected))
        torch.testing.assert_close(block(x, (side, side))[0], expected, atol=1e-5, rtol=1e-5)


def count_flops(model, pixels):
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(pixels, return_attention=True)  # the explicit attention path: its products are counted
    return counter.get_total_flops()


def test_parameters_do_not_depend_on_the_image_size_and_flops_grow_linearly_with_the_patches():
    small, large = Swin(SwinConfig(**SMALL)), Swin(SwinConfig(**{**SMALL, "image_size": 64}))
    assert small.num_parameters() == large.num_parameters()
    pixels, pixels_4x = torch.randn(1, 3, 32, 32), torch.randn(1, 3, 64, 64)
    assert count_flops(small, pixels_4x) == 4 * count_flops(small, pixels)  # 4x the patches: 4x the windows
    # ViT of the same width on the same patches: every patch attends to every other, so 4x the patches cost
    # far more than 4x.
    vit = ViT(ViTConfig(image_size=32, patch_size=2, d_model=16, n_heads=2, n_layers=4))
    assert count_flops(vit, pixels_4x) > 8 * count_flops(vit, pixels)


@pytest.mark.parametrize(("preset", "heads", "width"), [("fashion", (3, 6), 96), ("fashion-small", (2, 4), 64)])
def test_fashion_presets_run_through_every_stage(preset, heads, width):
    model = SwinClassifier(SwinConfig.from_preset(preset, n_classes=10)).eval()
    logits, attention = model(torch.randn(2, 1, 28, 28), return_attention=True)
    assert logits.shape == (2, 10)
    # 14x14 patches in four shifted 7x7 windows, then 7x7 tokens in one window
    assert [tuple(a.shape) for a in attention] == [(2, 4, heads[0], 49, 49)] * 2 + [(2, 1, heads[1], 49, 49)] * 2
    stages = [m for m in model.modules() if isinstance(m, SwinStage)]
    assert [s.merge is not None for s in stages] == [True, False]
    assert model.swin(torch.randn(2, 1, 28, 28)).shape == (2, 49, width)


@pytest.mark.parametrize(("pixels", "message"), [
    (torch.randn(2, 1, 32, 32), "3 channel"),
    (torch.randn(2, 3, 31, 32), "multiples of the patch size 2"),
    (torch.randn(3, 32, 32), "shape \\(B, C, H, W\\)"),
    (torch.zeros(2, 3, 32, 32, dtype=torch.uint8), "float tensor"),
])
def test_bad_images_raise_one_clear_error(pixels, message):
    model = Swin(SwinConfig(**SMALL))
    with pytest.raises((ValueError, TypeError), match=message):
        model(pixels)


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(depths=(2, 2), stage_heads=(2,)), "one entry per stage"),
    (dict(stage_heads=(2, 5)), "32 wide, which must be divisible by stage_heads\\[1\\]=5"),
    (dict(depths=(2, 0)), "depths\\[1\\] must be >= 1"),
    (dict(image_size=30, patch_size=4), "divisible by patch_size"),
    (dict(positional="learned"), "positional must be 'none'"),
    (dict(window_size=0), "window_size must be >= 1"),
    (dict(mlp_ratio=0.0), "mlp_ratio must be positive"),
])
def test_config_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        SwinConfig(**{**SMALL, **overrides})


def test_classifier_and_checkpoint_errors():
    with pytest.raises(ValueError, match="needs n_classes"):
        SwinClassifier(SwinConfig(**SMALL))
    hf, config = hf_swin(depths=[2, 2], num_heads=[2, 4])
    with pytest.raises(ValueError, match="use_absolute_embeddings"):
        load_swin_from_hf(hf.state_dict(), {**config.to_dict(), "use_absolute_embeddings": True})
    state = dict(hf.state_dict())
    del state["encoder.layers.0.downsample.reduction.weight"]
    with pytest.raises(ValueError, match=re.escape("missing ['encoder.layers.0.downsample.reduction.weight']")):
        load_swin_from_hf(state, config.to_dict())


@pytest.mark.parametrize("family", ["swin", "vit"])
def test_qk_norm_and_relu2_normalise_each_head_and_keep_images_independent(family):
    """The speedruns' switches in the image models: a norm over each head's width on its queries and keys, ReLU²
    in the feed-forward network; an image's output is the same in a batch as alone."""
    torch.manual_seed(0)
    if family == "swin":
        model, head = Swin(SwinConfig(**SMALL, qk_norm=True, activation="relu2")).eval(), (8,)
    else:
        model, head = ViT(ViTConfig(image_size=16, patch_size=4, d_model=32, n_heads=4, n_layers=2, d_ff=64,
                                    qk_norm=True, activation="relu2", dropout=0.0)).eval(), (8,)
    widths = {m.q_norm.weight.numel() for m in model.modules() if isinstance(m, MultiHeadAttention)}
    assert sorted(widths) == sorted(set(head))
    size = model.config.image_size
    images = torch.randn(3, 3, size, size)
    with torch.no_grad():
        batched = model(images)
        for i in range(3):
            torch.testing.assert_close(batched[i], model(images[i : i + 1])[0], atol=1e-5, rtol=1e-5)
