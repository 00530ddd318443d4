"""Checkpoints: save -> load gives the same model; writes are atomic; bad files are refused clearly."""

import json

import pytest
import torch

from qkv import (
    BERT,
    CLIP,
    GPT,
    BERTConfig,
    CLIPConfig,
    GPTConfig,
    Swin,
    SwinConfig,
    Transformer,
    TransformerConfig,
    ViT,
    ViTConfig,
)
from qkv.checkpoint import CheckpointError, load_checkpoint, resolve, save_checkpoint
from qkv.models import SwinClassifier, ViTClassifier
from qkv.tasks.translation import translate
from qkv.tokenizers import CharTokenizer


@pytest.fixture
def translator():
    tok = CharTokenizer.train(["abcdefghij klmnop"])
    cfg = TransformerConfig(src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size, d_model=32, n_heads=4,
                            n_layers=1, d_ff=64, share_embeddings=True, max_seq_len=40)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3)
    return model, {"src": tok, "tgt": tok}


def test_save_load_translates_identically(tmp_path, translator):
    model, toks = translator
    save_checkpoint(tmp_path / "ckpt", model, tokenizers=toks, meta={"task": "translation"})
    loaded = load_checkpoint(tmp_path / "ckpt")
    assert loaded.arch == "transformer" and loaded.meta["task"] == "translation"
    sentences = ["abc def", "ponm lk", "ja"]
    assert translate(loaded.model, loaded.tokenizers, sentences, beam_size=2) == \
        translate(model, toks, sentences, beam_size=2)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert loaded.model.lm_head.weight is loaded.model.tgt_emb.weight  # tying survives the round trip


@pytest.mark.parametrize("model", [
    GPT(GPTConfig(vocab_size=50, d_model=32, n_heads=4, n_layers=1)),
    GPT(GPTConfig.from_preset("llama", vocab_size=50, d_model=32, n_heads=4, n_kv_heads=2, n_layers=1)),
    BERT(BERTConfig(vocab_size=50, d_model=32, n_heads=4, n_layers=1)),
])
def test_every_family_round_trips(tmp_path, model):
    save_checkpoint(tmp_path / "m", model, tokenizers={})
    loaded = load_checkpoint(tmp_path / "m").model
    ids = torch.randint(1, 50, (2, 7))
    torch.testing.assert_close(loaded(ids), model.eval()(ids))


@pytest.mark.parametrize("model", [
    ViT(ViTConfig.from_preset("fashion", d_model=32, n_layers=1)),
    ViTClassifier(ViTConfig.from_preset("fashion", d_model=32, n_layers=1, n_classes=10)),
    Swin(SwinConfig.from_preset("fashion")),
    SwinClassifier(SwinConfig.from_preset("fashion", n_classes=10)),
])
def test_every_vision_family_round_trips(tmp_path, model):
    save_checkpoint(tmp_path / "m", model, tokenizers={})
    loaded = load_checkpoint(tmp_path / "m").model
    pixels = torch.randn(2, 1, 28, 28)
    torch.testing.assert_close(loaded(pixels), model.eval()(pixels))


def test_clip_round_trips(tmp_path):
    model = CLIP(CLIPConfig.from_preset("fashion", text=dict(vocab_size=60, eos_id=59))).eval()
    save_checkpoint(tmp_path / "m", model, tokenizers={})
    loaded = load_checkpoint(tmp_path / "m").model
    pixels, ids = torch.randn(2, 1, 28, 28), torch.tensor([[5, 7, 59], [8, 59, 0]])
    torch.testing.assert_close(loaded(pixels, ids), model(pixels, ids))


def test_an_interrupted_swap_is_recovered(tmp_path, translator):
    model, toks = translator
    save_checkpoint(tmp_path / "last", model, tokenizers=toks)
    (tmp_path / "last").rename(tmp_path / ".last.old")  # crash between the two renames
    assert resolve(tmp_path) == tmp_path / ".last.old"
    load_checkpoint(tmp_path)


def test_trainer_state_loads_without_executing_code(tmp_path, translator):
    model, toks = translator
    state = {"step": 3, "torch_rng": torch.get_rng_state(), "optimizer": {"state": {}, "param_groups": []}}
    save_checkpoint(tmp_path / "last", model, tokenizers=toks, trainer_state=state)
    assert load_checkpoint(tmp_path / "last", with_trainer_state=True).trainer_state["step"] == 3

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"step": Evil()}, tmp_path / "last" / "trainer_state.pt")
    with pytest.raises(CheckpointError, match="cannot be loaded safely"):
        load_checkpoint(tmp_path / "last", with_trainer_state=True)


def test_bad_checkpoints_raise_clear_errors(tmp_path, translator):
    model, toks = translator
    with pytest.raises(CheckpointError, match="no such model directory"):
        load_checkpoint(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no qkv checkpoint here"):
        load_checkpoint(tmp_path / "empty")
    save_checkpoint(tmp_path / "c", model, tokenizers=toks)
    (tmp_path / "c" / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="corrupted"):
        load_checkpoint(tmp_path / "c")
    save_checkpoint(tmp_path / "d", model, tokenizers=toks)
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    config["model"]["d_model"] = 64
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="does not fit the config"):
        load_checkpoint(tmp_path / "d")
    (tmp_path / "d" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config.json: not valid JSON"):
        load_checkpoint(tmp_path / "d")


@pytest.mark.parametrize("where, error", [
    ("safetensors.torch.save_model", "SafetensorError"),  # a full disk while the weights are written
    ("qkv.checkpoint.save_tokenizer", "OSError"),  # ... or a tokenizer
])
def test_a_failed_save_keeps_the_previous_checkpoint_and_leaves_nothing(tmp_path, translator, monkeypatch, where,
                                                                         error):
    """One clear OSError, the previous checkpoint intact (and loadable), no temporary folder left over."""
    from safetensors import SafetensorError

    model, toks = translator
    save_checkpoint(tmp_path / "last", model, tokenizers=toks)
    before = (tmp_path / "last" / "model.safetensors").read_bytes()

    def full_disk(*args, **kwargs):
        message = "I/O error: No space left on device (os error 28)"
        raise SafetensorError(message) if error == "SafetensorError" else OSError(message)

    monkeypatch.setattr(where, full_disk)
    with torch.no_grad():
        model.src_emb.weight.add_(1.0)
    with pytest.raises(OSError, match=r"cannot write the checkpoint .*last: .*No space left on device.*previous "
                                      r"checkpoint is kept"):
        save_checkpoint(tmp_path / "last", model, tokenizers=toks)
    assert (tmp_path / "last" / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]
    load_checkpoint(tmp_path / "last")


def test_weights_are_written_with_the_mode_of_their_siblings(tmp_path, translator):
    model, toks = translator
    save_checkpoint(tmp_path / "c", model, tokenizers=toks)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "c").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], modes


def test_weights_that_are_not_finite_are_refused(tmp_path, translator):
    model, toks = translator
    with torch.no_grad():
        model.lm_head.weight[3, 5] = float("nan")  # tied: the embedding shares it
    save_checkpoint(tmp_path / "c", model, tokenizers=toks)
    with pytest.raises(CheckpointError, match=r"not finite .*src_emb.weight|not finite .*tgt_emb.weight"):
        load_checkpoint(tmp_path / "c")


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.pop("model"), r"config.json is not a qkv model config \(KeyError: 'model'\)"),
    (lambda c: c.update(model=[1, 2]), r"\"model\" must be an object"),
    (lambda c: c["model"].update(d_ff="big"), r"config.json: d_ff must be an int"),
    (lambda c: c["model"].update(d_ff=10**12), r"has 130,000,000,[\d,]+ parameters and needs .* TiB .* more than the"),
])
def test_a_bad_config_is_refused_before_anything_is_allocated(tmp_path, translator, edit, message):
    model, toks = translator
    save_checkpoint(tmp_path / "c", model, tokenizers=toks)
    config = json.loads((tmp_path / "c" / "config.json").read_text())
    edit(config)
    (tmp_path / "c" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path / "c")


def test_unreadable_weights_are_not_called_missing(tmp_path, translator):
    model, toks = translator
    save_checkpoint(tmp_path / "c", model, tokenizers=toks)
    (tmp_path / "c" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors: missing"):
        load_checkpoint(tmp_path / "c")
    (tmp_path / "c" / "model.safetensors").mkdir()  # there, but not a readable file
    with pytest.raises(CheckpointError, match=r"model\.safetensors cannot be read: Is a directory"):
        load_checkpoint(tmp_path / "c")


def _edit_config(directory, edit):
    config = json.loads((directory / "config.json").read_text())
    edit(config)
    (directory / "config.json").write_text(json.dumps(config))


def test_a_header_that_says_integers_for_float_weights_is_refused(tmp_path, translator):
    """I32 and F32 have the same size, so the file reads; copied into the model, its integers became garbage."""
    model, toks = translator
    save_checkpoint(tmp_path / "c", model, tokenizers=toks)
    weights = tmp_path / "c" / "model.safetensors"
    data = weights.read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    name = next(k for k, v in json.loads(data[8:header_end]).items() if k != "__metadata__" and len(v["shape"]) == 2)
    start = data.index(f'"{name}":{{"dtype":"F32"'.encode())
    weights.write_bytes(data[:start] + data[start:header_end].replace(b'"F32"', b'"I32"', 1) + data[header_end:])
    with pytest.raises(CheckpointError, match=rf"tensor {name} is stored as I32 of shape \[\d+, 32\], "
                                              r"expected a floating-point tensor of shape \[\d+, 32\]"):
        load_checkpoint(tmp_path / "c")


def test_a_flipped_bit_in_the_weights_is_noticed_and_old_checkpoints_still_load(tmp_path, translator):
    model, toks = translator
    save_checkpoint(tmp_path / "c", model, tokenizers=toks)
    weights = tmp_path / "c" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01  # the lowest bits of a float32 near the end: still finite, still the right shape
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors is corrupted or was changed since it was saved "
                                              r"\(its sha256 differs .*\); use the run's other checkpoint"):
        load_checkpoint(tmp_path / "c")
    _edit_config(tmp_path / "c", lambda c: c.pop("weights_sha256"))
    assert load_checkpoint(tmp_path / "c").meta == {}  # unchecked, as before; the record is not meta


def _bpe(size):
    from qkv.tokenizers import BPETokenizer

    text = ["the cat sat on the mat", "a dog and a cat", "mats and hats and bats"] * 3
    return BPETokenizer.train(text, vocab_size=size, min_frequency=1)


def test_a_tokenizer_that_does_not_fit_the_model_is_refused(tmp_path):
    from qkv.tokenizers import CharTokenizer, WordPieceTokenizer, save_tokenizer

    bpe = _bpe(40)
    chars = CharTokenizer([chr(ord("a") + i) for i in range(bpe.vocab_size - 4)])  # as many tokens, another kind
    model = GPT(GPTConfig(vocab_size=bpe.vocab_size, d_model=32, n_heads=4, n_layers=1, vocab_multiple=64))
    save_checkpoint(tmp_path / "c", model, tokenizers={"text": bpe})
    path = tmp_path / "c" / "tokenizer.text.json"
    smaller = _bpe(30)
    save_tokenizer(smaller, path)  # fewer tokens than the model's vocabulary (and its table's 64 rows)
    with pytest.raises(CheckpointError, match=rf"tokenizer\.text\.json has {smaller.vocab_size} tokens, but the "
                                              rf"model's vocabulary has {bpe.vocab_size}: it does not fit the model"):
        load_checkpoint(tmp_path / "c")
    save_tokenizer(chars, path)
    with pytest.raises(CheckpointError, match=r"tokenizer\.text\.json is a char tokenizer, but this gpt model's is "
                                              r"bpe"):
        load_checkpoint(tmp_path / "c")
    wordpiece = WordPieceTokenizer.train(["the cat sat"] * 3, vocab_size=30, min_frequency=1)
    save_tokenizer(wordpiece, path)
    _edit_config(tmp_path / "c", lambda c: c.pop("tokenizers"))  # saved before kinds were recorded
    with pytest.raises(CheckpointError, match=r"is a wordpiece tokenizer, but this gpt model's is char or bpe or "
                                              r"pretrained"):
        load_checkpoint(tmp_path / "c")
    (tmp_path / "c" / "tokenizer.text.json").unlink()
    save_checkpoint(tmp_path / "d", model, tokenizers={"text": bpe})
    (tmp_path / "d" / "tokenizer.text.json").unlink()
    with pytest.raises(CheckpointError, match=r"lacks tokenizer\.text\.json, which was saved with the model"):
        load_checkpoint(tmp_path / "d")


IMAGE_META = {"task": "classify-image", "labels": [str(i) for i in range(10)], "mean": [0.3], "std": [0.35],
              "image_shape": [1, 28, 28]}


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(labels="0123456789"), r"\"labels\" must be a list of 10 strings, got str '0123456789'"),
    (lambda m: m.update(labels=["a", "b"]), r"\"labels\" must be a list of 10 strings, got list \['a', 'b'\]"),
    (lambda m: m.pop("image_shape"), r"\"image_shape\" must be a list of 3 integers, got nothing"),
    (lambda m: m.update(image_shape=[3, 28, 28]), r"\"image_shape\" must be \[channels, height, width\] with 1 "
                                                  r"channels \(the model's\), got \[3, 28, 28\]"),
    (lambda m: m.update(mean="0.3"), r"\"mean\" must be a list of 1 numbers, got str '0.3'"),
    (lambda m: m.update(std=[0.0]), r"\"std\" must be positive"),
    (lambda m: m.update(arch="vit"), r"task 'classify-image' trains vit-classifier or swin-classifier models, not "
                                     r"'vit'"),
])
def test_an_image_classifier_config_with_bad_fields_is_refused(tmp_path, edit, message):
    model = ViTClassifier(ViTConfig.from_preset("fashion", d_model=32, n_layers=1, n_classes=10))
    meta = json.loads(json.dumps(IMAGE_META))
    save_checkpoint(tmp_path / "c", model, tokenizers={}, meta=meta)
    assert load_checkpoint(tmp_path / "c").meta["labels"] == IMAGE_META["labels"]
    _edit_config(tmp_path / "c", edit)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path / "c")


def test_a_clip_config_without_templates_and_a_deeply_nested_config_are_refused(tmp_path):
    model = CLIP(CLIPConfig.from_preset("fashion", text=dict(vocab_size=60, eos_id=59)))
    meta = {**IMAGE_META, "task": "contrastive", "class_names": [f"c{i}" for i in range(10)],
            "templates": ["a photo of {}"]}
    save_checkpoint(tmp_path / "c", model, tokenizers={}, meta=meta)
    load_checkpoint(tmp_path / "c")
    _edit_config(tmp_path / "c", lambda c: c.pop("templates"))
    with pytest.raises(CheckpointError, match=r"\"templates\" must be a list of one or more strings, got nothing"):
        load_checkpoint(tmp_path / "c")
    (tmp_path / "c" / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON \(nested too deeply\)"):
        load_checkpoint(tmp_path / "c")


def test_a_text_classifier_whose_labels_are_a_string_is_refused(tmp_path):
    from qkv.config import BERTClassifierConfig
    from qkv.models import BERTClassifier

    model = BERTClassifier(BERTClassifierConfig(vocab_size=50, d_model=32, n_heads=4, n_layers=1, n_labels=2))
    save_checkpoint(tmp_path / "c", model, tokenizers={}, meta={"task": "classify", "labels": "ab", "max_length": 64})
    with pytest.raises(CheckpointError, match=r"\"labels\" must be a list of 2 strings, got str 'ab'"):
        load_checkpoint(tmp_path / "c")
