"""The ``qkv`` command: one subcommand per user task, each registered by the module of its task.

This module is the one error boundary. Whatever a command raises ends as one line on stderr, never a
traceback: exit status 2 for what the user can fix (bad values, files, checkpoints: ``ValueError``,
``TypeError``, ``OSError``, a diverged run's ``FloatingPointError``, ``MemoryError``), 1 for anything else, an
internal error, which the line names by type. ``--debug`` shows the traceback instead. Ctrl-C exits 130; a
training run stopped by a signal saves first and exits 128 + its number.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .. import __version__
from . import bert, demo, explore, lm, tour, translation, vision
from .common import Parser

log = logging.getLogger("qkv")

USER_ERRORS = (ValueError, TypeError, OSError, FloatingPointError, MemoryError)
# `qkv train WHAT`: the trainers that are not translation's, each with its own parser.
TRAINERS = {"lm": lm.train_parser, "mlm": bert.mlm_parser, "classify": bert.classify_parser,
            "vit": vision.vit_parser, "swin": vision.swin_parser, "clip": vision.clip_parser}


def _add_debug(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error, not one line")


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``qkv`` and its subcommands (``qkv train lm|mlm|classify|vit|swin|clip`` have their own:
    :data:`TRAINERS`)."""
    parser = Parser(prog="qkv", description="A Transformer toolkit written from the building blocks up.")
    parser.add_argument("--version", action="version", version=f"qkv {__version__}")
    _add_debug(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (demo, translation, lm, bert, vision, explore, tour):
        module.add_commands(sub)
    for command_parser in sub.choices.values():
        _add_debug(command_parser)
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    if argv[:1] == ["train"] and argv[1:2] and argv[1] in TRAINERS:
        parser = TRAINERS[argv[1]]()
        _add_debug(parser)
        return parser.parse_args(argv[2:])
    return build_parser().parse_args(argv)


def _one_line(command: str, err: BaseException) -> int:
    """Print ``err`` as one line; the exit status."""
    message = " ".join(str(err).split()) or type(err).__name__
    status = 2
    if isinstance(err, MemoryError):
        message = f"out of memory ({message}); use a smaller model, batch or input"
    elif not isinstance(err, USER_ERRORS):
        message = f"{type(err).__name__}: {message} (an internal error; --debug shows its traceback)"
        status = 1
    print(f"qkv {command}: error: {message}", file=sys.stderr)
    return status


def main(argv: list[str] | None = None) -> int:
    args = parse(list(sys.argv[1:] if argv is None else argv))
    rank = os.environ.get("RANK", "0")  # under torchrun, rank 0 speaks for the run
    logging.basicConfig(level=logging.INFO if rank == "0" else logging.WARNING, format="qkv: %(message)s",
                        stream=sys.stderr)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    try:
        return args.run(args) or 0
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
