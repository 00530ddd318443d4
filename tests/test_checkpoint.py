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
    assert loaded.model.out_proj.weight is loaded.model.tgt_emb.weight  # tying survives the round trip


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
        model.out_proj.weight[3, 5] = float("nan")  # tied: the embedding shares it
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
