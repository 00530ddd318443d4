"""Classification: reading text<TAB>label files, the held-out split, and a tiny BERT that learns an easy split."""

import random

import pytest
import torch

from qkv.config import BERTClassifierConfig
from qkv.data import DataError
from qkv.models import BERTClassifier
from qkv.tasks.classify import ClassifyTask, label_set, predict, read_labelled, split_examples
from qkv.tokenizers import WordPieceTokenizer
from qkv.training import Trainer, TrainOptions


def test_read_labelled_takes_the_label_after_the_last_tab(tmp_path):
    path = tmp_path / "d.tsv"
    path.write_text("a good day\tpos\n\n  tabs\tin text\tneg \nbad\tneg\n", encoding="utf-8")
    assert read_labelled(path) == [("a good day", "pos"), ("tabs\tin text", "neg"), ("bad", "neg")]


@pytest.mark.parametrize(("content", "message"), [
    ("fine\tpos\nno tab here\n", "line 2 has no tab"),
    ("fine\tpos\n\tneg\n", "line 2 has an empty text"),
    ("fine\t \n", "line 1 has an empty label"),
    ("\n\n", "no examples"),
])
def test_bad_files_say_which_line(tmp_path, content, message):
    path = tmp_path / "d.tsv"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError, match=message):
        read_labelled(path)


def test_split_is_seeded_and_holds_out_the_fraction():
    examples = [(f"text {i}", str(i % 2)) for i in range(50)]
    train, valid = split_examples(examples, 0.2, seed=1)
    assert (len(train), len(valid)) == (40, 10) and sorted(train + valid) == sorted(examples)
    assert split_examples(examples, 0.2, seed=1) == (train, valid) != split_examples(examples, 0.2, seed=2)
    with pytest.raises(ValueError, match="too few"):
        split_examples(examples[:1], 0.5)
    assert label_set(examples) == ["0", "1"]
    with pytest.raises(ValueError, match="at least 2 labels"):
        label_set([("a", "x")])


# An easy but not trivial split: the label is whether an animal or a vehicle is mentioned, among filler words.
ANIMALS, VEHICLES = ["cat", "dog", "horse", "bird", "fish"], ["car", "bus", "train", "bike", "boat"]
FILLER = ["the", "a", "big", "small", "red", "blue", "old", "new", "fast", "slow", "near", "far", "my", "your", "this",
          "that"]


def _examples(n, seed):
    r = random.Random(seed)
    out = []
    for _ in range(n):
        label = r.choice(["animal", "vehicle"])
        words = r.sample(FILLER, r.randint(2, 6))
        words.insert(r.randint(0, len(words)), r.choice(ANIMALS if label == "animal" else VEHICLES))
        out.append((" ".join(words), label))
    return out


@pytest.mark.parametrize("pooling", ["pooler", "mean"])
def test_a_tiny_bert_learns_an_easy_split(tmp_path, pooling):
    train, valid = _examples(400, seed=0), _examples(100, seed=1)
    tok = WordPieceTokenizer.train([t for t, _ in train], vocab_size=80, min_frequency=1)
    torch.manual_seed(0)
    cfg = BERTClassifierConfig(vocab_size=tok.vocab_size, d_model=32, n_heads=2, n_layers=1, d_ff=64,
                               max_seq_len=16, dropout=0.0, pad_id=tok.pad_id, n_labels=2, pooling=pooling)
    task = ClassifyTask(BERTClassifier(cfg), tok, label_set(train), train, valid, batch_size=32, max_length=16)
    with torch.no_grad():
        before = task.evaluate(task.model)
    assert before["val_accuracy"] < 0.75
    opts = TrainOptions(out=str(tmp_path), max_steps=120, lr=3e-3, warmup=5, schedule="cosine", eval_every=120,
                        progress=False)
    after = Trainer(task, opts).run().last_eval
    assert after["val_accuracy"] >= 0.95 and after["val_loss"] < before["val_loss"] / 3, (before, after)
    probs = predict(task.model, tok, ["the red bus", "my old dog"], max_length=16)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))
    assert probs.argmax(-1).tolist() == [1, 0]  # labels sorted: animal 0, vehicle 1


def test_labels_outside_the_training_set_are_refused():
    tok = WordPieceTokenizer.train(["a b c"], vocab_size=30, min_frequency=1)
    cfg = BERTClassifierConfig(vocab_size=tok.vocab_size, d_model=8, n_heads=2, n_layers=1, max_seq_len=8,
                               n_labels=2)
    with pytest.raises(ValueError, match=r"labels \['z'\] are not among the training labels"):
        ClassifyTask(BERTClassifier(cfg), tok, ["x", "y"], [("a", "x"), ("b", "y")], [("c", "z")], batch_size=2,
                     max_length=8)
    with pytest.raises(ValueError, match="2 outputs for 3 labels"):
        ClassifyTask(BERTClassifier(cfg), tok, ["x", "y", "z"], [("a", "x")], [("c", "z")], batch_size=2,
                     max_length=8)
