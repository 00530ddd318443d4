"""The training loop: schedules, accumulation, exact resume, stopping."""

import itertools
import math
from pathlib import Path

import pytest
import torch

from qkv import Transformer, TransformerConfig
from qkv.checkpoint import load_checkpoint
from qkv.tasks.translation import ParallelData, TranslationTask
from qkv.tokenizers import CharTokenizer
from qkv.training import Trainer, TrainOptions, learning_rate

WORDS = ["red", "ball", "robot", "picked", "up", "the", "a", "blue", "cat", "sat"]


def make_task(seed=0, dropout=0.1):
    g = torch.Generator().manual_seed(123)
    pairs = []
    for _ in range(120):
        words = [WORDS[i] for i in torch.randint(0, len(WORDS), (int(torch.randint(2, 6, (1,), generator=g)),),
                                                 generator=g)]
        pairs.append((" ".join(words), " ".join(reversed(words))))
    tok = CharTokenizer.train([p[0] for p in pairs])
    toks = {"src": tok, "tgt": tok}
    train = ParallelData.encode(pairs[:100], toks, max_len=60, name="train")
    valid = ParallelData.encode(pairs[100:], toks, max_len=60, name="valid")
    torch.manual_seed(seed)
    cfg = TransformerConfig(src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size, d_model=32, n_heads=4,
                            n_layers=1, d_ff=64, dropout=dropout, share_embeddings=True, max_seq_len=64)
    return TranslationTask(Transformer(cfg), toks, train, valid, batch_tokens=300, seed=seed, bleu_samples=5)


def log_rows(out, column):
    """The rows of ``out/log.csv`` that fill ``column`` (training rows have an lr, evaluation rows a val_loss)."""
    header, *lines = (Path(out) / "log.csv").read_text().splitlines()
    rows = [dict(zip(header.split(","), line.split(","), strict=False)) for line in lines]
    return [r for r in rows if r.get(column)]


def options(out, **kw):
    return TrainOptions(out=str(out), lr=3e-3, warmup=3, eval_every=4, progress=False, **kw)


def test_schedules():
    opts = TrainOptions(out="x", max_steps=100, lr=1.0, warmup=10)
    assert learning_rate(5, opts, 100) == pytest.approx(0.5)  # linear warmup
    assert learning_rate(40, opts, 100) == pytest.approx(math.sqrt(10 / 40))  # inverse square root
    cos = TrainOptions(out="x", max_steps=100, lr=1.0, warmup=10, schedule="cosine", min_lr_ratio=0.1)
    assert learning_rate(10, cos, 100) == pytest.approx(1.0)
    assert learning_rate(55, cos, 100) == pytest.approx(0.55)  # halfway: (1 + 0.1) / 2
    assert learning_rate(100, cos, 100) == pytest.approx(0.1)
    timed = TrainOptions(out="x", max_minutes=60, lr=1.0, warmup=10, schedule="cosine", min_lr_ratio=0.1)
    assert learning_rate(5, timed, None, 0.01) == pytest.approx(0.5)  # warmup still counts steps
    assert learning_rate(500, timed, None, 0.5) == pytest.approx(0.55)  # half the time budget used
    assert learning_rate(900, timed, None, 1.2) == pytest.approx(0.1)  # past the budget: the floor
    assert learning_rate(500, timed, None) == pytest.approx(1.0)  # no step or time budget: constant


def test_a_resumed_time_budget_counts_the_whole_run(tmp_path, monkeypatch):
    """--max-minutes, like --max-steps, is the run's budget: a resumed run keeps its place on the time cosine
    and stops when the minutes of all its invocations add up; an already spent budget is a clear error."""
    import qkv.training as training

    clock = iter(range(0, 100_000, 5))  # every look at the clock moves it 5 s on
    monkeypatch.setattr(training.time, "monotonic", lambda: float(next(clock)))

    def timed(minutes, resume=False):
        return TrainOptions(out=str(tmp_path), lr=1e-2, warmup=1, schedule="cosine", min_lr_ratio=0.1,
                            max_minutes=minutes, eval_every=1000, log_every=1, progress=False, resume=resume)

    first = Trainer(make_task(dropout=0.0), timed(1.0)).run()
    assert first.stopped_because == "time budget reached"
    before = log_rows(tmp_path, "lr")
    resumed = Trainer(make_task(dropout=0.0), timed(2.0, resume=True)).run()
    assert resumed.stopped_because == "time budget reached"
    after = log_rows(tmp_path, "lr")[len(before):]
    assert after, "the resumed run took no step"
    # the schedule goes on from about half of the 2-minute budget, not from its peak again
    assert float(after[0]["lr"]) < 0.6 * 1e-2
    assert all(float(a["lr"]) >= float(b["lr"]) for a, b in itertools.pairwise(after))
    assert 120 <= float(after[-1]["elapsed_s"]) < 120 + 60  # both invocations together, not 2 more minutes
    with pytest.raises(ValueError, match=r"already ran .* minutes.*raise --max-minutes"):
        Trainer(make_task(dropout=0.0), timed(2.0, resume=True)).run()


def test_resumed_run_ends_with_the_same_weights(tmp_path):
    straight = make_task()
    Trainer(straight, options(tmp_path / "a", max_steps=14)).run()

    interrupted = make_task()
    Trainer(interrupted, options(tmp_path / "b", max_steps=6)).run()  # stops mid-epoch, saves last/
    resumed = make_task(seed=0)
    with torch.no_grad():  # whatever the new process starts from is overwritten by the checkpoint
        for p in resumed.model.parameters():
            p.zero_()
    torch.manual_seed(999)  # and its RNG state too
    Trainer(resumed, options(tmp_path / "b", max_steps=14, resume=True)).run()

    a = load_checkpoint(tmp_path / "a" / "last").model.state_dict()
    b = load_checkpoint(tmp_path / "b" / "last").model.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    state = load_checkpoint(tmp_path / "b" / "last", with_trainer_state=True).trainer_state
    assert state["step"] == 14


def test_accumulating_two_batches_equals_one_batch_twice_as_large(tmp_path):
    task = make_task(dropout=0.0)
    b1, b2 = task.batches(0)[:2]
    params = list(task.model.parameters())
    (task.loss(b1)[0] + task.loss(b2)[0]).div(b1.n_tokens + b2.n_tokens).backward()
    expected = [p.grad.clone() for p in params]
    task.model.zero_grad()
    trainer = Trainer(task, options(tmp_path, max_steps=1, accum=2, clip=0.0))
    trainer.optimizer.step = lambda: None  # look at the gradients, not the update
    trainer.optimizer.zero_grad = lambda set_to_none=True: None
    trainer._train_step([b1, b2], lr=1e-3)
    for p, g in zip(params, expected, strict=True):
        torch.testing.assert_close(p.grad, g, atol=1e-6, rtol=1e-5)


def test_training_reduces_loss_and_keeps_best(tmp_path):
    task = make_task()
    before = task.evaluate()["val_loss"]
    result = Trainer(task, options(tmp_path, max_steps=20)).run()
    assert result.last_eval["val_loss"] < before
    assert result.best is not None and (tmp_path / "best" / "model.safetensors").exists()
    rows = (tmp_path / "log.csv").read_text().splitlines()
    assert rows[0].startswith("step,") and len(rows) > 2 and (tmp_path / "loss.png").stat().st_size > 1000


def test_batches_depend_only_on_seed_and_epoch():
    a, b = make_task(), make_task()
    assert [x.src.tolist() for x in a.batches(1)] == [x.src.tolist() for x in b.batches(1)]
    assert [x.src.tolist() for x in a.batches(0)] != [x.src.tolist() for x in a.batches(1)]


@pytest.mark.parametrize("kwargs, message", [
    ({}, "give a budget"),
    ({"max_steps": 0}, "max_steps must be positive"),
    ({"max_steps": 5, "schedule": "linear"}, "schedule must be one of"),
    ({"max_steps": 5, "lr": -1.0}, "lr must be positive"),
])
def test_bad_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainOptions(out="x", **kwargs)


def test_evaluations_at_wall_clock_marks(tmp_path, monkeypatch):
    """With a fake clock that advances 20 s per reading, marks at 1 and 2 minutes fall between steps and each
    gets exactly one evaluation, besides those every --eval-every steps."""
    import qkv.training as training

    clock = iter(range(0, 10_000, 20))
    monkeypatch.setattr(training.time, "monotonic", lambda: float(next(clock)))
    task = make_task(dropout=0.0)
    opts = TrainOptions(out=str(tmp_path), lr=3e-3, warmup=3, eval_every=100, progress=False, max_steps=8,
                        eval_at_minutes=(1.0, 2.0))
    Trainer(task, opts).run()
    evals = log_rows(tmp_path, "val_loss")
    assert len(evals) == 3  # the two marks and the end of the run
    times = [float(r["elapsed_s"]) for r in evals]
    assert 60 <= times[0] < 120 <= times[1] < times[2]
