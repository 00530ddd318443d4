"""The LLaMA family's other members against transformers, from Hugging Face folders and from GGUF files: Qwen2
(biases on Q, K and V; Q and K stored unpermuted in GGUF files), Qwen3 (RMSNorm on each head's queries and keys,
heads wider than the model's width over their count), Mistral (a sliding window), and Llama 3's
rotary scaling (``rope_type: llama3`` in a config, ``rope_freqs`` in a GGUF file). Random weights in real
layouts; the same logits to 1e-5 and the same greedy tokens through the KV cache."""

from __future__ import annotations

import pytest
import torch
from hf_greedy import greedy_hf, greedy_qkv
from tiny_gguf import TOKENS, llama_cpp_permute, write_gguf

from qkv.interop import load_gpt_from_gguf, load_gpt_from_hf
from qkv.interop.at_rest import load_quantized_gpt

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf", reason="reading GGUF files needs the gguf package: pip install gguf")

VOCAB = len(TOKENS)  # the tiny GGUF files' tokenizer
SIZES = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
             intermediate_size=64, max_position_embeddings=64, rope_theta=500.0, rms_norm_eps=1e-5,
             attn_implementation="eager")
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16}  # a short context, so that every pair is scaled


def _randomized(model):
    with torch.no_grad():  # away from the initial values (zero biases, unit gains), so a swap shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model.eval()


def qwen2(*, tie: bool):
    return _randomized(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SIZES, tie_word_embeddings=tie)))


def qwen3(*, tie: bool):
    """Heads of 16 features where the width over the head count is 8, as Qwen3-0.6B's are 128 for 64."""
    config = transformers.Qwen3Config(**SIZES, head_dim=16, tie_word_embeddings=tie)
    return _randomized(transformers.Qwen3ForCausalLM(config))


def mistral():
    return _randomized(transformers.MistralForCausalLM(transformers.MistralConfig(**SIZES, sliding_window=5,
                                                                                   tie_word_embeddings=False)))


def llama3():
    config = transformers.LlamaConfig(**{**SIZES, "rope_theta": None}, tie_word_embeddings=False,
                                      rope_parameters={**LLAMA3_SCALING, "rope_theta": 500.0})
    return _randomized(transformers.LlamaForCausalLM(config))


def _same_as_transformers(model, hf):
    ids = torch.randint(0, VOCAB, (2, 14), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).float(), hf(ids).logits, atol=1e-5, rtol=1e-5)
        ours, theirs = greedy_qkv(model, ids[:, :4], 10), greedy_hf(hf, ids[:, :4], 10)
    assert torch.equal(ours, theirs), f"qkv {ours.tolist()} != transformers {theirs.tolist()}"


@pytest.mark.parametrize("make", [lambda: qwen2(tie=False), lambda: qwen2(tie=True), lambda: qwen3(tie=True),
                                  mistral, llama3], ids=["qwen2", "qwen2-tied", "qwen3", "mistral", "llama3"])
def test_hugging_face_folders_of_the_family_match_transformers(make):
    hf = make()
    model = load_gpt_from_hf(hf.state_dict(), hf.config.to_dict())
    kind = hf.config.model_type
    assert model.config.qkv_bias == (kind == "qwen2") and model.config.window == (5 if kind == "mistral" else None)
    assert model.config.qk_norm == (kind == "qwen3") and model.config.head_dim == (16 if kind == "qwen3" else 8)
    _same_as_transformers(model, hf)


def test_each_feature_matters():
    """Without the biases, the window or the rotary scaling, the same weights give other logits: the parity
    above tests each of them."""
    ids = torch.randint(0, VOCAB, (1, 14), generator=torch.Generator().manual_seed(1))
    for hf, change in ((qwen2(tie=False), {"model_type": "llama"}), (mistral(), {"model_type": "llama"}),
                       (llama3(), {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}})):
        state = {k: v for k, v in hf.state_dict().items() if not k.endswith("_proj.bias")}
        config = {**hf.config.to_dict(), **change}
        if hf.config.model_type == "llama":
            config.pop("rope_scaling", None)
        model = load_gpt_from_hf(state, config)
        with torch.no_grad():
            assert (model(ids) - hf(ids).logits).abs().max() > 1e-3, hf.config.model_type
    hf = qwen3(tie=False)
    model = load_gpt_from_hf(hf.state_dict(), hf.config.to_dict())
    for layer in model.decoder.layers:
        layer.self_attn.q_norm = layer.self_attn.k_norm = None
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max() > 1e-3, "qwen3"


# ----------------------------------------------------------------------------------------------------- GGUF

GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def _gguf_file(path, hf, *, arch: str, rope_freqs=None):
    """``hf`` as llama.cpp's converter writes it: Q and K permuted for the llama architecture only."""
    tensors = {}
    for name, param in hf.named_parameters():
        weight = param.detach()
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            key = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                   "lm_head.weight": "output.weight"}[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            module, part = rest.rsplit(".", 1)
            key = f"blk.{layer}.{GGUF_NAMES[module]}.{part}"
            heads = {"self_attn.q_proj": 4, "self_attn.k_proj": 2}.get(module)
            if arch == "llama" and heads and part == "weight":
                weight = llama_cpp_permute(weight, heads)
        tensors[key] = weight.numpy()
    if rope_freqs is not None:
        tensors["rope_freqs.weight"] = torch.tensor(rope_freqs, dtype=torch.float32).numpy()
    key_length = {f"{arch}.attention.key_length": hf.config.head_dim} if arch == "qwen3" else {}
    return write_gguf(path, tensors, arch=arch, **key_length)


def _gguf_at_rest(tmp_path, hf, arch):
    """``hf`` written as a GGUF file: read by the float32 reference path and into float32 layers at rest, both
    the same as transformers; returned read into int8 layers at rest."""
    path = _gguf_file(tmp_path / f"{arch}.gguf", hf, arch=arch)
    for load in (load_gpt_from_gguf, lambda p: load_quantized_gpt(p, mode="none")[0]):
        _same_as_transformers(load(path), hf)
    return load_quantized_gpt(path, mode="int8")[0]


@pytest.mark.parametrize("tie", [False, True])
def test_qwen2_gguf_files_match_transformers(tmp_path, tie):
    at_rest = _gguf_at_rest(tmp_path, qwen2(tie=tie), "qwen2")
    assert at_rest.decoder.layers[0].self_attn.qkv_proj.bias is not None


@pytest.mark.parametrize("tie", [False, True])
def test_qwen3_gguf_files_match_transformers(tmp_path, tie):
    hf = qwen3(tie=tie)
    at_rest = _gguf_at_rest(tmp_path, hf, "qwen3")
    attention = at_rest.decoder.layers[1].self_attn
    assert attention.qkv_proj.out_features == (4 + 2 * 2) * 16  # the stacked layer, heads of 16
    assert torch.equal(attention.k_norm.weight, hf.model.layers[1].self_attn.k_norm.weight)
    with torch.no_grad():  # int8 weights: near the reference, not equal
        ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
        assert (at_rest(ids) - hf(ids).logits).abs().max() < 0.05 * hf(ids).logits.abs().max()


def test_llama3_rope_freqs_in_a_gguf_file_match_transformers(tmp_path):
    hf = llama3()
    factors = load_gpt_from_hf(hf.state_dict(), hf.config.to_dict()).config.rope_freq_factors
    assert factors[0] < 8.0 == factors[-1]  # the fastest pair blended, the slow ones scaled in full
    path = _gguf_file(tmp_path / "llama3.gguf", hf, arch="llama", rope_freqs=factors)
    for load in (load_gpt_from_gguf, lambda p: load_quantized_gpt(p, mode="none")[0]):
        model = load(path)
        assert model.config.rope_freq_factors == pytest.approx(factors)
        _same_as_transformers(model, hf)


# ------------------------------------------------------------------------------------------------ tokenizers


@pytest.mark.parametrize(("arch", "pre"), [("qwen2", "qwen2"), ("llama", "llama-bpe"), ("llama", "gpt2")])
def test_each_pre_tokenizer_splits_as_transformers_reads_the_file(tmp_path, monkeypatch, arch, pre):
    """Merges that join digits tell the splits apart: Qwen2 cuts numbers into single digits, Llama 3 into runs
    of up to three, GPT-2 not at all. (transformers reads "smollm" files as another split; SmolLM2's is checked
    against its own tokenizer.json in test_gguf.py.)"""
    import tiny_gguf

    monkeypatch.setattr(tiny_gguf, "MERGES", [*tiny_gguf.MERGES, "1 2", "12 3", "Ġ 1"])
    monkeypatch.setattr(tiny_gguf, "TOKENS", [*TOKENS, "12", "123", "Ġ1"])
    table = torch.zeros(len(tiny_gguf.TOKENS), 32).numpy()
    path = write_gguf(tmp_path / "tok.gguf", {"token_embd.weight": table}, arch=arch, pre=pre)
    ours = _tokenizer(path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ("the 1234567 cats' 12,345.6\n\n  the end 123", "Ünïcödé 😀 x1y22z333 ...!!\t\tok"):
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), (pre, text)


def test_sentencepiece_llama_files_tokenize_as_transformers_reads_them(tmp_path):
    """LLaMA 2's kind: pieces joined by score, ▁ for spaces and one in front, byte tokens for the rest."""
    from tiny_gguf import SPM_TOKENS

    table = torch.zeros(len(SPM_TOKENS), 32).numpy()
    path = write_gguf(tmp_path / "spm.gguf", {"token_embd.weight": table}, tokenizer="llama")
    ours = _tokenizer(path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ("the cat sits on it", "  the  猫 sits\nin   the cat. Ünï 😀", "cat"):
        ids = ours.encode(text)
        # SentencePiece and llama.cpp put ▁ in front of every text; transformers' reading of a GGUF file not in front
        # of one that begins with a space already (so "  the" is ▁▁▁the to the first two, ▁▁the to it)
        assert ids == theirs.encode(" " + text if text[0] == " " else text, add_special_tokens=False), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert ours.tokens("  the")[:2] == ["▁▁", "▁the"]
    # and llama.cpp puts one in front of the text after each special token too (llama-vocab.cpp, is_prev_special)
    assert ours.encode("<s>the cat</s> sits") == [1, *ours.encode("the cat"), 2, *ours.encode(" sits")]
    assert ours.tokens("</s> sits")[1:] == ["▁", "▁sits"]
    assert ours.tokens("the cat sits") == ["▁the", "▁cat", "▁sits"]
    assert ours.tokens("é") == ["▁", "<0xC3>", "<0xA9>"]  # not in the vocabulary: its UTF-8 bytes
    assert (ours.bos_id, ours.eos_id) == (1, 2) and ours.decode(ours.encode("the 猫  😀")) == "the 猫  😀"
    # a prompt starts with <s>, as transformers' encode (special tokens on) and llama.cpp put it; once only
    assert ours.add_bos and ours.encode_prompt("the cat") == theirs.encode("the cat") == [1, *ours.encode("the cat")]
    assert ours.encode_prompt("<s>the cat") == ours.encode("<s>the cat")


def _tokenizer(path):
    from qkv.interop.gguf import open_gguf
    from qkv.interop.gguf_tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(open_gguf(path)[1])
