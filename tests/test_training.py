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
from qkv.training import Trainer, TrainOptions, cooling_down, learning_rate

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
    wsd = TrainOptions(out="x", max_steps=110, lr=1.0, warmup=10, schedule="wsd", min_lr_ratio=0.0)
    assert learning_rate(5, wsd, 110) == pytest.approx(0.5)  # warmup as ever
    assert [learning_rate(s, wsd, 110) for s in (10, 50, 90)] == pytest.approx([1.0, 1.0, 1.0])  # stable
    assert learning_rate(100, wsd, 110) == pytest.approx(0.5)  # halfway down the last fifth
    assert learning_rate(110, wsd, 110) == pytest.approx(0.0)  # to the floor: zero here
    timed_wsd = TrainOptions(out="x", max_minutes=60, lr=1.0, warmup=10, schedule="wsd", min_lr_ratio=0.1)
    assert learning_rate(500, timed_wsd, None, 0.9) == pytest.approx(0.55)  # by time, as cosine


def test_the_cool_down_is_where_wsd_lowers_the_rate():
    wsd = TrainOptions(out="x", max_steps=110, lr=1.0, warmup=10, schedule="wsd")
    steps = [s for s in range(1, 111) if cooling_down(s, wsd, 110)]
    assert steps == list(range(91, 111))  # the last fifth after warmup
    assert all(learning_rate(s, wsd, 110) < 0.99 for s in steps) and learning_rate(90, wsd, 110) == pytest.approx(1)
    timed = TrainOptions(out="x", max_minutes=10, lr=1.0, warmup=10, schedule="wsd")
    assert [cooling_down(500, timed, None, f) for f in (0.79, 0.81)] == [False, True]  # by time, as the rate
    assert not cooling_down(5, timed, None, 0.9)  # warmup is never the cool-down
    assert not cooling_down(500, timed, None)  # no budget, no cool-down
    cosine = TrainOptions(out="x", max_steps=110, lr=1.0, warmup=10, schedule="cosine")
    assert not any(cooling_down(s, cosine, 110) for s in range(1, 111))


class FakeClock:
    """The trainer's clock, moved only by the work: a training batch takes ``step_s``, an evaluation ``eval_s``."""

    def __init__(self, monkeypatch, *, step_s: float, eval_s: float) -> None:
        import qkv.training as training

        self.now, self.step_s, self.eval_s = 0.0, step_s, eval_s
        monkeypatch.setattr(training.time, "monotonic", lambda: self.now)

    def task(self, **kwargs):
        task = make_task(dropout=0.0, **kwargs)
        loss, evaluate = task.loss, task.evaluate

        def timed_loss(model, batch, **kw):
            self.now += self.step_s
            return loss(model, batch, **kw)

        def timed_evaluate(model, *group):  # its own validation losses do not count as training steps
            start = self.now
            metrics = evaluate(model, *group)
            self.now = start + self.eval_s
            return metrics

        task.loss, task.evaluate = timed_loss, timed_evaluate
        return task


def timed(out, minutes, resume=False, **kw):
    return TrainOptions(out=str(out), lr=1e-2, warmup=1, schedule="cosine", min_lr_ratio=0.1, max_minutes=minutes,
                        eval_every=1000, log_every=1, progress=False, resume=resume, **kw)


def test_a_time_budget_includes_the_final_evaluation(tmp_path, monkeypatch):
    """Steps of 5 s and evaluations of 20 s under a 2-minute budget: the first evaluation comes by a quarter of
    the budget, and from then on the run stops early enough for its last evaluation and save to fit."""
    clock = FakeClock(monkeypatch, step_s=5, eval_s=20)
    result = Trainer(clock.task(), timed(tmp_path, 2.0)).run()
    assert result.stopped_because == "time budget reached"
    assert 120 - 5 <= result.elapsed_s <= 120  # within one step of the budget, never over it
    evals = log_rows(tmp_path, "val_loss")
    assert float(evals[0]["elapsed_s"]) <= 0.25 * 120 + 5 + 20  # the first, timed evaluation
    assert float(evals[-1]["elapsed_s"]) == result.elapsed_s  # the log and the result agree
    state = load_checkpoint(tmp_path / "last", with_trainer_state=True).trainer_state
    assert state["elapsed_s"] == result.elapsed_s and state["step"] == result.step


def test_a_resumed_time_budget_counts_the_whole_run(tmp_path, monkeypatch):
    """--max-minutes, like --max-steps, is the run's budget: a resumed run keeps its place on the time cosine
    and stops when the minutes of all its invocations add up; an already spent budget is a clear error."""
    clock = FakeClock(monkeypatch, step_s=5, eval_s=10)
    first = Trainer(clock.task(), timed(tmp_path, 1.0)).run()
    # steps of 5 s, evaluations of 10 s: the last step starts by 60 - 5 - 10 s, the last evaluation ends at 55 s
    assert first.stopped_because == "time budget reached" and first.elapsed_s == 55
    before = log_rows(tmp_path, "lr")
    resumed = Trainer(clock.task(), timed(tmp_path, 2.0, resume=True)).run()
    assert resumed.stopped_because == "time budget reached"
    after = log_rows(tmp_path, "lr")[len(before):]
    assert after, "the resumed run took no step"
    # the schedule goes on from 55 s of the 2-minute budget, not from its peak again
    assert float(after[0]["lr"]) == pytest.approx(1e-3 + 9e-3 * 0.5 * (1 + math.cos(math.pi * 55 / 120)), rel=1e-4)
    assert all(float(a["lr"]) >= float(b["lr"]) for a, b in itertools.pairwise(after))
    assert resumed.elapsed_s == 115  # both invocations together, not 2 more minutes
    assert float(log_rows(tmp_path, "val_loss")[-1]["elapsed_s"]) == 115
    with pytest.raises(ValueError, match=r"already ran .* minutes.*raise --max-minutes"):
        Trainer(clock.task(), timed(tmp_path, 2.0, resume=True)).run()


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resumed_run_ends_with_the_same_weights(tmp_path, optimizer):
    """Bit-identical to an uninterrupted run, with Muon's momentum and AdamW's moments both restored."""
    straight = make_task()
    Trainer(straight, options(tmp_path / "a", max_steps=14, optimizer=optimizer)).run()

    interrupted = make_task()
    Trainer(interrupted, options(tmp_path / "b", max_steps=6, optimizer=optimizer)).run()  # mid-epoch, saves last/
    resumed = make_task(seed=0)
    with torch.no_grad():  # whatever the new process starts from is overwritten by the checkpoint
        for p in resumed.model.parameters():
            p.zero_()
    torch.manual_seed(999)  # and its RNG state too
    Trainer(resumed, options(tmp_path / "b", max_steps=14, resume=True, optimizer=optimizer)).run()

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
    (task.loss(task.model, b1)[0] + task.loss(task.model, b2)[0]).div(b1.n_tokens + b2.n_tokens).backward()
    expected = [p.grad.clone() for p in params]
    task.model.zero_grad()
    trainer = Trainer(task, options(tmp_path, max_steps=1, accum=2, clip=0.0))
    trainer.optimizer.step = lambda: None  # look at the gradients, not the update
    trainer.optimizer.zero_grad = lambda set_to_none=True: None
    trainer._step([b1, b2], total=1)
    for p, g in zip(params, expected, strict=True):
        torch.testing.assert_close(p.grad, g, atol=1e-6, rtol=1e-5)


def test_training_reduces_loss_and_keeps_best(tmp_path):
    task = make_task()
    before = task.evaluate(task.model)["val_loss"]
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
    ({"max_steps": 0}, "max_steps must be a positive finite number"),
    ({"max_minutes": float("nan")}, "max_minutes must be a positive finite number, got nan"),
    ({"epochs": float("inf")}, "epochs must be a positive finite number, got inf"),
    ({"max_steps": 5, "clip": float("nan")}, "clip must be a finite number >= 0"),
    ({"max_steps": 5, "eval_at_minutes": (1.0, -3.0)}, "eval_at_minutes must be a positive"),
    ({"max_steps": 5, "schedule": "linear"}, "schedule must be one of"),
    ({"max_steps": 5, "lr": -1.0}, "lr must be a positive finite number"),
    ({"max_steps": 5, "muon_lr": 0.0}, "muon_lr must be a positive finite number"),
    ({"max_steps": 5, "optimizer": "sgd"}, "optimizer must be one of"),
])
def test_bad_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainOptions(out="x", **kwargs)


def test_evaluations_at_wall_clock_marks(tmp_path, monkeypatch):
    """Steps of 20 s: marks at 1 and 2 minutes fall between steps and each gets exactly one evaluation,
    besides the one at the end of the run."""
    task = FakeClock(monkeypatch, step_s=20, eval_s=0).task()
    opts = TrainOptions(out=str(tmp_path), lr=3e-3, warmup=3, eval_every=100, progress=False, max_steps=8,
                        eval_at_minutes=(1.0, 2.0))
    Trainer(task, opts).run()
    evals = log_rows(tmp_path, "val_loss")
    assert [int(r["step"]) for r in evals] == [3, 6, 8]  # the two marks and the end of the run
    assert [float(r["elapsed_s"]) for r in evals] == [60, 120, 160]


def _poisoned(task, *, loss_at: int | None = None, eval_at: int | None = None):
    """The task, with its training loss made NaN from batch ``loss_at`` on, or its ``eval_at``-th validation."""
    loss, evaluate, counts = task.loss, task.evaluate, {"loss": 0, "eval": 0}

    def bad_loss(model, batch, **kw):
        value, n = loss(model, batch, **kw)
        if model.training:
            counts["loss"] += 1
            if loss_at is not None and counts["loss"] >= loss_at:
                value = value * float("nan")
        return value, n

    def bad_evaluate(model, *group):
        counts["eval"] += 1
        metrics = evaluate(model, *group)
        return {**metrics, "val_loss": float("nan")} if counts["eval"] == eval_at else metrics

    task.loss, task.evaluate = bad_loss, bad_evaluate
    return task


@pytest.mark.parametrize("poison, message", [
    ({"loss_at": 7}, r"diverged at step 7 \(loss nan\)"),
    ({"eval_at": 2}, r"diverged at step 8 \(val_loss nan\)"),
])
def test_a_run_that_goes_to_nan_keeps_its_last_good_checkpoint(tmp_path, poison, message):
    """Nothing that is not finite is ever applied to the weights or saved: last/ and best/ stay at step 4."""
    task = _poisoned(make_task(dropout=0.0), **poison)
    with pytest.raises(FloatingPointError, match=message + r".*last is kept"):
        Trainer(task, options(tmp_path, max_steps=20)).run()
    for name in ("last", "best"):
        ckpt = load_checkpoint(tmp_path / name)  # refuses weights that are not finite
        assert ckpt.meta["step"] == 4, name
    assert all(int(r["step"]) <= 8 for r in log_rows(tmp_path, "val_loss"))


def test_a_fresh_run_that_diverges_before_its_first_checkpoint_saves_nothing(tmp_path):
    task = _poisoned(make_task(dropout=0.0), loss_at=2)
    with pytest.raises(FloatingPointError, match="nothing was saved"):
        Trainer(task, options(tmp_path, max_steps=20)).run()
    assert not (tmp_path / "last").exists() and not (tmp_path / "best").exists()


def test_throughput_counts_training_time_only(tmp_path, monkeypatch):
    """Steps of 2 s and evaluations of 100 s: the log's throughput stays the same after every evaluation."""
    clock = FakeClock(monkeypatch, step_s=2, eval_s=100)
    task = clock.task()
    opts = TrainOptions(out=str(tmp_path), lr=3e-3, warmup=3, eval_every=3, log_every=1, progress=False, max_steps=9)
    result = Trainer(task, opts).run()
    rows = log_rows(tmp_path, "lr")
    rates = [float(r["target_tokens_per_s"]) for r in rows]
    tokens = [b.n_tokens for b in [*task.batches(0), *task.batches(1)][:9]]  # the 9 steps, across epochs
    assert rates == [pytest.approx(n / 2, abs=0.5) for n in tokens]
    assert result.rate == pytest.approx(sum(tokens) / 18) and result.unit == "target_tokens"


def test_metrics_print_with_their_decimals():
    from qkv.progress import format_metrics

    assert format_metrics({"val_loss": 1.00044, "val_bleu": 36.351, "val_ppl": 1234.5}) == \
        "val_loss 1.0004  val_bleu 36.3510  val_ppl 1234.5"
    assert format_metrics({"val_loss": 1.0, "step": 30}) == "val_loss 1.0000  step 30"  # a count, not 30.0000


def test_only_the_main_process_prints_validations(capsys):
    """tqdm.write prints even from a disabled bar: every rank of a torchrun printed each validation line."""
    from qkv.progress import Progress

    for main in (True, False):
        progress = Progress(None, unit="tokens", title="t", total=3, initial=0, show=False, log_every=1,
                            max_minutes=None, main=main)
        progress.evaluated(3, {"val_loss": 1.5})
        progress.close()
    assert capsys.readouterr().out == "step 3: val_loss 1.5000\n"


def _scripted(task, evaluations):
    """The task, its validations returning ``evaluations`` in turn, its best checkpoint chosen by exact match."""
    results = iter(evaluations)
    task.evaluate = lambda model, *group: next(results)
    task.selection_metric, task.higher_is_better = "val_exact", True
    return task


def test_a_tie_of_the_selection_metric_falls_to_the_validation_loss(tmp_path):
    """Validations with no exact match: the one with the lowest loss is the best (a strict > on the exact match
    kept the first, at a loss of 3.84); a later tie with a higher loss does not replace it."""
    scores = [{"val_loss": loss, "val_exact": 0.0} for loss in (3.84, 1.42, 1.50)]
    result = Trainer(_scripted(make_task(dropout=0.0), scores), options(tmp_path, max_steps=12)).run()
    assert result.best == {"val_loss": 1.42, "val_exact": 0.0, "step": 8}
    assert load_checkpoint(tmp_path / "best").meta["step"] == 8


def test_a_better_selection_metric_wins_whatever_its_loss(tmp_path):
    scores = [{"val_loss": 1.0, "val_exact": 0.0}, {"val_loss": 2.0, "val_exact": 0.5}]
    result = Trainer(_scripted(make_task(dropout=0.0), scores), options(tmp_path, max_steps=8)).run()
    assert result.best["step"] == 8


@pytest.mark.parametrize("steps, logged", [
    (7, list(range(1, 8))), (30, [1, *range(3, 31, 3)]), (1000, [1, *range(50, 1001, 50)]),
])
def test_a_run_logs_its_first_step_and_about_ten_training_rows(tmp_path, monkeypatch, steps, logged):
    """The training loss at the first step and every min(50, steps // 10) steps (at least every step): a run
    shorter than 50 steps had no training row at all. Only the count matters: the steps are counted, not run."""
    trainer = Trainer(make_task(dropout=0.0), TrainOptions(out=str(tmp_path), max_steps=steps, warmup=0,
                                                           eval_every=10_000, progress=False))

    def count(chunk, total):
        trainer.state.step += 1
        return 1.0, chunk[0].n_tokens, 1e-3

    monkeypatch.setattr(trainer, "_step", count)
    monkeypatch.setattr(trainer, "_evaluate_and_save", lambda progress: {"val_loss": 1.0})
    trainer.run()
    assert [int(r["step"]) for r in log_rows(tmp_path, "train_loss")] == logged


@pytest.mark.parametrize("final_scoring", [0.0, 1.0])
def test_a_time_budget_fits_the_last_step_evaluation_and_final_scoring(tmp_path, monkeypatch, final_scoring):
    """Steps of 7 s and evaluations of 30 s under 2 minutes (the budget is no multiple of a step): the run stops
    before the budget minus one step, its last evaluation and the caller's scoring after it (``final_scoring``
    evaluations: a test set as large as the validation set). Stopping only when the evaluation would no longer
    fit ran a step too many, and took 123 s."""
    clock = FakeClock(monkeypatch, step_s=7, eval_s=30)
    scoring = {"final_scoring": final_scoring} if final_scoring else {}  # without it: the options of before
    result = Trainer(clock.task(), timed(tmp_path, 2.0, **scoring)).run()
    assert result.stopped_because == "time budget reached"
    assert result.elapsed_s + final_scoring * 30 <= 120
    assert result.elapsed_s + final_scoring * 30 > 120 - 7 - 30  # not much earlier either


def test_a_time_budget_counts_from_the_command_start(tmp_path, monkeypatch):
    """A command that spent 40 s reading data and training a tokenizer before the trainer started (``started``)
    has 80 s left of its 2 minutes: the user's minutes are the command's, not the loop's."""
    clock = FakeClock(monkeypatch, step_s=5, eval_s=10)
    clock.now = 40.0
    result = Trainer(clock.task(), timed(tmp_path, 2.0, started=0.0)).run()
    assert result.stopped_because == "time budget reached" and 120 - 5 - 10 < result.elapsed_s <= 120
    assert float(log_rows(tmp_path, "lr")[0]["elapsed_s"]) == 45  # the first step ends 45 s into the command


class Watched:
    """A task the trainer may read but never write to; it records the models its loss and evaluation are given."""

    def __init__(self, task, out) -> None:
        object.__setattr__(self, "_task", task)
        object.__setattr__(self, "_out", out)
        object.__setattr__(self, "seen", {"loss": set(), "evaluate": set(), "held": set()})

    def __getattr__(self, name):
        return getattr(self._task, name)

    def __setattr__(self, name, value):
        raise AssertionError(f"the trainer set task.{name}")

    def loss(self, model, batch):
        from qkv.rundir import holds

        self.seen["loss"].add(model)
        self.seen["held"].add(holds(self._out))  # whether the run directory is claimed while it trains
        return self._task.loss(model, batch)

    def evaluate(self, model, group):
        self.seen["evaluate"].add(model)
        return self._task.evaluate(model, group)


def test_the_trainer_hands_the_task_its_model_and_never_swaps_it(tmp_path):
    inner = make_task(dropout=0.0)
    task = Watched(inner, tmp_path)
    trainer = Trainer(task, options(tmp_path, max_steps=4))
    trainer.run()
    assert task.seen["loss"] == {inner.model} and task.seen["evaluate"] == {inner.model}
    assert trainer.model is inner.model and trainer.training_model is inner.model  # one process: no DDP wrapper
    assert task.seen["held"] == {True}  # the trainer claimed the run directory for its run
    from qkv.rundir import holds

    assert not holds(tmp_path)  # and let it go


def test_a_trainer_inside_a_claim_of_its_directory_trains_in_it(tmp_path):
    """A command claims --out for its whole run; the trainer it starts does not claim it again."""
    from qkv.rundir import claim

    with claim(tmp_path, resume=False):
        result = Trainer(make_task(dropout=0.0), options(tmp_path, max_steps=2)).run()
    assert result.step == 2 and (tmp_path / "last").is_dir()


def test_a_runtime_handed_in_is_the_one_used(tmp_path):
    from qkv.distributed import SINGLE
    from qkv.runtime import Runtime

    runtime = Runtime.resolve("cpu", "fp32")
    assert runtime == Runtime(torch.device("cpu"), runtime.precision, SINGLE) and runtime.precision.dtype is None
    opts = options(tmp_path, max_steps=1, device="cuda:99")  # no machine has it: resolving it would fail
    with pytest.raises(ValueError, match="cuda:99"):
        Trainer(make_task(), opts)
    assert Trainer(make_task(), opts, runtime=runtime).device == torch.device("cpu")


def test_the_trainer_state_is_saved_and_restored_whole():
    from dataclasses import asdict

    from qkv.training import TrainState

    state = TrainState(step=14, epoch=1, batch_index=3, tokens_seen=5000, elapsed_s=61.5, eval_s=2.0,
                       best={"val_loss": 1.25, "step": 12})
    saved = {**asdict(state), "optimizer": {}, "scaler": {}, "torch_rng": torch.get_rng_state(), "rank_rngs": [],
             "cuda_rng": [], "options": {}}
    assert TrainState.saved(saved) == state
    # an earlier qkv's: no wall-clock or evaluation time yet, and {} for "no best"
    earlier = {"step": 6, "epoch": 0, "batch_index": 6, "tokens_seen": 900, "best": {}, "optimizer": {}}
    assert TrainState.saved(earlier) == TrainState(step=6, batch_index=6, tokens_seen=900)


@pytest.mark.parametrize("loss_at, saved", [(2, False), (7, True)])
def test_a_diverged_run_advises_resume_only_when_there_is_a_checkpoint(tmp_path, loss_at, saved):
    """--resume is refused without last/: the advice says it only when last/ is there, and names it."""
    task = _poisoned(make_task(dropout=0.0), loss_at=loss_at)
    with pytest.raises(FloatingPointError) as err:
        Trainer(task, options(tmp_path, max_steps=20)).run()
    message = str(err.value)
    assert (tmp_path / "last").exists() == saved
    assert ("then --resume" in message and str(tmp_path / "last") in message) == saved, message
    assert ("nothing was saved" in message and "without --resume" in message) != saved, message


class Killed(BaseException):
    """A kill -9 or a full disk at a chosen point of a save: nothing after it runs."""


def _failing_save(monkeypatch, *, name: str, step: int, after: bool):
    """Saves that stop the run at checkpoint ``name`` of ``step``: ``after`` its rename (a kill before the next
    write), or instead of it (a disk that filled up)."""
    import qkv.training

    real = qkv.training.save_checkpoint

    def save(directory, model, **kw):
        if (Path(directory).name, kw["meta"]["step"]) != (name, step):
            return real(directory, model, **kw)
        if after:
            real(directory, model, **kw)
        raise Killed

    monkeypatch.setattr(qkv.training, "save_checkpoint", save)


def test_a_kill_after_a_checkpoint_keeps_its_log_row_and_resumes_whole(tmp_path, monkeypatch):
    """The log's row is written before the checkpoints: killed right after last/ of step 8 was renamed into place,
    the run still has step 8's row, and the resumed run's log holds each evaluation once."""
    _failing_save(monkeypatch, name="last", step=8, after=True)
    with pytest.raises(Killed):
        Trainer(make_task(), options(tmp_path, max_steps=12)).run()
    assert [int(r["step"]) for r in log_rows(tmp_path, "val_loss")] == [4, 8]
    monkeypatch.undo()
    Trainer(make_task(), options(tmp_path, max_steps=12, resume=True)).run()
    assert [int(r["step"]) for r in log_rows(tmp_path, "val_loss")] == [4, 8, 12]


def test_a_best_checkpoint_cut_short_is_saved_again_on_resume(tmp_path, monkeypatch):
    """last/ is saved before best/: a disk that fills up on best/ of step 8 leaves last/ of step 8, which records
    step 8 as the best; the resumed run saves that model as best/ again, and it stays the best."""
    _failing_save(monkeypatch, name="best", step=8, after=False)
    scores = [{"val_loss": 2.0, "val_exact": 0.1}, {"val_loss": 1.0, "val_exact": 0.5}]
    with pytest.raises(Killed):
        Trainer(_scripted(make_task(dropout=0.0), scores), options(tmp_path, max_steps=12)).run()
    assert load_checkpoint(tmp_path / "best").meta["step"] == 4
    at_8 = load_checkpoint(tmp_path / "last").model.state_dict()
    monkeypatch.undo()
    worse = [{"val_loss": 3.0, "val_exact": 0.0}] * 2
    Trainer(_scripted(make_task(dropout=0.0), worse), options(tmp_path, max_steps=12, resume=True)).run()
    best = load_checkpoint(tmp_path / "best")
    assert best.meta["step"] == 8
    for name, tensor in best.model.state_dict().items():
        assert torch.equal(tensor, at_8[name]), name


def test_bf16_asked_for_on_a_cpu_without_native_bf16_is_warned_as_auto_would_say(tmp_path, monkeypatch, caplog):
    """``--precision bf16`` on a CPU that multiplies bf16 in software (several times slower than fp32) says so,
    with the words ``auto`` logs when it picks fp32 for that reason; on a CPU with native bf16 it says nothing."""
    import logging

    import qkv.training
    from qkv.device import NO_NATIVE_BF16, Precision
    from qkv.runtime import Runtime

    bf16 = Runtime(torch.device("cpu"), Precision("bf16", torch.bfloat16))
    for flag, warned in ((None, True), ("amx_bf16", False)):
        monkeypatch.setattr(qkv.training, "native_bf16", lambda flag=flag: flag)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="qkv"):
            Trainer(make_task(), options(tmp_path / str(flag), max_steps=1), runtime=bf16).run()
        notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("precision:")]
        assert notes == ([f"precision: bf16, as --precision asks, but {NO_NATIVE_BF16}: --precision auto (fp32 here) "
                          "trains faster"] if warned else []), notes


def test_a_validation_through_the_tasks_batches_moves_a_progress_bar(monkeypatch):
    """Each batch a task's evaluation goes through, its process's share included, moves the bar; the task's own
    valid_batches is back afterwards."""
    import tqdm

    from qkv.distributed import Group
    from qkv.training import _validation_bar

    bars = []

    class Bar:
        def __init__(self, **kw):
            self.kw, self.total, self.n, self.closed = kw, kw["total"], 0, False
            bars.append(self)

        def update(self, n):
            assert not self.closed
            self.n += n

        def refresh(self):
            pass

        def close(self):
            self.closed = True

    monkeypatch.setattr(tqdm, "tqdm", Bar)

    class Task:
        def valid_batches(self):
            return list(range(10))

        def evaluate(self, group):
            return [batch for batch in group.shard(self.valid_batches())]

    task, group = Task(), Group(rank=1, world=2, local_rank=1)
    with _validation_bar(task, show=True):
        assert task.evaluate(group) == [5, 6, 7, 8, 9]
    assert "valid_batches" not in vars(task) and task.valid_batches() == list(range(10))
    [bar] = bars
    assert (bar.kw["desc"], bar.total, bar.n, bar.closed) == ("validating", 5, 5, True)
    with _validation_bar(task, show=False):  # --no-progress, or not the first process
        task.evaluate(group)
    assert len(bars) == 1
