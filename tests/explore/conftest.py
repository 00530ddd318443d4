"""Tiny saved models for the explorer's tests: a character-level GPT (Chinese characters among its tokens) and a
translation Transformer, each written with save_checkpoint as a training run writes them."""

import pytest
import torch

from qkv import GPT, GPTConfig, Transformer, TransformerConfig
from qkv.checkpoint import save_checkpoint
from qkv.tokenizers import CharTokenizer

TEXT = "the cat sat on the mat.\n猫坐在垫子上。"


@pytest.fixture(scope="session")
def lm_dir(tmp_path_factory):
    torch.manual_seed(0)
    tok = CharTokenizer.train([TEXT])
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_seq_len=96))
    path = tmp_path_factory.mktemp("explore") / "lm"
    save_checkpoint(path, model.eval(), tokenizers={"text": tok})
    return path


@pytest.fixture(scope="session")
def translator_dir(tmp_path_factory):
    torch.manual_seed(0)
    tok = CharTokenizer.train([TEXT])
    cfg = TransformerConfig(src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size, d_model=32, n_heads=4,
                            n_layers=2, d_ff=64, max_seq_len=64)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # sharper attention than the initial weights give
        for p in model.parameters():
            p.mul_(3)
    path = tmp_path_factory.mktemp("explore") / "translator"
    save_checkpoint(path, model, tokenizers={"src": tok, "tgt": tok})
    return path


@pytest.fixture(scope="session")
def vit_dir(tmp_path_factory):
    """A ViT classifier of 8 × 8 grey images in 4 × 4 patches (a 2 × 2 grid), three classes."""
    from qkv import ViTConfig
    from qkv.models import ViTClassifier

    torch.manual_seed(0)
    model = ViTClassifier(ViTConfig(image_size=8, patch_size=4, channels=1, n_classes=3, d_model=16, n_heads=2,
                                    n_layers=2, d_ff=32)).eval()
    path = tmp_path_factory.mktemp("explore") / "vit"
    save_checkpoint(path, model, tokenizers={}, meta={"labels": ["cat", "dog", "猫"], "mean": [0.5], "std": [0.25]})
    return path


@pytest.fixture(scope="session")
def png(tmp_path_factory):
    """A 12 × 10 colour PNG: the explorer converts it to the model's grey 8 × 8."""
    from PIL import Image

    path = tmp_path_factory.mktemp("explore") / "picture.png"
    gradient = (torch.arange(120).reshape(12, 10, 1) * 2).repeat(1, 1, 3).to(torch.uint8).numpy()
    Image.fromarray(gradient).save(path)
    return path


@pytest.fixture(scope="session")
def clip_dir(tmp_path_factory):
    """A CLIP of 8 × 8 grey images with a character tokenizer, its class names and templates in its meta."""
    from qkv.config import CLIPConfig, CLIPTextConfig, ViTConfig
    from qkv.models.clip import CLIP
    from qkv.tokenizers import EOS_ID

    torch.manual_seed(0)
    tok = CharTokenizer.train(["a photo of a cat dog"])
    vision = ViTConfig(image_size=8, patch_size=4, channels=1, d_model=16, n_heads=2, n_layers=2, embed_norm=True,
                       patch_bias=False, activation="quick_gelu")
    text = CLIPTextConfig(vocab_size=tok.vocab_size, eos_id=EOS_ID, d_model=16, n_heads=2, n_layers=1,
                          max_seq_len=24)
    model = CLIP(CLIPConfig(vision=vision, text=text, projection_dim=8)).eval()
    path = tmp_path_factory.mktemp("explore") / "clip"
    save_checkpoint(path, model, tokenizers={"text": tok},
                    meta={"labels": ["c", "d"], "class_names": ["cat", "dog"], "templates": ["a photo of a {}"],
                          "mean": [0.5], "std": [0.25]})
    return path
