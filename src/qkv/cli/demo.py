"""``qkv demo``: the README's main job (see :mod:`qkv.tasks.demo`)."""

from __future__ import annotations

import argparse

from .common import add_device_arguments, command
from .numbers import POSITIVE, SEED


def demo(args: argparse.Namespace) -> None:
    from ..tasks.demo import run_demo

    run_demo(out=args.out, minutes=args.minutes, seed=args.seed, progress=not args.no_progress, device=args.device,
             precision=args.precision, compile=args.compile)


def add_commands(sub) -> None:
    p = command(sub, "demo", "train an English->Chinese date and number translator in about three minutes, score "
                             "it on held-out pairs and draw its cross-attention")
    p.add_argument("--out", default="runs/demo", help="run directory (default runs/demo; a new one if it holds a "
                                                      "model)")
    p.add_argument("--minutes", type=POSITIVE, default=2.5, help="training budget in minutes (default 2.5)")
    p.add_argument("--seed", type=SEED, default=0)
    p.add_argument("--no-progress", action="store_true")
    add_device_arguments(p)
    p.set_defaults(run=demo)
