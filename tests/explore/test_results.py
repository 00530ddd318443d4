"""The explorer's data: for each kind of model, the weights it shows are the model's own attention (computed
apart here), the output is what qkv's decoding writes, and each step's candidates are the model's probabilities."""

import json
import re

import numpy as np
import pytest
import torch

from qkv.checkpoint import load_checkpoint
from qkv.config import GPTConfig
from qkv.explore import InputError, lm_result, page, translation_result
from qkv.explore.results import MAX_TOKENS
from qkv.generation import LMDecoder, generate
from qkv.tasks.translation import translate_ids
from qkv.tokenizers import token_label as label


def _close(shown, expected):
    """The page's numbers (4 decimals) against the model's."""
    assert torch.tensor(shown).shape == expected.shape
    torch.testing.assert_close(torch.tensor(shown, dtype=torch.float64), expected.double(), atol=5.1e-5, rtol=0)


def test_a_language_model_shows_its_continuation_attention_and_candidates(lm_dir):
    ckpt = load_checkpoint(lm_dir)
    model, tok = ckpt.model, ckpt.tokenizers["text"]
    result = lm_result(model, tok, "the 猫", name="lm", new_tokens=6)
    prompt = tok.encode("the 猫")
    decoder = LMDecoder(model, [prompt])
    never = sorted(tok.special_ids)  # qkv's decoding never writes them: no share of the shown distribution
    output = generate(decoder, start=decoder.start, max_new_tokens=6, suppress_ids=never)[0]
    steps, view = result["steps"], result["views"][0]
    assert steps["first"] == len(prompt) - 1 and steps["tokens"] == [label(tok, i) for i in output]
    assert view["queries"] == view["keys"] == [label(tok, i) for i in prompt + output]
    with torch.no_grad():
        logits, attention = model(torch.tensor([prompt + output]), return_attention=True)
    _close(view["attention"], torch.stack([a[0] for a in attention]))  # (layers, heads, T, T)
    for step, (candidates, token) in enumerate(zip(steps["top"], steps["tokens"], strict=True)):
        assert candidates[0]["token"] == token  # greedy: the most likely candidate is the one written
        probs = logits[0, len(prompt) - 1 + step].index_fill(-1, torch.tensor(never), float("-inf")).softmax(-1)
        assert candidates[0]["p"] == pytest.approx(probs.max().item(), abs=5e-5)
    assert view["stepped"] and json.loads(json.dumps(result)) == result  # plain JSON
    assert (label(tok, tok.stoi[" "]), label(tok, tok.stoi["\n"])) == ("␣", "↵")  # made visible


def test_local_and_global_layers_are_named_and_a_local_one_sees_its_window_alone(lm_dir):
    """A model of Gemma's kinds of layers (two local ones with a window of 3, a global one, one without positions):
    the page names each layer's kind, and a local layer's weights are zero beyond its window."""
    from qkv import GPT
    from qkv.config import LayerSpec

    tok = load_checkpoint(lm_dir).tokenizers["text"]
    layers = [LayerSpec(window=3), LayerSpec(), LayerSpec(window=3), LayerSpec(rotary=False)]
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, d_model=32, n_heads=2, n_layers=4, positional="rope",
                          norm="rms", activation="geglu_tanh", layers=layers)).eval()
    view = lm_result(model, tok, "the cat sat", name="local", new_tokens=3)["views"][0]
    assert view["layers"] == ["local, window 3", "global", "local, window 3", "global, no positions"]
    weights = torch.tensor(view["attention"])  # (layers, heads, T, T)
    rows, cols = torch.meshgrid(torch.arange(weights.size(-1)), torch.arange(weights.size(-1)), indexing="ij")
    beyond = rows - cols >= 3
    assert beyond.any() and (weights[0][:, beyond] == 0).all() and (weights[1][:, beyond] > 0).any()


def test_a_translator_shows_encoder_decoder_and_cross_attention(translator_dir):
    ckpt = load_checkpoint(translator_dir)
    model, toks = ckpt.model, ckpt.tokenizers
    result = translation_result(model, toks, "the cat", name="t")
    source = toks["src"].encode("the cat")
    output = translate_ids(model, [source])[0]
    views = {v["id"]: v for v in result["views"]}
    assert result["steps"]["tokens"] == [label(toks["tgt"], i) for i in output] + ["</s>"]
    with torch.no_grad():
        _, attention = model(torch.tensor([source]), torch.tensor([[1, *output]]), return_attention=True)
    for view_id, key in (("encoder", "encoder"), ("decoder", "decoder_self"), ("cross", "decoder_cross")):
        _close(views[view_id]["attention"], torch.stack([a[0] for a in attention[key]]))
    assert len(views["cross"]["queries"]) == len(output) + 1 and len(views["cross"]["keys"]) == len(source)
    assert views["decoder"]["queries"][0] == "<s>" and not views["encoder"]["stepped"]


def test_a_steps_candidates_are_what_decoding_chooses_from(translator_dir):
    """Padding, <s> and <unk> are never written by decoding, so they are never shown as candidates, and the
    probabilities shown are those of the distribution decoding chooses from."""
    from qkv.tasks.translation import NOT_TEXT

    ckpt = load_checkpoint(translator_dir)
    model, toks = ckpt.model, ckpt.tokenizers
    result = translation_result(model, toks, "the cat", name="t")
    output = translate_ids(model, [toks["src"].encode("the cat")])[0]
    with torch.no_grad():
        logits = model(torch.tensor([toks["src"].encode("the cat")]), torch.tensor([[1, *output]]))[0]
    never = torch.tensor(NOT_TEXT)
    special = {label(toks["tgt"], i) for i in NOT_TEXT}
    raw_top = logits[:, : model.config.tgt_vocab_size].softmax(-1).topk(5, dim=-1).indices
    assert any(i in NOT_TEXT for i in raw_top.flatten().tolist())  # without the rule, they would be shown
    for step, candidates in enumerate(result["steps"]["top"]):
        assert not special & {c["token"] for c in candidates}
        probs = logits[step, : model.config.tgt_vocab_size].index_fill(-1, never, float("-inf")).softmax(-1)
        assert candidates[0]["p"] == pytest.approx(probs.max().item(), abs=5e-5)


def test_inputs_it_cannot_show_are_clear_errors(lm_dir):
    ckpt = load_checkpoint(lm_dir)
    with pytest.raises(InputError, match="the prompt has no tokens: type a sentence"):
        lm_result(ckpt.model, ckpt.tokenizers["text"], "", name="lm")
    with pytest.raises(InputError, match=f"the prompt is 70 tokens long; the explorer shows at most {MAX_TOKENS - 16}"):
        lm_result(ckpt.model, ckpt.tokenizers["text"], "a" * 70, name="lm")


def test_the_page_inlines_its_script_style_and_data_and_nothing_else():
    result = {"model": "m", "kind": "encoder", "input": "x", "steps": None, "image": None,
              "views": [{"id": "self", "title": "Self", "queries": ["</script>", "猫"], "keys": ["</script>", "猫"],
                         "attention": [[[[1.0, 0.0], [0.5, 0.5]]]], "stepped": False}]}
    html = page(result, "a <title>")
    data = re.search(r'<script id="qkv-data" type="application/json">(.*?)</script>', html, re.S).group(1)
    assert json.loads(data) == result  # a label "</script>" cannot end the data early
    assert "<title>qkv" not in html and "a &lt;title&gt;" in html
    assert "__QKV_DATA__" not in html and "/*QKV_JS*/" not in html and "/*QKV_CSS*/" not in html
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)  # nothing from elsewhere
    assert "@import" not in html and "url(http" not in html
    served = page(None, "t")
    assert re.search(r'<script id="qkv-data" type="application/json">null</script>', served)


def test_an_image_classifier_shows_its_patches_the_image_and_its_classes():
    import base64
    import io

    from PIL import Image

    from qkv import ViTConfig
    from qkv.explore import image_result
    from qkv.images import normalize
    from qkv.models import ViTClassifier

    torch.manual_seed(0)
    model = ViTClassifier(ViTConfig(image_size=8, patch_size=4, channels=1, n_classes=3, d_model=16, n_heads=2,
                                    n_layers=2, d_ff=32)).eval()
    pixels = torch.randint(0, 256, (1, 8, 8), dtype=torch.uint8)
    probs = torch.tensor([0.2, 0.7, 0.1])
    result = image_result(model.vit, pixels, mean=[0.5], std=[0.25], name="vit", labels=["a", "b", "c"], probs=probs)
    view = result["views"][0]
    assert view["queries"] == ["[CLS]", "0,0", "0,1", "1,0", "1,1"] and result["image"]["grid"] == [2, 2]
    with torch.no_grad():
        attention = model.vit(normalize(pixels[None], [0.5], [0.25]), return_attention=True).attention
    _close(view["attention"], torch.stack([a[0] for a in attention]))
    assert [c["token"] for c in result["steps"]["top"][0]] == ["b", "a", "c"] and result["steps"]["tokens"] == ["b"]
    src = result["image"]["src"]
    assert src.startswith("data:image/png;base64,")
    decoded = Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1])))
    assert torch.equal(torch.from_numpy(np.array(decoded)), pixels[0])  # the very pixels
