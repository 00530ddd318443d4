"""How the CLI's error boundary says an error in words: the library's own texts (``[Errno 2] No such file or
directory: '.best.123.x1y2.tmp/x'``, Python's integer-digit limit, a lost torchrun peer) as one plain line that names
the user's path and says what to do.

Only the wording is decided here; which errors are the user's to fix (exit 2) and which are internal (exit 1) is
:mod:`qkv.cli`'s.
"""

from __future__ import annotations

import errno
import re
from pathlib import Path

from ..files import quoted

# What to do about the errors of files a user names, by errno.
_ADVICE = {
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "a part of the path is a file, not a folder; check the path",
    errno.EISDIR: "give a file, not a folder",
    errno.EACCES: "check its permissions",
    errno.EPERM: "check its permissions",
    errno.ENOSPC: "free some space on that disk, or write elsewhere",
    errno.EFBIG: "the file is larger than this system or limit allows; write elsewhere",
    errno.EROFS: "write elsewhere",
    errno.ELOOP: "a symbolic link points back at itself; check the path",
    errno.ENAMETOOLONG: "give a shorter name",
}
# The scratch names files.scratch_beside writes into (.NAME.PID.RANDOM.tmp): an error names the NAME the user knows.
_SCRATCH = re.compile(r"^\.(?P<name>.+)\.\d+\.[^./]+\.tmp$")
# Python's refusal of an integer of more digits than int() converts (a number in a JSON file or an option).
_DIGITS = re.compile(r"Exceeds the limit \((?P<limit>\d+) digits\) for integer string conversion(?:: value has "
                     r"(?P<has>\d+) digits)?[^;]*; use sys\.set_int_max_str_digits\(\) to increase the limit")
# torch.distributed's errors when another process of the run is gone (killed, crashed, its machine lost): its own
# types, and gloo's, a RuntimeError that says so ("Connection closed by peer [...]. This is typically caused by a
# remote worker crashing. [...] GLHF!").
_PEER_GONE = ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError")
_PEER_GONE_WORDS = re.compile(r"Connection (?:closed|reset) by peer|remote worker crashing")


def user_path(name: str | bytes | Path) -> str:
    """``name`` with each scratch folder or file of a save (``.best.123.x1y2.tmp``) named as what it becomes
    (``best``)."""
    name = Path(name.decode(errors="replace") if isinstance(name, bytes) else name)
    parts = [(_SCRATCH.match(part) or {"name": part})["name"] if part.startswith(".") else part
             for part in name.parts]
    return str(Path(*parts)) if parts else str(name)


def os_error(err: OSError) -> str | None:
    """An OSError of a file as ``PATH: what happened; what to do`` (no ``[Errno N]``), or None for one that names
    no file (its own text is kept). A rename's error names its destination, the name the user gave."""
    name = err.filename2 if err.filename2 is not None else err.filename
    if name is None or not err.strerror:
        return None
    advice = _ADVICE.get(err.errno or 0)
    what = err.strerror[0].lower() + err.strerror[1:]
    # a path is shown whole up to a length no real path reaches (an endless one, refused as ENAMETOOLONG, is cut)
    return f"{quoted(user_path(name), limit=1024)}: {what}" + (f"; {advice}" if advice else "")


def plain_digits(message: str) -> str:
    """``message`` with Python's integer-digit limit said as what it means for a number in a file or an option."""
    def said(match: re.Match) -> str:
        has = f" of {int(match['has']):,} digits" if match["has"] else ""
        return (f"a number{has} is longer than the {int(match['limit']):,} digits qkv reads; give a number of "
                "sensible size")

    return _DIGITS.sub(said, message)


def peer_gone(err: BaseException) -> str | None:
    """The words for a distributed run whose other process stopped (torch.distributed's ``DistError`` family,
    recognised by name so that this module imports no torch, or gloo's RuntimeError), or None for any other
    error."""
    ours = any(cls.__name__ in _PEER_GONE for cls in type(err).__mro__)
    if not ours and not (isinstance(err, RuntimeError) and _PEER_GONE_WORDS.search(str(err))):
        return None
    return ("another process of this distributed run stopped or lost its connection (killed, crashed, or out of "
            "memory; its own output says which), so this one cannot go on; what the run saved is kept: start all its "
            "processes again, with --resume once it has saved a checkpoint")
