"""Time to a given validation loss on tinyshakespeare, characters: qkv's speedrun recipe, its classic one and a
nanoGPT-shaped reference with nanoGPT's own CPU settings, one after the other on the same cores.

    python benchmarks/bench_time_to_quality.py [--minutes 4] [--budgets 1 2] [--targets 2.2 2.0 1.91 1.88 1.8]
                                               [--contenders nanogpt classic speedrun] [--json out.json]

Each contender is its own process, run in turn for at most ``--minutes`` of wall-clock (its start-up, data
reading and validations included), and validated at the same wall-clock marks (every ``--every`` seconds) on
the same share of the validation text (the last 10% of ``input.txt``, as nanoGPT's ``prepare.py`` splits it):
200 windows spread evenly over it, about 13,000 characters, as nanoGPT's 20 batches of 12 × 64. Printed: the
seconds each needed to reach each target, and the ratio to the reference's.

* nanogpt: nanoGPT's model as ``bench_train_step.py`` writes it (4 layers, 128 wide, 4 heads, context 64, the
  65 characters, tied embeddings, no biases, no dropout), initialised as nanoGPT does, with the settings of
  nanoGPT's README CPU recipe: batch 12, AdamW lr 1e-3 (β₂ 0.99, weight decay 0.1), 100 warmup steps, cosine
  to 1e-4 at 2,000 steps, gradient clipping at 1, random windows; it stops at 2,000 steps, as the recipe does.
* classic: ``qkv train lm --recipe classic --max-minutes M``: qkv's recipe before the speedrun one (the 4 × 256
  ``mini`` GPT, context 128, batch 32, AdamW, cosine over the budget).
* speedrun: ``qkv train lm --max-minutes M``: the default recipe (Muon, see ``qkv train lm --help``).

The two qkv recipes decay their learning rate over their budget (``--max-minutes``): a validation in the middle
of a 4-minute run is taken at the full rate, before the decay that brings most of the loss down. So each qkv
recipe also runs once for each of ``--budgets`` (minutes), and the loss at the end of such a run joins its curve
at the time it ended: what a user who asks for that budget gets. A target the reference does not reach in its
2,000 steps is compared with the whole of its run: the ratio is then an upper bound ("<").

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
from pathlib import Path

TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare" / "input.txt"
CONTENDERS = ("nanogpt", "classic", "speedrun")
EVAL_WINDOWS = 200


def qkv_run(recipe: str, text: Path, minutes: float, every: float | None, workdir: Path) -> list[tuple[float, float]]:
    """(seconds, validation loss) of ``qkv train lm`` with ``recipe``, read back from its log.csv: validated every
    ``every`` seconds, or (None) only at its end."""
    out = workdir / f"{recipe}-{minutes:g}"
    marks = [] if every is None else [round(every * i / 60, 4) for i in range(1, int(minutes * 60 / every) + 1)]
    cmd = ["qkv", "train", "lm", "--recipe", recipe, "--text", str(text), "--out", str(out), "--no-progress",
           "--max-minutes", str(minutes), "--eval-every", "1000000", "--eval-windows", str(EVAL_WINDOWS)]
    subprocess.run(cmd + (["--eval-at-minutes", *map(str, marks)] if marks else []), check=True,
                   stdout=subprocess.DEVNULL)
    with open(out / "log.csv", newline="") as f:
        return [(float(r["elapsed_s"]), float(r["val_loss"])) for r in csv.DictReader(f) if r.get("val_loss")]


def nanogpt_run(text: Path, minutes: float, every: float) -> list[tuple[float, float]]:
    """nanoGPT's CPU recipe, written here (see the module's text); (seconds, validation loss) at each mark."""
    started = time.monotonic()
    import torch
    from bench_train_step import CONTEXT, VOCAB, ReferenceGPT, reference_optimizer, reference_update
    from torch import nn

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


def first_reached(curve: list[tuple[float, float]], target: float) -> float | None:
    return next((seconds for seconds, loss in sorted(curve) if loss <= target), None)


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
    parser.add_argument("--text", type=Path, default=TEXT)
    parser.add_argument("--minutes", type=float, default=4.0, help="wall-clock budget of each contender")
    parser.add_argument("--every", type=float, default=10.0, help="seconds between validations")
    parser.add_argument("--budgets", type=float, nargs="*", default=[1.0, 2.0],
                        help="shorter budgets (minutes) each qkv recipe also runs, validated at their end")
    parser.add_argument("--targets", type=float, nargs="+", default=[2.2, 2.0, 1.91, 1.88, 1.8])
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", choices=["nanogpt"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(nanogpt_run(args.text, args.minutes, args.every)))
        return
    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.contenders:
            if name == "nanogpt":
                out = subprocess.run([sys.executable, __file__, "--child", "nanogpt", "--text", str(args.text),
                                      "--minutes", str(args.minutes), "--every", str(args.every)],
                                     check=True, capture_output=True, text=True).stdout
                curves[name] = json.loads(out.splitlines()[-1])
            else:
                curves[name] = qkv_run(name, args.text, args.minutes, args.every, Path(tmp))
                for budget in args.budgets:
                    curves[name] += qkv_run(name, args.text, budget, None, Path(tmp))[-1:]
            best = min(loss for _, loss in curves[name])
            print(f"{name}: {len(curves[name])} validations, best {best:.3f}", file=sys.stderr, flush=True)
    reference = curves.get("nanogpt")
    print("| validation loss | " + " | ".join(args.contenders) + " |")
    print("|---" * (len(args.contenders) + 1) + "|")
    for target in args.targets:
        base = first_reached(reference, target) if reference else None
        bound = base is None and bool(reference) and reference[-1][0] < args.minutes * 60
        if bound:
            base = reference[-1][0]  # its 2,000 steps ended before the budget, above the target
        cells = [cell(first_reached(curves[name], target), None if name == "nanogpt" else base, bound)
                 for name in args.contenders]
        print(f"| ≤ {target} | " + " | ".join(cells) + " |")
    print("| best | " + " | ".join(f"{min(loss for _, loss in curves[n]):.3f}" for n in args.contenders) + " |")
    if args.json:
        args.json.write_text(json.dumps({"minutes": args.minutes, "curves": curves}, indent=1))


if __name__ == "__main__":
    main()
