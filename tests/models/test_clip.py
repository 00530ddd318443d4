"""CLIP: parity with Hugging Face CLIPModel, the contrastive loss, the temperature clamp, zero-shot, recall@k."""

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from qkv.config import CLIPConfig, CLIPTextConfig, ViTConfig
from qkv.interop.hf_clip import clip_config_from_hf, load_clip_from_hf
from qkv.models.clip import (
    CLIP,
    contrastive_loss,
    retrieval_recall,
    zero_shot_classifier,
    zero_shot_predict,
)

transformers = pytest.importorskip("transformers")

# Different widths for the two towers, so that a projection or a norm read from the wrong tower shows.
HF_TEXT = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=12, bos_token_id=0, eos_token_id=39, pad_token_id=1)
HF_VISION = dict(image_size=16, patch_size=8, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4)


def hf_clip(**text_overrides):
    torch.manual_seed(0)
    config = transformers.CLIPConfig(text_config={**HF_TEXT, **text_overrides}, vision_config=HF_VISION,
                                     projection_dim=24)
    config._attn_implementation = "eager"  # the one that returns attention weights
    model = transformers.CLIPModel(config).eval()
    with torch.no_grad():  # random everything, so that a weight loaded in the wrong place shows
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model, config


# Right-padded captions ending in the end-of-text token 39; the last row pads with 39 itself, so only the
# first 39 may be read.
IDS = torch.tensor([[0, 5, 7, 39, 1, 1], [0, 3, 4, 8, 9, 39], [0, 12, 39, 39, 39, 39]])
MASK = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])


def test_image_and_text_features_equal_hugging_face_clip():
    hf, config = hf_clip()
    ours = load_clip_from_hf(hf.state_dict(), config.to_dict())
    pixels = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        expected_image = hf.get_image_features(pixel_values=pixels, output_attentions=True)
        expected_text = hf.get_text_features(input_ids=IDS, attention_mask=MASK, output_attentions=True)
        image, image_attention = ours.encode_image(pixels, return_attention=True)
        text, text_attention = ours.encode_text(IDS, MASK, return_attention=True)
    torch.testing.assert_close(image, expected_image.pooler_output, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(text, expected_text.pooler_output, atol=1e-5, rtol=1e-5)
    pairs = [*zip(image_attention, expected_image.attentions, strict=True),
             *zip(text_attention, expected_text.attentions, strict=True)]
    for mine, theirs in pairs:
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


def test_logits_per_image_equal_hugging_face():
    hf, config = hf_clip()
    ours = load_clip_from_hf(hf.state_dict(), config.to_dict())
    pixels = torch.randn(4, 3, 16, 16)  # 4 images against 3 texts
    with torch.no_grad():
        expected = hf(input_ids=IDS, pixel_values=pixels, attention_mask=MASK).logits_per_image
        torch.testing.assert_close(ours(pixels, IDS, MASK), expected, atol=1e-5, rtol=1e-5)


def test_legacy_eos_id_pools_at_the_highest_id_as_hugging_face():
    hf, config = hf_clip(eos_token_id=2)  # configs written before the fix: the end-of-text id is the highest
    ours = load_clip_from_hf(hf.state_dict(), config.to_dict())
    assert ours.config.text.eos_id is None
    ids = torch.tensor([[0, 5, 38, 3, 1], [0, 37, 4, 6, 7]])  # the highest ids sit in the middle
    with torch.no_grad():
        expected = hf.get_text_features(input_ids=ids).pooler_output
        torch.testing.assert_close(ours.encode_text(ids), expected, atol=1e-5, rtol=1e-5)


def test_hugging_face_default_config_is_the_vit_b_32_preset():
    converted = clip_config_from_hf(transformers.CLIPConfig().to_dict())
    preset = CLIPConfig.from_preset("vit-b-32")
    # Hugging Face writes attention_dropout=0.0 where qkv leaves None (= dropout, 0.0): the same model.
    assert dataclasses.replace(converted.vision, attention_dropout=None) == preset.vision
    assert dataclasses.replace(converted.text, attention_dropout=None) == preset.text
    assert (converted.projection_dim, converted.logit_scale_init) == (preset.projection_dim, preset.logit_scale_init)


# --------------------------------------------------------------------------------------------- a tiny CLIP

WORDS = ["<eot>", "a", "photo", "of", "the", "stripes", "rows", "columns", "checks", "diagonal", "blurry"]
NAMES = ["rows", "columns", "checks", "diagonal"]


def tokenize(text):
    return [WORDS.index(word) for word in text.split()] + [0]  # 0 is the end-of-text token


def tiny_clip(seed=0):
    torch.manual_seed(seed)
    # Xavier: with N(0, 0.02) weights a model this narrow starts with every caption and image almost alike
    # (the residual branches are tiny next to the end-of-text and [CLS] embeddings) and learns slowly.
    vision = ViTConfig(image_size=8, patch_size=4, channels=1, d_model=16, n_heads=2, n_layers=1, embed_norm=True,
                       patch_bias=False, activation="quick_gelu", norm_eps=1e-5, init="xavier")
    text = CLIPTextConfig(vocab_size=len(WORDS), eos_id=0, d_model=16, n_heads=2, n_layers=1, max_seq_len=8,
                          init="xavier")
    return CLIP(CLIPConfig(vision=vision, text=text, projection_dim=8))


# One 4x4 tile per class, repeated over the image: rows, columns, a checkerboard, an anti-diagonal.
TILES = torch.stack([
    torch.arange(4.0).repeat(4, 1),
    torch.arange(4.0)[:, None].repeat(1, 4),
    (torch.arange(4)[:, None] + torch.arange(4)).remainder(2).float() * 3,
    torch.eye(4).flip(0) * 3,
]) - 1.5


def pattern_images(labels):
    return TILES[labels].repeat(1, 2, 2)[:, None] + 0.3 * torch.randn(len(labels), 1, 8, 8)  # (B, 1, 8, 8)


def test_a_tiny_clip_learns_four_patterns_and_classifies_new_images_zero_shot():
    model = tiny_clip()
    captions = [tokenize(f"a photo of the {name}") for name in NAMES]  # all of one length: no padding
    ids, labels = torch.tensor(captions), torch.arange(4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(40):
        loss = contrastive_loss(model(pattern_images(labels), ids))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.1  # from ln 4 = 1.39
    model.eval()
    classifier = zero_shot_classifier(model, tokenize, NAMES, ["a photo of the {}"])
    test_labels = torch.arange(4).repeat(8)
    assert torch.equal(zero_shot_predict(model, pattern_images(test_labels), classifier), test_labels)


def test_zero_shot_classifier_is_the_renormalised_mean_of_normalised_template_embeddings():
    model = tiny_clip().eval()
    templates = ["a photo of the {}", "the {label}", "a blurry photo of the {} stripes"]  # three lengths
    classifier = zero_shot_classifier(model, tokenize, NAMES, templates)
    with torch.no_grad():
        for row, name in zip(classifier, NAMES, strict=True):
            alone = [F.normalize(model.encode_text(torch.tensor([tokenize(t.format(name, label=name))])), dim=-1)
                     for t in templates]  # each prompt alone, unpadded
            torch.testing.assert_close(row, F.normalize(torch.cat(alone).mean(0), dim=-1), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(classifier.norm(dim=-1), torch.ones(4))


def test_padded_texts_equal_each_text_alone():
    model = tiny_clip().eval()
    ids = torch.tensor([[1, 2, 3, 4, 5, 0, 9, 9], [1, 5, 0, 9, 9, 9, 9, 9]])  # 9s: padding after the end of text
    mask = torch.tensor([[1] * 6 + [0] * 2, [1] * 3 + [0] * 5])
    with torch.no_grad():
        batch = model.encode_text(ids, mask)
        alone = torch.cat([model.encode_text(ids[:1, :6]), model.encode_text(ids[1:, :3])])
    torch.testing.assert_close(batch, alone, atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------------------------- loss and metrics


def test_contrastive_loss_equals_a_hand_written_reference():
    torch.manual_seed(0)
    logits = 3 * torch.randn(4, 4)
    rows = logits.tolist()
    n = len(rows)
    # image i must pick text i among the texts (its row), text j image j among the images (its column)
    image_to_text = sum(-rows[i][i] + math.log(sum(math.exp(rows[i][j]) for j in range(n))) for i in range(n)) / n
    text_to_image = sum(-rows[j][j] + math.log(sum(math.exp(rows[i][j]) for i in range(n))) for j in range(n)) / n
    assert contrastive_loss(logits).item() == pytest.approx((image_to_text + text_to_image) / 2, rel=1e-6)
    assert contrastive_loss(torch.tensor([[5.0]])).item() == 0.0  # one pair: nothing to confuse it with


def test_logit_scale_is_clamped_at_100():
    model = tiny_clip().eval()
    pixels, ids = pattern_images(torch.arange(4)), torch.tensor([tokenize(f"a photo of the {n}") for n in NAMES])
    with torch.no_grad():
        cosines = F.normalize(model.encode_image(pixels), dim=-1) @ F.normalize(model.encode_text(ids), dim=-1).t()
        for log_scale, scale in ((math.log(10), 10.0), (math.log(1000), 100.0)):
            model.logit_scale.fill_(log_scale)
            torch.testing.assert_close(model(pixels, ids), scale * cosines, atol=1e-5, rtol=1e-5)
    assert model.config.logit_scale_init == pytest.approx(math.log(1 / 0.07), abs=1e-4)


def test_retrieval_recall_on_hand_made_embeddings():
    images = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]) * torch.tensor([[2.0], [0.5], [3.0]])  # norms differ
    texts = torch.tensor([[1.0, 0.1], [1.0, 0.0], [0.0, 1.0]])
    # Image -> text, candidates above the true caption: image 0: text 1; image 1: texts 2 and 0; image 2: text 0
    # (text 1 ties with its caption and does not count). Text -> image: none; images 0 and 2; image 1.
    assert retrieval_recall(images, texts, ks=(1, 2, 3)) == pytest.approx({
        "image_to_text@1": 0.0, "text_to_image@1": 1 / 3,
        "image_to_text@2": 2 / 3, "text_to_image@2": 2 / 3,
        "image_to_text@3": 1.0, "text_to_image@3": 1.0,
    })
    assert retrieval_recall(texts, texts, ks=(1,)) == {"image_to_text@1": 1.0, "text_to_image@1": 1.0}


def test_retrieval_recall_by_class_counts_any_candidate_of_the_right_class():
    images = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    texts = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.9, 0.1]])
    labels = torch.tensor([0, 0, 1])
    # Image 0's best caption of class 0 is text 1 (first place), image 1's is text 0; image 2's only one, text 2,
    # comes after text 1 (class 0). Each text's best image of its class is first (image 2 ties with image 0).
    assert retrieval_recall(images, texts, ks=(1, 2), labels=(labels, labels)) == pytest.approx({
        "image_to_text@1": 2 / 3, "text_to_image@1": 1.0, "image_to_text@2": 1.0, "text_to_image@2": 1.0})
    assert retrieval_recall(images, texts, ks=(1,))["image_to_text@1"] == 0.0  # exact partners: all missed
    # Unpaired: the two class-0 images against two class-0 captions.
    assert retrieval_recall(images[:2], texts[1:], ks=(1,), labels=(labels[:2], torch.tensor([0, 0]))) == {
        "image_to_text@1": 1.0, "text_to_image@1": 1.0}
    with pytest.raises(ValueError, match="labels must be \\(3,\\) for the images"):
        retrieval_recall(images, texts, labels=(labels[:2], labels))
    with pytest.raises(ValueError, match="must be paired"):
        retrieval_recall(images, texts[:2])


# --------------------------------------------------------------------------------------------- config and errors


def test_config_round_trips_through_json():
    config = CLIPConfig.from_preset("fashion", text=dict(vocab_size=40, eos_id=1))
    assert (config.text.d_model, config.text.vocab_size, config.vision.patch_bias) == (64, 40, False)
    data = json.loads(json.dumps(config.to_dict()))
    assert CLIPConfig.from_dict(data) == config
    with pytest.raises(ValueError, match="unknown CLIPTextConfig fields \\['colour'\\]"):
        CLIPConfig.from_dict({**data, "text": {**data["text"], "colour": 1}})


def test_config_errors():
    with pytest.raises(ValueError, match="eos_id=10 is outside the vocabulary"):
        CLIPTextConfig(vocab_size=10, eos_id=10)
    with pytest.raises(ValueError, match="pad_id=3 equals eos_id"):
        CLIPTextConfig(vocab_size=10, eos_id=3, pad_id=3)
    with pytest.raises(TypeError, match="text must be a CLIPTextConfig"):
        CLIPConfig(vision=ViTConfig(), text="small")


@pytest.mark.parametrize(("call", "message"), [
    (lambda model: zero_shot_classifier(model, tokenize, [], ["a {}"]), "class_names is empty"),
    (lambda model: zero_shot_classifier(model, tokenize, NAMES, []), "templates is empty"),
    (lambda model: zero_shot_classifier(model, tokenize, NAMES, ["a photo"]), "needs \\{\\} or \\{label\\}"),
    (lambda model: zero_shot_predict(model, torch.randn(2, 1, 8, 8), torch.randn(4, 5)), "shape \\(n_classes, 8\\)"),
    (lambda model: model.encode_image(torch.randn(2, 3, 8, 8)), "1 channel"),
    (lambda model: model.encode_image(torch.randn(2, 1, 10, 8)), "multiples of the patch size 4"),
    (lambda model: model.encode_text(torch.tensor([[1, 2, 0], [1, 2, 3]])), "row 1 of ids has no end-of-text token"),
    (lambda model: contrastive_loss(torch.randn(2, 3)), "square \\(B, B\\) logits"),
    (lambda model: retrieval_recall(torch.randn(3, 4), torch.randn(2, 4)), "must be paired"),
])
def test_errors_are_one_clear_line(call, message):
    model = tiny_clip()
    with pytest.raises((ValueError, TypeError), match=message):
        call(model)
