"""Running ``qkv`` in a subprocess, as a user would, and checking how it ends."""

import gzip
import os
import subprocess
import sys
from pathlib import Path

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# The smallest models the command-line tests train: seconds each on 2 cores.
TRANSLATION_TINY = ["--d-model", "32", "--n-heads", "2", "--n-layers", "1", "--d-ff", "64", "--vocab-size", "300",
                    "--batch-tokens", "800", "--eval-every", "3", "--bleu-samples", "10", "--no-progress",
                    "--warmup", "2"]
LM_TINY = ["--preset", "tiny", "--d-model", "32", "--n-heads", "2", "--n-layers", "1", "--context", "32",
           "--batch-size", "4", "--eval-every", "3", "--warmup", "2", "--no-progress"]
# ../shared/data beside the project (QKV_DATA overrides)
DATA = Path(os.environ.get("QKV_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


def gz_lines(path: Path, n: int) -> list[str]:
    """The first ``n`` lines of a gzipped text file."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read().splitlines()[:n]


def command(*args) -> list[str]:
    return [sys.executable, "-m", "qkv.cli", *map(str, args)]


# How long a subprocess of a test may run before it counts as hung: far beyond any test's time on a loaded machine
# (the slowest take seconds on quiet cores), so a slow machine never fails a test on time; pytest's own timeout
# (pyproject.toml) is the same.
HANG = 600
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg"}


def qkv(*args, cwd: Path, input: str | None = None, **popen) -> subprocess.CompletedProcess:
    """Run ``qkv ARGS`` to the end; ``popen`` as for subprocess.run (e.g. a ``preexec_fn``)."""
    if input is None:
        popen.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.run(command(*args), cwd=cwd, env=ENV, input=input, capture_output=True, text=True, timeout=HANG,
                          **popen)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    return proc


def last_line_error(proc: subprocess.CompletedProcess, *phrases: str, status: int = 2) -> str:
    """A command that logs as it works and then fails: exit ``status``, no traceback, and the last line of stderr
    is the one-line error saying each of ``phrases``."""
    assert proc.returncode == status, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("qkv ") and ": error: " in last, last
    for phrase in phrases:
        assert phrase in last, last
    return last


def one_line_error(proc: subprocess.CompletedProcess, *phrases: str) -> str:
    """Non-zero exit, exactly one line on stderr, starting with "qkv", saying each of ``phrases``."""
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("qkv"), lines[0]
    for phrase in phrases:
        assert phrase in lines[0], lines[0]
    return lines[0]


def recipe_settings(recipe_cls, command: str, **typed) -> dict:
    """The settings a recipe class gives for what was typed (None: not typed), as ``qkv train`` merges them."""
    import argparse

    from qkv.recipes.settings import merged_settings

    args = argparse.Namespace(out="run", resume=False, **typed)
    recipe = recipe_cls(args)
    return merged_settings(args, recipe.defaults(), command=command, recipes=recipe.recipes())
