"""``qkv demo``: the notes' running example, end to end: 900 training steps, 2–4 minutes on two quiet CPU cores.

English dates and numbers are translated into Chinese ("March 3, 2021" -> "2021年3月3日", "four hundred and
twelve" -> "四百一十二"). The corpus is generated (see :mod:`qkv.tasks.dates_numbers`), so the demo needs no
download; the year moves from the end to the front, so the cross-attention map shows real reordering.

The source is split into words (a small BPE vocabulary ends up word-level on this text, with digits one by one)
and the target into characters. Training runs for a budget of steps (:data:`STEPS`), its learning rate decaying
along a cosine over them (an early stop at a validation score fired before the one-word numbers, which
validation cannot hold, were learnt), so the model does not depend on the machine's speed: a busy machine takes
longer for the same model. A time limit (``max_minutes``) is there if wanted; a run it cuts short says so. The
checkpoint with the best validation exact match (ties to the lower validation loss) is then scored on 1,000 test
pairs never seen in training, overall and per kind of pair (small numbers, round numbers, each date style, ...:
see :data:`qkv.tasks.dates_numbers.KINDS`), so a kind the model has not learnt shows up even when it is a small
share of the test set; every printed sample is checked against :func:`qkv.tasks.dates_numbers.to_chinese`, and a
model below :data:`GOOD_ENOUGH` is called undertrained, not offered.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ..config import TransformerConfig
from ..device import device_of
from ..metrics import Score, bleu
from ..models import Transformer
from ..options import STEPS
from ..tokenizers import BPETokenizer, CharTokenizer
from ..training import Trainer, TrainOptions
from ..viz import attention_heatmap
from .dates_numbers import KINDS, kind_of, to_chinese, train_test_split
from .translation import ParallelData, TranslationTask, cross_attention, translate

log = logging.getLogger(__name__)

EXAMPLES = ["March 3, 2021", "eleven", "twelve", "twenty", "one", "four hundred and twelve", "five thousand",
            "ninety-nine thousand nine hundred and ninety-nine", "the 21st of December, 1999", "4 July 1976",
            "Jul 4, 1976", "May 17th, 1990"]
"""The samples printed after training: what a new user types first (small and round numbers), a large number,
and several date styles. The first one is drawn as the cross-attention map: its year moves to the front."""

GOOD_ENOUGH = 0.95
"""Below this exact match on the test pairs the demo says the model is undertrained instead of offering it."""


class DemoTask(TranslationTask):
    """Translation, with the best checkpoint chosen by exact match (every character right)."""

    selection_metric = "val_exact"


def _free_directory(out: Path) -> Path:
    """``out``, or ``out-2``, ``out-3``, ... if a model is already there: a rerun never overwrites one."""
    candidate, n = out, 1
    while (candidate / "best").exists() or (candidate / "last").exists():
        n += 1
        candidate = out.with_name(f"{out.name}-{n}")
    if candidate != out:
        log.info("%s already holds a model; this run goes to %s", out, candidate)
    return candidate


def exact_match_per_kind(sources: Sequence[str], hyps: Sequence[str], references: Sequence[str]
                         ) -> dict[str, tuple[int, float]]:
    """Exact match of each kind of pair present, in the order of ``KINDS``: ``{kind: (pairs, accuracy)}``.

    Raises:
        ValueError: if a source is no English side of the corpus (see :func:`kind_of`).
    """
    counts: dict[str, list[int]] = {}
    for source, hyp, ref in zip(sources, hyps, references, strict=True):
        tally = counts.setdefault(kind_of(source), [0, 0])
        tally[0] += 1
        tally[1] += hyp == ref
    return {kind: (counts[kind][0], counts[kind][1] / counts[kind][0]) for kind in KINDS if kind in counts}


def _check_budget(steps: int, max_minutes: float | None) -> None:
    """Refuse a budget that is no budget, before any work is done."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a whole number >= 1, got {steps!r}")
    # nan passes a "minutes <= 0" check and would train for ever: test what is allowed, not what is not.
    if max_minutes is not None and not (math.isfinite(max_minutes) and max_minutes > 0):
        raise ValueError(f"max_minutes must be a finite number > 0, got {max_minutes!r}")


def _task(seed: int) -> tuple[DemoTask, list[tuple[str, str]]]:
    """The generated corpus, its tokenizers and a new model: (the task, the test pairs)."""
    train_pairs, held_out = train_test_split(30_000, 1_500, seed=seed)
    valid_pairs, test_pairs = held_out[:500], held_out[500:]
    tokenizers = {
        "src": BPETokenizer.train([p[0] for p in train_pairs], vocab_size=200, min_frequency=1),
        "tgt": CharTokenizer.train([p[1] for p in train_pairs]),
    }
    train = ParallelData.encode(train_pairs, tokenizers, max_len=64, name="train")
    valid = ParallelData.encode(valid_pairs, tokenizers, max_len=64, name="valid")
    cfg = TransformerConfig(
        src_vocab_size=tokenizers["src"].vocab_size, tgt_vocab_size=tokenizers["tgt"].vocab_size, d_model=128,
        n_heads=4, n_layers=2, d_ff=256, dropout=0.0, max_seq_len=64,
    )
    model = Transformer(cfg)
    log.info("demo: %d training pairs, e.g. %r -> %r; model %.2fM parameters", len(train), *train_pairs[0],
             model.num_parameters() / 1e6)
    task = DemoTask(model, tokenizers, train, valid, batch_tokens=2500, seed=seed, label_smoothing=0.0,
                    bleu_samples=len(valid), target_language="zh", meta={"title": "demo en→zh"})
    return task, test_pairs


def _marked(source: str, hyp: str, reference: str, width: int) -> str:
    """A translation's line, with the reference beside it when the translation is wrong."""
    return f"  {source:{width}s} -> {hyp}" + ("" if hyp == reference else f"   WRONG: should be {reference}")


def _print_samples(model, tokenizers, sources: Sequence[str], hyps: Sequence[str], references: Sequence[str]) -> None:
    """The :data:`EXAMPLES`, then three held-out misses; every wrong translation marked."""
    print("\nsamples:")
    for source, hyp in zip(EXAMPLES, translate(model, tokenizers, EXAMPLES), strict=True):
        print(_marked(source, hyp, to_chinese(source), 52))
    misses = [(s, h, r) for s, h, r in zip(sources, hyps, references, strict=True) if h != r][:3]
    if misses:
        print("held-out pairs it gets wrong:")
    for source, hyp, reference in misses:
        print(_marked(source, hyp, reference, 52))


def _print_test(sources: Sequence[str], hyps: Sequence[str], references: Sequence[str]
                ) -> tuple[float, Score, dict[str, tuple[int, float]]]:
    """The test pairs' exact match and BLEU, overall and per kind: (exact match, BLEU, per kind)."""
    exact = sum(h == r for h, r in zip(hyps, references, strict=True)) / len(references)
    score = bleu(hyps, references, language="zh")
    print(f"held-out test ({len(references)} pairs never seen in training): exact match {exact:.1%}, {score}")
    per_kind = exact_match_per_kind(sources, hyps, references)
    print(f"  {'kind':16s} {'pairs':>5s}  exact match")
    for kind, (pairs, accuracy) in per_kind.items():
        print(f"  {kind:16s} {pairs:5d}  {accuracy:11.1%}")
    return exact, score, per_kind


def _verdict(exact: float, step: int, steps: int, stopped_because: str, out: Path) -> str:
    """The closing line: what went short, or what to try with the model."""
    if step < steps:
        if stopped_because == "time budget reached":
            return (f"stopped by --max-minutes after {step} of {steps} steps: the result is not the demo's; rerun "
                    "without --max-minutes")
        return f"{stopped_because} after {step} of {steps} steps: the result is not the demo's; rerun it to the end"
    if exact < GOOD_ENOUGH:
        advice = f"rerun with the default --steps {STEPS}" if steps < STEPS else f"train longer (--steps {2 * steps})"
        return (f"the model is undertrained ({exact:.1%} exact match, where the demo's {STEPS} steps reach 99%): "
                f"{advice} before using it")
    return f"try: qkv translate --model {out} \"May 17, 1990\" --attention a.png"


def run_demo(*, out: str | Path = "runs/demo", steps: int = STEPS, max_minutes: float | None = None, seed: int = 0,
             progress: bool = True, device: str = "cpu", precision: str = "fp32", compile: bool = False) -> dict:
    """Generate the corpus, train, evaluate on held-out pairs, print samples, draw the attention map.

    Args:
        out: where the model goes (``out-2``, ``out-3``, ... if a model is already there).
        steps: training budget in optimizer steps: the learning rate decays over them, and the result does not
            depend on the machine's speed.
        max_minutes: an optional wall-clock limit, the final evaluation and test scoring included; a run it cuts
            short says so.
        seed: seeds the corpus, the initialisation and the batch order.
        progress: show a progress bar (steps, their rate and the time left).
        device, precision: where and how to train and translate (see :mod:`qkv.device`).
        compile: torch.compile the model for training.

    Returns:
        the test numbers: ``{"exact_match", "bleu", "train_minutes", "steps", "completed", "signal",
        "per_kind"}``, ``completed`` saying whether all ``steps`` were trained, ``signal`` the signal that stopped
        training (None if none did), ``per_kind`` mapping each kind of pair to its exact match.

    Raises:
        ValueError: if ``steps`` is no whole number >= 1 or ``max_minutes`` no finite number above zero (checked
            before any work is done).
    """
    _check_budget(steps, max_minutes)
    out = _free_directory(Path(out))
    torch.manual_seed(seed)  # before the model is built: the same seed, the same run
    start = time.monotonic()
    task, test_pairs = _task(seed)
    model = task.model
    # The test set is twice the validation set: its scoring, after training, is reserved under --max-minutes.
    opts = TrainOptions(out=str(out), max_steps=steps, max_minutes=max_minutes, lr=1.5e-3, warmup=150,
                        schedule="cosine", min_lr_ratio=0.05, eval_every=100, seed=seed, progress=progress,
                        device=device, precision=precision, compile=compile,
                        final_scoring=len(test_pairs) / len(task.valid), started=start)
    result = Trainer(task, opts).run()
    train_minutes = (time.monotonic() - start) / 60

    from ..checkpoint import load_checkpoint

    best = load_checkpoint(out / "best")
    best.model.to(device_of(model))  # where training left the model
    sources, references = [p[0] for p in test_pairs], [p[1] for p in test_pairs]
    hyps = translate(best.model, best.tokenizers, sources)
    print(f"\ntrained {result.step} of {steps} steps in {train_minutes:.1f} min ({result.stopped_because}); "
          f"{model.num_parameters() / 1e6:.2f}M parameters")
    exact, score, per_kind = _print_test(sources, hyps, references)
    _print_samples(best.model, best.tokenizers, sources, hyps, references)
    example = EXAMPLES[0]
    target = best.tokenizers["tgt"].encode(translate(best.model, best.tokenizers, [example])[0])
    weights, tgt_labels, src_labels = cross_attention(best.model, best.tokenizers, example, target)
    heatmap = attention_heatmap(weights, tgt_labels, src_labels, out / "attention.png",
                                title=f"cross-attention (last layer, mean of heads): {example}")
    print(f"\ncross-attention map: {heatmap}\nloss curve: {out / 'loss.png'}\nthe model: {out / 'best'}")
    print(_verdict(exact, result.step, steps, result.stopped_because, out))
    return {"exact_match": exact, "bleu": score.score, "train_minutes": train_minutes, "steps": result.step,
            "completed": result.step >= steps, "signal": result.signal,
            "per_kind": {kind: accuracy for kind, (_, accuracy) in per_kind.items()}}
