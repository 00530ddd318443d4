"""What the commands share: the parser class, the training options and the start of every training run
(owning ``--out``, merging typed options with a stored run's for ``--resume``, seeding), the end-of-run report,
and reading sentences from arguments, a file or stdin."""

from __future__ import annotations

import argparse
import contextlib
import logging
import random
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from .numbers import COUNT, NON_NEGATIVE, POSITIVE, PROBABILITY, SEED, integer, real

log = logging.getLogger("qkv")

VOCAB_MULTIPLE = 64  # embedding and output tables of new models padded to whole tiles (ModelConfig.table_rows)


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        # No prefixes of options: `--max-minute 2` is a typo, not --max-minutes (subcommands' parsers are
        # made by this class too, so this holds for every parser of qkv)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        """One line, not a usage dump: what was wrong and where to look."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def command(sub, name: str, summary: str) -> argparse.ArgumentParser:
    """A subcommand whose summary is both its line in ``qkv --help`` and the description in its own help."""
    return sub.add_parser(name, help=summary, description=summary[0].upper() + summary[1:] + ".")


# --- starting a training run ----------------------------------------------------------------------------------

# The command that made a run, by the task its checkpoints record (runs made before "command" was recorded).
TASK_COMMANDS = {"translation": "train", "language_model": "train lm", "masked_lm": "train mlm",
                 "classify": "train classify"}
# What a resumed run may change: its budget, the optimizer's settings and when it evaluates. Everything else
# (data, tokenizer, model, batching, seed, what validation measures) is the run's and stays as it was.
RESUMABLE = frozenset({"max_steps", "epochs", "max_minutes", "eval_every", "eval_at_minutes", "lr", "warmup",
                       "schedule", "min_lr_ratio", "clip", "weight_decay", "accum", "label_smoothing",
                       "teacher_forcing"})  # and --device, --precision: how this invocation runs, never stored


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


# Where a run's checkpoints record its data files as they were when it started, for --resume to check:
# {absolute path: {"size": bytes, "sha256": hex}}. Recipes store settings(...)[DATA_FILES] in their meta.
DATA_FILES = "data_files"


def _stored_args(out: Path, command: str) -> dict:
    """The options a run was started with, checked to belong to ``qkv {command}``."""
    from ..checkpoint import read_meta

    meta = read_meta(out / "last")
    made_by = meta.get("command") or TASK_COMMANDS.get(meta.get("task"))
    if "args" not in meta or made_by is None:
        raise ValueError(f"{out} was not made by a qkv train command (it records no options), so it cannot be "
                         "resumed; start a new run with another --out")
    if made_by != command:
        raise ValueError(f"{out} is a `qkv {made_by}` run, not a `qkv {command}` one; resume it with "
                         f"`qkv {made_by} --out {out} --resume`")
    return {**meta["args"], DATA_FILES: meta.get(DATA_FILES)}


def settings(args: argparse.Namespace, defaults: dict, *, command: str, paths: Sequence[str] = ()) -> dict:
    """Defaults, then (with --resume) what the run stored, then what was typed now.

    Every option of a train command defaults to None in its parser, so typed options can be told from the
    rest. File options named in ``paths`` are stored absolute, so ``--resume`` works from any directory. On
    ``--resume`` a typed option outside :data:`RESUMABLE` must equal the stored one, and the data files must
    be those the run started with (same size and sha256, where the run recorded them). The settings'
    :data:`DATA_FILES` is that record, for the run's meta.

    Raises:
        ValueError: for a run of another command, a typed option that would change what the run is, or (on
            ``--resume``) a data file that changed since the run started.
    """
    typed = {k: v for k, v in vars(args).items() if k in defaults and v is not None}
    for key in paths:
        if typed.get(key) is not None:
            value = typed[key]
            typed[key] = [_absolute(v) for v in value] if isinstance(value, list) else _absolute(value)
    stored = _stored_args(Path(args.out), command) if args.resume else {}
    recorded = stored.pop(DATA_FILES, None)
    if args.resume:
        for key, value in typed.items():
            before = stored.get(key, defaults[key])
            if key not in RESUMABLE and value != before:
                raise ValueError(f"{_flag(key)} {_shown(value)} differs from this run's {_shown(before)}: a resumed "
                                 "run keeps its data, tokenizer and model (only the budget, the optimizer's settings "
                                 f"and evaluation times can change); drop {_flag(key)}, or start a new run with "
                                 "another --out")
    merged = {**defaults, **stored, **typed}
    files = [f for key in paths for f in (merged[key] if isinstance(merged[key], list) else [merged[key]]) if f]
    return {**merged, DATA_FILES: _data_files(files, recorded if isinstance(recorded, dict) else {})}


def _data_files(files: Sequence[str], recorded: dict) -> dict:
    """Size and sha256 of each regular file of the run's data (a pipe is read once, so never hashed), checked
    against the record of the run's start where there is one (a run from before records none)."""
    from ..checkpoint import file_sha256

    now = {}
    for name in files:
        path = Path(name)
        if not path.is_file():
            continue  # a pipe, or missing: reading the data says what is wrong
        now[name] = {"size": path.stat().st_size, "sha256": file_sha256(path)}
        before = recorded.get(name)
        if isinstance(before, dict) and before != now[name]:
            change = (f"size {before.get('size')} -> {now[name]['size']} bytes" if before.get("size") !=
                      now[name]["size"] else "same size, another sha256")
            raise ValueError(f"{name} changed since the run started ({change}); resume with the original data, or "
                             "start a new run with another --out")
    return now


def _absolute(path: str) -> str:
    """A file option's path from the root. A pipe (``--src <(zcat train.de.gz)``, /dev/fd/63) keeps its name:
    resolved, it would become /proc/PID/fd/pipe:[N], which names nothing that can be opened."""
    p = Path(path)
    return str(p.resolve() if p.is_file() else p.absolute())


def _shown(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


# Where the settings of a training run hold its runtime (a qkv.runtime.Runtime), for its Trainer.
RUNTIME = "runtime"


@contextlib.contextmanager
def training_run(args: argparse.Namespace, defaults: dict, *, command: str, paths: Sequence[str] = ()
                 ) -> Iterator[dict]:
    """What every ``qkv train`` command does first: resolve ``--device`` and ``--precision`` and join the process
    group under torchrun, once (a :class:`qkv.runtime.Runtime`), own ``--out`` for the whole run (rank 0; see
    :func:`qkv.rundir.claim`), merge the settings (:func:`settings`) and seed every random source, before anything
    random (tokenizer training, the model's initialisation) happens. Yields the settings, the runtime under
    :data:`RUNTIME`: ``Trainer(task, opts, runtime=s["runtime"])``."""
    import time

    import torch

    from ..rundir import claim
    from ..runtime import Runtime

    args.started = time.monotonic()  # --max-minutes counts from here: reading data, tokenizers (train_options)
    runtime = Runtime.resolve(args.device, args.precision)  # a device this machine lacks: said first
    with claim(args.out, resume=args.resume) if runtime.group.main else contextlib.nullcontext():
        s = settings(args, defaults, command=command, paths=paths)
        torch.manual_seed(s["seed"])
        random.seed(s["seed"])
        yield {**s, RUNTIME: runtime}


def add_size_arguments(group: argparse._ArgumentGroup) -> None:
    """The fields of a Transformer's size every trainer lets the command line override (the preset's otherwise)."""
    group.add_argument("--d-model", type=COUNT, help="width of every token vector")
    group.add_argument("--n-heads", type=COUNT, help="attention heads (they divide --d-model)")
    group.add_argument("--n-layers", type=COUNT)
    group.add_argument("--d-ff", type=COUNT, help="hidden width of the feed-forward network")
    group.add_argument("--dropout", type=PROBABILITY)


def add_input_arguments(p: argparse.ArgumentParser, *, blank: str = "") -> None:
    """Sentences as arguments, else --input FILE, else stdin (see :func:`read_inputs`)."""
    p.add_argument("text", nargs="*", help="sentences (else --input FILE, else stdin)")
    p.add_argument("--input", help=f"file of sentences, one per line{blank}")


def add_device_arguments(p: argparse.ArgumentParser, *, quantize: bool = False) -> None:
    """``--device``, ``--precision`` (see :mod:`qkv.device`) and ``--compile``, for every command that runs a
    model; ``--quantize`` and ``--group-size`` (see :mod:`qkv.quantize`) for those that only run one."""
    from ..device import DEVICES, PRECISIONS
    from ..quantize import DEFAULT_GROUP_SIZE, GROUP_SIZES, MODES

    group = p.add_argument_group("device")
    group.add_argument("--device", default="auto", help=f"{DEVICES} (default auto: a CUDA GPU when there is one)")
    group.add_argument("--precision", default="auto", choices=PRECISIONS,
                       help="matrix products in fp32, bf16 or fp16 autocast (default auto: bf16 on a GPU that has "
                            "it, fp32 on a CPU; fp16 on CUDA only)")
    group.add_argument("--compile", action="store_true",
                       help="torch.compile the model first: minutes of compiling, then faster steps (pays off on "
                            "GPUs, long runs and long outputs; on a CPU, decoding with --quantize)")
    if quantize:
        group.add_argument("--quantize", choices=MODES,
                           help="weights of the linear layers in 8 or 4 bits, on the CPU (default none; int4 for "
                                "--pretrained smollm2 on a CPU: 4x faster, perplexity within 0.2%%)")
        group.add_argument("--group-size", type=integer(1), choices=GROUP_SIZES, default=DEFAULT_GROUP_SIZE,
                           help=f"int4: inputs that share a scale and zero point ({DEFAULT_GROUP_SIZE})")


def place(model, device, args: argparse.Namespace, *, quantize: str = "none", calibrate=None):
    """``model`` on ``device``, quantized as --quantize asks (else as ``quantize``, the model's own default, said
    on stderr), compiled when --compile asks: with dynamic shapes, so one graph serves every prompt length and
    every step of a growing KV cache. ``calibrate`` runs the model on :data:`qkv.quantize.CALIBRATION_TEXT`:
    given, int8 keeps each layer's outlier input columns in fp32 (see :mod:`qkv.quantize`)."""
    from ..quantize import DEFAULT_GROUP_SIZE, input_magnitudes
    from ..quantize import quantize as quantize_weights

    mode = getattr(args, "quantize", None)
    if mode is None and device.type == "cpu" and quantize != "none":
        mode = quantize
        log.info("%s weights (this model's default on a CPU; --quantize none for fp32)", mode)
    magnitudes = input_magnitudes(model, calibrate) if mode == "int8" and calibrate is not None else None
    quantize_weights(model, mode or "none", group_size=getattr(args, "group_size", DEFAULT_GROUP_SIZE),
                     magnitudes=magnitudes)
    model.to(device)
    if args.compile:
        model.compile(dynamic=True)  # in place: the module and its state dict stay as they are
    return model


def runtime(args: argparse.Namespace):
    """(device, precision, autocast context) of --device and --precision, checked before any model is loaded."""
    from ..device import autocast, prepare, resolve_device, resolve_precision

    device = resolve_device(args.device)
    precision = resolve_precision(args.precision, device)
    if getattr(args, "quantize", None) not in (None, "none") and device.type != "cpu":
        raise ValueError(f"--quantize {args.quantize} runs on the CPU's kernels; use --device cpu, or drop --quantize "
                         f"on {device}")
    prepare(device)
    return device, precision, autocast(device, precision)


def add_training_arguments(p: argparse.ArgumentParser, defaults: dict, *, batch: tuple[str, str],
                           lr_help: str | None = None, warmup_help: str | None = None) -> argparse._ArgumentGroup:
    """The options every ``qkv train`` command shares: budget, batch, optimizer, schedule, checkpoints.

    ``batch`` is the batch option's flag and what it counts (``("--batch-size", "windows per batch")``); help
    texts show the command's own ``defaults``. Returns the group, for the command's own training options.
    """
    train = p.add_argument_group("training")
    train.add_argument("--out", required=True, help="run directory: checkpoints, log.csv, loss.png")
    train.add_argument("--resume", action="store_true", help="continue the run in --out exactly where it stopped")
    train.add_argument("--max-steps", type=COUNT)
    train.add_argument("--epochs", type=POSITIVE)
    train.add_argument("--max-minutes", type=POSITIVE,
                       help="wall-clock budget of the whole run, its final evaluation included (--resume counts the "
                            "minutes already trained)")
    flag, counts = batch
    train.add_argument(flag, type=COUNT, help=f"{counts} ({defaults[flag[2:].replace('-', '_')]})")
    train.add_argument("--accum", type=COUNT, help="batches per optimizer step (gradient accumulation)")
    train.add_argument("--lr", type=POSITIVE, help=lr_help or f"peak learning rate ({defaults['lr']:g})")
    train.add_argument("--warmup", type=integer(0), help=warmup_help or f"warmup steps ({defaults['warmup']})")
    train.add_argument("--schedule", choices=["cosine", "inverse_sqrt", "constant"],
                       help=f"after warmup ({defaults['schedule']}); cosine decays to --min-lr-ratio × --lr by the "
                            "end of --max-steps/--epochs or, without them, of --max-minutes")
    train.add_argument("--min-lr-ratio", type=real(0, 1),
                       help=f"cosine floor as a fraction of --lr ({defaults['min_lr_ratio']:g})")
    train.add_argument("--clip", type=NON_NEGATIVE, help=f"gradient-norm clipping ({defaults['clip']}; 0 disables)")
    train.add_argument("--weight-decay", type=NON_NEGATIVE, help=f"AdamW weight decay ({defaults['weight_decay']:g})")
    train.add_argument("--eval-every", type=COUNT,
                       help=f"steps between validations and checkpoints ({defaults['eval_every']})")
    train.add_argument("--eval-at-minutes", type=POSITIVE, nargs="+", metavar="M",
                       help="also validate (and checkpoint) when the run has trained this many minutes")
    train.add_argument("--seed", type=SEED, help="seeds the model's initialisation, the data order and dropout (0)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_device_arguments(p)
    return train


def train_options(s: dict, args: argparse.Namespace, **fixed):
    """``TrainOptions`` from merged settings ``s`` (see :func:`settings`); ``fixed`` sets what a command decides
    itself (``betas``, a learning rate that depends on the starting point)."""
    from ..training import TrainOptions

    chosen = {k: s[k] for k in ("max_steps", "epochs", "max_minutes", "lr", "schedule", "warmup", "weight_decay",
                                "clip", "accum", "eval_every", "seed")}
    if s.get("min_lr_ratio") is not None:
        chosen["min_lr_ratio"] = s["min_lr_ratio"]
    chosen["eval_at_minutes"] = tuple(s.get("eval_at_minutes") or ())
    return TrainOptions(**{**chosen, **fixed}, out=str(args.out), resume=args.resume, progress=not args.no_progress,
                        device=args.device, precision=args.precision, compile=args.compile,
                        started=getattr(args, "started", None))


def report(result, out: Path) -> int:
    """Print how the run ended (rank 0 of a distributed run); the exit status: 0, or 128 + the signal that
    stopped it (130 for Ctrl-C, 143 for SIGTERM), so that ``qkv train ... && qkv evaluate ...`` does not go on
    after an interrupted run."""
    from ..distributed import current
    from ..progress import format_metrics

    if not current().main:
        return 128 + result.signal if result.signal is not None else 0
    print(f"{result.stopped_because} after {result.step} steps ({result.epoch} epochs), {result.elapsed_s / 60:.1f} "
          f"min in all, {result.rate:,.0f} {result.unit.replace('_', ' ')}/s while training")
    if result.best:
        print(f"best: {format_metrics(result.best)}  -> {out / 'best'}")
    print(f"log: {out / 'log.csv'}, curve: {out / 'loss.png'}")
    if result.signal is not None:
        print(f"the run was stopped by {signal.Signals(result.signal).name}; {out / 'last'} holds it, to --resume",
              file=sys.stderr)
        return 128 + result.signal
    return 0


# --- sentences in ---------------------------------------------------------------------------------------------

def read_inputs(texts: list[str], input_file: str | None, what: str, *, keep_blank: bool = False) -> list[str]:
    """Sentences from the arguments, else ``--input FILE``, else stdin, one per line (all read at once, so they
    are batched like a file's).

    ``keep_blank`` keeps every line as it is, so outputs stay line-aligned with the input (translation);
    otherwise lines are stripped and blank ones skipped.
    """
    from ..data import read_lines

    if texts and input_file:
        raise ValueError("give sentences as arguments or with --input, not both")
    if input_file:
        lines = read_lines(input_file)
    elif texts:
        lines = checked_arguments(texts)
    elif sys.stdin is not None and not sys.stdin.closed and not sys.stdin.isatty():
        lines = _read_stdin().splitlines()
    else:
        lines = []
    if not any(line.strip() for line in lines):
        raise ValueError(f"nothing to {what}: give sentences as arguments, with --input FILE, or on stdin")
    return lines if keep_blank else [line.strip() for line in lines if line.strip()]


def _read_stdin() -> str:
    """stdin as UTF-8, checked: Python's own decoding of stdin may pass bad bytes on as lone surrogates
    (``surrogateescape``), which the tokenizers then refuse without naming the line."""
    from ..data import decode_text

    buffer = getattr(sys.stdin, "buffer", None)
    return sys.stdin.read() if buffer is None else decode_text(buffer.read(), "stdin")


def checked_arguments(texts: list[str]) -> list[str]:
    """Sentences from the command line, which Python decodes with ``surrogateescape``: bytes that are not
    UTF-8 arrive as lone surrogates, refused here with the argument's number."""
    for number, text in enumerate(texts, 1):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"sentence {number} of the arguments is not valid UTF-8; convert it to UTF-8") from None
    return texts
