"""What fine-tuning data may be: a regular file, bounded in size and line length as it streams (a device, a FIFO, a
gzip bomb and a long line are one-line errors, none of them read whole), gzip or not whatever its name, JSONL by its
name or its content; a chat of bounded length prepared in renderings linear in its turns, with progress in the log;
and every text valid Unicode before it reaches a tokenizer, the error naming the file and the line."""

import gzip
import json
import logging
import os
import threading
import tracemalloc
from functools import cache

import pytest

from qkv import chat, files
from qkv.data import DataError
from qkv.tasks import finetune
from qkv.tasks.finetune import read_examples
from qkv.tasks.preference import read_pairs
from qkv.tokenizers import PretrainedTokenizer, tokenizer_from_dict

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@cache
def _tokenizer() -> PretrainedTokenizer:
    """A small byte-level BPE tokenizer with ChatML's markers (offsets, as chat_training_ids needs)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(["Hello there, how are you? I am fine, thank you."], trainer=trainer)
    return PretrainedTokenizer(hf, bos_id=None, eos_id=hf.token_to_id("<|im_end|>"), add_bos=False)


def _chat(n: int) -> dict:
    return {"messages": [{"role": "user", "content": f"Hello {n}"}, {"role": "assistant", "content": "Fine."}]}


def _one_line(err: pytest.ExceptionInfo, *parts: str) -> str:
    text = str(err.value)
    assert "\n" not in text and len(text) < 400, text
    for part in parts:
        assert part in text, text
    return text


def _read_both(path):
    """Each reader of fine-tuning data on ``path``: examples, and preference pairs."""
    yield lambda: read_examples(path, _tokenizer(), CHATML)
    yield lambda: read_pairs(path, _tokenizer(), CHATML, context=64)


# --- item 6: bounded, regular files only --------------------------------------------------------------------------
@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero here")
def test_a_device_is_refused_before_it_is_read():
    for read in _read_both("/dev/zero"):
        with pytest.raises(ValueError) as err:
            read()
        _one_line(err, "/dev/zero", "it is a device, not a regular file")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_with_no_writer_is_refused_without_waiting(tmp_path):
    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    for read in _read_both(fifo):
        outcome = {}

        def run(read=read, outcome=outcome):
            try:
                read()
            except ValueError as err:
                outcome["error"] = str(err)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(10)
        if thread.is_alive():  # it opened the FIFO and waits for a writer: give it one that ends at once
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            thread.join(10)
            pytest.fail("reading a FIFO waited for a writer")
        assert "it is a FIFO (a named pipe), not a regular file" in outcome["error"]


def test_a_gzip_bomb_stops_at_the_bound_without_being_held_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(finetune, "MAX_DATA_BYTES", 1 << 20)
    bomb = tmp_path / "chats.jsonl.gz"
    bomb.write_bytes(gzip.compress(b"\n" * (16 << 20), compresslevel=9))  # 16 MiB of empty lines in ~16 KiB
    assert bomb.stat().st_size < 100_000
    for read in _read_both(bomb):
        tracemalloc.start()
        try:
            with pytest.raises(ValueError) as err:
                read()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        _one_line(err, str(bomb), "more than 1,048,576 bytes (the most it may hold once decompressed)")
        assert peak < 6 << 20  # a few pieces of 1 MiB, never the 16 MiB


def test_a_line_longer_than_the_bound_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr(finetune, "MAX_LINE_BYTES", 100)
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps(_chat(0)) + "\n" + json.dumps({"prompt": "x" * 200, "completion": "y"}) + "\n",
                    encoding="utf-8")
    for read in _read_both(path):
        with pytest.raises(ValueError) as err:
            read()
        _one_line(err, str(path), "line 2 is longer than 100 bytes, the most a line may hold")


@pytest.mark.parametrize("piece", [1, 3, 7, 1 << 20])
def test_line_lengths_are_counted_across_the_pieces_read(tmp_path, monkeypatch, piece):
    monkeypatch.setattr(files, "_PIECE", piece)
    path = tmp_path / "lines.txt"
    path.write_bytes(b"abcd\n12345\n\nxyz")
    assert files.read_bounded(path, max_bytes=100, max_line=5) == b"abcd\n12345\n\nxyz"
    with pytest.raises(ValueError, match=r"line 2 is longer than 4 bytes"):
        files.read_bounded(path, max_bytes=100, max_line=4)
    with pytest.raises(ValueError, match=r"more than 10 bytes"):
        files.read_bounded(path, max_bytes=10, max_line=5)


# --- item 7: the format from the content, after decompression ------------------------------------------------------
@pytest.mark.parametrize("name", ["chats.jsonl.gz", "chats.gz", "chats.txt"])
def test_chats_are_chats_gzip_or_not_whatever_the_name(tmp_path, name):
    path = tmp_path / name
    text = "".join(json.dumps(_chat(n)) + "\n" for n in range(30)).encode()
    path.write_bytes(gzip.compress(text) if name.endswith(".gz") else text)
    examples = read_examples(path, _tokenizer(), CHATML)
    assert len(examples) == 30
    learnt = [_tokenizer().hf.decode([i for i, m in zip(e.ids, e.learn, strict=True) if m], skip_special_tokens=False)
              for e in examples]
    assert learnt == ["Fine.<|im_end|>"] * 30


def test_preference_pairs_may_be_compressed(tmp_path):
    path = tmp_path / "pairs.jsonl.gz"
    pair = {"prompt": "Hello", "chosen": "Fine.", "rejected": "No."}
    path.write_bytes(gzip.compress((json.dumps(pair) + "\n").encode() * 3))
    assert len(read_pairs(path, _tokenizer(), CHATML, context=64)) == 3


def test_plain_text_compressed_is_still_plain_text(tmp_path):
    path = tmp_path / "book.gz"
    path.write_bytes(gzip.compress(b"How are you?\nI am fine.\n"))
    [example] = read_examples(path, _tokenizer(), CHATML)
    assert _tokenizer().hf.decode(example.ids) == "How are you?\nI am fine.\n" and all(example.learn)


# --- item 8: renderings linear in the turns, a bounded conversation, progress ----------------------------------------
def _counting_renders(monkeypatch) -> list:
    calls = []
    render = chat.render_chat

    def counted(*args, **kwargs):
        calls.append(1)
        return render(*args, **kwargs)

    monkeypatch.setattr(chat, "render_chat", counted)
    return calls


@pytest.mark.parametrize("turns", [1, 4, 16, 32])
def test_a_conversation_is_prepared_in_renderings_linear_in_its_turns(monkeypatch, turns):
    calls = _counting_renders(monkeypatch)
    messages = [m for n in range(turns) for m in _chat(n)["messages"]]
    ids, mask = chat.chat_training_ids(CHATML, messages, _tokenizer())
    assert len(calls) == 2 * turns  # the whole once, each turn's prompt, each turn but the last closed
    assert _tokenizer().hf.decode([i for i, m in zip(ids, mask, strict=True) if m],
                                  skip_special_tokens=False) == "Fine.<|im_end|>" * turns


def test_a_conversation_longer_than_the_bound_is_refused_before_it_is_rendered(tmp_path, monkeypatch):
    calls = _counting_renders(monkeypatch)
    messages = [m for n in range(chat.MAX_TRAINING_MESSAGES // 2 + 1) for m in _chat(n)["messages"]]
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps(_chat(0)) + "\n" + json.dumps({"messages": messages}) + "\n", encoding="utf-8")
    with pytest.raises(DataError) as err:
        read_examples(path, _tokenizer(), CHATML)
    _one_line(err, f"{path}: line 2: the conversation has {len(messages)} messages, more than the "
              f"{chat.MAX_TRAINING_MESSAGES} a training conversation may hold")
    assert len(calls) == 2  # the first line's, none of the second's


def test_preparing_a_file_writes_its_progress_to_the_log(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(finetune, "PROGRESS_EVERY_S", 0.0)
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(_chat(n)) + "\n" for n in range(5)), encoding="utf-8")
    with caplog.at_level(logging.INFO, logger="qkv.tasks.finetune"):
        read_examples(path, _tokenizer(), CHATML)
    lines = [r.getMessage() for r in caplog.records if "lines prepared" in r.getMessage()]
    assert lines and lines[-1].startswith(f"{path}: 4 of 5 lines prepared (") and "lines/s, about" in lines[-1]


# --- item 9: every text valid Unicode before a tokenizer, errors naming the file and line ---------------------------
@pytest.mark.parametrize(("record", "message"), [
    ({"messages": [{"role": "user", "content": "a\ud800"}, {"role": "assistant", "content": "b"}]},
     "message 0's content is not valid UTF-8 (a lone surrogate U+D800)"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant\udcff", "content": "b"}]},
     "message 1's role is not valid UTF-8"),
    ({"prompt": "a", "completion": "b\ud800"}, '"completion" is not valid UTF-8 (a lone surrogate U+D800)'),
    ({"prompt": "\udfff", "completion": "b"}, '"prompt" is not valid UTF-8 (a lone surrogate U+DFFF)'),
])
def test_a_lone_surrogate_in_the_examples_is_one_line_naming_the_line(tmp_path, record, message):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(_chat(0)) + "\n" + json.dumps(record) + "\n", encoding="utf-8")  # \ud800 escaped
    with pytest.raises(DataError) as err:
        read_examples(path, _tokenizer(), CHATML)
    _one_line(err, f"{path}: line 2: {message}")


@pytest.mark.parametrize(("record", "message"), [
    ({"prompt": "a", "chosen": "b\ud800", "rejected": "c"}, '"chosen" is not valid UTF-8 (a lone surrogate U+D800)'),
    ({"prompt": "a\ud800", "chosen": "b", "rejected": "c"}, '"prompt" is not valid UTF-8'),
    ({"prompt": [{"role": "user", "content": "a"}], "chosen": [{"role": "assistant", "content": "b"}],
      "rejected": [{"role": "assistant", "content": "\ud800"}]}, "message 1's content is not valid UTF-8"),
])
def test_a_lone_surrogate_in_the_pairs_is_one_line_naming_the_line(tmp_path, record, message):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n" + json.dumps(record) + "\n",
                    encoding="utf-8")
    with pytest.raises(DataError) as err:
        read_pairs(path, _tokenizer(), CHATML, context=64)
    _one_line(err, f"{path}: line 2: {message}")


def test_every_text_a_tokenizer_encodes_is_checked():
    tokenizer = _tokenizer()
    for encode in (tokenizer.encode, tokenizer.encode_prompt, tokenizer.tokens, lambda t: tokenizer.encode_batch([t])):
        with pytest.raises(ValueError, match=r"is not valid UTF-8 \(a lone surrogate U\+D800\)"):
            encode("a\ud800b")
    assert tokenizer.encode("héllo") == tokenizer.hf.encode("héllo", add_special_tokens=False).ids


# --- item 10: the tokenizer's kind quoted, cut ---------------------------------------------------------------------
def test_an_unknown_tokenizer_kind_is_quoted_cut():
    with pytest.raises(ValueError) as err:
        tokenizer_from_dict({"kind": "k" * 2_000_000})
    _one_line(err, "unknown tokenizer kind", "characters)")
