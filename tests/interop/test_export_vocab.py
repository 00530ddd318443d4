"""Character vocabularies (``qkv train lm``'s default) in GGUF files: byte-level BPE with no merges, one-byte
characters as normal tokens in GPT-2's byte alphabet, longer ones as user-defined tokens. Checked with the gguf
package's reader against GPT-2's alphabet written out here, with qkv's own GGUF reader (the same ids, text,
logits and greedy continuation), with the README's own run through the command line, and, where a llama.cpp build
is found (QKV_LLAMA_CPP), with llama.cpp's tokenizer and its greedy continuation."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from clitools import ok
from hf_greedy import greedy_qkv

from qkv import GPT, GPTConfig
from qkv.interop import load_pretrained
from qkv.interop.gguf_export import export_gguf
from qkv.tokenizers import CharTokenizer

gguf = pytest.importorskip("gguf", reason="writing GGUF files needs the gguf package: pip install gguf")

TEXTS = {"en": "The robot picked up the red ball,\n42 times.", "de": "Der Roboter hob den Ball über 3 Stühle: ß!",
         "zh": "机器人捡起了红色的球。", "emoji": "Well done 🙂👍🏽!\tå"}
CONTROL, NORMAL, USER_DEFINED = 3, 1, 4  # llama.cpp's token types


@pytest.fixture(scope="module")
def tokenizer() -> CharTokenizer:
    return CharTokenizer.train(TEXTS.values())


def _model(vocab_size: int, scale: float = 0.1) -> GPT:
    """A tiny LLaMA-style GPT, its table padded to 64 rows (the export cuts the padding), its weights moved away
    from their initial values by noise of ``scale``."""
    cfg = GPTConfig(vocab_size=vocab_size, d_model=64, n_heads=4, n_layers=2, d_ff=64, max_seq_len=64,
                    vocab_multiple=64, norm="rms", positional="rope", activation="swiglu", bias=False)
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model.eval()


def gpt2_alphabet() -> dict[int, str]:
    """GPT-2's byte -> character table, from its definition: the printable bytes ``!``-``~``, ``¡``-``¬`` and
    ``®``-``ÿ`` stand for themselves; the other 68, in byte order, take the characters from U+0100 on."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(0x100 + i) for i, b in enumerate(others)}


def test_a_character_vocabulary_is_byte_level_bpe_without_merges(tokenizer, tmp_path):
    """The gguf package reads: specials as control tokens, each one-byte character as GPT-2's alphabet spells its
    byte (a space "Ġ", a line break "Ċ", a tab "ĉ"), each longer character as itself, user-defined; no merges."""
    path = export_gguf(_model(tokenizer.vocab_size), tokenizer, tmp_path / "m.gguf", storage="f32")
    fields = {name: field.contents() for name, field in gguf.GGUFReader(path).fields.items()}
    alphabet = gpt2_alphabet()
    chars = tokenizer.itos[4:]
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.merges"] == []
    assert fields["tokenizer.ggml.pre"] == "gpt-2"  # llama.cpp's name for GPT-2's split ("gpt2" it refuses)
    assert fields["tokenizer.ggml.tokens"] == ["<pad>", "<s>", "</s>", "<unk>", *(
        alphabet[ord(c)] if ord(c) < 128 else c for c in chars)]
    assert fields["tokenizer.ggml.token_type"] == [CONTROL] * 4 + [NORMAL if ord(c) < 128 else USER_DEFINED
                                                                  for c in chars]
    assert {" ", "\n", "\t", "ü", "机", "🙂"} <= set(chars)
    assert (fields["tokenizer.ggml.bos_token_id"], fields["tokenizer.ggml.eos_token_id"],
            fields["tokenizer.ggml.padding_token_id"], fields["tokenizer.ggml.add_bos_token"]) == (1, 2, 0, False)


def test_qkv_reads_an_exported_character_model_back_as_it_was(tokenizer, tmp_path):
    """qkv's GGUF reader: the same ids and text on English, German, Chinese and emoji (ü, ß and å, which a byte-
    level decoder would take for single bytes, included), the same logits and greedy continuation. A character
    the vocabulary lacks is dropped, as llama.cpp drops it, where qkv's own tokenizer writes <unk>. What is read
    back exports to the same tokenizer (a fine-tuned character model goes back to GGUF)."""
    model = _model(tokenizer.vocab_size)
    path = export_gguf(model, tokenizer, tmp_path / "m.gguf", storage="f32")
    back = load_pretrained(path, weights="none")
    for text in TEXTS.values():
        ids = tokenizer.encode(text)
        assert back.tokenizer.encode(text) == ids, text
        assert back.tokenizer.decode(ids) == tokenizer.decode(ids) == text
    ids = torch.tensor([tokenizer.encode(TEXTS["de"] + TEXTS["zh"])])
    with torch.no_grad():
        torch.testing.assert_close(back.model(ids), model(ids), atol=1e-5, rtol=1e-5)
        assert torch.equal(greedy_qkv(back.model, ids[:, :12], 16), greedy_qkv(model, ids[:, :12], 16))
    a, b = tokenizer.stoi["a"], tokenizer.stoi["机"]
    assert "猫" not in tokenizer.stoi and "x" not in tokenizer.stoi
    assert tokenizer.encode("a猫x机") == [a, 3, 3, b] and back.tokenizer.encode("a猫x机") == [a, b]
    again = export_gguf(back.model, back.tokenizer, tmp_path / "again.gguf", storage="f32")
    fields = [{name: field.contents() for name, field in gguf.GGUFReader(file).fields.items()
               if name.startswith("tokenizer.")} for file in (path, again)]
    assert fields[0] == fields[1]


def test_qkv_reads_user_defined_tokens_as_their_text_and_normal_ones_as_bytes():
    """llama.cpp's rule, which the tokenizers library's byte-level decoder alone breaks for "é" and "ü" (bytes
    0xE9 and 0xFC in GPT-2's alphabet): a user-defined token is matched whole and written as it is; a normal one,
    "é" inside it or not, is bytes."""
    from qkv.interop.gguf_tokenizer import tokenizer_from_gguf

    alphabet = gpt2_alphabet()
    spelt = "".join(alphabet[b] for b in "默".encode())
    assert spelt[0] == "é"
    tokens = ["<s>", "a", "Ġ", spelt, "é", "ü", "<think>"]
    tokenizer = tokenizer_from_gguf({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [CONTROL, NORMAL, NORMAL, NORMAL, USER_DEFINED, USER_DEFINED, USER_DEFINED],
        "tokenizer.ggml.merges": []})
    assert tokenizer.encode("a é ü<think>a") == [1, 2, 4, 2, 5, 6, 1]
    assert tokenizer.decode([1, 4, 2, 3, 5, 6, 0]) == "aé 默ü<think>"


def test_characters_llama_cpp_spells_alike_are_refused_in_one_line(tmp_path):
    """GPT-2's alphabet writes a line break as "Ċ", which is also a letter (Maltese): one token for two."""
    tokenizer = CharTokenizer.train(["Ċ\n"])
    with pytest.raises(ValueError, match=r"the characters '\\n' and 'Ċ' are one GGUF token, 'Ċ', .*--format hf"):
        export_gguf(_model(tokenizer.vocab_size), tokenizer, tmp_path / "m.gguf")
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_the_readmes_character_run_exports_to_gguf_and_generates_the_same(lm_run, tmp_path, here):
    """``qkv train lm`` (characters, its default) -> ``qkv export --format gguf`` -> ``qkv generate --pretrained``
    continues a prompt as ``qkv generate --model`` does."""
    ok(here("export", "--model", lm_run, "--format", "gguf", "--type", "f32", "--out", tmp_path / "m.gguf",
            cwd=tmp_path))
    prompt = ["--prompt", "KING RICHARD:\nWhat", "--max-new-tokens", "40", "--no-stream"]
    from_run = ok(here("generate", "--model", lm_run, *prompt, cwd=tmp_path)).stdout
    from_file = ok(here("generate", "--pretrained", tmp_path / "m.gguf", *prompt, cwd=tmp_path)).stdout
    assert from_file == from_run and from_run.startswith("KING RICHARD:\nWhat") and len(from_run) > 30


# ------------------------------------------------------------------------------------------- llama.cpp


def _llama_cpp() -> Path | None:
    """$QKV_LLAMA_CPP, a llama.cpp build's bin folder with llama-completion (see docs/export.md)."""
    folder = os.environ.get("QKV_LLAMA_CPP")
    return Path(folder) if folder and (Path(folder) / "llama-completion").is_file() else None


def _run(command: list, done) -> tuple[str, str]:
    """stdout and stderr of a llama.cpp command whose output ``done`` finds whole: its logger (a thread) now and
    then loses its last lines at exit, so it is run again, up to 5 times."""
    for _ in range(5):
        run = subprocess.run(command, capture_output=True, check=True, stdin=subprocess.DEVNULL)
        out, err = run.stdout.decode("utf-8"), run.stderr.decode("utf-8", errors="replace")
        if done(out, err):
            break
    return out, err


def _llama_cpp_ids(bin_dir: Path, model: Path, text_file: Path) -> list[int]:
    """llama.cpp's ids for the text: llama-tokenize's list where it is built, else the prompt llama-completion
    lists with --verbose-prompt (``  ID -> 'piece'``, one a line, after its count)."""
    if (bin_dir / "llama-tokenize").is_file():
        out, _ = _run([bin_dir / "llama-tokenize", "-m", model, "-f", text_file, "--ids", "--no-escape",
                       "--log-disable"], lambda out, err: out.endswith("]\n"))
        return [int(i) for i in re.findall(r"\d+", out)]

    out, err = _run([bin_dir / "llama-completion", "-m", model, "-f", text_file, "--no-escape", "-n", "0",
                     "--verbose-prompt", "-no-cnv", "-t", "2", "--no-warmup"],
                    lambda out, err: len(_listed(err)[1]) == _listed(err)[0])
    return _listed(err)[1]


def _listed(log: str) -> tuple[int, list[int]]:
    """(how many tokens llama-completion says the prompt has, the ids it lists after that), or (-1, [])."""
    found = re.search(r"number of tokens in prompt = (\d+)\n(.*)", log, flags=re.S)
    if found is None:
        return -1, []
    return int(found[1]), [int(i) for i in re.findall(r"^\S*(?: I)? +(\d+) -> '", found[2], flags=re.M)]


@pytest.mark.skipif(_llama_cpp() is None, reason="no llama.cpp build (set QKV_LLAMA_CPP to its bin folder)")
def test_llama_cpp_tokenizes_and_continues_an_exported_character_model_as_qkv_does(tokenizer, tmp_path):
    """The ids of a text of every language here (llama-tokenize, or llama-completion's prompt), and a greedy
    continuation written as text (llama-completion), are qkv's: the model's weights are noisy enough that it
    writes characters of every kind, and special tokens, which llama.cpp does not print."""
    bin_dir, model = _llama_cpp(), _model(tokenizer.vocab_size, scale=0.5)
    export_gguf(model, tokenizer, tmp_path / "m.gguf", storage="f32")
    text = " ".join(TEXTS.values())
    (tmp_path / "text.txt").write_text(text + "\n", encoding="utf-8")  # llama-completion's -f drops one "\n"
    assert _llama_cpp_ids(bin_dir, tmp_path / "m.gguf", tmp_path / "text.txt")[:len(text)] == tokenizer.encode(text)
    prompt = TEXTS["de"]
    (tmp_path / "prompt.txt").write_text(prompt + "\n", encoding="utf-8")
    # the continuation, then " [end of text]" if it ended at </s>, then "\n\n": the sign that all came out
    out, _ = _run([bin_dir / "llama-completion", "-m", tmp_path / "m.gguf", "-f", tmp_path / "prompt.txt",
                   "--no-escape", "-n", "16", "--temp", "0", "-no-cnv", "-t", "2", "--no-warmup",
                   "--no-display-prompt"], lambda out, err: out.endswith("\n\n"))
    with torch.no_grad():
        ours = greedy_qkv(model, torch.tensor([tokenizer.encode(prompt)]), 16)[0].tolist()
    ours = ours[: ours.index(2)] if 2 in ours else ours  # llama.cpp stops at </s> and writes no special token
    assert len(set(ours)) > 8
    assert out.removesuffix("\n\n").removesuffix(" [end of text]") == tokenizer.decode([i for i in ours if i > 3])
