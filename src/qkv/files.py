"""qkv's small files: reading JSON or text with a one-line error that names the file, and writing a file whole.

Configs, tokenizers and the side files of other projects' model folders are small JSON files. Each reader
wants the same thing of them: the value, or one ``ValueError`` that names the file and says what is wrong
with it, so that the CLI can print it as one line instead of a traceback. A user's larger data file is read by
:func:`read_bounded`: a regular file only, gzip or not, within a size and a line length checked as it streams.

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
import gzip
import hashlib
import json
import os
import shutil
import stat
import tempfile
import zlib
from collections.abc import Callable, Iterable
from errno import ENOSPC
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
    remove_stale_scratch(path.parent, path.name)
    if folder:
        return Path(tempfile.mkdtemp(dir=path.parent, prefix=f"{prefix}{os.getpid()}.", suffix=".tmp"))
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{prefix}{os.getpid()}.", suffix=".tmp")
    os.close(fd)
    return Path(tmp)


def remove_stale_scratch(folder: Path, name: str | None = None) -> None:
    """Remove the scratch files and folders (:func:`scratch_beside`) in ``folder`` that processes no longer running
    left, of ``name`` or of any name."""
    pattern = f".{glob.escape(name)}.*.tmp" if name is not None else ".*.*.tmp"
    for old in folder.glob(pattern):
        pid = old.name.rsplit(".", 3)[-3]  # .NAME.PID.RANDOM.tmp, NAME may hold dots, RANDOM none
        if pid.isdigit() and not _running(int(pid)):
            _remove(old)


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


def write_atomically(path: str | os.PathLike, write: Callable[[Path], object], *, folder: bool = False) -> Path:
    """``write(tmp)`` into a new file (``folder``: a new folder) beside ``path``, then rename it to ``path`` (see
    the module's text). The one writer of whole files and folders: a run's log and pictures, checkpoints, exports.

    A folder's files are flushed to the disk before the rename, so a crash leaves the old folder or the new one,
    never a new name over half-written files. A folder already at ``path`` is first renamed ``.NAME.old`` and
    removed once the new one is in place; a crash between the two renames leaves ``.NAME.old`` for the reader
    (:func:`qkv.checkpoint.resolve`) and the next run (:func:`qkv.rundir.claim`) to take back.

    Example:
        >>> write_atomically("run/loss.png", lambda tmp: fig.savefig(tmp, format="png"))  # doctest: +SKIP

    Raises:
        OSError: ``"cannot write {path}: {reason}"``, one line naming ``path`` (a full disk: "No space left on
            device"), whatever error type ``write`` met (safetensors reports a full disk as its own); nothing is
            left beside ``path`` and what was at ``path`` is as it was.
    """
    path = Path(path)
    tmp = scratch_beside(path, folder=folder)
    try:
        write(tmp)
        as_umask_gives(tmp)
        if folder:
            _flush(tmp)
            _replace_folder(tmp, path)
        else:
            os.replace(tmp, path)
    except (ValueError, TypeError):  # what ``write`` refuses, said by it
        _remove(tmp)
        raise
    except Exception as err:
        _remove(tmp)
        raise OSError(f"cannot write {path}: {_reason(err)}") from None
    except BaseException:
        _remove(tmp)
        raise
    return path


def _replace_folder(tmp: Path, path: Path) -> None:
    old = path.parent / f".{path.name}.old"
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


def _flush(folder: Path) -> None:
    for item in folder.rglob("*"):
        if item.is_file() and not item.is_symlink():
            with open(item, "rb") as handle:
                os.fsync(handle.fileno())


def _reason(err: BaseException) -> str:
    """What went wrong, in words and one line: a full disk said so whichever library met it (safetensors says
    "3145728 requested and 687728 written"; torch.save, "unexpected pos"), else the error's first line."""
    errno_ = getattr(err, "errno", None)
    text = (getattr(err, "strerror", None) or str(err)).strip()
    if errno_ == ENOSPC or "No space left" in text or " requested and " in text:
        return "No space left on device; free some space and run it again"
    return text.splitlines()[0] if text else type(err).__name__


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a file's bytes, hex: about 0.1 s for 100 MB, little beside reading the weights."""
    digest = hashlib.sha256()  # hashlib.file_digest needs Python 3.11
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def check_finite(tensors: Iterable[tuple[str, Any]], holder: str, advice: str) -> None:
    """Refuse weights that are NaN or infinite: a model holding one outputs garbage, or NaN everywhere.

    Args:
        tensors: (name, tensor) pairs; only floating-point tensors are checked, one at a time.
        holder: what holds them, for the message (``"model.safetensors holds"``).
        advice: what to do instead.

    Raises:
        ValueError: naming the first tensor that is not finite.
    """
    bad = [name for name, tensor in tensors if tensor.is_floating_point() and not all_finite(tensor)]
    if bad:
        raise ValueError(f"{holder} weights that are not finite (NaN or Inf) in {len(bad)} tensor(s), e.g. "
                         f"{bad[0]}: {advice}")


def all_finite(tensor: Any) -> bool:
    """Whether every element of a floating-point tensor is finite. A NaN or an infinity makes the sum NaN or
    infinite, so a finite sum settles it in one cheap pass; only a sum that overflowed (or a real NaN) needs the
    element-wise look."""
    return bool(tensor.sum().isfinite()) or bool(tensor.isfinite().all())


def check_out(out: Path, what: str) -> None:
    """``out`` must not exist, or (a folder) be empty: an export never overwrites anything."""
    if out.is_symlink() or (out.exists() and not (out.is_dir() and what == "folder" and not any(out.iterdir()))):
        raise ValueError(f"{out} exists; give --out a new {what} (an export never overwrites)")
    if not out.parent.is_dir():
        raise ValueError(f"{out.parent} is not a folder; create it first")


GZIP_MAGIC = b"\x1f\x8b"  # how every gzip stream begins: no UTF-8 text begins so (0x8b continues a character)
_PIECE = 1 << 20  # bytes read at a time


def read_bounded(path: str | os.PathLike, *, max_bytes: int, max_line: int) -> bytes:
    """The bytes of the regular file ``path``, decompressed where they are gzip (told by their first bytes, not by
    the name), read a piece at a time and refused as soon as they pass ``max_bytes`` (after decompression) or hold a
    line longer than ``max_line`` bytes: an endless file or a gzip bomb stops at the bound, never held whole.

    A FIFO, a device or a socket is refused from its ``os.stat``, before it is opened: opening a FIFO that nothing
    writes to waits forever, and a device (``/dev/zero``) never ends.

    Raises:
        ValueError: ``"cannot read {path}: {reason}"``, one line: no such file, not a regular file, unreadable, a
            broken gzip stream, more than ``max_bytes`` bytes, or a line (numbered) longer than ``max_line``.
    """
    path = Path(path)
    _check_regular(path)
    try:
        # O_NONBLOCK: a FIFO put in the file's place since the check must not block the open either
        with os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as f:
            _check_regular(path, os.fstat(f.fileno()))
            stream = gzip.GzipFile(fileobj=f) if f.peek(2)[:2] == GZIP_MAGIC else f
            return _read_within(stream, path, max_bytes, max_line)
    except (EOFError, zlib.error, gzip.BadGzipFile) as err:  # a truncated or corrupt gzip stream
        raise ValueError(f"cannot read {path}: a broken gzip stream ({err})") from None
    except OSError as err:  # no permission, ...: strerror says which without repeating the path
        raise ValueError(f"cannot read {path}: {err.strerror or err}") from None


def _check_regular(path: Path, status: os.stat_result | None = None) -> None:
    """Refuse what is not a regular file (``status``: the open file's, else the path's)."""
    try:
        mode = (status or os.stat(path)).st_mode
    except FileNotFoundError:
        raise ValueError(f"cannot read {path}: no such file") from None
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err.strerror or err}") from None
    if not stat.S_ISREG(mode):
        kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO (a named pipe)" if stat.S_ISFIFO(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "a device")
        raise ValueError(f"cannot read {path}: it is {kind}, not a regular file")


def _read_within(stream, path: Path, max_bytes: int, max_line: int) -> bytes:
    """``stream`` to its end, a piece at a time, within ``max_bytes`` and lines of ``max_line`` bytes."""
    pieces, size, lines, open_line = [], 0, 0, 0  # open_line: the bytes of the line not yet ended
    # pieces no longer than a line may be: a line that ends within one is shorter, so only the line open across
    # pieces is measured (a piece's many short lines are never split out)
    while piece := stream.read(max(1, min(_PIECE, max_line))):
        size += len(piece)
        if size > max_bytes:
            raise ValueError(f"cannot read {path}: more than {max_bytes:,} bytes (the most it may hold" +
                             (" once decompressed)" if isinstance(stream, gzip.GzipFile) else ")"))
        first, last = piece.find(b"\n"), piece.rfind(b"\n")
        if open_line + (len(piece) if first < 0 else first) > max_line:
            raise ValueError(f"cannot read {path}: line {lines + 1:,} is longer than {max_line:,} bytes, the most a "
                             "line may hold")
        lines += 0 if first < 0 else piece.count(b"\n")
        open_line = open_line + len(piece) if first < 0 else len(piece) - last - 1
        pieces.append(piece)
    return b"".join(pieces)


__all__ = ["all_finite", "as_umask_gives", "check_finite", "check_out", "file_sha256", "quoted", "read_bounded",
           "read_json", "read_text", "remove_stale_scratch", "scratch_beside", "write_atomically"]
