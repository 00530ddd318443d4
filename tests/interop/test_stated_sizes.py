"""Every size a GGUF header or a config.json states is bounded, and agrees with the tensors, before anything is
allocated: one table of cases, run through both readers (``load_pretrained`` on a GGUF file and on a Hugging
Face folder), with the model's constructor made to fail so that an error reached after allocating shows.

Cases that used to run for minutes: a header claiming 10⁹ layers (it holds 2) walked 10⁹ layers and reached
5 GB before "out of memory"; so did a config.json with ``num_hidden_layers`` 10⁹.
"""

from __future__ import annotations

import json
import shutil

import pytest
from tiny_gguf import gguf_tensors, tiny_llama, write_gguf

from qkv.interop import load_pretrained
from qkv.models import GPT

transformers = pytest.importorskip("transformers")

BEYOND = "is beyond what qkv takes"
SHAPE = "has shape"  # the strict converter: a tensor that does not hold the stated size
LAYERS = "the config states 3 layers but the LLaMA tensors hold 2"

# what is stated            GGUF key (after "llama.")             config.json key           value    message
CASES = [
    ("layers, huge",        "block_count",                        "num_hidden_layers",       10**9,   BEYOND),
    ("layers, one too many", "block_count",                       "num_hidden_layers",       3,       LAYERS),
    ("heads, huge",         "attention.head_count",               "num_attention_heads",     10**6,   BEYOND),
    ("heads, other",        "attention.head_count",               "num_attention_heads",     8,       SHAPE),
    ("kv heads, huge",      "attention.head_count_kv",            "num_key_value_heads",     10**6,   BEYOND),
    ("kv heads, other",     "attention.head_count_kv",            "num_key_value_heads",     4,       SHAPE),
    ("head width, huge",    "attention.key_length",               "head_dim",                10**5,   BEYOND),
    ("head width, other",   "attention.key_length",               "head_dim",                16,      SHAPE),
    ("width, huge",         "embedding_length",                   "hidden_size",             10**6,   BEYOND),
    ("width, other",        "embedding_length",                   "hidden_size",             64,      SHAPE),
    ("feed-forward, huge",  "feed_forward_length",                "intermediate_size",       10**9,   BEYOND),
    ("feed-forward, other", "feed_forward_length",                "intermediate_size",       65,      SHAPE),
    ("context, huge",       "context_length",                     "max_position_embeddings", 2**40,   BEYOND),
    ("rope base, huge",     "rope.freq_base",                     "rope_theta",              1e30,    BEYOND),
    ("rope base, NaN",      "rope.freq_base",                     "rope_theta",              float("nan"),
     "must be a positive"),
    ("epsilon, huge",       "attention.layer_norm_rms_epsilon",   "rms_norm_eps",            10.0,    BEYOND),
    ("vocabulary, huge",    None,                                 "vocab_size",              10**9,   BEYOND),
]  # a GGUF file's vocabulary is its embedding's rows and token list, not a number it states
IN_GGUF = [case for case in CASES if case[1]]


@pytest.fixture(autouse=True)
def no_model_is_built(monkeypatch):
    """A check that comes after the model's layers were made fails the test, whatever its message."""
    def built(*_, **__):
        raise AssertionError("the model was built before the stated sizes were checked")

    monkeypatch.setattr(GPT, "__init__", built)


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(tie=False)


@pytest.fixture(scope="module")
def hf_folder(llama, tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("hf") / "llama"
    llama.save_pretrained(folder)
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate("abc")}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(("what", "gguf_key", "hf_key", "value", "message"), IN_GGUF, ids=[c[0] for c in IN_GGUF])
def test_a_gguf_header_is_checked_before_the_model_is_built(llama, tmp_path, what, gguf_key, hf_key, value,
                                                            message):
    path = write_gguf(tmp_path / "stated.gguf", gguf_tensors(llama), **{f"llama.{gguf_key}": value})
    with pytest.raises(ValueError) as err:
        load_pretrained(path)
    text = str(err.value)
    assert "\n" not in text and "stated.gguf" in text and message in text, text
    if message == BEYOND:
        assert f"llama.{gguf_key}=" in text


@pytest.mark.parametrize(("what", "gguf_key", "hf_key", "value", "message"), CASES, ids=[c[0] for c in CASES])
def test_a_config_json_is_checked_before_the_model_is_built(hf_folder, tmp_path, what, gguf_key, hf_key, value,
                                                            message):
    folder = tmp_path / "stated"
    shutil.copytree(hf_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    rope = config.get("rope_parameters") if hf_key == "rope_theta" else None
    (rope if rope else config)[hf_key] = value  # transformers 5 keeps the rotary base in rope_parameters
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        load_pretrained(folder)
    text = str(err.value)
    assert "\n" not in text and message in text, text
    if message == BEYOND:
        assert f"{hf_key}=" in text


@pytest.mark.parametrize(("key", "value", "message"), [
    ("n_layer", 10**9, BEYOND), ("n_layer", 3, "the config states 3 layers but the GPT-2 tensors hold 2"),
    ("n_head", 10**6, BEYOND), ("n_embd", 10**6, BEYOND), ("n_inner", 10**9, BEYOND),
    ("n_positions", 2**40, BEYOND), ("n_positions", 64, SHAPE), ("layer_norm_epsilon", 10.0, BEYOND),
])
def test_a_gpt2_config_json_is_checked_before_the_model_is_built(tmp_path, key, value, message):
    from qkv.interop.hf_gpt import gpt_config_from_hf, gpt_state_dict_from_hf

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=16, n_embd=8, n_head=2, n_layer=2,
                                                                 n_positions=32))
    config = model.config.to_dict() | {key: value}
    with pytest.raises(ValueError) as err:
        gpt_state_dict_from_hf(model.state_dict(), gpt_config_from_hf(config), "gpt2")
    assert message in str(err.value) and "\n" not in str(err.value)
