"""Vision Transformer: parity with Hugging Face ViT, patches, positions, errors."""

import pytest
import torch
import torch.nn.functional as F

from qkv import ViT, ViTConfig
from qkv.interop import load_vit_from_hf
from qkv.models.vit import ConvStem, PatchEmbedding, ViTClassifier, drop_patches

transformers = pytest.importorskip("transformers")

HF_SMALL = dict(image_size=32, patch_size=8, num_channels=3, hidden_size=48, num_hidden_layers=2,
                num_attention_heads=4, intermediate_size=96, hidden_act="gelu")


def hf_vit(cls=None, **overrides):
    torch.manual_seed(0)
    config = transformers.ViTConfig(**{**HF_SMALL, **overrides})
    config._attn_implementation = "eager"  # the one that returns attention weights
    model = (cls or transformers.ViTModel)(config).eval()
    with torch.no_grad():  # random everything, so that a weight loaded in the wrong place shows
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model, config


def test_hidden_states_equal_hugging_face_vit_model():
    hf, config = hf_vit()
    ours = load_vit_from_hf(hf.state_dict(), config.to_dict())
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = hf(pixel_values=pixels, output_attentions=True)
        hidden, attention = ours(pixels, return_attention=True)
    torch.testing.assert_close(hidden, expected.last_hidden_state, atol=1e-5, rtol=1e-5)
    for mine, theirs in zip(attention, expected.attentions, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


def test_interpolated_positions_equal_hugging_face_at_another_size():
    hf, config = hf_vit()
    ours = load_vit_from_hf(hf.state_dict(), config.to_dict())
    pixels = torch.randn(1, 3, 48, 40)  # a 6 x 5 grid of patches where the table is 4 x 4
    with torch.no_grad():
        expected = hf(pixel_values=pixels, interpolate_pos_encoding=True).last_hidden_state
        torch.testing.assert_close(ours(pixels), expected, atol=1e-5, rtol=1e-5)


def test_classifier_logits_equal_hugging_face():
    hf, config = hf_vit(transformers.ViTForImageClassification, num_labels=5)
    ours = load_vit_from_hf(hf.state_dict(), config.to_dict())
    assert isinstance(ours, ViTClassifier)
    pixels = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(pixels), hf(pixel_values=pixels).logits, atol=1e-5, rtol=1e-5)


def test_patch_convolution_equals_unfold_then_linear():
    embed = PatchEmbedding(3, 4, 16)
    pixels = torch.randn(2, 3, 12, 8)
    torch.testing.assert_close(embed(pixels), embed.as_linear(pixels), atol=1e-5, rtol=1e-5)
    # and the order of the patches is row-major: patch (row 1, col 0) is the third of a 2-wide grid
    patch = pixels[:, :, 4:8, 0:4].reshape(2, -1)
    torch.testing.assert_close(embed(pixels)[:, 2], F.linear(patch, embed.proj.weight.flatten(1), embed.proj.bias))


def test_conv_stem_is_its_formula_and_sees_only_its_neighbourhood():
    """Two 3x3 stride-2 convolutions with GELU and a 1x1 one, written out with F.conv2d; a token (row r, column
    c) of a 4-pixel grid sees the pixels 4r-3 ... 4r+3 (the receptive field of the two 3x3 convolutions), so a
    pixel beyond them leaves it alone and one inside moves it."""
    torch.manual_seed(0)
    stem = ConvStem(1, 4, 16)
    pixels = torch.randn(2, 1, 28, 28)
    (c1, _, c2, _), proj = stem.convs, stem.proj
    x = F.gelu(F.conv2d(pixels, c1.weight, c1.bias, stride=2, padding=1))
    x = F.gelu(F.conv2d(x, c2.weight, c2.bias, stride=2, padding=1))
    expected = F.conv2d(x, proj.weight, proj.bias).flatten(2).transpose(1, 2)
    tokens = stem(pixels)
    assert tokens.shape == (2, 49, 16) and c1.out_channels == 8
    torch.testing.assert_close(tokens, expected)
    token = 2 * 7 + 2  # row 2, column 2: pixels 5 ... 11 in each direction
    for (row, col), moves in (((11, 11), True), ((5, 8), True), ((12, 8), False), ((8, 4), False)):
        nudged = pixels.clone()
        nudged[:, :, row, col] += 1.0
        changed = not torch.equal(stem(nudged)[:, token], tokens[:, token])
        assert changed == moves, (row, col)


def test_a_vit_with_the_conv_stem_reads_each_image_alone_and_any_size():
    torch.manual_seed(0)
    model = ViTClassifier(ViTConfig(image_size=28, patch_size=4, channels=1, d_model=16, n_heads=2, n_layers=1,
                                    stem="conv", n_classes=3)).eval()
    pixels = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(model(pixels)[1:2], model(pixels[1:2]), atol=1e-6, rtol=1e-5)
        assert model(torch.randn(1, 1, 32, 24)).shape == (1, 3)  # a 8 x 6 grid: positions interpolated


@pytest.mark.parametrize(("preset", "layers", "width", "millions"),
                         [("fashion-small", 4, 64, 0.20), ("fashion", 6, 128, 0.81)])
def test_the_fashion_presets_read_28_pixel_images_at_their_documented_sizes(preset, layers, width, millions):
    """The sizes the recipes and the --preset help promise, each reading a batch of 28 x 28 grey images into ten
    classes, each image as alone."""
    config = ViTConfig.from_preset(preset, n_classes=10)
    assert (config.n_layers, config.d_model, config.d_model % config.n_heads) == (layers, width, 0)
    torch.manual_seed(0)
    model = ViTClassifier(config).eval()
    assert abs(sum(p.numel() for p in model.parameters()) / 1e6 - millions) < 0.01
    with torch.no_grad():
        pixels = torch.randn(3, 1, 28, 28)
        logits = model(pixels)
        assert logits.shape == (3, 10)
        torch.testing.assert_close(logits[2:], model(pixels[2:]), atol=1e-5, rtol=1e-4)


def test_mean_pooling_reads_the_patches_only():
    model = ViT(ViTConfig(image_size=8, patch_size=4, channels=1, d_model=16, n_heads=2, n_layers=1,
                          pooling="mean")).eval()
    hidden = model(torch.randn(2, 1, 8, 8))
    assert hidden.shape == (2, 5, 16)
    torch.testing.assert_close(model.pool(hidden), hidden[:, 1:].mean(1))


def test_patch_dropout_keeps_the_cls_token_and_a_fresh_ordered_subset_of_patches():
    tokens = torch.arange(50.0)[None, :, None].expand(3, -1, 2)  # each token holds its index: [CLS] 0, patches 1-49
    torch.manual_seed(0)
    kept = drop_patches(tokens, 0.5)
    assert kept.shape == (3, 1 + 24, 2)  # round(49 / 2) patches
    index = kept[..., 0].long()
    assert (index[:, 0] == 0).all() and (index[:, 1:] >= 1).all() and (index[:, 1:].diff(dim=1) > 0).all()
    assert len({tuple(row.tolist()) for row in index}) == 3  # drawn for each image alone
    assert torch.equal(kept[..., 1], kept[..., 0])  # whole tokens move
    assert drop_patches(tokens, 0.99).shape == (3, 2, 2)  # at least one patch


def test_patch_dropout_trains_on_the_kept_patches_and_evaluates_on_all():
    """In training the encoder reads the [CLS] token and the kept patches, positions added before the cut; in
    evaluation, every patch, as a model without patch dropout does."""
    sizes = dict(image_size=8, patch_size=2, channels=1, d_model=16, n_heads=2, n_layers=2, dropout=0.0)
    model = ViT(ViTConfig(**sizes, patch_dropout=0.5))
    plain = ViT(ViTConfig(**sizes))
    plain.load_state_dict(model.state_dict())
    pixels = torch.randn(2, 1, 8, 8)
    torch.manual_seed(1)
    trained = model(pixels)
    torch.manual_seed(1)  # the same draw, on tokens that name themselves
    index = drop_patches(torch.arange(17.0)[None, :, None].expand(2, -1, 1), 0.5)[..., 0].long()
    assert trained.shape == (2, 1 + 8, 16)
    plain.eval()
    with torch.no_grad():
        tokens = plain.embed(pixels).gather(1, index[..., None].expand(-1, -1, 16))
        torch.testing.assert_close(trained.detach(), plain.encoder(tokens)[0])
        model.eval()
        torch.testing.assert_close(model(pixels), plain(pixels))


@pytest.mark.parametrize(("pixels", "message"), [
    (torch.randn(2, 3, 8, 8), "1 channel"),
    (torch.randn(2, 1, 10, 8), "multiples of the patch size 4"),
    (torch.randn(1, 8, 8), "shape \\(B, C, H, W\\)"),
    (torch.zeros(2, 1, 8, 8, dtype=torch.uint8), "float tensor"),
])
def test_bad_images_raise_one_clear_error(pixels, message):
    model = ViT(ViTConfig(image_size=8, patch_size=4, channels=1, d_model=16, n_heads=2, n_layers=1))
    with pytest.raises((ValueError, TypeError), match=message):
        model(pixels)


def test_config_errors():
    with pytest.raises(ValueError, match="divisible by patch_size"):
        ViTConfig(image_size=30, patch_size=4)
    with pytest.raises(ValueError, match="pooling"):
        ViTConfig(pooling="max")
    with pytest.raises(ValueError, match="stem"):
        ViTConfig(stem="resnet")
    with pytest.raises(ValueError, match="patch_dropout must be in"):
        ViTConfig(patch_dropout=1.0)
    for patch_size, d_model in ((6, 48), (1, 48), (8, 42)):
        with pytest.raises(ValueError, match="power of two"):
            ViTConfig(image_size=48, patch_size=patch_size, d_model=d_model, n_heads=2, stem="conv")
    with pytest.raises(ValueError, match="needs n_classes"):
        ViTClassifier(ViTConfig(image_size=8, patch_size=4, d_model=16, n_heads=2, n_layers=1))
