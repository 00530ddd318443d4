"""Gemma 3, Gemma 2, Phi-3, SmolLM3, OLMo 2, Granite and the mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
Granite-MoE) from Hugging Face checkpoints against transformers: the same
logits at every position (fp32), the same greedy tokens through qkv's KV cache, a padded batch equal to each row
alone; and each block that sets a family apart changes the logits, so that the parity tests it."""

from __future__ import annotations

import pytest
import torch
from family_models import FAMILIES, MOE, VOCAB, family_model
from hf_greedy import greedy_hf, greedy_qkv, greedy_uncached

from qkv.interop import load_gpt_from_hf

transformers = pytest.importorskip("transformers")


def _ids(b: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def _qkv(hf):
    return load_gpt_from_hf(hf.state_dict(), hf.config.to_dict())


@pytest.mark.parametrize("kind", FAMILIES)
def test_logits_and_greedy_tokens_equal_transformers(kind):
    hf = family_model(transformers, kind)
    model = _qkv(hf)
    ids = _ids(2, 14)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)
        ours, theirs = greedy_qkv(model, ids[:, :4], 10), greedy_hf(hf, ids[:, :4], 10, use_cache=True)
    assert torch.equal(ours, theirs), f"qkv {ours.tolist()} != transformers {theirs.tolist()}"


@pytest.mark.parametrize(("kind", "change"), [("qwen3_moe", {"norm_topk_prob": False}),
                                            ("qwen2_moe", {"norm_topk_prob": True, "decoder_sparse_step": 2}),
                                            ("mixtral", {"num_experts_per_tok": 1})])
def test_the_routing_variants_equal_transformers(kind, change):
    """Qwen3-MoE with its top-k weights as the softmax gave them, Qwen2-MoE renormalising and with every other layer
    dense, Mixtral sending each token to one expert."""
    hf = family_model(transformers, kind, **change)
    model = _qkv(hf)
    ids = _ids(2, 14, seed=9)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", [k for k in FAMILIES if k != "phi3"])
def test_cached_decoding_equals_uncached(kind):
    """(Phi-3's LongRoPE changes every position's rotation once a sequence outgrows its original context, so its
    cached keys differ from a rerun's past that point, in transformers as in qkv: the test above holds it.)"""
    model = _qkv(family_model(transformers, kind))
    prompt = _ids(2, 3, seed=1)
    with torch.no_grad():
        assert torch.equal(greedy_qkv(model, prompt, 10), greedy_uncached(model, prompt, 10))


@pytest.mark.parametrize("kind", FAMILIES)
def test_a_left_padded_batch_equals_each_row_alone(kind):
    model = _qkv(family_model(transformers, kind))
    short, long = _ids(1, 5, seed=2)[0], _ids(1, 9, seed=3)[0]
    ids = torch.stack([torch.cat([torch.zeros(4, dtype=torch.long), short]), long])
    mask = ids != 0
    mask[1] = True
    with torch.no_grad():
        batch = model(ids, attention_mask=mask)
        torch.testing.assert_close(batch[0, 4:], model(short[None])[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(batch[1], model(long[None])[0], atol=1e-5, rtol=1e-5)


# What each family's parity would miss without it, where the weights do not show it: a change of its config that
# turns the block off (the blocks with weights of their own, norms and fused tensors, are checked by the strict loader)
NO_LONG = {"rope_long_factors": None, "rope_original_context": None}
BLOCKS = {
    "gemma3_text": [{"layers": None}, {"norm_offset": False}, {"embedding_scale": 1.0}, {"attention_scale": None},
                    {"rope_freq_factors": None}],
    "gemma2": [{"attention_softcap": None}, {"logit_softcap": None}, {"layers": None}],
    "phi3": [NO_LONG, {"rope_scale": 1.0}, {"rotary_dim": None, "rope_freq_factors": None, **NO_LONG}],
    "smollm3": [{"layers": None}],
    "olmo2": [],
    "granite": [{"embedding_scale": 1.0}, {"residual_scale": 1.0}, {"attention_scale": None}, {"logit_scale": 1.0}],
    "mixtral": [{"expert_normalize": False}, {"expert_top_k": 1}],
    "qwen2_moe": [{"expert_normalize": True}, {"expert_top_k": 3}],
    "qwen3_moe": [{"expert_normalize": False}, {"expert_top_k": 1}],
    "olmoe": [{"expert_normalize": True}],
    "granitemoe": [{"expert_normalize": False}, {"residual_scale": 1.0}],
}


@pytest.mark.parametrize("kind", [k for k in FAMILIES if BLOCKS[k]])
def test_each_block_changes_the_logits(kind):
    import dataclasses

    model = _qkv(family_model(transformers, kind))
    ids = _ids(1, 14, seed=4)
    with torch.no_grad():
        reference = model(ids)
        for change in BLOCKS[kind]:
            changed = type(model)(dataclasses.replace(model.config, **change)).eval()
            changed.load_state_dict(model.state_dict(), strict=True)
            assert (changed(ids) - reference).abs().max() > 1e-3, (kind, change)


@pytest.mark.parametrize("kind", FAMILIES)
def test_folders_read_at_rest_equal_transformers(tmp_path, kind):
    """Read a slice at a time through the safetensors files' memory maps (what ``--pretrained FOLDER`` does): in
    float32 the same logits; quantized to int8, near them (a wrong tensor is off by the logits' own size). A mixture
    of experts is held to the mean error: rounding sends the odd token, whose router was near a tie, to another
    expert, and that token's logits move by their own size."""
    from qkv.interop.at_rest import load_hf_gpt_at_rest
    from qkv.interop.hf_folder import read_config

    hf = family_model(transformers, kind)
    hf.save_pretrained(tmp_path)
    ids = _ids(1, 12, seed=5)
    with torch.no_grad():
        expected = hf(ids).logits
        for mode, tolerance in (("none", 1e-4), ("int8", 0.15)):  # int8 weights and activations: near, not equal
            model = load_hf_gpt_at_rest(tmp_path, read_config(tmp_path), mode=mode)
            gap = (model(ids) - expected).abs()
            error = gap.mean() / expected.abs().mean() if kind in MOE else gap.max() / expected.abs().max()
            assert error < tolerance, (mode, float(error))


def test_a_multimodal_gemma3_folder_gives_its_text_model(tmp_path, caplog):
    """Gemma 3 from 4B is Gemma3ForConditionalGeneration: a vision tower, a projector and the text model, under
    names of their own; qkv reads the text model and says what it leaves."""
    from qkv.interop.at_rest import load_hf_gpt_at_rest
    from qkv.interop.hf_folder import read_config

    text = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                intermediate_size=64, head_dim=8, sliding_window=4)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4)).eval()
    hf.save_pretrained(tmp_path)
    model = load_hf_gpt_at_rest(tmp_path, read_config(tmp_path))
    ids = _ids(1, 12, seed=6)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
    assert "its text model is read, not its vision tower and projector" in caplog.text


@pytest.mark.parametrize(("change", "message"), [
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "layer_types must name"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10.0},
                          "full_attention": {"rope_type": "default", "rope_theta": 1000.0}}}, "rope_type='dynamic'"),
    ({"hidden_activation": "relu"}, "hidden_activation must be"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true"),
])
def test_what_qkv_does_not_implement_is_refused_in_one_line_naming_it(change, message):
    config = family_model(transformers, "gemma3_text").config.to_dict() | change
    with pytest.raises(ValueError, match=message):
        load_gpt_from_hf({}, config)


def test_other_families_state_what_qkv_refuses():
    for kind, change, message in (("smollm3", {"no_rope_layers": [1, 2, 1]}, "no_rope_layers must be"),
                                  ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10.0}},
                                   "longrope scaling needs short_factor"),
                                  ("granite", {"attention_bias": True}, "attention_bias=true")):
        config = family_model(transformers, kind).config.to_dict() | change
        with pytest.raises(ValueError, match=message):
            load_gpt_from_hf({}, config)


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.mark.parametrize("kind", FAMILIES)
def test_a_qkv_adapter_of_each_family_runs_in_peft_as_in_qkv(tmp_path, kind):
    """LoRA on every projection by the family's own names (Phi-3's fused qkv_proj and gate_up_proj, one adapter each,
    as PEFT places them): the adapter qkv writes, loaded by peft onto the transformers model, gives qkv's logits;
    read back by qkv, the same adapter."""
    peft = pytest.importorskip("peft")
    from qkv.adapters import load_peft_adapter, save_peft_adapter
    from qkv.lora import TARGETS, LoRAConfig, add_lora, lora_config_of

    hf = family_model(transformers, kind)
    # a mixture of experts: adapters on attention, as PEFT places them by module; it adapts transformers' stacked
    # experts by parameter (target_parameters), which qkv does not write
    targets = ATTENTION if kind in MOE else TARGETS
    model = add_lora(_qkv(hf), LoRAConfig(rank=4, alpha=8.0, targets=targets)).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B starts at zero: adapters that change nothing would check nothing
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    config = lora_config_of(model)
    assert set(config.targets) == ({"qkv_proj", "o_proj", "gate_up_proj", "down_proj"} if kind == "phi3" else
                                   set(targets))
    save_peft_adapter(model, config, tmp_path / "adapter", base_name=kind)
    theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids = _ids(2, 12, seed=7)
    with torch.no_grad():
        ours, adapted = model(ids), theirs(ids).logits
        torch.testing.assert_close(ours, adapted, atol=1e-4, rtol=1e-4)
        with theirs.disable_adapter():
            assert (theirs(ids).logits - adapted).abs().max() > 0.1
    again = _qkv(family_model(transformers, kind))
    load_peft_adapter(again, tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(ids), ours, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("params", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 50.0},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16.0, "beta_slow": 2.0,
     "rope_theta": 500.0, "attention_factor": 1.3},
    {"rope_type": "linear", "factor": 3.0, "rope_theta": 500.0},
], ids=["yarn", "yarn-stated", "linear"])
def test_rotary_scalings_equal_transformers(params):
    """YaRN (SmolLM3's and Qwen's long-context setting) and linear scaling, as a SmolLM3's config states them."""
    hf = family_model(transformers, "smollm3", rope_parameters=params, max_position_embeddings=128)
    model = _qkv(hf)
    assert model.config.rope_freq_factors is not None
    ids = _ids(1, 40, seed=8)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("change", "message"), [
    ({"num_experts_per_tok": 5}, r"num_experts_per_tok=5 must be an int from 1 to the 4 experts"),
    ({"num_experts": 0}, r"names its experts in num_experts .* this one has 0"),
    ({"num_experts": 10**9}, r"num_experts=1000000000 is beyond what qkv takes"),
])
def test_impossible_experts_in_a_config_are_one_line(change, message):
    config = family_model(transformers, "qwen3_moe").config.to_dict()
    config["num_experts"] = config.pop("num_local_experts", None) or config["num_experts"]  # either name is read
    with pytest.raises(ValueError, match=message):
        load_gpt_from_hf({}, config | change)


@pytest.mark.parametrize(("name", "shape", "message"), [
    ("model.layers.0.mlp.gate.weight", (3, 32), r"mlp\.gate\.weight has shape \(3, 32\), expected \(4, 32\)"),
    ("model.layers.1.mlp.experts.2.down_proj.weight", (32, 20),
     r"mlp\.experts\.2\.down_proj\.weight has shape \(32, 20\), expected \(32, 48\)"),
])
def test_a_router_or_expert_of_the_wrong_shape_is_named_before_any_weight_is_read(tmp_path, name, shape, message):
    """Read at rest, the names and shapes are checked on the header alone (tensors holding shapes only)."""
    from safetensors.torch import load_file, save_file

    from qkv.interop.at_rest import load_hf_gpt_at_rest
    from qkv.interop.hf_folder import read_config

    family_model(transformers, "mixtral").save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors = {k.replace("block_sparse_moe.gate.", "mlp.gate.").replace("block_sparse_moe.experts.2.w2.",
                                                                        "mlp.experts.2.down_proj."): v
               for k, v in tensors.items()}
    tensors[name] = torch.zeros(shape)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=message):
        load_hf_gpt_at_rest(tmp_path, read_config(tmp_path), mode="int8")
