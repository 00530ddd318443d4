"""Configs: validation with messages that name the field, presets, and JSON round trips."""

import json

import pytest

from qkv import BERTConfig, GPTConfig, TransformerConfig


@pytest.mark.parametrize(
    "fields, error, message",
    [
        (dict(d_model=100, n_heads=3), ValueError, "d_model=100 must be divisible by n_heads=3"),
        (dict(d_model=512.0), TypeError, "d_model must be an int, got float 512.0"),
        (dict(n_layers=0), ValueError, "n_layers must be >= 1, got n_layers=0"),
        (dict(dropout=1.0), ValueError, r"dropout must be in \[0, 1\), got dropout=1.0"),
        (dict(activation="tanh"), ValueError, "activation must be one of"),
        (dict(positional="alibi"), ValueError, "positional must be one of"),
        (dict(n_kv_heads=3), ValueError, "n_heads=8 must be divisible by n_kv_heads=3"),
        (dict(pad_id=100), ValueError, "pad_id=100 is outside the vocabulary: src_vocab_size=100"),
        (dict(tgt_vocab_size=90, share_embeddings=True), ValueError, "share_embeddings needs one vocabulary"),
        (dict(src_vocab_size="100"), TypeError, "src_vocab_size must be an int, got str"),
    ],
)
def test_transformer_config_validation(fields, error, message):
    with pytest.raises(error, match=message):
        TransformerConfig(**{"src_vocab_size": 100, "tgt_vocab_size": 100, **fields})


def test_defaults_fill_in():
    cfg = TransformerConfig(src_vocab_size=10, tgt_vocab_size=10, d_model=64, n_heads=4, n_layers=3)
    assert cfg.d_ff == 256 and cfg.n_encoder_layers == cfg.n_decoder_layers == 3 and cfg.head_dim == 16


def test_json_round_trip_and_unknown_fields():
    cfg = GPTConfig.from_preset("smollm2-135m")
    again = GPTConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    with pytest.raises(ValueError, match=r"unknown GPTConfig fields \['colour'\]"):
        GPTConfig.from_dict({**cfg.to_dict(), "colour": "red"})


def test_presets():
    assert BERTConfig.from_preset("minilm-l6").d_model == 384
    assert GPTConfig.from_preset("llama", vocab_size=100).norm == "rms"
    with pytest.raises(ValueError, match="unknown GPTConfig preset 'gpt5'"):
        GPTConfig.from_preset("gpt5")


@pytest.mark.parametrize("field, value, message", [
    ("dropout", "0.1", r"dropout must be a finite number, got str '0.1'"),
    ("norm_eps", None, r"norm_eps must be a finite number, got NoneType None"),
    ("rope_base", float("nan"), r"rope_base must be a finite number, got float nan"),
    ("bias", "yes", r"bias must be true or false, got str 'yes'"),
    ("n_kv_heads", 2.0, r"n_kv_heads must be an int or null, got float 2.0"),
    ("norm", 1, r"norm must be a string, got int 1"),
])
def test_a_json_config_of_the_wrong_types_is_refused_naming_the_field(field, value, message):
    """A checkpoint's config.json is read with from_dict: a value of another type used to pass, or fail later
    inside a comparison ('<=' not supported between 'str' and 'int')."""
    data = GPTConfig(vocab_size=50, d_model=32, n_heads=4, n_layers=1).to_dict()
    with pytest.raises(TypeError, match=message):
        GPTConfig.from_dict({**data, field: value})
    assert GPTConfig.from_dict(json.loads(json.dumps(data))) == GPTConfig(**data)


@pytest.mark.parametrize("field", ["rope_base", "norm_eps", "init_std"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0])
def test_a_config_made_in_code_refuses_a_scale_that_is_not_positive_and_finite(field, value):
    """from_dict's type check is for JSON; a reader that builds the config itself (an HF folder's rope_theta NaN)
    meets this one."""
    with pytest.raises(ValueError, match=rf"^{field} must be a positive finite number, got {value!r}$"):
        GPTConfig(vocab_size=50, d_model=32, n_heads=4, n_layers=1, **{field: value})
