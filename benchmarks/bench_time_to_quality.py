"""Time to a given validation quality: qkv's speedrun recipe against its classic one (and, for the language
model, a nanoGPT-shaped reference with nanoGPT's own CPU settings), one after the other on the same cores.

    python benchmarks/bench_time_to_quality.py [--task lm] [--minutes 4] [--budgets 1 2]
                                               [--targets 2.2 2.0 1.91 1.88 1.8]
                                               [--contenders nanogpt classic speedrun] [--json out.json]
    python benchmarks/bench_time_to_quality.py --task vit --minutes 30 --budgets 10 [--targets 0.85 0.88 0.9]
    python benchmarks/bench_time_to_quality.py --task swin ...

Each contender is its own process, run in turn for at most ``--minutes`` of wall-clock (counted, for every
contender alike, from the end of its imports: data reading, model building and validations included), and
validated at the same wall-clock marks (every ``--every`` seconds).
Printed: the seconds each needed to reach each target, and the ratio to the reference's (the first contender).

``--task lm``, tinyshakespeare's characters, validation loss on the last 10% of ``input.txt`` (as nanoGPT's
``prepare.py`` splits it): 200 windows spread evenly over it, about 13,000 characters, as nanoGPT's 20 batches of
12 × 64.

* nanogpt: nanoGPT's model as ``bench_train_step.py`` writes it (4 layers, 128 wide, 4 heads, context 64, the
  65 characters, tied embeddings, no biases, no dropout), initialised as nanoGPT does, with the settings of
  nanoGPT's README CPU recipe: batch 12, AdamW lr 1e-3 (β₂ 0.99, weight decay 0.1), 100 warmup steps, cosine
  to 1e-4 at 2,000 steps, gradient clipping at 1, random windows; it stops at 2,000 steps, as the recipe does.
* classic: ``qkv train lm --recipe classic --max-minutes M``: qkv's recipe before the speedrun one (the 4 × 256
  ``mini`` GPT, context 128, batch 32, AdamW, cosine over the budget).
* speedrun: ``qkv train lm --max-minutes M``: the default recipe (Muon, see ``qkv train lm --help``).
* moe: the speedrun recipe with each feed-forward network a mixture of 4 experts, each token through one
  (``--experts 4 --top-k 1``): the dense model's active parameters per token, four times its feed-forward weights.

``--task vit`` and ``--task swin``: Fashion-MNIST (Debian's ``dataset-fashion-mnist``), validation accuracy on
the 6,000 training images each run holds out, ``qkv train vit|swin --recipe classic|speedrun``.

The qkv recipes decay their learning rate over their budget (``--max-minutes``): a validation in the middle
of a long run is taken at the full rate, before the decay that brings most of the loss down. So each qkv
recipe also runs once for each of ``--budgets`` (minutes), and the quality at the end of such a run joins its
curve at the time it ended: what a user who asks for that budget gets. A target the reference does not reach
in its 2,000 steps is compared with the whole of its run: the ratio is then an upper bound ("<").

Nothing here is a test: the numbers depend on the machine, only the ratios travel.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare" / "input.txt"
EVAL_WINDOWS = 200


@dataclass(frozen=True)
class Task:
    """What ``--task`` trains and measures: ``qkv train`` + ``command``, the ``metric`` column of its log.csv
    (``lower``: lower is better), and the defaults of the other options."""

    command: tuple[str, ...]
    metric: str
    lower: bool
    targets: tuple[float, ...]
    minutes: float
    every: float
    budgets: tuple[float, ...]
    contenders: tuple[str, ...]


TASKS = {
    "lm": Task(("lm", "--eval-windows", str(EVAL_WINDOWS)), "val_loss", True, (2.2, 2.0, 1.91, 1.88, 1.8), 4.0,
               10.0, (1.0, 2.0), ("nanogpt", "classic", "speedrun")),
    "vit": Task(("vit", "--data", "fashion-mnist"), "val_accuracy", False, (0.8, 0.85, 0.88, 0.9), 10.0, 60.0, (5.0,),
                ("classic", "speedrun")),
    "swin": Task(("swin", "--data", "fashion-mnist"), "val_accuracy", False, (0.8, 0.85, 0.88, 0.9), 10.0, 60.0, (5.0,),
                 ("classic", "speedrun")),
}


# The qkv contenders: name -> qkv train's recipe and options
QKV_CONTENDERS = {"classic": ("classic",), "speedrun": ("speedrun",),
                  "moe": ("speedrun", "--experts", "4", "--top-k", "1")}


def qkv_run(task: Task, name: str, data: list[str], minutes: float, every: float | None,
            workdir: Path) -> list[tuple[float, float]]:
    """(seconds, quality) of ``qkv train`` as contender ``name`` runs it, read back from its log.csv: validated
    every ``every`` seconds, or (None) only at its end."""
    out = workdir / f"{name}-{minutes:g}"
    marks = [] if every is None else [round(every * i / 60, 4) for i in range(1, int(minutes * 60 / every) + 1)]
    recipe, *options = QKV_CONTENDERS[name]
    cmd = ["qkv", "train", *task.command, *data, "--recipe", recipe, *options, "--out", str(out), "--no-progress",
           "--max-minutes", str(minutes), "--eval-every", "1000000"]
    subprocess.run(cmd + (["--eval-at-minutes", *map(str, marks)] if marks else []), check=True,
                   stdout=subprocess.DEVNULL)
    with open(out / "log.csv", newline="") as f:
        return [(float(r["elapsed_s"]), float(r[task.metric])) for r in csv.DictReader(f) if r.get(task.metric)]


def nanogpt_run(text: Path, minutes: float, every: float) -> list[tuple[float, float]]:
    """nanoGPT's CPU recipe, written here (see the module's text); (seconds, validation loss) at each mark. Its
    clock starts where qkv's does: after the imports (torch's, and torch._dynamo, which an optimizer imports)."""
    import torch
    import torch._dynamo
    from bench_train_step import CONTEXT, VOCAB, ReferenceGPT, reference_optimizer, reference_update
    from torch import nn

    started = time.monotonic()

    chars = text.read_text(encoding="utf-8")
    ids = {c: i for i, c in enumerate(sorted(set(chars)))}
    if len(ids) > VOCAB:
        raise SystemExit(f"{text} has {len(ids)} distinct characters; the reference holds {VOCAB}")
    data = torch.tensor([ids[c] for c in chars])
    cut = int(0.9 * len(data))
    train, valid = data[:cut], data[cut:]
    torch.manual_seed(1337)
    model = ReferenceGPT()
    for name, p in model.named_parameters():  # nanoGPT's initialisation: N(0, 0.02), residual projections scaled
        if p.dim() == 2:
            std = 0.02 / math.sqrt(2 * len(model.blocks)) if name.endswith(("c_proj.weight", "mlp_proj.weight")) \
                else 0.02
            nn.init.normal_(p, 0.0, std)
    opt = reference_optimizer(model)
    starts = torch.linspace(0, len(valid) - CONTEXT - 1, EVAL_WINDOWS).long()
    windows = valid[starts[:, None] + torch.arange(CONTEXT + 1)]

    def lr(step: int) -> float:  # nanoGPT's get_lr with warmup_iters=100, lr_decay_iters=2000, min_lr=1e-4
        if step < 100:
            return 1e-3 * (step + 1) / 101
        return 1e-4 + 0.5 * (1 + math.cos(math.pi * min(1.0, (step - 100) / 1900))) * (1e-3 - 1e-4)

    results, next_mark, step = [], every, 0
    while step < 2000 and time.monotonic() - started < minutes * 60:
        for group in opt.param_groups:
            group["lr"] = lr(step)
        reference_update(model, opt, train)
        step += 1
        if time.monotonic() - started >= next_mark or step == 2000:
            model.eval()
            with torch.no_grad():
                val = sum(model(w[:, :-1], w[:, 1:]).item() for w in windows.split(20)) / (len(windows) // 20)
            model.train()
            results.append((time.monotonic() - started, val))
            next_mark = (results[-1][0] // every + 1) * every
    return results


def first_reached(curve: list[tuple[float, float]], target: float, lower: bool) -> float | None:
    return next((seconds for seconds, value in sorted(curve) if (value <= target if lower else value >= target)),
                None)


def best(curve: list[tuple[float, float]], lower: bool) -> float:
    return (min if lower else max)(value for _, value in curve)


def cell(seconds: float | None, base: float | None, bound: bool) -> str:
    """A contender's time to a target, with its ratio to the reference's (``bound``: the reference never got
    there, ``base`` is its whole run)."""
    if seconds is None:
        return "not reached"
    if base is None:
        return f"{seconds:.0f} s"
    return f"{seconds:.0f} s ({'< ' if bound else ''}{seconds / base:.2f}×)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="lm")
    parser.add_argument("--text", type=Path, default=TEXT, help="--task lm's text")
    parser.add_argument("--minutes", type=float, help="wall-clock budget of each contender (lm: 4, images: 10)")
    parser.add_argument("--every", type=float, help="seconds between validations (lm: 10, images: 60)")
    parser.add_argument("--budgets", type=float, nargs="*",
                        help="shorter budgets (minutes) each qkv recipe also runs, validated at their end "
                             "(lm: 1 2, images: 5)")
    parser.add_argument("--targets", type=float, nargs="+")
    parser.add_argument("--contenders", nargs="+", choices=["nanogpt", *QKV_CONTENDERS],
                        help="lm: nanogpt classic speedrun; images: classic speedrun")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", choices=["nanogpt"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    task = TASKS[args.task]
    if args.task == "lm" and not args.text.is_file():
        parser.error(f"--text {args.text}: no such file; pass tinyshakespeare's input.txt (../shared/data/...)")
    minutes = args.minutes if args.minutes is not None else task.minutes
    every = args.every if args.every is not None else task.every
    if args.child:
        print(json.dumps(nanogpt_run(args.text, minutes, every)))
        return
    contenders = args.contenders or list(task.contenders)
    if "nanogpt" in contenders and args.task != "lm":
        parser.error("the nanogpt reference trains the language model: --task lm")
    budgets = args.budgets if args.budgets is not None else list(task.budgets)
    targets = args.targets or list(task.targets)
    data = ["--text", str(args.text)] if args.task == "lm" else []
    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in contenders:
            if name == "nanogpt":
                out = subprocess.run([sys.executable, __file__, "--child", "nanogpt", "--text", str(args.text),
                                      "--minutes", str(minutes), "--every", str(every)],
                                     check=True, capture_output=True, text=True).stdout
                curves[name] = json.loads(out.splitlines()[-1])
            else:
                curves[name] = qkv_run(task, name, data, minutes, every, Path(tmp))
                for budget in budgets:
                    curves[name] += qkv_run(task, name, data, budget, None, Path(tmp))[-1:]
            print(f"{name}: {len(curves[name])} validations, best {best(curves[name], task.lower):.3f}",
                  file=sys.stderr, flush=True)
    reference = curves[contenders[0]]
    reference_end = max(seconds for seconds, _ in reference)
    what, sign = ("validation loss", "≤") if task.lower else ("validation accuracy", "≥")
    print(f"| {what} | " + " | ".join(contenders) + " |")
    print("|---" * (len(contenders) + 1) + "|")
    for target in targets:
        base = first_reached(reference, target, task.lower)
        bound = base is None and reference_end < minutes * 60 - every
        if bound:
            base = reference_end  # the reference's run (nanoGPT's 2,000 steps) ended early, short of the target
        cells = [cell(first_reached(curves[name], target, task.lower), None if i == 0 else base, bound)
                 for i, name in enumerate(contenders)]
        print(f"| {sign} {target} | " + " | ".join(cells) + " |")
    print("| best | " + " | ".join(f"{best(curves[n], task.lower):.3f}" for n in contenders) + " |")
    if args.json:
        args.json.write_text(json.dumps({"task": args.task, "minutes": minutes, "curves": curves}, indent=1))


if __name__ == "__main__":
    main()
