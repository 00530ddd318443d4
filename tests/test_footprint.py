"""qkv.footprint: sizes checked against the machine's memory before anything is allocated, with the figure in a
one-line error; and the sizes qkv's own presets and command defaults use are never refused."""

import time

import pytest
import torch

from qkv import GPT, footprint
from qkv.config import BERTConfig, CLIPConfig, GPTConfig, RNNConfig, SwinConfig, TransformerConfig, ViTConfig
from qkv.footprint import (
    MAX_LAYERS,
    activation_bytes,
    build_model,
    check_decoding,
    check_model,
    decoding_bytes,
    padded_images,
    stacks,
)
from qkv.models import BERT, CLIP, LSTMSeq2Seq, Swin, Transformer, ViT, ViTClassifier

GIB = 2**30


@pytest.fixture
def memory_of(monkeypatch):
    """``memory_of(n)``: the machine has ``n`` bytes available, as far as qkv.footprint can tell."""
    return lambda n: monkeypatch.setattr(footprint, "available_memory", lambda device=None: n)


def _tiny_gpt(**overrides) -> GPTConfig:
    return GPTConfig(**{"vocab_size": 50, "d_model": 16, "n_heads": 2, "n_layers": 1, "max_seq_len": 32,
                        **overrides})


@pytest.mark.parametrize("sizes, phrase", [
    (dict(d_model=10**9, n_heads=1), "d_model 1,000,000,000"),
    (dict(max_seq_len=10**9), "max_seq_len 1,000,000,000"),
])
def test_a_huge_position_table_is_refused_before_it_is_computed(sizes, phrase):
    """Sinusoidal tables are computed on the CPU even when the model is sized on the meta device: they are
    checked from the config first (before, the allocator failed inside PyTorch)."""
    cfg = TransformerConfig(src_vocab_size=50, tgt_vocab_size=50, n_layers=1, d_ff=32,
                            **{"d_model": 16, "n_heads": 2, **sizes})
    with pytest.raises(ValueError, match=f"position table of the model .*{phrase}.* needs .* more than the "
                                         ".* of memory available; choose smaller sizes"):
        build_model(Transformer, cfg)


def test_too_many_layers_are_refused_before_building():
    """Building takes about a millisecond a layer even on the meta device: 10^7 layers would take hours."""
    start = time.monotonic()
    with pytest.raises(ValueError, match=f"has {MAX_LAYERS + 1:,} layers; qkv builds at most {MAX_LAYERS:,}"):
        build_model(GPT, _tiny_gpt(n_layers=MAX_LAYERS + 1))
    with pytest.raises(ValueError, match="has 20,000,000 layers"):  # an encoder and a decoder of 10^7 each
        build_model(Transformer, TransformerConfig(src_vocab_size=50, tgt_vocab_size=50, d_model=16, n_heads=2,
                                                   n_layers=10**7))
    assert time.monotonic() - start < 1


def test_buffers_count_with_the_parameters(memory_of):
    """Weights and buffers (here the sinusoidal table, 4 bytes an entry) are counted exactly."""
    cfg = TransformerConfig(src_vocab_size=10_000, tgt_vocab_size=10_000, d_model=16, n_heads=2, n_layers=1,
                            d_ff=32, max_seq_len=4096)
    model = Transformer(cfg)
    need = 4 * sum(p.numel() for p in model.parameters()) + 4 * 4096 * 16
    memory_of(need)
    check_model(Transformer, cfg)
    memory_of(need - 1)
    with pytest.raises(ValueError, match=r"has [\d,]+ parameters and needs [\d.]+ GiB for its weights \(fp32\), more "
                                         "than the"):
        check_model(Transformer, cfg)


def test_one_batch_is_counted_with_the_model():
    cfg = _tiny_gpt()
    assert isinstance(build_model(GPT, cfg, training=True, batch=(4, 32)), GPT)
    with pytest.raises(ValueError, match=r"parameters and needs .* to train \(weights, gradients and AdamW's "
                                         r"moments, fp32\) and one batch of 1,000,000 × 32 tokens, more than"):
        build_model(GPT, cfg, training=True, batch=(10**6, 32))


def test_the_activation_formula():
    """B·T·(L·(8d + 2d_ff) + 2V) + B·H·T·K numbers to train; one layer's and one V to use (module text)."""
    cfg = _tiny_gpt(n_layers=3, window=8)  # d 16, d_ff 64, H 2, V 50, T 32, K 8
    assert activation_bytes(cfg, 2, None, training=True) == 4 * (2 * 32 * (3 * (8 * 16 + 2 * 64) + 2 * 50)
                                                                 + 2 * 2 * 32 * 8)
    assert activation_bytes(cfg, 2, 10, training=False) == 4 * (2 * 10 * (8 * 16 + 2 * 64 + 50) + 2 * 2 * 10 * 8)
    assert decoding_bytes(cfg, 5, 20) == 4 * 5 * (6 * 3 * 20 * 16 + 3 * 50)
    # checkpointed: each layer's input, and one layer's activations at a time
    assert activation_bytes(cfg, 2, None, training=True, checkpointing=True) == \
        4 * (2 * 32 * (3 * 16 + 8 * 16 + 2 * 64 + 2 * 50) + 2 * 2 * 32 * 8)
    gated = _tiny_gpt(n_layers=3, window=8, activation="swiglu")  # gate, up, their activation and product
    assert activation_bytes(gated, 2, 10, training=False) == 4 * (2 * 10 * (8 * 16 + 4 * 64 + 50) + 2 * 2 * 10 * 8)


def test_padded_images_are_counted(memory_of):
    cfg = ViTConfig(image_size=8, patch_size=4, channels=1, d_model=16, n_heads=2, n_layers=1, n_classes=10)
    assert padded_images(3, cfg, 2) == 3 * 1 * 12 * 12
    memory_of(GIB)
    with pytest.raises(ValueError, match="one batch of 128, more than"):
        build_model(ViTClassifier, cfg, training=True, batch=(128, None), inputs=padded_images(128, cfg, 10**9))


def test_beams_are_checked_before_decoding(memory_of):
    from qkv.tasks.translation import translate_ids

    cfg = TransformerConfig(src_vocab_size=50, tgt_vocab_size=50, d_model=16, n_heads=2, n_layers=1, d_ff=32)
    model = Transformer(cfg)
    check_decoding(cfg, sequences=1, beams=10**4, length=20)  # 10^4 beams of a tiny model fit
    memory_of(10 * 2**20)
    with pytest.raises(ValueError, match=r"decoding 1 sequence\(s\) with 10,000 beam\(s\) each to 20 tokens needs "
                                         r"[\d.]+ GiB, more than the 0.0 GiB of memory available"):
        translate_ids(model, [[5, 6, 7, 8, 9]], beam_size=10**4)


def test_the_memory_is_the_devices():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    assert footprint.available_memory("cuda") == torch.cuda.mem_get_info("cuda")[0]


def _families():
    """Every preset of every family, and the command line's training defaults with their batches."""
    for cls, config_cls, fixed in [(Transformer, TransformerConfig, dict(src_vocab_size=8000, tgt_vocab_size=8000)),
                                   (GPT, GPTConfig, dict(vocab_size=50257)),
                                   (BERT, BERTConfig, dict(vocab_size=30522)),
                                   (ViT, ViTConfig, {}), (Swin, SwinConfig, {}),
                                   (CLIP, CLIPConfig, dict(text=dict(vocab_size=49408, eos_id=2))),
                                   (LSTMSeq2Seq, RNNConfig, dict(src_vocab_size=8000, tgt_vocab_size=8000))]:
        for name in config_cls.PRESETS:
            if cls is GPT and name == "llama":  # a style, not a size: it is merged into another preset
                continue
            missing = {k: v for k, v in fixed.items() if k not in config_cls.PRESETS[name] or isinstance(v, dict)}
            yield pytest.param(cls, config_cls.from_preset(name, **missing), id=f"{config_cls.__name__}-{name}")


@pytest.mark.parametrize("model_cls, cfg", list(_families()))
def test_no_preset_is_refused_on_a_small_machine(model_cls, cfg, memory_of):
    """Every preset trains on 16 GiB: its weights with AdamW's moments and a batch of 8 × 512 tokens."""
    memory_of(16 * GIB)
    check_model(model_cls, cfg, training=True, batch=(8, 512))
    assert all(s.layers <= MAX_LAYERS for s in stacks(cfg))


@pytest.mark.parametrize("cfg, batch", [
    (GPTConfig.from_preset("mini", vocab_size=4000), (32, 128)),  # qkv train lm
    (BERTConfig.from_preset("tiny", vocab_size=8000), (32, 128)),  # qkv train mlm / classify
    (ViTConfig.from_preset("fashion", n_classes=10, image_size=32, channels=3), (128, None)),  # qkv train vit
])
def test_the_command_defaults_need_little(cfg, batch):
    """What ``qkv train`` builds by default fits on a 4 GiB machine, batch included."""
    assert activation_bytes(cfg, *batch, training=True) < 4 * GIB


def test_an_encoding_batch_is_checked_as_large_as_it_is(memory_of):
    """``--batch-size 1000000`` of a few sentences is a batch of those few: checked at its real size."""
    from qkv.tasks.embeddings import embed
    from qkv.tokenizers import WordPieceTokenizer

    texts = ["a small dog runs", "the cat sleeps on a mat"] * 10
    tokenizer = WordPieceTokenizer.train(texts, vocab_size=60)
    model = BERT(BERTConfig(vocab_size=tokenizer.vocab_size, d_model=16, n_heads=2, n_layers=1, max_seq_len=32))
    assert embed(model, tokenizer, texts, batch_size=10**6).shape == (20, 16)
    memory_of(2**10)
    with pytest.raises(ValueError, match=r"encoding 20 sentences of \d+ tokens at once needs .* more than the"):
        embed(model, tokenizer, texts, batch_size=10**6)


FAULTS = """
import resource, sys, torch
from qkv.footprint import reuse_freed_memory
if sys.argv[1] == "kept":
    reuse_freed_memory()
def step():  # what a training step does: blocks of a few megabytes, touched, freed
    return sum(float(torch.ones(s).sum()) for s in (300_000, 400_000, 900_000, 300_000))
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not hasattr(footprint.libc(), "mallopt"), reason="the C library has no mallopt (not glibc)")
def test_a_step_reuses_the_memory_the_last_one_freed():
    """With reuse_freed_memory (what training sets up), blocks freed and allocated again each step come back without
    page faults; by default, glibc hands many of them back to the system and each step faults its pages in again.
    (In fresh processes: the setting is the process's.)"""
    import subprocess
    import sys

    faults = {how: int(subprocess.run([sys.executable, "-c", FAULTS, how], capture_output=True, text=True,
                                      check=True).stdout) for how in ("default", "kept")}
    assert faults["kept"] < 50 < faults["default"], faults
