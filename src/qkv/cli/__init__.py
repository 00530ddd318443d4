"""The ``qkv`` command: one subcommand per user task, each registered by the module of its task.

This module is the one error boundary. Whatever a command raises ends as one line on stderr, never a traceback: exit
status 2 for what the user can fix (bad values, files, checkpoints: ``ValueError``, ``TypeError``, ``OSError``, a
diverged run's ``FloatingPointError``, ``MemoryError``, a distributed run's lost process), 1 for anything else, an
internal error, which the line names by type. The library's own wording (an ``[Errno N]``, a scratch file's name) is
said in plain words (:mod:`qkv.cli.errors`). ``--debug`` shows the traceback instead. Ctrl-C exits 130; a training
run stopped by a signal saves first and exits 128 + its number.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import sys

from .. import __version__, threads
from . import bert, demo, explore, export, finetune, lm, perplexity, serve, tour, train, translation, vision
from .common import Parser
from .errors import os_error, peer_gone, plain_digits

log = logging.getLogger("qkv")

USER_ERRORS = (ValueError, TypeError, OSError, FloatingPointError, MemoryError)


def _add_debug(parser: argparse.ArgumentParser, *, default=False) -> None:
    parser.add_argument("--debug", action="store_true", default=default,
                        help="show the traceback of an error, not one line")


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``qkv`` and its subcommands, ``qkv train RECIPE`` nested in ``qkv train``."""
    parser = Parser(prog="qkv", description="A Transformer toolkit written from the building blocks up.")
    parser.add_argument("--version", action="version", version=f"qkv {__version__}")
    _add_debug(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (demo, train, finetune, translation, lm, perplexity, serve, bert, vision, explore, export, tour):
        module.add_commands(sub)
    for command_parser in train.parsers(parser):
        if command_parser is not parser:
            # SUPPRESS: a subcommand's default would overwrite the `qkv --debug COMMAND` that the main parser read
            _add_debug(command_parser, default=argparse.SUPPRESS)
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    """The options of ``qkv [--debug] COMMAND ...``; ``--debug`` also works after the command (and the recipe of
    ``qkv train``)."""
    return build_parser().parse_args(train.with_default_recipe(argv))


def _one_line(command: str, err: BaseException) -> int:
    """Print ``err`` as one line (in plain words, :mod:`qkv.cli.errors`); the exit status."""
    message = plain_digits(" ".join(str(err).split())) or type(err).__name__
    status = 2
    plain = os_error(err) if isinstance(err, OSError) else peer_gone(err)
    if isinstance(err, MemoryError):
        message = f"out of memory ({message}); use a smaller model, batch or input"
    elif plain:
        message = plain
    elif not isinstance(err, USER_ERRORS):
        message = f"{type(err).__name__}: {message} (an internal error; --debug shows its traceback)"
        status = 1
    print(f"qkv {command}: error: {message}", file=sys.stderr)
    return status


class _ClosedStdout(io.TextIOBase):
    """sys.stdout when file descriptor 1 was closed (``qkv ... >&-``), where Python would set it to None and
    print() would drop every line without a word: writing to it is an error instead."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        raise OSError("stdout is closed, so the output cannot be written; redirect it to a file (> FILE) instead of "
                      "closing it")


def main(argv: list[str] | None = None) -> int:
    """``qkv``: the console script. Ctrl-C at any point, importing torch included, ends in one line and status
    130 (this module imports nothing heavy, so the handler below is in place within milliseconds of the start)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("qkv: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    if sys.stdout is None:
        sys.stdout = _ClosedStdout()
    args = parse(list(sys.argv[1:] if argv is None else argv))
    rank = os.environ.get("RANK", "0")  # under torchrun, rank 0 speaks for the run
    logging.basicConfig(level=logging.INFO if rank == "0" else logging.WARNING, format="qkv: %(message)s",
                        stream=sys.stderr)
    for chatty in ("matplotlib", "gguf"):  # their progress notes are not qkv's to say
        logging.getLogger(chatty).setLevel(logging.WARNING)
    try:
        if hasattr(args, "threads"):  # a command that runs a model
            threads.use(args.threads)
        status = args.run(args) or 0
        sys.stdout.flush()  # a write that fails (a full disk, a closed pipe) fails here, inside the boundary
        return status
    except KeyboardInterrupt:
        print(f"qkv {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`qkv embed ... | head`): nothing left to say to it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as err:
        if args.debug:
            raise
        return _one_line(args.command, err)


if __name__ == "__main__":
    sys.exit(main())
