"""PEFT's LoRA adapter folders, both ways, against peft itself: an adapter trained in qkv runs in peft on the
transformers model of the same folder with the same logits, and one made in peft runs in qkv (float layers, and
the stacked layers of a quantized model); every file qkv cannot use exactly is refused in one line.

Tiny random models of each LLaMA-family member, written by transformers' save_pretrained; nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_pretrained import VOCAB, _train_tokenizer

from qkv.adapters import load_peft_adapter, peft_tensors, read_peft_adapter, save_peft_adapter
from qkv.config import GPTConfig
from qkv.interop import load_pretrained
from qkv.lora import TARGETS, LoRAConfig, add_lora, lora_layers
from qkv.models import GPT
from qkv.nn import LoRALinear

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

SIZES = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
             intermediate_size=128, max_position_embeddings=64, rope_theta=500.0, rms_norm_eps=1e-5,
             tie_word_embeddings=False)
FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM", {}),
            "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 6}),  # shorter than IDS
            "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),  # biases on Q, K, V
            "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32})}  # 4 heads of 32 on a width of 64
IDS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
KEY = "base_model.model.model.layers.{}.{}.lora_{}.weight"


def _hf_model(family: str, seed: int = 0, **sizes):
    config_class, model_class, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**{**SIZES, **extra, **sizes})
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():  # away from the initial values (zero biases, unit gains), so a swap shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> a Hugging Face folder of a tiny random model of it, with a tokenizer; written on first use."""
    made, tokenizer = {}, _train_tokenizer()

    def folder(family: str):
        if family not in made:
            made[family] = tmp_path_factory.mktemp(family)
            _hf_model(family).save_pretrained(made[family])
            tokenizer.save_pretrained(made[family])
        return made[family]

    return folder


def _hf(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def _randomize_lora(model, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)


def _logits(model):
    with torch.no_grad():
        out = model(IDS)
    return getattr(out, "logits", out)


# ------------------------------------------------------------------------------------------ qkv -> peft

QKV_CONFIGS = {"llama": LoRAConfig(rank=4, alpha=8.0),
               "mistral": LoRAConfig(rank=4, alpha=8.0, rslora=True),
               "qwen2": LoRAConfig(rank=4, alpha=6.0, targets=("q_proj", "v_proj", "down_proj")),
               "qwen3": LoRAConfig(rank=4, alpha=8.0, dropout=0.05)}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_qkv_adapter_runs_in_peft_as_in_qkv(family, folders, tmp_path):
    folder, config = folders(family), QKV_CONFIGS[family]
    model = load_pretrained(folder, weights="none").model
    add_lora(model, config).eval()  # the new layers start in training mode, their dropout on
    _randomize_lora(model)
    adapter = tmp_path / "adapter"
    save_peft_adapter(model, config, adapter, base_name=str(folder))

    hf = peft.PeftModel.from_pretrained(_hf(folder), adapter).eval()
    theirs = _logits(hf)
    torch.testing.assert_close(_logits(model), theirs, atol=1e-4, rtol=1e-4)
    with hf.disable_adapter():  # the adapters matter: the parity above checks them
        assert (_logits(hf) - theirs).abs().max() > 0.1
    written = peft.PeftConfig.from_pretrained(adapter)
    assert (written.r, written.lora_alpha, written.use_rslora, written.lora_dropout) == (
        config.rank, config.alpha, config.rslora, config.dropout)
    assert set(written.target_modules) == set(config.targets) and written.task_type == "CAUSAL_LM"
    assert written.base_model_name_or_path == str(folder)
    assert (adapter / WEIGHTS).stat().st_mode == (adapter / CONFIG).stat().st_mode  # not safetensors' private 0600
    assert read_peft_adapter(adapter)[0] == config


def test_the_tensors_are_contiguous_float32_copies_under_peft_names(folders):
    model = load_pretrained(folders("llama"), weights="int8").model  # stacked layers: views of their parameters
    add_lora(model, LoRAConfig(rank=4, alpha=8.0))
    tensors = peft_tensors(model)
    assert len(tensors) == 2 * len(TARGETS) * 2
    assert tensors[KEY.format(1, "self_attn.k_proj", "B")].shape == (32, 4)  # the key part of qkv_proj's rows
    assert all(t.is_contiguous() and t.dtype == torch.float32 for t in tensors.values())
    tensors[KEY.format(0, "mlp.up_proj", "A")].add_(1.0)
    assert not torch.equal(tensors[KEY.format(0, "mlp.up_proj", "A")],
                           model.decoder.layers[0].feed_forward.gate_up.part("up_proj")[0])


# ------------------------------------------------------------------------------------------ peft -> qkv


def _peft_adapter(hf, path, *, targets=TARGETS, rslora: bool = False, alpha: int = 8):
    """``hf`` adapted by peft (rank 4), its adapters random, saved by peft into ``path``."""
    config = peft.LoraConfig(r=4, lora_alpha=alpha, target_modules=targets if isinstance(targets, str)
                             else list(targets), use_rslora=rslora, task_type="CAUSAL_LM")
    adapted = peft.get_peft_model(hf, config)
    _randomize_lora(adapted)
    adapted.save_pretrained(path)
    return adapted.eval()


@pytest.mark.parametrize(("family", "targets", "rslora"), [("llama", TARGETS, False), ("mistral", "all-linear", True),
                                                           ("qwen2", ("q_proj", "v_proj"), False),
                                                           ("qwen3", TARGETS, True)])
def test_a_peft_adapter_runs_in_qkv_as_in_peft(family, targets, rslora, folders, tmp_path):
    folder = folders(family)
    hf = _peft_adapter(_hf(folder), tmp_path / "adapter", targets=targets, rslora=rslora)
    model = load_pretrained(folder, weights="none").model
    config = load_peft_adapter(model, tmp_path / "adapter")
    expected = TARGETS if targets == "all-linear" else targets
    assert config == LoRAConfig(rank=4, alpha=8.0, rslora=rslora, targets=expected)
    assert len(lora_layers(model)) == 2 * len(expected)
    torch.testing.assert_close(_logits(model), _logits(hf), atol=1e-4, rtol=1e-4)


def test_a_quantized_model_takes_the_adapter_into_its_stacked_layers(folders, tmp_path):
    """int8 layers hold Q, K, V (and gate, up) stacked: each part gets its projection's adapter, and the logits
    stay near the float model's with the same adapter: within 5% (relative RMS), as the int8 base alone is."""
    folder = folders("qwen3")
    _peft_adapter(_hf(folder), tmp_path / "adapter")
    tensors = load_file(tmp_path / "adapter" / WEIGHTS)
    floats = load_pretrained(folder, weights="none").model
    load_peft_adapter(floats, tmp_path / "adapter")
    quantized = load_pretrained(folder, weights="int8").model
    load_peft_adapter(quantized, tmp_path / "adapter")

    for i, block in enumerate(quantized.decoder.layers):
        for layer, module, targets in ((block.self_attn.qkv_proj, "self_attn", ("q_proj", "k_proj", "v_proj")),
                                       (block.feed_forward.gate_up, "mlp", ("gate_proj", "up_proj"))):
            assert isinstance(layer, LoRALinear) and layer.targets == targets
            for target in targets:
                a, b = layer.part(target)
                assert torch.equal(a, tensors[KEY.format(i, f"{module}.{target}", "A")])
                assert torch.equal(b, tensors[KEY.format(i, f"{module}.{target}", "B")])
    expected = _logits(floats)
    error = (_logits(quantized) - expected).norm() / expected.norm()  # 2.1% here; the base alone: 2.3%
    assert error < 0.05, f"int8 logits differ from float32 ones by {error:.1%} (relative RMS)"


# ------------------------------------------------------------------------------------------ refusals


@pytest.fixture(scope="module")
def good_adapter(folders, tmp_path_factory):
    path = tmp_path_factory.mktemp("good") / "adapter"
    _peft_adapter(_hf(folders("llama")), path)
    return path


def _config_change(**fields):
    def change(adapter):
        config = json.loads((adapter / CONFIG).read_text())
        (adapter / CONFIG).write_text(json.dumps({**config, **fields}))
    return change


def _tensors_change(edit):
    def change(adapter):
        tensors = load_file(adapter / WEIGHTS)
        edit(tensors)
        save_file(tensors, adapter / WEIGHTS)
    return change


def _set_nan(tensors):
    tensors[KEY.format(1, "mlp.down_proj", "B")][3, 1] = float("nan")


BROKEN = {
    "no config": (lambda a: (a / CONFIG).unlink(), "has no adapter_config.json"),
    "no weights": (lambda a: (a / WEIGHTS).unlink(), "has no adapter_model.safetensors: expected a PEFT adapter"),
    "pickle only": (lambda a: (a / WEIGHTS).rename(a / "adapter_model.bin"), "pickled adapter_model.bin"),
    "not json": (lambda a: (a / CONFIG).write_text("{r: 4"), "adapter_config.json: not valid JSON"),
    "not lora": (_config_change(peft_type="LOHA"), "peft_type='LOHA', expected 'LORA'"),
    "dora": (_config_change(use_dora=True), "use_dora=True is not supported"),
    "fan in fan out": (_config_change(fan_in_fan_out=True), "fan_in_fan_out=True is not supported"),
    "rank pattern": (_config_change(rank_pattern={"q_proj": 8}), "rank_pattern={'q_proj': 8} is not supported"),
    "alpha pattern": (_config_change(alpha_pattern={"v_proj": 4}), "alpha_pattern={'v_proj': 4} is not supported"),
    "some layers": (_config_change(layers_to_transform=[0]), "layers_to_transform=[0] is not supported"),
    "modules to save": (_config_change(modules_to_save=["lm_head"]), "modules_to_save=['lm_head'] is not supported"),
    "bias": (_config_change(bias="all"), "bias='all' is not supported"),
    "pissa": (_config_change(init_lora_weights="pissa"), "init_lora_weights='pissa' is not supported"),
    "regex": (_config_change(target_modules=".*q_proj"), "target_modules='.*q_proj' is not supported"),
    "gpt-2 names": (_config_change(target_modules=["c_attn"]),
                    "names ['c_attn'], which are not projections of the LLaMA family or of Marian"),
    "rank zero": (_config_change(r=0), "r=0, expected a positive whole number"),
    "rank text": (_config_change(r="4"), "r='4', expected a positive whole number"),
    "alpha negative": (_config_change(lora_alpha=-8), "lora_alpha=-8, expected a positive number"),
    "alpha past any float": (_config_change(lora_alpha=10**400), "lora_alpha=1000000000000000000000000000000000000"),
    "alpha infinite": (lambda a: (a / CONFIG).write_text((a / CONFIG).read_text().replace('"lora_alpha": 8',
                                                                                          '"lora_alpha": 1e400')),
                       "lora_alpha=inf, expected a positive number of at most"),
    "rank huge": (_config_change(r=10**30), "r=1000000000000000000000000000000, expected a positive whole number"),
    "dropout huge": (_config_change(lora_dropout=10**400), "lora_dropout=1000000000"),
    "float8 weights": (_tensors_change(lambda t: t.update({k: v.to(torch.float8_e4m3fn) for k, v in t.items()})),
                       "is float8_e4m3fn of shape"),
    "integer weights": (_tensors_change(lambda t: t.update({k: v.to(torch.int32) for k, v in t.items()})),
                        "is int32 of shape"),
    "another rank": (_config_change(r=8), "expected floating-point weights of shape (8, in) (r=8"),
    "not finite": (_tensors_change(_set_nan), "model.layers.1.mlp.down_proj.lora_B.weight holds weights that are "
                                              "not finite"),
    "not lora weight": (_tensors_change(lambda t: t.update({"base_model.model.lm_head.weight": torch.ones(2, 2)})),
                        "base_model.model.lm_head.weight is not a LoRA weight of a LLaMA-family or Marian "
                        "projection"),
    "untargeted": (_config_change(target_modules=["q_proj", "v_proj"]),
                   "layers.0.self_attn.k_proj.lora_A.weight adapts a module that target_modules"),
    "half a pair": (_tensors_change(lambda t: t.pop(KEY.format(0, "mlp.up_proj", "B"))), "but not base_model"),
    "corrupt": (lambda a: (a / WEIGHTS).write_bytes(b"\x00" * 64), "cannot read"),
    "missing layer": (_tensors_change(lambda t: [t.pop(KEY.format(1, "self_attn.v_proj", s)) for s in "AB"]),
                      "the adapter has no base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"),
}


def _refused(model, adapter, expected: str) -> None:
    """``load_peft_adapter`` refuses in one line containing ``expected`` and leaves the model as it was."""
    before = {name: (p.clone(), p.requires_grad) for name, p in model.named_parameters()}
    with pytest.raises(ValueError) as err:
        load_peft_adapter(model, adapter)
    message = str(err.value)
    assert expected in message and "\n" not in message, message
    assert not lora_layers(model)
    after = dict(model.named_parameters())
    assert before.keys() == after.keys()
    assert all(torch.equal(p, after[n]) and grad == after[n].requires_grad for n, (p, grad) in before.items())


@pytest.mark.parametrize("how", BROKEN)
def test_an_adapter_qkv_cannot_use_exactly_is_refused_in_one_line(how, good_adapter, folders, tmp_path):
    damage, expected = BROKEN[how]
    adapter = shutil.copytree(good_adapter, tmp_path / "adapter")
    damage(adapter)
    _refused(load_pretrained(folders("llama"), weights="none").model, adapter, expected)


@pytest.mark.parametrize(("sizes", "expected"), [
    ({"hidden_size": 96}, "model.layers.0.self_attn.q_proj.lora_A.weight has shape (4, 96) but qkv's decoder.layers.0."
                          "self_attn.q_proj needs (4, 64): the adapter was made for another base model"),
    ({"num_hidden_layers": 3}, "model.layers.2.self_attn.q_proj.lora_A.weight is for a layer this model does not "
                               "have (2 decoder layers): the adapter was made for another base model"),
    ({"intermediate_size": 96}, "model.layers.0.mlp.gate_proj.lora_B.weight has shape (96, 4) but qkv's "
                                "decoder.layers.0.feed_forward.gate_up needs (128, 4)"),
], ids=["width", "layers", "feed-forward"])
def test_an_adapter_made_for_another_base_model_is_refused(sizes, expected, folders, tmp_path):
    _peft_adapter(_hf_model("llama", **sizes), tmp_path / "adapter")
    weights = "int8" if "gate_up" in expected else "none"  # the stacked layers are named as qkv holds them
    _refused(load_pretrained(folders("llama"), weights=weights).model, tmp_path / "adapter", expected)


def test_all_linear_reads_as_every_target(good_adapter, tmp_path):
    adapter = shutil.copytree(good_adapter, tmp_path / "adapter")
    _config_change(target_modules="all-linear")(adapter)
    config, tensors = read_peft_adapter(adapter)
    assert config.targets == TARGETS and len(tensors) == 2 * len(TARGETS) * 2
    assert all(t.dtype == torch.float32 for t in tensors.values())


def test_models_outside_the_llama_family_and_adapted_models_are_refused(good_adapter, folders, tmp_path):
    gpt2 = GPT(GPTConfig(vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=1, max_seq_len=16))
    for call in (lambda: load_peft_adapter(gpt2, good_adapter), lambda: peft_tensors(gpt2)):
        with pytest.raises(ValueError, match=r"^LoRA adapters are placed by Hugging Face's names in the LLaMA family "
                                             r"\(.*\) and in Marian translation models \(.*\), "
                                             r"got a GPT with norm='layer', positional='learned'"):
            call()
    model = load_pretrained(folders("llama"), weights="none").model
    config = load_peft_adapter(model, good_adapter)
    saved = {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}
    for layer in lora_layers(model).values():
        torch.nn.init.zeros_(layer.lora_A)
    assert load_peft_adapter(model, good_adapter) == config  # a resumed run: the same adapters read back
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    other = dataclasses.replace(config, rank=config.rank + 1)
    with pytest.raises(ValueError, match="is not the one the model has"):
        model_with_other = load_pretrained(folders("llama"), weights="none").model
        add_lora(model_with_other, other)
        load_peft_adapter(model_with_other, good_adapter)


def test_saving_refuses_what_the_folder_could_not_say(folders, tmp_path):
    model = load_pretrained(folders("llama"), weights="none").model
    config = LoRAConfig(rank=4, alpha=8.0)
    with pytest.raises(ValueError, match="the model has no LoRA layers to write"):
        save_peft_adapter(model, config, tmp_path / "none", base_name="x")
    add_lora(model, config)
    for other, expected in ((LoRAConfig(rank=4, alpha=16.0), "has rank 4, alpha 8, rslora False, but the config says "
                                                             "rank 4, alpha 16"),
                            (LoRAConfig(rank=4, alpha=8.0, targets=("q_proj",)), "the model has an adapter the config "
                                                                                  "does not target")):
        with pytest.raises(ValueError, match=expected):
            save_peft_adapter(model, other, tmp_path / "wrong", base_name="x")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="taken exists"):
        save_peft_adapter(model, config, tmp_path / "taken", base_name="x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # nothing half-written left behind
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"


def test_a_gguf_lora_file_is_named_as_such_not_a_missing_folder(folders, tmp_path):
    lora = tmp_path / "tuned-lora.gguf"
    lora.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(24))
    _refused(load_pretrained(folders("llama"), weights="none").model, lora, "is a GGUF file (a GGUF LoRA adapter")
    other = tmp_path / "notes.txt"
    other.write_text("not an adapter")
    _refused(load_pretrained(folders("llama"), weights="none").model, other, "a file, not a folder")
