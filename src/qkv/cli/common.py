"""What the commands share: merging typed options with a stored run's, for ``--resume``."""

from __future__ import annotations

import argparse
import json
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
