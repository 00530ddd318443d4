"""qkv's small files: reading JSON or text with a one-line error that names the file, and writing a file whole.

Configs, tokenizers and the side files of other projects' model folders are small JSON files. Each reader
wants the same thing of them: the value, or one ``ValueError`` that names the file and says what is wrong
with it, so that the CLI can print it as one line instead of a traceback.

Files a run writes beside its checkpoints (the log, the loss curve, pictures, the held-out test set) are
written by :func:`write_atomically`: into a new file of a random name in the same folder, then renamed over
the name. A reader never sees half a file, and a name that is a symbolic link is replaced by the file, never
written through (the rename replaces the link itself, and the new file is created with ``O_EXCL``). The
temporary name, ``.NAME.PID.RANDOM.tmp`` (:func:`scratch_beside`), says which process made it: one left by a
process that was killed while writing is removed by the next write of that name. What is written gets the
modes the umask gives a new file or folder (``tempfile`` makes them private), so a file exported for another
program (a llama.cpp server running as another user) can be read as any other file there.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Python type -> its name in JSON, for "expected a JSON object, got a JSON array".
_JSON_NAMES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


def read_json(path: str | os.PathLike, *, expect: type = dict, required: bool = True) -> Any:
    """The value stored in the JSON file ``path``.

    Example:
        >>> read_json("run/last/config.json")["arch"]  # doctest: +SKIP
        'gpt'

    Args:
        path: the file.
        expect: the Python type the top-level value must have (``dict`` for a JSON object, ``list`` for an
            array, ...).
        required: if False, a missing file is not an error and gives ``expect()`` (an empty dict or list).

    Returns:
        The parsed value, an instance of ``expect``.

    Raises:
        ValueError: ``"cannot read {path}: {reason}"``, one line, for a missing file (when ``required``), a
            file that cannot be read or is not UTF-8, text that is not JSON, or a top-level value that is not
            an ``expect``.
    """
    path = Path(path)
    if not path.exists() and not required:
        return expect()
    text = read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"cannot read {path}: not valid JSON ({err})") from None
    except RecursionError:  # json's parser recurses once per level of nesting
        raise ValueError(f"cannot read {path}: not valid JSON (nested too deeply)") from None
    if not isinstance(data, expect):
        expected = _JSON_NAMES.get(expect, expect.__name__)
        actual = _JSON_NAMES.get(type(data), type(data).__name__)
        raise ValueError(f"cannot read {path}: expected a JSON {expected}, got a JSON {actual}")
    return data


def read_text(path: str | os.PathLike, *, max_bytes: int | None = None) -> str:
    """The UTF-8 text of ``path``; with ``max_bytes``, a regular file of at most that size (never a device or a
    pipe, which can be endless: ``/dev/zero``).

    Raises:
        ValueError: ``"cannot read {path}: {reason}"``, one line, for a missing file, one that cannot be read or
            is not UTF-8, or (``max_bytes``) one that is not a regular file or is larger.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"cannot read {path}: no such file")
    if max_bytes is not None:
        if not path.is_file():
            raise ValueError(f"cannot read {path}: not a regular file")
        if path.stat().st_size > max_bytes:
            raise ValueError(f"cannot read {path}: {path.stat().st_size:,} bytes, more than the {max_bytes:,} it may "
                             "hold")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"cannot read {path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:  # a folder, no permission, ...: strerror says which without repeating the path
        raise ValueError(f"cannot read {path}: {err.strerror or err}") from None


def quoted(value: Any, limit: int = 80) -> str:
    """``repr(value)`` as a one-line error quotes a user's input: its first ``limit`` characters, and its length
    where it is longer (a 2 MB string must not make a 2 MB error line)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def scratch_beside(path: Path, *, folder: bool = False) -> Path:
    """A new, empty file (or folder) beside ``path`` for this process to write, ``.NAME.PID.RANDOM.tmp``, made
    exclusively (never through a link). Those of the same name left by processes no longer running are removed
    first."""
    prefix = f".{path.name}."
    for old in path.parent.glob(f"{glob.escape(prefix)}*.tmp"):
        pid = old.name[len(prefix) :].split(".", 1)[0]
        if pid.isdigit() and not _running(int(pid)):
            with contextlib.suppress(OSError):
                shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
    if folder:
        return Path(tempfile.mkdtemp(dir=path.parent, prefix=f"{prefix}{os.getpid()}.", suffix=".tmp"))
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{prefix}{os.getpid()}.", suffix=".tmp")
    os.close(fd)
    return Path(tmp)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _umask() -> int:
    """The process's umask: from /proc (Linux), else by setting it, briefly to 0o077, so that a file another
    thread creates meanwhile is, if anything, more private."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def as_umask_gives(path: Path) -> None:
    """``path`` (a file, or a folder and everything in it) with the modes the umask gives new ones."""
    mask = _umask()
    for item in [path, *(path.rglob("*") if path.is_dir() else ())]:
        if not item.is_symlink():
            os.chmod(item, (0o777 if item.is_dir() else 0o666) & ~mask)


def write_atomically(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """``write(tmp)`` into a new file beside ``path``, then rename it to ``path`` (see the module's text).

    Example:
        >>> write_atomically("run/loss.png", lambda tmp: fig.savefig(tmp, format="png"))  # doctest: +SKIP
    """
    path = Path(path)
    tmp = scratch_beside(path)
    try:
        write(tmp)
        as_umask_gives(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


__all__ = ["as_umask_gives", "quoted", "read_json", "read_text", "scratch_beside", "write_atomically"]
