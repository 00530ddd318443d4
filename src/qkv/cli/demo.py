"""``qkv demo``: the README's main job (see :mod:`qkv.tasks.demo`).

The budget is in steps, so the result is the same on a slow machine as on a fast one; ``--max-minutes`` only
bounds the time, and says so when it cuts the run short.
"""

from __future__ import annotations

import argparse

from ..options import STEPS, STEPS_MINUTES
from .common import add_device_arguments, command
from .numbers import COUNT, POSITIVE, SEED


def demo(args: argparse.Namespace) -> int:
    """The demo; exit status 128 + the signal that stopped its training (130 for Ctrl-C), as ``qkv train``."""
    from ..tasks.demo import run_demo

    result = run_demo(out=args.out, steps=args.steps, max_minutes=args.max_minutes, seed=args.seed,
                      progress=not args.no_progress, device=args.device, precision=args.precision,
                      compile=args.compile)
    return 0 if result["signal"] is None else 128 + result["signal"]


def add_commands(sub) -> None:
    p = command(sub, "demo", f"train an English->Chinese date and number translator ({STEPS} steps, about "
                             f"{STEPS_MINUTES} minutes on two quiet CPU cores), score it on held-out pairs and draw "
                             "its cross-attention")
    p.add_argument("--out", default="runs/demo", help="run directory (default runs/demo; a new one if it holds a "
                                                      "model)")
    p.add_argument("--steps", type=COUNT, default=STEPS,
                   help=f"training budget in optimizer steps (default {STEPS}: >= 99%% exact match on the test "
                        f"pairs; about {STEPS_MINUTES} minutes on two quiet CPU cores, longer on busy ones: the "
                        "model is the same)")
    p.add_argument("--max-minutes", type=POSITIVE,
                   help="stop after this many minutes even if the steps are not done (default: no limit); a run "
                        "cut short says so, and its model is not the demo's")
    p.add_argument("--seed", type=SEED, default=0)
    p.add_argument("--no-progress", action="store_true")
    add_device_arguments(p)
    p.set_defaults(run=demo)
