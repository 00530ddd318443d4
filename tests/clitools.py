"""Running ``qkv`` in a subprocess, as a user would, and checking how it ends."""

import gzip
import os
import subprocess
import sys
from pathlib import Path

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# ../shared/data beside the project (QKV_DATA overrides)
DATA = Path(os.environ.get("QKV_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


def gz_lines(path: Path, n: int) -> list[str]:
    """The first ``n`` lines of a gzipped text file."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read().splitlines()[:n]


def qkv(*args, cwd: Path, input: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, "-m", "qkv.cli", *map(str, args)], cwd=cwd, env=env, input=input,
                          stdin=subprocess.DEVNULL if input is None else None, capture_output=True, text=True,
                          timeout=300)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    return proc


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
