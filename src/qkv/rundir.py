"""A run directory: what one training run owns on disk, and the rules that keep everything else safe.

    RUN/
      .qkv-run            the mark of a qkv run, and its lock: held while a process trains into RUN
      best/  last/        checkpoints (see checkpoint.py), each replaced atomically
      log.csv  loss.png   the run's log and its curve
      test.src.txt ...    what a command writes beside them (translation's held-out test set)

The rules, all applied by :func:`claim` before anything is written:

* One process at a time. ``claim`` takes an exclusive lock on ``.qkv-run`` (``flock``). The kernel releases
  it when the process ends, however it ends (kill -9 included), so a crashed run never leaves it stuck.
* A refusal changes nothing. The lock is all a claim does to an existing run's mark (no pid is written into it:
  the kernel names the holder), and every check comes before the run writes anything: a refused ``--resume`` or
  start leaves each file of the run as it was, its bytes and its times.
* Once within a process. Whoever starts the run claims its directory, once: a command for its whole run, before
  it reads data (:meth:`qkv.recipes.base.Recipe.run`); a library caller's :class:`qkv.training.Trainer` for its
  ``run()``, which claims only a directory that this process does not hold already (:func:`holds`). A second
  claim of a held directory is a mistake in the program, and an error.
* A new run goes only into a new or empty directory, or into one that an earlier qkv run left without a model
  (it stopped before its first checkpoint). A directory that holds a model needs ``resume``; one holding
  ``best/`` without ``last/`` can be neither resumed nor restarted, and says how to go on (a model is never
  replaced by a new run); a directory holding anything else is never touched.
* Leftovers of a save interrupted by a kill are cleaned up: the scratch files and folders (``.NAME.PID.RANDOM.tmp``)
  of processes no longer running are deleted, and a ``.NAME.old`` whose ``NAME`` is missing (killed between the
  two renames of a save) is put back.
* Nothing is written through a symbolic link. A run writes its files by name (the mark, ``log.csv``,
  ``loss.png``, ``test.src.txt``, ...), and writing to a name that is a link would overwrite the file it points
  to, anywhere on the disk: a directory with a link among its entries is refused, naming the link.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from .files import remove_stale_scratch

log = logging.getLogger(__name__)

MARK = ".qkv-run"
CHECKPOINTS = ("best", "last")

_held: dict[Path, int] = {}  # run directories this process holds -> the lock's file descriptor


@contextlib.contextmanager
def claim(out: str | Path, *, resume: bool) -> Iterator[Path]:
    """Own ``out`` for a training run, for the duration of the ``with`` block.

    Once per process (see :func:`holds`). A directory this call created is removed again if the block fails
    before anything but the mark was written.

    Raises:
        ValueError: if ``out`` is a file or a link to nowhere, holds files that are not a qkv run's or symbolic
            links, holds a model and ``resume`` is false, has nothing to resume and ``resume`` is true, or another
            process is training into it.
        RuntimeError: if this process holds ``out`` already (claims do not nest).
    """
    out = Path(out)
    key = out.resolve()
    if key in _held:
        raise RuntimeError(f"{out} is claimed already by this process: claim a run directory once, where the run "
                           "starts (a Trainer claims it only when nothing else in the process holds it)")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a directory for the run")
    if out.is_symlink() and not out.exists():
        raise ValueError(f"--out {out} is a symbolic link to {os.readlink(out)}, which does not exist; create that "
                         "directory, or give another --out")
    created = not out.exists()
    _refuse_foreign(out)
    _refuse_links(out)
    out.mkdir(parents=True, exist_ok=True)
    _held[key] = _lock(out)
    try:
        _clean_leftovers(out)
        _check_model(out, resume)
        yield out
    except BaseException:
        if created and {p.name for p in out.iterdir()} <= {MARK}:
            shutil.rmtree(out, ignore_errors=True)  # a run that failed to start leaves nothing behind
        raise
    finally:
        os.close(_held.pop(key))  # closing the descriptor releases the lock


def holds(out: str | Path) -> bool:
    """True while this process holds ``out`` (inside a :func:`claim` of it)."""
    return Path(out).resolve() in _held


def resumable(out: str | Path) -> bool:
    """True where ``resume`` can continue a run: ``out`` holds its ``last`` checkpoint."""
    return (Path(out) / "last" / "config.json").is_file()


def is_run(out: Path) -> bool:
    """True for a directory that a qkv run wrote (its mark, or a checkpoint from before runs were marked)."""
    return (out / MARK).is_file() or any((out / name / "config.json").is_file() for name in CHECKPOINTS)


def _refuse_foreign(out: Path) -> None:
    if not out.is_dir() or is_run(out):
        return
    names = sorted(p.name for p in out.iterdir())
    if names:
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise ValueError(f"--out {out} is not empty and is not a qkv run (it holds {shown}); choose a new or "
                         "empty directory, so that nothing in it is overwritten")


def _refuse_links(out: Path) -> None:
    if not out.is_dir():
        return
    links = sorted(p for p in out.iterdir() if p.is_symlink())
    if links:
        shown = ", ".join(f"{p.name} -> {os.readlink(p)}" for p in links[:3]) + (" ..." if len(links) > 3 else "")
        raise ValueError(f"--out {out} holds symbolic links ({shown}); a run writes its files by name and would "
                         "overwrite what a link points to: remove the links, or choose a new --out")


def _lock(out: Path) -> int:
    """An exclusive, non-blocking lock on the run's mark; returns the open descriptor that holds it."""
    try:  # O_NOFOLLOW: a link put in the mark's place since _refuse_links looked is not followed either
        fd = os.open(out / MARK, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as err:
        raise ValueError(f"cannot open {out / MARK}: {err.strerror or err} (a symbolic link is never followed); "
                         "remove it, or choose a new --out") from None
    try:
        import fcntl
    except ImportError:  # not POSIX: no advisory locks, the other rules still hold
        return fd
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = _lock_holder(fd)
        os.close(fd)
        raise ValueError(f"another qkv process (pid {holder}) is training into {out}; wait for it to finish or "
                         "choose another --out") from None
    return fd


def _lock_holder(fd: int) -> str:
    """The pid holding the lock on the open file ``fd``, as the kernel lists it (/proc/locks), or "unknown".

    Read from the kernel, not from the mark: a claim writes nothing into the mark, so that a refused start (a
    ``--resume`` of changed settings, a run that holds a model) leaves the run's files as they were, bytes and
    times."""
    status = os.fstat(fd)
    device = f"{os.major(status.st_dev):02x}:{os.minor(status.st_dev):02x}:{status.st_ino}"
    with contextlib.suppress(OSError):
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()  # 1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF
            if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == device:
                return fields[4]
    return "unknown"


def _clean_leftovers(out: Path) -> None:
    """Undo what a kill in the middle of a save left (see checkpoint.save_checkpoint)."""
    remove_stale_scratch(out)
    for name in CHECKPOINTS:
        old = out / f".{name}.old"
        if old.is_dir():
            if (out / name).exists():
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(old, out / name)
                log.info("%s: restored %s/ from an interrupted save", out, name)
    (out / "log.tmp").unlink(missing_ok=True)


def _check_model(out: Path, resume: bool) -> None:
    """A run with last/ needs ``resume``; ``resume`` needs last/. A run with best/ alone (a save order older than
    :class:`qkv.training.Trainer`'s, which writes last/ first; or last/ deleted) holds a model but nothing to
    resume: refused both ways, saying how to go on, and its model is never replaced."""
    if (out / "best").exists() and not (out / "last").exists():
        raise ValueError(f"{out} holds a model in best/ but no last/, so there is no training state to resume; "
                         "to keep that model, choose another --out; to train this run again from the start, move "
                         "best/ out of it first")
    if resume and not resumable(out):
        raise ValueError(f"{out} has no checkpoint to resume; drop --resume to start a new run")
    if not resume and (out / "last").exists():
        raise ValueError(f"{out} already holds a trained model; pass --resume to continue it, or choose another "
                         "--out")
