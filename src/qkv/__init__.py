"""qkv: a Transformer toolkit written from the building blocks up."""

from importlib import import_module

__version__ = "0.1.0"
__all__ = ["BERT", "CLIP", "GPT", "BERTConfig", "CLIPConfig", "GPTConfig", "LSTMSeq2Seq", "RNNConfig", "Swin",
           "SwinConfig", "Transformer", "TransformerConfig", "ViT", "ViTConfig"]


def __getattr__(name: str):
    """The models and configs, imported on first use (PEP 562): ``import qkv.cli`` must not import torch, so
    that the ``qkv`` command is ready for Ctrl-C (and --help) before the second it takes to load."""
    if name not in __all__:
        raise AttributeError(f"module 'qkv' has no attribute {name!r}")
    return getattr(import_module(".config" if name.endswith("Config") else ".models", __name__), name)
