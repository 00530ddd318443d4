"""What the commands share: merging typed options with a stored run's, for ``--resume``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path


def settings(args: argparse.Namespace, defaults: dict, *, paths: Sequence[str] = ()) -> dict:
    """Defaults, then (with --resume) what the run stored, then what was typed now.

    Every option of a train command defaults to None in its parser, so typed options can be told from the
    rest. File options named in ``paths`` are stored absolute, so ``--resume`` works from any directory.
    """
    typed = {k: v for k, v in vars(args).items() if k in defaults and v is not None}
    for key in paths:
        if typed.get(key) is not None:
            value = typed[key]
            typed[key] = [str(Path(v).resolve()) for v in value] if isinstance(value, list) else str(
                Path(value).resolve())
    stored = {}
    if args.resume:
        from ..checkpoint import CheckpointError, resolve

        try:
            last = resolve(Path(args.out) / "last")
        except CheckpointError:
            raise ValueError(f"{args.out} has no checkpoint to resume; drop --resume to start a new run") from None
        stored = json.loads((last / "config.json").read_text(encoding="utf-8")).get("args", {})
    return {**defaults, **stored, **typed}


def refuse_to_overwrite(out: Path, resume: bool) -> None:
    """A new run never replaces a trained model."""
    if not resume and ((out / "last").exists() or (out / "best").exists()):
        raise ValueError(f"{out} already holds a trained model; pass --resume to continue it, or choose another --out")


def read_inputs(texts: list[str], input_file: str | None, what: str, *, keep_blank: bool = False) -> list[str]:
    """Sentences from the arguments, else ``--input FILE``, else stdin, one per line.

    ``keep_blank`` keeps every line as it is, so outputs stay line-aligned with the input (translation);
    otherwise lines are stripped and blank ones skipped.
    """
    from ..data import read_lines

    if texts and input_file:
        raise ValueError("give sentences as arguments or with --input, not both")
    if input_file:
        lines = read_lines(input_file)
    elif texts:
        lines = texts
    elif not sys.stdin.isatty():
        lines = sys.stdin.read().splitlines()
    else:
        lines = []
    if not any(line.strip() for line in lines):
        raise ValueError(f"nothing to {what}: give sentences as arguments, with --input FILE, or on stdin")
    return lines if keep_blank else [line.strip() for line in lines if line.strip()]
