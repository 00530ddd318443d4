"""LoRA adapters as GGUF LoRA files (llama.cpp's ``--lora``), read back with the gguf package: the header
llama.cpp checks, every tensor's name, shape and values, Q and K's rows in the base file's rotary order (checked
with the reader's un-permutation, and against the GGUF files of the base and merged models), the same file from a
quantized model's stacked layers, rsLoRA's α, the refusals; and, where a llama.cpp build is found, llama.cpp's
perplexity with the adapter equal to the merged model's, and its greedy continuation of a prompt qkv's. Tiny random
models; nothing downloaded.
"""

from __future__ import annotations

import copy
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from llama_cpp_tools import llama_cpp, llama_perplexity

from qkv import GPT, GPTConfig
from qkv.adapters import peft_tensors
from qkv.interop.gguf import unpermute_rope_rows
from qkv.interop.gguf_export import export_gguf
from qkv.interop.gguf_lora import export_gguf_lora
from qkv.lora import LLAMA, LoRAConfig, add_lora, lora_layers, merge_lora, targets_of
from qkv.quantize import quantize
from qkv.tokenizers import BPETokenizer

gguf = pytest.importorskip("gguf", reason="writing GGUF files needs the gguf package: pip install gguf")

N_HEADS, N_KV_HEADS, RANK = 4, 2, 4
KINDS = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
         "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
PEFT_KEY = "base_model.model.model.layers.{}.{}.{}.lora_{}.weight"
ROTARY_HEADS = {"attn_q": N_HEADS, "attn_k": N_KV_HEADS}
CONFIG = LoRAConfig(rank=RANK, alpha=8)
CORPUS = ["The robot picked up the red ball, 42 times.", "The cat sat on the mat.", "A cat and a robot."] * 20


def _model(vocab_size: int = 64, **overrides) -> GPT:
    torch.manual_seed(0)
    sizes = dict(vocab_size=vocab_size, n_layers=2, d_model=64, n_heads=N_HEADS, n_kv_heads=N_KV_HEADS, d_ff=128,
                 max_seq_len=32)
    return GPT(GPTConfig.from_preset("llama", **sizes, **overrides)).eval()


def _adapted(model: GPT, config: LoRAConfig = CONFIG) -> GPT:
    add_lora(model, config)
    with torch.no_grad():  # B starts at zero: random, so that a wrong or misplaced row shows
        for layer in lora_layers(model).values():
            layer.lora_B.normal_(0, 0.1)
    return model


def _read(path: Path) -> tuple[dict, dict[str, np.ndarray], dict[str, list[int]]]:
    """(metadata, numpy arrays, ggml's ``ne`` shapes) of a GGUF file."""
    reader = gguf.GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    arrays = {t.name: np.array(t.data) for t in reader.tensors}
    shapes = {t.name: [int(n) for n in t.shape] for t in reader.tensors}
    assert {t.tensor_type for t in reader.tensors} == {gguf.GGMLQuantizationType.F32}
    return fields, arrays, shapes


def test_the_file_holds_the_header_names_shapes_and_values_llama_cpp_reads(tmp_path):
    model = _adapted(_model())
    export_gguf_lora(model, tmp_path / "a.gguf")
    fields, arrays, shapes = _read(tmp_path / "a.gguf")
    assert fields == {"general.architecture": "llama", "general.type": "adapter", "adapter.type": "lora",
                      "adapter.lora.alpha": 8.0}
    assert set(arrays) == {f"blk.{i}.{kind}.weight.lora_{side}" for i in range(2) for kind in KINDS.values()
                           for side in "ab"}
    tensors = peft_tensors(model)
    for i in range(2):
        for target, kind in KINDS.items():
            a = tensors[PEFT_KEY.format(i, MODULES[target], target, "A")]
            b = tensors[PEFT_KEY.format(i, MODULES[target], target, "B")]
            name = f"blk.{i}.{kind}.weight"
            # llama-adapter.cpp: a.ne = [in, r] (ne[0] = the base's in), b.ne = [r, out], a.ne[1] == b.ne[0]
            assert shapes[f"{name}.lora_a"] == [a.shape[1], RANK] and shapes[f"{name}.lora_b"] == [RANK, b.shape[0]]
            torch.testing.assert_close(torch.from_numpy(arrays[f"{name}.lora_a"]), a, rtol=0, atol=0)
            lora_b = torch.from_numpy(arrays[f"{name}.lora_b"])
            if kind in ROTARY_HEADS:  # the reader's inverse of the base export's reordering gives B back
                lora_b = unpermute_rope_rows(lora_b, ROTARY_HEADS[kind])
            torch.testing.assert_close(lora_b, b, rtol=0, atol=0)


def test_the_product_is_the_change_of_the_base_files_rows(tmp_path):
    """B A, scaled as llama.cpp scales it (α / r, r from lora_b), is the merged model's GGUF weight minus the base
    model's, every adapted matrix, with each file's own rotary order."""
    tokenizer = BPETokenizer.train(CORPUS, vocab_size=300, byte_level=True)
    model = _model(tokenizer.vocab_size)
    export_gguf(model, tokenizer, tmp_path / "base.gguf", storage="f32")
    export_gguf_lora(_adapted(model), tmp_path / "a.gguf")
    export_gguf(merge_lora(copy.deepcopy(model)), tokenizer, tmp_path / "merged.gguf", storage="f32")
    fields, adapter, shapes = _read(tmp_path / "a.gguf")
    base, merged = _read(tmp_path / "base.gguf")[1], _read(tmp_path / "merged.gguf")[1]
    for name in {n.rsplit(".", 1)[0] for n in adapter}:
        scale = fields["adapter.lora.alpha"] / shapes[f"{name}.lora_b"][0]
        delta = torch.from_numpy(merged[name] - base[name])
        product = scale * torch.from_numpy(adapter[f"{name}.lora_b"]) @ torch.from_numpy(adapter[f"{name}.lora_a"])
        torch.testing.assert_close(product, delta, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family, overrides", [("qwen2", dict(qkv_bias=True)), ("qwen3", dict(qk_norm=True))])
def test_qwen_files_keep_the_rows_in_order(family, overrides, tmp_path):
    """llama.cpp reads Qwen2 and Qwen3 rows as Hugging Face holds them: B is written as it is."""
    model = _adapted(_model(**overrides))
    export_gguf_lora(model, tmp_path / "a.gguf")
    fields, arrays, _ = _read(tmp_path / "a.gguf")
    assert fields["general.architecture"] == family
    b = peft_tensors(model)[PEFT_KEY.format(1, "self_attn", "k_proj", "B")]
    np.testing.assert_array_equal(arrays["blk.1.attn_k.weight.lora_b"], b.numpy())


def test_a_quantized_models_stacked_layers_write_the_same_file(tmp_path):
    floats = _adapted(_model())
    stacked = add_lora(quantize(_model(), "int8"), CONFIG)
    assert any(len(layer.parts) > 1 for layer in lora_layers(stacked).values())
    theirs = peft_tensors(floats)
    with torch.no_grad():
        for name, layer in lora_layers(stacked).items():
            i = int(name.split(".")[2])
            for target in targets_of(name, layer, LLAMA):
                a, b = layer.part(target if len(layer.parts) > 1 else "")
                a.copy_(theirs[PEFT_KEY.format(i, MODULES[target], target, "A")])
                b.copy_(theirs[PEFT_KEY.format(i, MODULES[target], target, "B")])
    export_gguf_lora(floats, tmp_path / "float.gguf")
    export_gguf_lora(stacked, tmp_path / "stacked.gguf")
    assert (tmp_path / "float.gguf").read_bytes() == (tmp_path / "stacked.gguf").read_bytes()


def test_rslora_writes_the_alpha_that_gives_its_scale(tmp_path):
    """llama.cpp scales by α' / r: rsLoRA's α / √r is α' = α √r."""
    model = _adapted(_model(), LoRAConfig(rank=RANK, alpha=8, rslora=True))
    export_gguf_lora(model, tmp_path / "a.gguf")
    alpha = _read(tmp_path / "a.gguf")[0]["adapter.lora.alpha"]
    assert alpha == pytest.approx(8 * math.sqrt(RANK))
    assert alpha / RANK == pytest.approx(next(iter(lora_layers(model).values())).scale)


def test_a_sliding_window_model_needs_the_bases_architecture(tmp_path):
    """export_gguf has no file for a sliding window; llama.cpp's converter writes Mistral as llama (permuted)."""
    model = _adapted(_model(window=8))
    with pytest.raises(ValueError, match="no sliding window"):
        export_gguf_lora(model, tmp_path / "a.gguf")
    export_gguf_lora(model, tmp_path / "a.gguf", architecture="llama")
    fields, arrays, _ = _read(tmp_path / "a.gguf")
    assert fields["general.architecture"] == "llama"
    b = peft_tensors(model)[PEFT_KEY.format(0, "self_attn", "q_proj", "B")]
    torch.testing.assert_close(unpermute_rope_rows(torch.from_numpy(arrays["blk.0.attn_q.weight.lora_b"]), N_HEADS),
                               b, rtol=0, atol=0)


def test_refusals_leave_no_file(tmp_path):
    gpt2 = GPT(GPTConfig.from_preset("gpt2", vocab_size=64, n_layers=1, d_model=32, n_heads=4, d_ff=64,
                                     max_seq_len=16))
    cases = [(_model(), {}, "no LoRA layers"), (gpt2, {}, "LLaMA family"),
             (_adapted(_model()), {"architecture": "qwen2"}, "architecture must be 'llama'"),
             (_adapted(_model()), {"architecture": "gpt2"}, "architecture must be 'llama'")]
    for model, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            export_gguf_lora(model, tmp_path / "a.gguf", **kwargs)
    assert not list(tmp_path.iterdir())
    (tmp_path / "a.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="exists"):
        export_gguf_lora(_adapted(_model()), tmp_path / "a.gguf")
    assert (tmp_path / "a.gguf").read_bytes() == b""


# ------------------------------------------------------------------------------------------- llama.cpp


@pytest.mark.skipif(llama_cpp("llama-perplexity") is None,
                    reason="no llama.cpp build (set QKV_LLAMA_CPP to its bin folder)")
@pytest.mark.parametrize("rslora", [False, True])
def test_llama_cpp_with_the_adapter_is_the_merged_model(rslora, tmp_path):
    """llama-perplexity of the base file with ``--lora`` is that of the merged model's file (within 0.1%), and
    differs from the base's alone."""
    tokenizer = BPETokenizer.train(CORPUS, vocab_size=300, byte_level=True)
    model = _model(tokenizer.vocab_size)
    export_gguf(model, tokenizer, tmp_path / "base.gguf", storage="f32")
    _adapted(model, LoRAConfig(rank=RANK, alpha=8, rslora=rslora))
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.mul_(5)  # a change the perplexity shows
    export_gguf(merge_lora(copy.deepcopy(model)), tokenizer, tmp_path / "merged.gguf", storage="f32")
    export_gguf_lora(model, tmp_path / "a.gguf")
    (tmp_path / "text.txt").write_text(" ".join(CORPUS), encoding="utf-8")
    text = tmp_path / "text.txt"
    with_lora = llama_perplexity(tmp_path / "base.gguf", text, 32, "--lora", tmp_path / "a.gguf")
    assert with_lora == pytest.approx(llama_perplexity(tmp_path / "merged.gguf", text, 32), rel=1e-3)
    assert with_lora != pytest.approx(llama_perplexity(tmp_path / "base.gguf", text, 32), rel=1e-2)


def _llama_completion(model: Path, prompt: str, *extra) -> str:
    """llama.cpp's greedy continuation of ``prompt`` (16 tokens), as text with the prompt, bytes that are not
    UTF-8 replaced as Python replaces them."""
    run = subprocess.run([llama_cpp("llama-completion"), "-m", model, "-p", prompt, "-n", "16",
                          "--temp", "0", "--ignore-eos", "-no-cnv", "--simple-io", "--no-warmup", "-c", "32", "-t",
                          "1", *extra], capture_output=True, check=True)
    return run.stdout.decode("utf-8", "replace")


@pytest.mark.skipif(llama_cpp("llama-completion") is None,
                    reason="no llama.cpp build (set QKV_LLAMA_CPP to its bin folder)")
def test_llama_cpp_with_the_adapter_continues_a_prompt_as_qkv_does(tmp_path):
    """``llama-completion --lora`` on the base file writes qkv's greedy continuation with the adapter (16 tokens,
    the smallest gap between the two best logits on the way 0.004 here), and the base alone writes another."""
    from qkv.tasks.language_model import complete

    tokenizer = BPETokenizer.train(CORPUS, vocab_size=300, byte_level=True)
    model = _model(tokenizer.vocab_size)
    export_gguf(model, tokenizer, tmp_path / "base.gguf", storage="f32")
    _adapted(model)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.mul_(5)
    export_gguf_lora(model, tmp_path / "a.gguf")
    prompt = "The robot picked up"
    ours = prompt + complete(model, tokenizer, [prompt], max_new_tokens=16)[0]
    theirs = _llama_completion(tmp_path / "base.gguf", prompt, "--lora", tmp_path / "a.gguf")
    assert theirs.startswith(ours) and not theirs[len(ours):].strip(), (ours, theirs)
    assert not _llama_completion(tmp_path / "base.gguf", prompt).startswith(ours)
