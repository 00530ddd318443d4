"""Language-model training: the data pipeline, the loss and validation numbers against direct computations,
and a tiny GPT that has to learn."""

import math

import pytest
import torch
import torch.nn.functional as F

from qkv import GPT, GPTConfig
from qkv.data import DataError
from qkv.sampling import Sampling
from qkv.tasks.language_model import (
    LanguageModelTask,
    complete,
    encode_text,
    read_corpus,
    split_text,
    windows,
)
from qkv.tokenizers import CharTokenizer, train_tokenizer
from qkv.training import Trainer, TrainOptions

TEXT = "the cat sat on the mat.\nthe dog sat on the log.\n" * 20


def tiny_gpt(vocab, context=16, **kw):
    return GPT(GPTConfig(vocab_size=vocab, d_model=32, n_heads=2, n_layers=2, d_ff=64, max_seq_len=context,
                         pad_id=None, **kw))


def test_split_is_a_contiguous_tail():
    train, valid = split_text("abcdefghij", 0.2)
    assert (train, valid) == ("abcdefgh", "ij")
    with pytest.raises(ValueError, match="fraction"):
        split_text("abc", 1.0)


def test_read_corpus_joins_files_and_rejects_empty(tmp_path):
    (tmp_path / "a.txt").write_text("one\n", encoding="utf-8")
    (tmp_path / "b.txt").write_text("two", encoding="utf-8")
    (tmp_path / "empty.txt").write_text("\n \n", encoding="utf-8")
    assert read_corpus([tmp_path / "a.txt", tmp_path / "b.txt"]) == "one\n\ntwo\n"
    with pytest.raises(DataError, match="no text"):
        read_corpus([tmp_path / "empty.txt"])


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_encoding_a_text_loses_nothing(kind):
    text = "First Citizen:\nBefore we proceed,  hear me speak.\n\nÄpfel, 3 € — 你好!\n"
    tok = train_tokenizer(kind, text.splitlines(keepends=True), vocab_size=300, byte_level=True)
    ids = encode_text(tok, text)
    assert tok.decode(ids.tolist()) == text


def test_windows_and_targets_are_shifted_by_one():
    stream = torch.arange(100)
    w = windows(stream, torch.tensor([0, 7, 90]), 5)
    assert w.tolist() == [[0, 1, 2, 3, 4], [7, 8, 9, 10, 11], [90, 91, 92, 93, 94]]


def make_task(context=16, batch_size=4, seed=0, **kw):
    tok = CharTokenizer.train([TEXT])
    train_text, valid_text = split_text(TEXT, 0.1)
    torch.manual_seed(0)
    model = tiny_gpt(tok.vocab_size, context=context, dropout=0.0)
    return LanguageModelTask(model, tok, encode_text(tok, train_text), encode_text(tok, valid_text),
                             context=context, batch_size=batch_size, seed=seed, **kw)


def test_batches_depend_only_on_seed_and_epoch():
    a, b = make_task(), make_task()
    first = [x.offsets for x in a.batches(0)]
    assert all(torch.equal(x, y.offsets) for x, y in zip(first, b.batches(0), strict=True))
    assert not all(torch.equal(x, y.offsets) for x, y in zip(first, a.batches(1), strict=True))
    assert len(first) == len(a.train) // (16 * 4)  # one epoch covers the stream once on average
    assert max(x.max().item() for x in first) + 16 < len(a.train)  # every window has its target


def test_loss_is_the_mean_next_token_cross_entropy():
    task = make_task()
    batch = task.batches(0)[0]
    loss, n = task.loss(task.model, batch)
    x = torch.stack([task.train[o : o + 17] for o in batch.offsets.tolist()])
    expected = F.cross_entropy(task.model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten(), reduction="sum")
    torch.testing.assert_close(loss, expected)
    assert n == 4 * 16


def test_validation_scores_every_position_once():
    task = make_task(context=16)
    task.model.eval()
    with torch.no_grad():
        got = task.evaluate(task.model)
        stream, total = task.valid, 0.0
        for start in range(0, len(stream) - 1, 16):  # consecutive windows, the last one shorter
            chunk = stream[start : start + 17]
            total += F.cross_entropy(task.model(chunk[None, :-1])[0], chunk[1:], reduction="sum").item()
    assert got["val_loss"] == pytest.approx(total / (len(stream) - 1), rel=1e-5)
    assert got["val_ppl"] == pytest.approx(math.exp(got["val_loss"]), rel=1e-6)


def test_a_tiny_gpt_learns_a_repetitive_text(tmp_path):
    task = make_task(context=32, batch_size=8)
    before = task.evaluate(task.model)["val_loss"]
    result = Trainer(task, TrainOptions(out=str(tmp_path), max_steps=150, lr=3e-3, warmup=10, eval_every=150,
                                        progress=False, schedule="cosine")).run()
    assert before > 2.5
    assert result.best["val_loss"] < 0.6  # the text is nearly deterministic given a few characters
    tok = task.tokenizers["text"]
    out = complete(task.model, tok, ["the cat sat on"], max_new_tokens=9)[0]
    assert out == " the mat."


def test_complete_rejects_empty_prompts_and_beam_without_stop():
    task = make_task()
    tok = task.tokenizers["text"]
    with pytest.raises(ValueError, match="empty"):
        complete(task.model, tok, ["the", ""], max_new_tokens=3)
    with pytest.raises(ValueError, match="stop token"):
        complete(task.model, tok, ["the"], max_new_tokens=3, beam_size=2)
    a = complete(task.model, tok, ["the"], max_new_tokens=8, sampling=Sampling(temperature=1.0), seed=3)
    assert a == complete(task.model, tok, ["the"], max_new_tokens=8, sampling=Sampling(temperature=1.0), seed=3)


def test_too_little_text_is_a_clear_error():
    tok = CharTokenizer.train(["abc"])
    with pytest.raises(ValueError, match="fewer than one window"):
        LanguageModelTask(tiny_gpt(tok.vocab_size), tok, torch.tensor([4, 5, 6]), torch.tensor([4, 5]),
                          context=16, batch_size=2)


def test_special_tokens_without_text_are_never_sampled():
    """A model that puts almost all its probability on <pad>, <s>, </s> and <unk> still writes only text: those
    ids decode to nothing (or to a literal "<unk>"), so sampling skips them."""
    tok = CharTokenizer.train(["abc"])
    model = tiny_gpt(tok.vocab_size)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # tied: the embeddings too; only the bias-free head's rows matter here
        model.lm_head.weight[:4] = 5.0  # the four specials: every hidden state scores them highest
    for sampling in (Sampling(temperature=1.0), Sampling(temperature=1.0, top_p=0.9), None):
        out = complete(model, tok, ["ab"] * 4, max_new_tokens=20, sampling=sampling, seed=1)
        assert all(len(text) == 20 and set(text) <= set("abc") for text in out), out


def test_eval_windows_must_count_something():
    tok = CharTokenizer.train([TEXT])
    ids = encode_text(tok, TEXT)
    with pytest.raises(ValueError, match="eval_windows must be >= 1"):
        LanguageModelTask(tiny_gpt(tok.vocab_size), tok, ids, ids, context=16, batch_size=2, eval_windows=0)


def test_eval_windows_are_spread_over_the_whole_validation_text():
    """A subset of the validation windows samples the text from its first window to its last, so a validation
    text that changes style half-way is seen whole; asking for every window (or more) reads every position."""
    tok = CharTokenizer.train([TEXT])
    ids = encode_text(tok, TEXT)
    n = (len(ids) - 1) // 16
    read = []
    model = tiny_gpt(tok.vocab_size)
    model.register_forward_pre_hook(lambda _, args: read.extend(args[0][:, 0].tolist()))
    LanguageModelTask(model, tok, ids, ids, context=16, batch_size=2, eval_windows=3).evaluate(model)
    assert n == 59 and read == ids[torch.tensor([0, 29, 58]) * 16].tolist()  # first, middle, last window
    full = LanguageModelTask(model, tok, ids, ids, context=16, batch_size=2).evaluate(model)
    assert LanguageModelTask(model, tok, ids, ids, context=16, batch_size=2, eval_windows=n + 1).evaluate(model) == full


def test_the_default_eval_windows_bound_evaluation_to_a_tenth_of_training():
    from dataclasses import replace

    from qkv.recipes.language_model import LMSettings, eval_windows

    s = LMSettings(eval_every=250, batch_size=12)
    assert eval_windows(s) == 900  # forward-only windows worth 0.1 x 250 training steps of 12 windows
    assert eval_windows(replace(s, accum=4)) == 3600 == eval_windows(replace(s, accum=2), world=2)  # a step's windows
    assert eval_windows(replace(s, eval_windows=0)) is None and eval_windows(replace(s, eval_windows=7)) == 7
